"""The process's host memory around IREE steps: heap retention, resident size, growth.

NumPy and the C library only (no JAX, no ``iree.runtime``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from .metadata import ModuleError

# -- the host heap of local CPU drivers ------------------------------------------------
#
# An IREE step on the local CPU drivers allocates its transient buffers from the host
# heap when it starts and frees them when it ends. glibc serves allocations above its
# mmap threshold (128 KiB, adapting up to 32 MiB) with a fresh mmap, gives them back
# with munmap on free, and trims the top of the heap above 128 KiB of free space, so
# every step faulted its working memory in again, one zero-filled 4 KiB page at a time:
# SmolLM2-135M's `paper` step took about 172,000 minor faults (700 MB) per step, and
# 1.6-2.2 s against 1.3-1.5 s with the memory kept (2-core Xeon, docs/deploying.md).

#: Environment variable: ``0`` (or ``false``/``no``/``off``) keeps glibc's heap defaults.
RETAIN_HEAP_ENV = "POCKJAX_RETAIN_HEAP"
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's <malloc.h>
_heap = {"retained": False}


def retain_freed_heap() -> bool:
    """Makes glibc keep freed heap memory mapped, so IREE steps stop page-faulting.

    Sets glibc's ``M_MMAP_MAX`` to 0 (no ``mmap`` for allocations from the main
    heap) and ``M_TRIM_THRESHOLD`` to 2 GiB (no trimming below that much free
    memory at the top of the heap): freed blocks stay in the process and the
    next step's transient buffers reuse them instead of being faulted in again.
    The process then holds on to its peak heap between steps instead of giving
    it back to the system; the peak itself does not change. Allocations of
    other threads' glibc arenas (XLA's worker threads) are not affected: those
    arenas fall back to ``mmap`` for large blocks whatever the setting
    (:func:`pockjax.keep_step_memory` moves in-process XLA steps onto the
    calling thread, whose allocations come from the main heap).

    pockjax calls it when it opens a device on a local CPU driver
    (:data:`HEAP_DRIVERS`: the in-process ``pockjax.compile(...,
    target="cpu")`` step and :func:`load`). Idempotent and process-wide.

    Returns:
      True if the setting is in effect (now or from an earlier call); False
      when ``POCKJAX_RETAIN_HEAP=0`` turns it off or the C library has no
      ``mallopt`` (musl, macOS).

    Example:
      >>> on = retain_freed_heap()   # False off glibc, or with POCKJAX_RETAIN_HEAP=0
      >>> heap_retained() == on
      True
    """
    if _heap["retained"]:
        return True
    if heap_off_by_env():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _heap["retained"] = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _heap["retained"]


def release_free_heap() -> bool:
    """Gives the free pages inside glibc's heap back to the system (``malloc_trim(0)``).

    With :func:`retain_freed_heap` in effect the heap keeps every page it
    ever used, so the memory of one phase of a run (loading the weights,
    compiling, generating for an evaluation) that the next phase cannot reuse
    whole (a step's temporaries are one large block) stays resident beside
    it. Called between phases, this keeps the process's resident memory near
    what is live; the steps of one phase still reuse their memory.

    Returns:
      Whether memory was released (False off glibc).

    Example:
      >>> isinstance(release_free_heap(), bool)
      True
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def heap_off_by_env() -> bool:
    """Whether ``POCKJAX_RETAIN_HEAP`` (:data:`RETAIN_HEAP_ENV`) turns the heap setting off.

    Example:
      >>> import os
      >>> from unittest import mock
      >>> with mock.patch.dict(os.environ, {"POCKJAX_RETAIN_HEAP": " Off"}):
      ...     heap_off_by_env()
      True
      >>> with mock.patch.dict(os.environ, {"POCKJAX_RETAIN_HEAP": "1"}):
      ...     heap_off_by_env()
      False
    """
    return os.environ.get(RETAIN_HEAP_ENV, "").strip().lower() in ("0", "false", "no", "off")


def heap_retained() -> bool:
    """Whether :func:`retain_freed_heap` is in effect in this process.

    Example:
      >>> heap_retained() in (True, False)
      True
    """
    return _heap["retained"]


#: Drivers whose buffers live in the host heap; opening one calls
#: :func:`retain_freed_heap` (``POCKJAX_RETAIN_HEAP=0`` to keep glibc's defaults).
HEAP_DRIVERS = ("local-task", "local-sync")


# IREE 3.13's local-task device serves each queue allocation larger than its 64 MiB pool
# slab from a pass-through pool, and a train step's transient slabs above that size are
# not given back: the process grows by about one such slab per step, without bound
# (SmolLM2-135M's `paper` step at batch 4 x 128: 360-380 MB per step; none at batch 1,
# whose transients fit a slab, nor on local-sync, whose allocations bypass the pools).
# Destroying the device frees it. StatefulModule warns once when it sees this growth.
MEMORY_GROWTH_DRIVERS = ("local-task",)
MEMORY_GROWTH_ENV = "POCKJAX_IREE_GROWTH_WARN_MB"
MEMORY_GROWTH_DEFAULT_MB = 2048


class MemoryGrowthWarning(ResourceWarning):
    """The process kept growing while an IREE step ran (see ``MEMORY_GROWTH_DRIVERS``)."""


def _growth_warn_bytes() -> int:
    raw = os.environ.get(MEMORY_GROWTH_ENV, "")
    try:
        mb = float(raw) if raw.strip() else MEMORY_GROWTH_DEFAULT_MB
    except ValueError as e:
        raise ModuleError(f"{MEMORY_GROWTH_ENV}={raw!r} is not a number of MiB (0 turns the check off)") from e
    return max(0, int(mb * 2**20))


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``None`` where ``/proc`` is missing).

    Example:
      >>> rss = process_rss_bytes()
      >>> rss is None or rss > 0
      True
    """
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
