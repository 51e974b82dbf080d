"""Weights as IREE parameter archives (``.irpa``) of named NumPy arrays."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from typing import Iterator, Mapping

import numpy as np

from .metadata import ModuleError


def save_weights(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes named arrays to an IREE parameter archive (``.irpa``).

    Each entry's metadata holds its dtype and shape as JSON so that
    :func:`load_weights` can rebuild the arrays; the payload is the raw
    little-endian bytes, which is what IREE's parameter providers serve to
    modules that read parameters by name.
    """
    import iree.runtime as rt

    index = rt.ParameterIndex()
    keep = []
    for name, a in arrays.items():
        a = np.array(a, order="C", copy=True)  # (np.ascontiguousarray would make 0-d arrays 1-d)
        keep.append(a)
        meta = json.dumps({"dtype": a.dtype.name, "shape": list(a.shape)})
        # add_buffer needs a non-empty buffer; scalars are fine, empty arrays are not.
        index.add_buffer(name, a.reshape(-1).view(np.uint8) if a.size else np.zeros(1, np.uint8), metadata=meta)
    with _atomic_output_path(path) as tmp:
        index.create_archive_file(tmp)


@contextlib.contextmanager
def _atomic_output_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary sibling for a writer that takes a file name; fsynced and renamed over ``path``.

    The same steps and temporary name (``NAME.pockjax-tmp-PID-TAG``) as
    ``pockjax.io.atomic.atomic_output_path``, which
    ``pockjax.io.atomic.remove_stale_temporaries`` cleans up after a killed
    process; written out here because the runtime imports nothing of pockjax
    outside itself (its folder also runs copied to a device on its own).
    """
    path = os.fspath(path)
    tmp = f"{path}.pockjax-tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        if not os.path.isfile(tmp):
            raise ModuleError(f"the writer of {path} produced no file")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on a directory
        pass
    finally:
        os.close(fd)


def load_weights(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Reads an archive written by :func:`save_weights` into NumPy arrays (copies)."""
    import iree.runtime as rt

    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModuleError(f"weights file {path!r} does not exist")
    if os.path.isdir(path):
        raise ModuleError(f"{path!r} is a directory; give the archive inside it (for an export: "
                          f"{os.path.join(path, 'weights.irpa')!r})")
    index = rt.ParameterIndex()
    index.load(path, mmap=False)
    out: dict[str, np.ndarray] = {}
    for key, entry in index.items():
        try:
            meta = json.loads(bytes(entry.metadata).decode())
            dtype, shape = np.dtype(meta["dtype"]), tuple(meta["shape"])
        except Exception as e:  # noqa: BLE001 - report any malformed entry the same way
            raise ModuleError(f"{path}: entry {key!r} has no pockjax dtype/shape metadata") from e
        raw = np.frombuffer(entry.file_view, dtype=np.uint8)
        n = int(np.prod(shape, dtype=np.int64))
        out[key] = raw[: n * dtype.itemsize].view(dtype).reshape(shape).copy()
    return out
