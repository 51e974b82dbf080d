"""Durable, atomic output: every file and directory pockjax writes goes through here.

Each writer puts its bytes in a temporary sibling of the target, fsyncs the
file, renames it over the target and fsyncs the directory. A reader therefore
sees the old content or the new content, never a mix, and after the function
returns the new content survives a power loss.

Temporaries are named ``NAME.pockjax-tmp-PID-TAG`` (``TAG``: 8 hex digits).
A process killed mid-write leaves one behind; :func:`remove_stale_temporaries`
removes those whose process is gone and keeps those of live processes.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_json(os.path.join(d, "run.json"), {"step": 3})
    >>> open(os.path.join(d, "run.json")).read()
    '{\\n "step": 3\\n}\\n'
    >>> os.listdir(d)
    ['run.json']
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import re
import secrets
import shutil
from typing import IO, Any, Iterator

__all__ = [
    "TEMP_PATTERN",
    "atomic_directory",
    "atomic_open",
    "atomic_output_path",
    "file_above",
    "fsync_directory",
    "save_figure",
    "fsync_tree",
    "is_temporary",
    "pid_alive",
    "remove_stale_temporaries",
    "temporary_name",
    "write_bytes",
    "write_json",
    "write_text",
]

#: Matches the name of a temporary: ``NAME.pockjax-tmp-PID-TAG`` (a file or
#: directory being written) or ``NAME.pockjax-old-PID-TAG`` (a directory being
#: replaced by :func:`atomic_directory`).
TEMP_PATTERN = re.compile(r"^(?P<target>.+)\.pockjax-(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def temporary_name(path: str | os.PathLike, kind: str = "tmp") -> str:
    """A fresh temporary sibling of ``path`` owned by this process.

    Example:
        >>> bool(TEMP_PATTERN.match(os.path.basename(temporary_name("/x/model.json"))))
        True
    """
    path = os.fspath(path)
    return f"{path}.pockjax-{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def is_temporary(name: str) -> bool:
    """Whether a file name is one of this module's temporaries.

    Example:
        >>> is_temporary("a.json.pockjax-tmp-12-0a1b2c3d"), is_temporary("a.json")
        (True, False)
    """
    return TEMP_PATTERN.match(os.path.basename(name)) is not None


def fsync_directory(path: str | os.PathLike) -> None:
    """fsyncs a directory, so that renames and new entries in it are durable."""
    try:
        fd = os.open(os.fspath(path) or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError as e:  # pragma: no cover - some file systems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike) -> None:
    """fsyncs every file and directory under ``path`` (and ``path`` itself)."""
    path = os.fspath(path)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            full = os.path.join(root, name)
            if os.path.islink(full):
                continue
            _fsync_file(full)
        fsync_directory(root)


def file_above(path: str | os.PathLike) -> str | None:
    """The nearest existing ancestor of ``path`` if it is not a directory (a file in the way), else None.

    Nothing can be written at ``path`` while such a file lies above it: an
    output check names it before any work, rather than the first write failing.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> write_text(os.path.join(d, "f"), "x")
        >>> file_above(os.path.join(d, "f", "new", "out")) == os.path.join(d, "f")
        True
        >>> file_above(os.path.join(d, "new", "out")) is None
        True
    """
    above = _parent(os.fspath(path))
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    return None if os.path.isdir(above) else above


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def _renamed_over(tmp: str, path: str) -> Iterator[None]:
    """Renames ``tmp`` over ``path`` after the block, or removes ``tmp`` if it raises."""
    try:
        yield
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(_parent(path))


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", *,
                encoding: str | None = None) -> Iterator[IO]:
    """Opens a temporary sibling of ``path`` for writing; on success it replaces ``path``.

    On a normal exit the file is flushed, fsynced, renamed over ``path`` and
    the directory is fsynced. On an exception the temporary is removed and
    ``path`` is left as it was.

    Args:
        path: The file to write.
        mode: ``"wb"`` or ``"w"`` (text, ``encoding`` defaults to UTF-8).
        encoding: Text encoding for ``"w"``.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "out.txt")
        >>> with atomic_open(p, "w") as f:
        ...     _ = f.write("hello")
        >>> open(p).read()
        'hello'
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode must be 'w' or 'wb', not {mode!r}")
    path = os.fspath(path)
    tmp = temporary_name(path)
    if mode == "w" and encoding is None:
        encoding = "utf-8"
    f = open(tmp, "x" + mode[1:], encoding=encoding)
    with _renamed_over(tmp, path), f:
        yield f
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_output_path(path: str | os.PathLike) -> Iterator[str]:
    """Yields a temporary path for a tool that writes the file; on success it replaces ``path``.

    For writers that take a file name rather than a file object (an IREE
    parameter archive, ``iree-compile -o``, ``savefig`` with an explicit
    ``format=``): the tool writes the temporary, which is then fsynced and
    renamed over ``path``. A tool that writes nothing fails the block.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "weights.irpa")
        >>> with atomic_output_path(p) as tmp:
        ...     with open(tmp, "wb") as f:
        ...         _ = f.write(b"IRPA")
        >>> open(p, "rb").read()
        b'IRPA'
    """
    path = os.fspath(path)
    tmp = temporary_name(path)
    with _renamed_over(tmp, path):
        yield tmp
        if not os.path.isfile(tmp):
            raise FileNotFoundError(f"the writer of {path} produced no file")
        _fsync_file(tmp)


