"""PyTorch's matmuls on a non-Intel x86 CPU: Intel MKL's vendor check.

PyTorch's x86 CPU builds do their float32 matrix products with Intel MKL. MKL
picks its kernels by the CPU's vendor: on a CPU that does not say
``GenuineIntel`` it takes generic code paths whatever the instruction set. On
the project's 2-core AMD EPYC with AVX-512 (Zen 5, 2026-11-24) a
512 x 576 x 1536 ``torch.mm`` ran at 212 GFLOP/s (the SmolLM2 projection
shapes at 212-219, the answer-window output projection at 125), against 472
for XLA's on the same machine; with MKL's vendor check answered "Intel" the
same products ran at 458-498 GFLOP/s (314 for the output projection).

``pockjax bench --torch-mkl-any-cpu`` runs the PyTorch rows that way, so that a
comparison on such a host is against PyTorch at its best rather than MKL's
generic path: :func:`build_vendor_shim` compiles a one-function shared library
that answers MKL's internal ``mkl_serv_intel_cpu_true`` with 1, and
:func:`preload_env` puts it in ``LD_PRELOAD`` of the PyTorch rows' processes.
MKL then picks kernels by the instruction set alone. The results record the
setting, and the table says which way PyTorch ran.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from pockjax.errors import PockjaxError
from pockjax.io.atomic import atomic_output_path, remove_stale_temporaries, write_text

__all__ = ["build_vendor_shim", "preload_env", "VendorShimError"]

SHIM_NAME = "libpockjax_mkl_any_cpu.so"

_SOURCE = """\
/* Answers Intel MKL's CPU-vendor check with "Intel", so that MKL picks its
   kernels by instruction set on any x86 CPU (pockjax bench --torch-mkl-any-cpu). */
int mkl_serv_intel_cpu_true(void) { return 1; }
"""


class VendorShimError(PockjaxError, RuntimeError):
    """The MKL vendor shim could not be built (no C compiler, or it failed)."""


def build_vendor_shim(directory: str, compiler: str | None = None) -> str:
    """Compiles the MKL vendor shim into ``directory`` and returns its path.

    Args:
      directory: Where the source and the shared library go (created).
      compiler: C compiler; default ``$CC`` or ``cc``.

    Raises:
      VendorShimError: no such compiler, or it failed (its output is in the
        message).

    Example:
      >>> import os, tempfile
      >>> path = build_vendor_shim(tempfile.mkdtemp())
      >>> os.path.basename(path), os.path.getsize(path) > 0
      ('libpockjax_mkl_any_cpu.so', True)
    """
    compiler = compiler or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise VendorShimError(
            f"--torch-mkl-any-cpu needs a C compiler to build its {SHIM_NAME}, and {compiler!r}"
            " is not on PATH: install one (apt-get install gcc) or set CC")
    os.makedirs(directory, exist_ok=True)
    src = os.path.join(directory, "mkl_any_cpu.c")
    out = os.path.join(directory, SHIM_NAME)
    remove_stale_temporaries(directory)
    write_text(src, _SOURCE)
    # the compiler writes a temporary, renamed over the library only once it succeeded
    # (a process that has the old library preloaded keeps its mapping)
    try:
        with atomic_output_path(out) as tmp:
            proc = subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", tmp, src],
                                  capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(tmp):
                raise VendorShimError(f"building {SHIM_NAME} with {compiler} failed (exit {proc.returncode}):\n"
                                      f"{(proc.stdout + proc.stderr).strip()}")
    except OSError as e:
        raise VendorShimError(f"building {SHIM_NAME} with {compiler} failed: {e}") from None
    return out


def preload_env(env: dict, shim: str) -> dict:
    """A copy of ``env`` with ``shim`` first in ``LD_PRELOAD`` (earlier entries kept).

    Example:
      >>> preload_env({"LD_PRELOAD": "/a.so"}, "/s.so")["LD_PRELOAD"]
      '/s.so:/a.so'
      >>> preload_env({}, "/s.so")["LD_PRELOAD"]
      '/s.so'
    """
    out = dict(env)
    out["LD_PRELOAD"] = ":".join(p for p in (shim, env.get("LD_PRELOAD", "")) if p)
    return out
