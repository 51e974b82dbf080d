"""Run ``arm64`` modules on an x86 machine: aarch64 ``iree-run-module`` under qemu.

The aarch64 ``iree-run-module`` binary comes from the aarch64 wheel of
``iree-base-runtime`` (same version as the installed runtime). It is fetched
once with ``pip download`` (nothing else is downloaded), extracted, and cached
under ``~/.cache/pockjax/iree-aarch64/<version>/`` (override with
``$POCKJAX_CACHE``). It runs under ``qemu-aarch64`` (Debian package
``qemu-user``) with the arm64 C/C++ libraries (``libc6:arm64``,
``libstdc++6:arm64``) installed multiarch; see ``.ci/system-deps.sh``.

Example::

    from pockjax.backends.iree import arm64
    prefix = arm64.command_prefix()   # ["qemu-aarch64", "-L", "/", ".../iree-run-module"]
    session = pockjax.runtime.CommandLineSession(vmfb, "local-task", prefix)
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from pockjax.io.atomic import atomic_open, remove_stale_temporaries

__all__ = ["Arm64RunnerUnavailable", "ensure_aarch64_runtime", "find_qemu", "command_prefix", "cache_dir"]

_WHEEL_PLATFORM = "manylinux_2_28_aarch64"
_TOOL = "iree-run-module"


class Arm64RunnerUnavailable(RuntimeError):
    """qemu-aarch64, the arm64 libraries or the aarch64 runtime wheel are missing."""


def _runtime_version() -> str:
    from importlib.metadata import version

    return version("iree-base-runtime")


def cache_dir() -> str:
    base = os.environ.get("POCKJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pockjax")
    return os.path.join(base, "iree-aarch64")


def ensure_aarch64_runtime(version: str | None = None, *, python_version: str | None = None) -> str:
    """Returns the path of the aarch64 ``iree-run-module``, downloading the wheel once.

    Runs ``pip download --only-binary=:all: --platform manylinux_2_28_aarch64
    --no-deps iree-base-runtime==<version>`` into a temporary directory and
    extracts ``iree/_runtime_libs/iree-run-module`` into the cache.

    Raises:
      Arm64RunnerUnavailable: the download failed (no network to the package
        index, no such version) with pip's message.
    """
    version = version or _runtime_version()
    python_version = python_version or f"{sys.version_info.major}.{sys.version_info.minor}"
    dest_dir = os.path.join(cache_dir(), version)
    dest = os.path.join(dest_dir, _TOOL)
    if os.path.exists(dest) and os.access(dest, os.X_OK):
        return dest
    os.makedirs(dest_dir, exist_ok=True)
    remove_stale_temporaries(dest_dir)
    with tempfile.TemporaryDirectory(prefix="pockjax-wheel-") as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
            "--platform", _WHEEL_PLATFORM, "--python-version", python_version, "--no-deps",
            f"iree-base-runtime=={version}", "-d", tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "iree_base_runtime-*aarch64*.whl"))
        if proc.returncode != 0 or not wheels:
            raise Arm64RunnerUnavailable(
                f"could not download the aarch64 iree-base-runtime=={version} wheel: {' '.join(cmd)}\n"
                f"{proc.stderr[-2000:]}"
            )
        with zipfile.ZipFile(wheels[0]) as z:
            member = f"iree/_runtime_libs/{_TOOL}"
            with z.open(member) as src, atomic_open(dest, "wb") as out:
                shutil.copyfileobj(src, out)
                os.fchmod(out.fileno(), 0o755)
    return dest


def find_qemu() -> str:
    """Path of ``qemu-aarch64`` (or ``qemu-aarch64-static``).

    Raises:
      Arm64RunnerUnavailable: with the apt command that installs it.
    """
    for name in ("qemu-aarch64", "qemu-aarch64-static"):
        p = shutil.which(name)
        if p:
            return p
    raise Arm64RunnerUnavailable(
        "qemu-aarch64 not found: the arm64 target is run under QEMU user-mode emulation here. "
        "Install it with .ci/system-deps.sh (apt-get install qemu-user libc6:arm64 libstdc++6:arm64)"
    )


def _sysroot() -> str:
    # Multiarch Debian puts the arm64 loader at /lib/ld-linux-aarch64.so.1; cross
    # toolchains use /usr/aarch64-linux-gnu.
    for root in ("/", "/usr/aarch64-linux-gnu"):
        if os.path.exists(os.path.join(root, "lib", "ld-linux-aarch64.so.1")):
            return root
    raise Arm64RunnerUnavailable(
        "the arm64 C library is missing (no ld-linux-aarch64.so.1): run .ci/system-deps.sh "
        "(dpkg --add-architecture arm64; apt-get install libc6:arm64 libstdc++6:arm64)"
    )


def command_prefix() -> list[str]:
    """The command that runs the aarch64 ``iree-run-module`` here.

    On an aarch64 host it is the tool itself; elsewhere it is run under qemu.
    """
    tool = ensure_aarch64_runtime()
    import platform

    if platform.machine().lower() in ("aarch64", "arm64"):
        return [tool]
    qemu = find_qemu()
    prefix = [qemu, "-L", _sysroot(), tool]
    proc = subprocess.run(prefix + ["--help"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Arm64RunnerUnavailable(
            f"{' '.join(prefix)} --help failed (exit {proc.returncode}); are libc6:arm64 and "
            f"libstdc++6:arm64 installed?\n{proc.stderr[-2000:]}"
        )
    return prefix