def write_bytes(path: str | os.PathLike, data: bytes | bytearray | memoryview) -> None:
    """Writes ``data`` to ``path`` atomically and durably.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "b.bin")
        >>> write_bytes(p, b"\\x00\\x01")
        >>> open(p, "rb").read()
        b'\\x00\\x01'
    """
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8") -> None:
    """Writes ``text`` to ``path`` atomically and durably.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "t.txt")
        >>> write_text(p, "héllo")
        >>> open(p, encoding="utf-8").read()
        'héllo'
    """
    with atomic_open(path, "w", encoding=encoding) as f:
        f.write(text)


def save_figure(fig: Any, path: str | os.PathLike, *, dpi: int = 110) -> str:
    """Save a Matplotlib figure atomically (format from the file's extension), then close it.

    Example:
        >>> import os, tempfile
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig = plt.figure()
        >>> path = save_figure(fig, os.path.join(tempfile.mkdtemp(), "plot.png"))
        >>> open(path, "rb").read(8)[1:4]
        b'PNG'
    """
    import matplotlib.pyplot as plt

    path = os.fspath(path)
    try:
        with atomic_open(path, "wb") as f:
            fig.savefig(f, format=os.path.splitext(path)[1].lstrip(".").lower() or "png", dpi=dpi)
    finally:
        plt.close(fig)
    return path


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1,
               sort_keys: bool = False, ensure_ascii: bool = False, allow_nan: bool = False,
               **dump_kwargs: Any) -> None:
    """Writes ``obj`` as JSON (plus a final newline) atomically and durably.

    The object is serialised before anything is written, so an object that
    JSON cannot represent leaves the old file untouched.

    NaN and infinities are refused (``allow_nan=False``, unlike :func:`json.dumps`):
    they are not JSON, and a strict reader (:func:`pockjax.io.jsonfile.read_json`,
    so ``pockjax finetune --resume``) cannot read the file back. Write None
    (``null``) for a figure that is missing.

    Raises:
        InputError: ``obj`` holds NaN or an infinity; the message names ``path``
            and where in ``obj`` the value is.

    Example:
        >>> import tempfile
        >>> p = os.path.join(tempfile.mkdtemp(), "m.json")
        >>> write_json(p, {"loss": 0.5}, indent=None)
        >>> open(p).read()
        '{"loss": 0.5}\\n'
        >>> write_json(p, {"loss": [0.5, float("nan")]})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        pockjax.errors.InputError: cannot write .../m.json: it would hold nan at ["loss"][1], ...
    """
    try:
        text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=ensure_ascii,
                          allow_nan=allow_nan, **dump_kwargs)
    except ValueError as e:
        if allow_nan or not str(e).startswith("Out of range float values"):
            raise
        from pockjax.errors import InputError

        try:
            where = _non_finite_at(obj)
        except RecursionError:  # an object that holds itself
            where = None
        raise InputError(f"cannot write {os.fspath(path)}: it would hold "
                         + (f"{where[1]} at {where[0]}" if where else "NaN or Infinity")
                         + ", and NaN/Infinity are not JSON (a reader cannot load the file);"
                           " write null (None) for a value that is missing") from None
    write_text(path, text + "\n")


