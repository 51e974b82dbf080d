"""Peak resident memory (RSS) of work run in a fresh process, for the memory benchmarks.

The work runs in a new Python interpreter, so nothing the parent has allocated or
imported counts. A child's ``ru_maxrss`` also counts the parent's image copied by
``fork`` before ``exec`` (hundreds of MiB for a process that has imported JAX), so:

* a callable reports its own high-water mark (``VmHWM`` of ``/proc/self/status``,
  which starts afresh at ``exec``; ``ru_maxrss`` where there is no ``/proc``);
* a command is started by a small launcher process (a bare interpreter, ~10 MiB) that
  forks and execs it and reads its ``ru_maxrss`` with ``os.wait4``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["RssResult", "peak_rss", "peak_rss_of_command"]

# Runs in the child: no pockjax import, so the baseline is the callable's own imports.
_BOOTSTRAP = r"""
import pickle, resource, sys
def _maxrss():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024
with open(sys.argv[1], "rb") as f:
    fn, args, kwargs = pickle.load(f)
baseline = _maxrss()
try:
    out = ("ok", fn(*args, **kwargs))
except BaseException as e:  # report, do not hide
    import traceback
    out = ("error", "".join(traceback.format_exception(e)))
peak = _maxrss()
try:
    payload = pickle.dumps((out, baseline, peak))
except Exception as e:
    payload = pickle.dumps((("ok", None), baseline, peak))
with open(sys.argv[2], "wb") as f:
    f.write(payload)
"""

# Starts a command and reports its ru_maxrss; run by a fresh, small interpreter.
_LAUNCHER = r"""
import json, os, sys
out, argv = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
r = usage.ru_maxrss if sys.platform == "darwin" else usage.ru_maxrss * 1024
with open(out, "w") as f:
    json.dump({"maxrss": r}, f)
sys.exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""


@dataclasses.dataclass(frozen=True)
class RssResult:
    """Peak RSS of one child process.

    Attributes:
      peak_bytes: the child's peak resident set size, in bytes (0 if it could not be
        read, e.g. the child was killed).
      baseline_bytes: for :func:`peak_rss`, the peak RSS just before the callable ran
        (interpreter plus the callable's module imports); None for commands.
      seconds: wall time of the child.
      returncode: its exit status.
      result: what the callable returned (None for commands, or if not picklable).
      output: the child's stdout and stderr (the last 4000 characters).

    Example:
      >>> r = RssResult(peak_bytes=300, baseline_bytes=100, seconds=1.0, returncode=0)
      >>> r.delta_bytes
      200
    """

    peak_bytes: int
    baseline_bytes: int | None
    seconds: float
    returncode: int
    result: Any = None
    output: str = ""

    @property
    def delta_bytes(self) -> int | None:
        """``peak_bytes - baseline_bytes``: memory the callable itself added."""
        return None if self.baseline_bytes is None else self.peak_bytes - self.baseline_bytes


def _run(argv: Sequence[str], env: Mapping[str, str] | None, timeout: float | None) -> tuple[int, int, float, str]:
    """Run ``argv``; returns (its ru_maxrss in bytes, exit code, seconds, output)."""
    with tempfile.TemporaryFile("w+b") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env) if env else None, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it started
            rc = proc.wait()
        seconds = time.perf_counter() - t0
        log.seek(0)
        output = log.read().decode(errors="replace")[-4000:]
    return rc, seconds, output


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def peak_rss_of_command(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> RssResult:
    """Run a command and report its peak RSS.

    Args:
      argv: the command, e.g. ``[sys.executable, "-m", "benchmarks.train_torch"]``.
      env: environment for the child (default: this process's).
      timeout: seconds after which the child is killed.

    Returns:
      An :class:`RssResult` (``baseline_bytes`` is None).

    Example:
      >>> import sys
      >>> r = peak_rss_of_command([sys.executable, "-c", "x = bytearray(64 * 2**20)"])
      >>> r.returncode, r.peak_bytes > 64 * 2**20
      (0, True)
    """
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rss.json")
        rc, seconds, output = _run([sys.executable, "-c", _LAUNCHER, out, *argv], env, timeout)
        peak = 0
        if os.path.exists(out):
            with open(out) as f:
                peak = int(json.load(f)["maxrss"])
    return RssResult(peak, None, seconds, rc, None, output)


def peak_rss(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    timeout: float | None = None,
    check: bool = True,
) -> RssResult:
    """Call ``fn(*args, **kwargs)`` in a fresh Python process and report its peak RSS.

    ``fn`` and the arguments are pickled, so ``fn`` must be importable by name (a
    module-level function; not a lambda or a function defined in ``__main__`` of an
    interactive session).

    Args:
      fn: the callable.
      args: its positional arguments.
      kwargs: its keyword arguments.
      timeout: seconds after which the child is killed.
      check: raise ``RuntimeError`` (with the child's traceback) if the call failed.

    Returns:
      An :class:`RssResult` with the returned value in ``result``.

    Example:
      >>> import math
      >>> r = peak_rss(math.factorial, (20,))
      >>> r.result, r.peak_bytes >= r.baseline_bytes > 0
      (2432902008176640000, True)
    """
    with tempfile.TemporaryDirectory() as d:
        inp, out = os.path.join(d, "in.pkl"), os.path.join(d, "out.pkl")
        with open(inp, "wb") as f:
            pickle.dump((fn, tuple(args), dict(kwargs or {})), f)
        rc, seconds, output = _run([sys.executable, "-c", _BOOTSTRAP, inp, out], _child_env(), timeout)
        status, result, baseline, peak = "error", output, None, 0
        if os.path.exists(out):
            with open(out, "rb") as f:
                (status, result), baseline, peak = pickle.load(f)
    if status != "ok":
        if check:
            raise RuntimeError(f"peak_rss: the call failed in the child (exit {rc}):\n{result}")
        result = None
    return RssResult(peak, baseline, seconds, rc, result, output)
