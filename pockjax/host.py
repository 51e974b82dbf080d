"""The host CPU and memory of in-process CPU steps.

:func:`cpu_vendor` names the host CPU's maker and :func:`cpu_has_avx512` says
whether it has AVX-512 (kernel choices that were measured to differ between
hosts key on them). The rest of this module reuses each step's working memory:

XLA's CPU client allocates a step's temporaries (about 1 GB for a full
SmolLM2-135M step) when the step starts and frees them when it ends. With JAX's
default asynchronous CPU dispatch that happens on a worker thread, whose glibc
arena serves every block above 32 MiB with a fresh ``mmap`` and returns it with
``munmap``: each step faulted its working memory in again, one zero-filled 4 KiB
page at a time (hundreds of thousands of minor faults per full SmolLM2 step;
the measurements are in docs/benchmarks.md).

:func:`keep_step_memory` runs CPU executions on the calling thread
(``jax_cpu_enable_async_dispatch=False``), whose allocations come from glibc's
main heap, and makes glibc keep freed heap memory mapped
(:func:`pockjax.runtime.retain_freed_heap`): after the first step a step
faults almost nothing in. The process keeps its peak heap between steps
instead of returning it; the peak itself does not grow.
"""

from __future__ import annotations

import warnings

from pockjax.runtime.heap import RETAIN_HEAP_ENV, heap_off_by_env, retain_freed_heap

_state = {"on": False}


def cpuinfo_field(key: str, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first ``key : value`` of ``cpuinfo`` (Linux), or ``""`` when absent or unreadable.

    Example:
      A file in the format of ``/proc/cpuinfo``, read by this function and by
      :func:`cpu_vendor` and :func:`cpu_has_avx512`:

      >>> import os, tempfile
      >>> with tempfile.TemporaryDirectory() as d:
      ...     path = os.path.join(d, "cpuinfo")
      ...     with open(path, "w") as f:
      ...         _ = f.write("processor\\t: 0\\nvendor_id\\t: AuthenticAMD\\n"
      ...                     "model name\\t: Some CPU\\nflags\\t: fpu avx2 avx512f avx512bw\\n")
      ...     print(repr(cpuinfo_field("model name", path)), repr(cpuinfo_field("bugs", path)))
      ...     print(cpu_vendor(path), cpu_has_avx512(path))
      'Some CPU' ''
      amd True
    """
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The host CPU's maker: ``"intel"``, ``"amd"``, or ``""`` when unknown.

    Read from the ``vendor_id`` line of ``cpuinfo`` (:func:`cpuinfo_field`);
    any other system, an unreadable file or another maker gives ``""``.

    Example:
      ``vendor_id : AuthenticAMD`` gives ``"amd"`` (:func:`cpuinfo_field`'s
      example); a missing file gives ``""``:

      >>> cpu_vendor("/no/such/file")
      ''
    """
    makers = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
    return makers.get(cpuinfo_field("vendor_id", cpuinfo), "")


def cpu_has_avx512(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the host CPU has AVX-512 (``avx512f`` among the ``flags`` of ``cpuinfo``).

    False when the file is unreadable or has no ``flags`` line (other systems).

    Example:
      ``flags : ... avx512f ...`` gives True (:func:`cpuinfo_field`'s
      example); a missing file gives False:

      >>> cpu_has_avx512("/no/such/file")
      False
    """
    return "avx512f" in cpuinfo_field("flags", cpuinfo).split()


def keep_step_memory(*, quiet: bool = False) -> bool:
    """Makes in-process CPU train steps reuse their working memory between steps.

    Sets ``jax_cpu_enable_async_dispatch`` to False (a CPU step runs on the
    thread that calls it; Python waits for it, as any step that reads its loss
    does anyway) and calls :func:`pockjax.runtime.retain_freed_heap`. Call it
    once, before the first JAX computation of the process: JAX reads the
    dispatch setting when it creates its CPU client. ``pockjax finetune`` and
    the pockjax rows of ``pockjax bench`` call it first thing.

    Args:
      quiet: Do not warn when it comes too late (JAX's backends already
        started) or is turned off.

    Returns:
      True if in effect. False when ``POCKJAX_RETAIN_HEAP=0`` turns it off,
      when glibc's ``mallopt`` is not there (musl, macOS), or when JAX had
      already started its backends with asynchronous CPU dispatch (a warning
      says so unless ``quiet``); nothing is changed then.

    Example:
      At the top of a training script, before any JAX computation::

          import pockjax
          pockjax.keep_step_memory()

      Once JAX has started its CPU client it is too late: nothing changes and
      it says so (here quietly); it returns whether the setting is in effect.

      >>> import jax.numpy as jnp
      >>> _ = jnp.zeros(2).block_until_ready()
      >>> keep_step_memory(quiet=True) == step_memory_kept()
      True
    """
    if _state["on"]:
        return True
    import jax

    from pockjax._compat import cpu_backend_started

    def _decline(why: str) -> bool:
        if not quiet:
            warnings.warn(f"pockjax.keep_step_memory: {why}", RuntimeWarning, stacklevel=3)
        return False

    if heap_off_by_env():
        return _decline(f"turned off by {RETAIN_HEAP_ENV}=0; CPU steps keep JAX's and glibc's defaults")
    if cpu_backend_started() and jax.config.read("jax_cpu_enable_async_dispatch"):
        return _decline("JAX has already started its CPU client with asynchronous dispatch; call "
                        "keep_step_memory() before the first JAX computation of the process "
                        "(right after the imports)")
    if not retain_freed_heap():
        return _decline("this C library has no glibc mallopt; nothing changed")
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    _state["on"] = True
    return True


def step_memory_kept() -> bool:
    """Whether :func:`keep_step_memory` is in effect in this process.

    Example:
      >>> import jax
      >>> step_memory_kept() == (step_memory_kept() and not jax.config.read("jax_cpu_enable_async_dispatch"))
      True
    """
    return _state["on"]