def nulls_for_non_finite(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, numbers) with every NaN or infinity replaced by None.

    For a report whose figures may be undefined (a gain over a diverged
    run): :func:`write_json` refuses non-finite numbers, and ``null`` is how
    JSON says "no figure".

    Example:
        >>> nulls_for_non_finite({"gain": float("inf"), "runs": [1.5, float("nan")], "name": "a"})
        {'gain': None, 'runs': [1.5, None], 'name': 'a'}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: nulls_for_non_finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nulls_for_non_finite(v) for v in obj]  # JSON has lists only
    return obj


def _non_finite_at(obj: Any, at: str = "") -> tuple[str, float] | None:
    """``(where, value)`` of the first NaN or infinity in ``obj`` (dicts, lists, tuples), or None.

    Example:
        >>> _non_finite_at({"a": [1.0, {"b": float("inf")}]})
        ('["a"][1]["b"]', inf)
    """
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (at or "the top level", obj)
    items = (obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple))
             else ())
    for k, v in items:
        found = _non_finite_at(v, f"{at}[{json.dumps(k) if isinstance(k, str) else k}]")
        if found:
            return found
    return None


# renameat2(2) with RENAME_EXCHANGE swaps two paths in one step (Linux >= 3.15).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swaps two existing paths; False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False  # pragma: no cover - old kernel or file system without exchange
    raise OSError(err, os.strerror(err), a)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[str]:
    """Builds a directory in a temporary sibling; on success it replaces ``path``.

    Yields the temporary directory to fill. On a normal exit every file in it
    is fsynced and it takes the place of ``path`` (an existing ``path`` is
    swapped out in one atomic step where the system supports it, and then
    removed). On an exception the temporary directory is removed and ``path``
    is left as it was. A process killed while writing leaves a temporary that
    :func:`remove_stale_temporaries` cleans up; one killed between the two
    renames of the fallback swap leaves ``NAME.pockjax-old-...``, which
    :func:`remove_stale_temporaries` moves back to ``path``.

    Example:
        >>> import tempfile
        >>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> with atomic_directory(out) as tmp:
        ...     write_text(os.path.join(tmp, "a.txt"), "1")
        >>> with atomic_directory(out) as tmp:
        ...     write_text(os.path.join(tmp, "b.txt"), "2")
        >>> os.listdir(out), len(os.listdir(os.path.dirname(out)))
        (['b.txt'], 1)
    """
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = temporary_name(path)
    os.mkdir(tmp)
    try:
        yield tmp
        fsync_tree(tmp)
        if os.path.lexists(path):
            if not _exchange(tmp, path):
                old = temporary_name(path, "old")
                os.rename(path, old)
                os.rename(tmp, path)
                tmp = old
        else:
            os.rename(tmp, path)
        fsync_directory(parent)
    finally:
        # after a successful swap ``tmp`` holds the previous directory
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.lexists(tmp):
            os.unlink(tmp)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id runs (on this machine, in this pid namespace).

    Example:
        >>> pid_alive(os.getpid()), pid_alive(999999999)
        (True, False)
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OverflowError:
        return False
    return True


def remove_stale_temporaries(directory: str | os.PathLike) -> list[str]:
    """Removes the temporaries in ``directory`` left by processes that no longer run.

    Only names matching :data:`TEMP_PATTERN` are touched, and only when the
    process id in the name is not alive, so a concurrent writer's temporary
    is kept. An interrupted directory swap (``NAME.pockjax-old-...`` with no
    ``NAME``) is repaired by moving the old directory back instead.

    Args:
        directory: The directory to clean (a missing directory is fine).

    Returns:
        The paths removed or restored.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> dead = os.path.join(d, "m.json.pockjax-tmp-999999999-00000000")
        >>> mine = temporary_name(os.path.join(d, "m.json"))
        >>> for p in (dead, mine):
        ...     write_text(p, "partial")
        >>> [os.path.basename(p) for p in remove_stale_temporaries(d)]
        ['m.json.pockjax-tmp-999999999-00000000']
        >>> os.path.exists(mine)
        True
    """
    directory = os.fspath(directory)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    done = []
    for name in names:
        m = TEMP_PATTERN.match(name)
        if m is None or pid_alive(int(m.group("pid"))):
            continue
        full = os.path.join(directory, name)
        target = os.path.join(directory, m.group("target"))
        if m.group("kind") == "old" and not os.path.lexists(target):
            os.rename(full, target)
        elif os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)
        done.append(full)
    if done:
        fsync_directory(directory)
    return done
