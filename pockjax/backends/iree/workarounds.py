"""Known IREE compiler failures on train steps, and what avoids each.

:data:`WORKAROUNDS` is the one registry: each :class:`Workaround` names the
symptom (a substring of IREE's error), the backends it applies to by default,
and the ``iree-compile`` flags or graph rewrite (:mod:`.rewrites`) that
avoids it. :func:`pockjax.backends.iree.compile_flat` applies the defaults of
a target; a failure whose diagnostics contain a known symptom names the
workaround in its error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from pockjax.backends.iree import rewrites as _rewrites
from pockjax.backends.iree import targets as _targets

__all__ = ["Workaround", "WORKAROUNDS", "default_workarounds"]


@dataclass(frozen=True)
class Workaround:
    """A fix for a known IREE failure.

    Attributes:
      name: short id, used in ``compile_flat(..., workarounds=...)``.
      symptom: the substring of the IREE error it fixes.
      applies_to: backends (``llvm-cpu``, ``cuda``...) it is applied for by default.
      flags: extra ``iree-compile`` flags.
      rewrite: optional StableHLO text -> text rewrite.
      fun_rewrite: optional ``(fun, flat_avals) -> fun`` graph rewrite applied
        before export (see :mod:`pockjax.backends.iree.rewrites`).
      why: what goes wrong and why this helps.
      requires_flag: applied by default only to targets whose flags include
        this one (a workaround for a failure that only that flag brings).
      default: applied by default where it applies; ``False`` for an
        alternative that is only applied when named.
      retry: applied after a failure with its symptom where it applies:
        :func:`pockjax.backends.iree.compile_flat` compiles once more with it
        (for a fix too costly to apply to every program).
    """

    name: str
    symptom: str
    applies_to: tuple[str, ...]
    flags: tuple[str, ...] = ()
    rewrite: Callable[[str], str] | None = None
    fun_rewrite: Callable[[Callable, Sequence[Any]], Callable] | None = None
    why: str = ""
    requires_flag: str | None = None
    default: bool = True
    retry: bool = False


WORKAROUNDS: dict[str, Workaround] = {}


def _register(w: Workaround) -> Workaround:
    WORKAROUNDS[w.name] = w
    return w


_register(
    Workaround(
        name="cuda-reduction-distribution",
        symptom="failed to get neutral element for reduction",
        applies_to=("cuda",),
        flags=("--iree-codegen-llvmgpu-use-reduction-vector-distribution=false",),
        why=(
            "The backward of log-softmax cross-entropy sums the incoming gradient over each "
            "row (fused with the scatter-add or select that produced it). IREE 3.13's LLVMGPU "
            "reduction vector-distribution pipeline picks that dispatch and fails to tile it "
            "('failed to get neutral element for reduction', 'tiling of level PartialReduction "
            "failed'). Turning that pipeline off makes IREE use its generic GPU reduction "
            "lowering, which compiles it."
        ),
    )
)


_register(
    Workaround(
        name="llvmcpu-no-aggressive-fusion",
        symptom="exceeded stack allocation limit",
        applies_to=("llvm-cpu",),
        flags=("--iree-dispatch-creation-enable-aggressive-fusion=false",),
        why=(
            "With aggressive dispatch fusion (on at --iree-opt-level=O3), IREE 3.13 fuses the "
            "embedding gradient (a scatter-add of every token's row into the table) with its "
            "producers and keeps a tile of tokens x dim on the stack; past 32 KiB llvm-cpu "
            "refuses it ('exceeded stack allocation limit'), and raising the limit only trades "
            "that for a worker-stack overflow at run time (IREE's task workers have 128 KiB). "
            "Keeping aggressive fusion off (last flag wins, so this holds even with O3) gives "
            "the scatter its own dispatch, which needs no stack."
        ),
    )
)


_register(
    Workaround(
        name="vulkan-merge-reduced-axes",
        symptom="(no compiler error: wrong values from a sum, max or min over several axes)",
        applies_to=("vulkan-spirv",),
        fun_rewrite=_rewrites.merge_reduced_axes,
        why=(
            "IREE 3.13's vulkan-spirv backend computes x - mean(x, axes=(0, 1, 2)) of an NHWC "
            "tensor (BatchNorm's centring, in its forward and backward) wrongly on Mesa "
            "lavapipe, without any error: values off by up to 1e32 for a (4, 4, 4, 24) input, "
            "and a MobileNetV2 step's gradients wrong below the head. The mean alone is right, "
            "and so is the same computation with the three axes merged into one by a reshape. "
            "The same holds for a max or min over several axes (x - x.max((0, 1, 2)): errors up "
            "to 1e37), for axes that are not neighbours, and inside a scan's body (a step's losses "
            "NaN). The rewrite takes every sum, max and min over several axes over one merged axis "
            "(a transpose first moves axes that are not neighbours last), in loop and branch "
            "bodies too (pockjax.backends.iree.rewrites.merge_reduced_axes); "
            "tests/test_vision_export.py checks each case and the whole step against XLA."
        ),
    )
)


_register(
    Workaround(
        name="scatter-add-to-select",
        symptom="op expected indices to be equal to batch rank or batch rank + 1",
        applies_to=("llvm-cpu", "vmvx", "vulkan-spirv", "cuda"),
        fun_rewrite=_rewrites.scatter_add_to_select,
        why=(
            "The backward of take_along_axis (cross-entropy picking the target log-prob) is a "
            "scatter-add into zeros. With batch size 1 JAX emits it with a size-1 window dim next "
            "to a batching dim, which IREE's StableHLO conversion rejects on every backend. Each "
            "logit gets at most one update, so the scatter is rewritten as operand + "
            "where(iota == index, update, 0). See pockjax.backends.iree.rewrites."
        ),
    )
)


_register(
    Workaround(
        name="cond-as-select",
        symptom="ref is null; while invoking native function hal.buffer_view.create",
        applies_to=("llvm-cpu", "vmvx", "vulkan-spirv", "cuda"),
        fun_rewrite=_rewrites.cond_as_select,
        why=(
            "A lax.cond one of whose branches returns an operand unchanged beside an integer "
            "operand (optax.apply_if_finite(adam): the skipped update keeps the state and the "
            "count) compiles, but every call fails in IREE 3.13's runtime with 'ref is null; while "
            "invoking native function hal.buffer_view.create', with finite inputs too; an "
            "optimization barrier on the branch outputs does not help. Computing every branch and "
            "selecting the taken one's values (pockjax.backends.iree.rewrites.cond_as_select) gives "
            "the same values and runs; the untaken branch's work is computed and dropped."
        ),
    )
)


_register(
    Workaround(
        name="llvmcpu-no-multi-use-fusion",
        symptom="One or more operations with large vector sizes",
        applies_to=("llvm-cpu",),
        flags=("--iree-dispatch-creation-fuse-multi-use=false",),
        requires_flag="--iree-opt-data-tiling=true",
        why=(
            "With data tiling (the cpu target's default), IREE 3.13 fuses the packing of a "
            "matmul operand (set_encoding) into the dispatch that produces it, also when that "
            "producer has other uses. In the full fine-tuning step the RMSNorm backward yields a "
            "gradient and its transpose from one elementwise op, both packed for the "
            "weight-gradient matmuls; llvm-cpu vectorises that pack of a transposed result as one "
            "64x64 vector and refuses it ('One or more operations with large vector sizes (16384 "
            "bytes)'); turning that check off only trades it for 'exceeded stack allocation "
            "limit' and a 9-minute compile. A second failure of the same family: a weight "
            "gradient over few tokens (batch 1 x 64, or the LM head's gradient over the answer "
            "window, 64 positions) whose AdamW moments are fused into its dispatch needs 145-290 "
            "KiB of stack ('exceeded stack allocation limit'). Both fused producers have several "
            "uses; with multi-use fusion off each keeps its own dispatch. (The alternative "
            "'dot-operands-behind-barrier' avoids the same failures, but every barrier became a "
            "host-side wait in IREE's stream schedule: 354 command buffers per SmolLM2 paper "
            "step against 5 with this flag, and a slower step.)"
        ),
    )
)


_register(
    Workaround(
        name="dot-operands-behind-barrier",
        symptom="One or more operations with large vector sizes",
        applies_to=("llvm-cpu",),
        fun_rewrite=_rewrites.dot_operands_behind_barrier,
        requires_flag="--iree-opt-data-tiling=true",
        default=False,
        why=(
            "An alternative to 'llvmcpu-no-multi-use-fusion', applied only when named: every "
            "computed dot_general operand passes through lax.optimization_barrier, which keeps its "
            "packing in its own dispatch (the values are unchanged), and the result of a batch-free "
            "matmul with a contraction shorter than 256 is fenced as well. Step inputs are left "
            "unfenced, so the packing of a frozen weight in an immutable global can be hoisted to "
            "load time. IREE's stream scheduling turns each barrier into a host-side wait between "
            "command buffers (0.4 s of idle time per SmolLM2 paper step), so the flag is the default."
        ),
    )
)


_register(
    Workaround(
        name="unroll-scans",
        symptom="circular dependency: input operation uses partition output",
        applies_to=("llvm-cpu", "vmvx", "vulkan-spirv", "cuda"),
        fun_rewrite=_rewrites.unroll_scans,
        default=False,
        retry=True,
        why=(
            "IREE 3.13 fails to partition the backward of a lax.scan whose body reads a value from "
            "outside the loop (an RNN's shared weight, a bias closed over): the loop accumulates that "
            "value's gradient in its carry, and stream partitioning reports 'circular dependency: "
            "input operation uses partition output' (plain jax.jit's StableHLO fails the same way, "
            "flags do not help). A scan over stacked weights (a scanned stack of layers) compiles. "
            "Unrolling every scan (pockjax.backends.iree.rewrites.unroll_scans) leaves no loop to "
            "partition: the same values, a longer compile. Too costly for every program, it is "
            "applied on a retry after the failure."
        ),
    )
)


def default_workarounds(target: _targets.Target) -> list[str]:
    """Names of the workarounds applied by default for a target."""
    return [
        w.name
        for w in WORKAROUNDS.values()
        if w.default and target.backend in w.applies_to
        and (w.requires_flag is None or w.requires_flag in target.flags)
    ]
