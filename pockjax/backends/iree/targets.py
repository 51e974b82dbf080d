"""The one table of IREE compilation targets pockjax knows.

Each :class:`Target` maps a short name to the IREE HAL target backend, the
``iree-compile`` flags and the IREE runtime driver that runs the result.
:func:`resolve` applies per-call options (a specific CPU, GPU architecture,
extra flags) and returns a new ``Target``.

=========  ============  ==========================================  =============
name       backend       flags (defaults)                            driver
=========  ============  ==========================================  =============
cpu        llvm-cpu      target-cpu=host, data tiling + ukernels     local-task
arm64      llvm-cpu      triple aarch64-linux-gnu, +neon, generic    local-task
vulkan     vulkan-spirv  --iree-vulkan-target=generic (lavapipe ok)  vulkan
cuda       cuda          --iree-cuda-target=sm_80 (overridable*)     cuda
dsp        vmvx          portable VM bytecode kernels                local-task
=========  ============  ==========================================  =============

(*) IREE 3.13 fails for ``sm_90`` and newer ("missing GPU target",
iree-org/iree#22147); :func:`resolve` then compiles sm_80 PTX (JIT-compiled by
the driver on Hopper/Blackwell) and warns.

About ``dsp``: the IREE release pockjax is built on (iree-base-compiler 3.13)
ships LLVM with the X86, ARM, AArch64, RISC-V and WebAssembly backends only;
it has **no Hexagon backend**, so there is no true Hexagon DSP code
generation. What is real and offered instead:

- ``dsp`` (default): IREE's ``vmvx`` backend, whose kernels are portable VM
  bytecode interpreted by the IREE runtime; it runs on anything the runtime
  runs on (including bare-metal/embedded builds of the runtime), slowly.
- ``dsp`` with ``options={"triple": "riscv32-unknown-elf"}`` (or any other
  embedded triple the bundled LLVM supports) and ``static_library=path``:
  llvm-cpu emits a static object + header for linking into a firmware image
  with IREE's static library loader (``--iree-llvmcpu-link-static`` and
  ``--iree-llvmcpu-static-library-output-path``). pockjax compiles this but
  cannot run it here.

Example:
    >>> from pockjax.backends.iree import targets
    >>> t = targets.resolve("arm64", cpu="cortex-a76")
    >>> t.driver, "--iree-llvmcpu-target-cpu=cortex-a76" in t.flags
    ('local-task', True)
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pockjax.errors import TargetError

__all__ = [
    "Target", "TARGETS", "resolve", "names", "DEFAULT_CUDA_ARCH", "DEFAULT_VULKAN_TARGET", "DATA_TILING_FLAGS",
    "DATA_TILING_MIN_MACS",
]

DEFAULT_CUDA_ARCH = "sm_80"
# "generic" is not a real vendor target; IREE's Vulkan backend accepts a
# small set of portable names. Lavapipe (Mesa's CPU Vulkan) advertises
# Vulkan 1.3 with subgroups but not cooperative matrices; IREE's
# "vp_android_baseline_2022" profile is the most conservative documented
# target and works on lavapipe, see ``_vulkan_flags``.
DEFAULT_VULKAN_TARGET = "vp_android_baseline_2022"


@dataclass(frozen=True)
class Target:
    """A named IREE compilation target.

    Attributes:
      name: pockjax target name (``cpu``, ``arm64``, ``vulkan``, ``cuda``, ``dsp``).
      backend: IREE HAL target backend (``--iree-hal-target-backends``).
      driver: IREE runtime driver / device URI that runs the module.
      flags: full list of ``iree-compile`` flags (backend selection included).
      triple: LLVM target triple for CPU backends, else None.
      runs_in_process: whether this machine can run the module with the
        in-process runtime (False for cross-compiled CPU modules).
      description: one line for humans.
    """

    name: str
    backend: str
    driver: str
    flags: tuple[str, ...]
    triple: str | None = None
    description: str = ""
    options: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "driver": self.driver,
            "flags": list(self.flags),
            "triple": self.triple,
            "options": dict(self.options),
        }


# Data tiling + microkernels for llvm-cpu matmuls (the ``data_tiling`` option, on for ``cpu``).
# Without it, IREE 3.13's llvm-cpu codegen tiles a matmul's parallel dims only and reads
# its operands in place; on a LLaMA train step (znver3, AVX2, 2 cores) the transposed and
# long-reduction matmuls of the backward ran 3-4x slower than XLA's (e.g. the SmolLM2 LM
# head's input gradient, 512x576x49152: 1.6 s against XLA's 0.38 s; its weight gradient,
# 49152x576x512 with a transposed operand: 1.7 s against 0.55 s), and the width-576 layer
# matmuls 1.5-2.2x. With data tiling every matmul operand is packed into the mmt4d tile
# layout (one copy per step, also for weights since they change every step) and run by
# the mmt4d ukernel: the layer matmuls reach XLA's speed in every operand layout
# (0.8-1.2x, packing included) and the LM-head gradient matmuls 1.1-2.3x. Needs the
# ``llvmcpu-no-multi-use-fusion`` workaround (pockjax.backends.iree.WORKAROUNDS).
# On small steps the packing dispatches cost more than they save (the tiny test LLaMA,
# width 64: 3.9 ms without against 8.9 ms with, XLA 3.3 ms), so the ``cpu`` default is
# ``"auto"``: pockjax.backends.iree.compile_flat turns data tiling on when the step has a
# matmul of at least DATA_TILING_MIN_MACS multiply-adds.
DATA_TILING_FLAGS = ("--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all")
DATA_TILING_MIN_MACS = 1 << 26


def _cpu_flags(triple: str | None, cpu: str | None, features: str | None, data_tiling: bool = False) -> list[str]:
    f = []
    if triple:
        f.append(f"--iree-llvmcpu-target-triple={triple}")
    if cpu:
        f.append(f"--iree-llvmcpu-target-cpu={cpu}")
    if features:
        f.append(f"--iree-llvmcpu-target-cpu-features={features}")
    if data_tiling:
        f += DATA_TILING_FLAGS
    return f


def _host_triple() -> str:
    import platform

    m = platform.machine().lower()
    m = {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)
    return f"{m}-unknown-linux-gnu"


# name -> (backend, driver, default options, description)
_TABLE: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "cpu": (
        "llvm-cpu",
        "local-task",
        {"cpu": "host", "data_tiling": "auto"},
        "this machine's CPU (llvm-cpu, host CPU features, data-tiled matmuls on ukernels)",
    ),
    "arm64": (
        "llvm-cpu",
        "local-task",
        {"triple": "aarch64-linux-gnu", "cpu": "generic", "features": "+neon"},
        "64-bit ARM Linux CPU with NEON (cross-compiled; run on the device or under qemu-aarch64)",
    ),
    "vulkan": (
        "vulkan-spirv",
        "vulkan",
        {"arch": DEFAULT_VULKAN_TARGET},
        "any Vulkan 1.1+ GPU via SPIR-V (tested on Mesa lavapipe)",
    ),
    "cuda": ("cuda", "cuda", {"arch": DEFAULT_CUDA_ARCH}, "NVIDIA GPU via PTX (arch overridable, e.g. sm_90)"),
    "dsp": (
        "vmvx",
        "local-task",
        {},
        "DSP-style/embedded: portable vmvx bytecode (no Hexagon backend in released IREE)",
    ),
}

TARGETS: Mapping[str, tuple[str, str, dict[str, Any], str]] = _TABLE


def names() -> list[str]:
    """The target names, in table order."""
    return list(_TABLE)


def resolve(
    target: "str | Target",
    *,
    cpu: str | None = None,
    features: str | None = None,
    arch: str | None = None,
    triple: str | None = None,
    static_library: str | None = None,
    stack_allocation_limit: int | None = None,
    data_tiling: bool | None = None,
    extra_flags: Sequence[str] = (),
    **unknown: Any,
) -> Target:
    """Returns the :class:`Target` for ``target`` with options applied.

    Args:
      target: a name from the table (or a ``Target``, returned unchanged
        except for the given options... pass options only with names).
      cpu: LLVM CPU name for CPU targets (``host``, ``cortex-a76``, ``znver4``).
      features: LLVM CPU features for CPU targets (``+neon,+dotprod``).
      arch: GPU architecture: ``sm_XX`` for cuda, an IREE Vulkan target name
        (``rdna3``, ``valhall``, ``ampere``, ``vp_android_baseline_2022``) for vulkan.
      triple: LLVM triple for CPU targets; for ``dsp`` it switches from vmvx
        to llvm-cpu code generation for that (embedded) triple.
      static_library: for CPU targets, also write a static object (+ ``.h``)
        to this path for linking into firmware (IREE's static library loader).
      stack_allocation_limit: llvm-cpu per-dispatch stack limit in bytes
        (power of two); see ``pockjax.backends.iree.WORKAROUNDS``.
      extra_flags: passed through to ``iree-compile`` last.

    Raises:
      ValueError: unknown target or option, or an option that does not apply.
    """
    if isinstance(target, Target):
        return target
    if unknown:
        raise TargetError(f"unknown target options {sorted(unknown)}; known: cpu, features, arch, triple, "
                         "static_library, stack_allocation_limit, data_tiling, extra_flags")
    if target not in _TABLE:
        raise TargetError(f"unknown IREE target {target!r}; known targets: {names()}")
    backend, driver, defaults, desc = _TABLE[target]
    opts = dict(defaults)
    given = {"cpu": cpu, "features": features, "arch": arch, "triple": triple}
    for k, v in given.items():
        if v is not None:
            opts[k] = v
    if static_library is not None:
        opts["static_library"] = static_library
    if stack_allocation_limit is not None:
        opts["stack_allocation_limit"] = int(stack_allocation_limit)
    if data_tiling is not None:
        opts["data_tiling"] = data_tiling if data_tiling == "auto" else bool(data_tiling)

    if target == "dsp" and triple is not None:
        backend = "llvm-cpu"
        desc = f"embedded CPU code for {triple} (llvm-cpu)"

    flags = [f"--iree-hal-target-backends={backend}"]
    out_triple = None
    if backend == "llvm-cpu":
        if any(k in given and given[k] is not None for k in ("arch",)):
            raise TargetError(f"option 'arch' applies to GPU targets, not {target!r}; use cpu= or features=")
        out_triple = opts.get("triple") or _host_triple()
        flags += _cpu_flags(opts.get("triple"), opts.get("cpu"), opts.get("features"), opts.get("data_tiling") is True)
        if "static_library" in opts:
            flags += ["--iree-llvmcpu-link-embedded=false", "--iree-llvmcpu-link-static",
                      f"--iree-llvmcpu-static-library-output-path={opts['static_library']}"]
        if "stack_allocation_limit" in opts:
            flags.append(f"--iree-llvmcpu-stack-allocation-limit={opts['stack_allocation_limit']}")
    else:
        bad = [k for k in ("cpu", "features", "triple") if given.get(k) is not None and not (target == "dsp")]
        if bad:
            raise TargetError(f"options {bad} apply to CPU targets, not {target!r}")
        if "static_library" in opts or "stack_allocation_limit" in opts or data_tiling is not None:
            raise TargetError(
                f"static_library/stack_allocation_limit/data_tiling apply to llvm-cpu targets, not {target!r}"
            )
        if backend == "cuda":
            arch = str(opts["arch"])
            m = re.fullmatch(r"sm_(\d+)a?", arch)
            if m and int(m.group(1)) >= 90:
                # iree-base-compiler 3.13 has no target details for sm_90+ and fails with
                # "missing GPU target in #hal.executable.target" (iree-org/iree#22147).
                # The module embeds PTX, which the CUDA driver JIT-compiles for newer GPUs,
                # so sm_80 PTX runs on Hopper/Blackwell.
                warnings.warn(
                    f"IREE 3.13 cannot compile for {arch} (iree-org/iree#22147); compiling sm_80 PTX, "
                    "which the CUDA driver JIT-compiles for this GPU",
                    stacklevel=2,
                )
                opts["arch_requested"] = arch
                opts["arch"] = arch = "sm_80"
            flags.append(f"--iree-cuda-target={arch}")
        elif backend == "vulkan-spirv":
            flags.append(f"--iree-vulkan-target={opts['arch']}")
    flags += list(extra_flags)
    if extra_flags:
        opts["extra_flags"] = list(extra_flags)
    return Target(
        name=target,
        backend=backend,
        driver=driver,
        flags=tuple(flags),
        triple=out_triple,
        description=desc,
        options=opts,
    )


def with_flags(target: Target, *flags: str) -> Target:
    """A copy of ``target`` with more ``iree-compile`` flags appended."""
    return dataclasses.replace(target, flags=tuple(target.flags) + tuple(flags))
