"""The planner: trace a step from abstract shapes, run the liveness, compare with XLA.

``plan`` never allocates the arguments: it traces with ``jax.ShapeDtypeStruct`` leaves
(``jax.make_jaxpr`` accepts them), so a LLaMA-2-7B step is planned on a laptop.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pockjax.memory.liveness import MemoryReport, analyze, format_bytes

__all__ = ["Plan", "XlaComparison", "plan", "xla_memory", "compare_with_xla", "compare_report", "flat_roles"]

_STATE_ROLES = ("param", "opt_state", "model_state")


def _default_roles(n_args: int) -> tuple[str, ...]:
    if n_args == 3:
        return ("param", "opt_state", "batch")
    if n_args == 2:
        return ("param", "batch")
    raise ValueError(
        f"cannot guess the roles of {n_args} arguments; pass roles=('param', 'opt_state', 'batch', ...)"
    )


def flat_roles(tree: Any, roles: Any) -> list[str]:
    """One role per leaf of ``tree``, from ``roles``: a pytree prefix of ``tree`` with
    role strings at its leaves (one string per argument is the common case).

    Args:
      tree: a pytree (e.g. the tuple of step arguments).
      roles: a string, or a prefix pytree of strings.

    Returns:
      A list with one role per leaf of ``tree``, in flattening order.

    Example:
      >>> flat_roles(({"w": 1, "b": 2}, (3,), 4), ("param", "opt_state", "batch"))
      ['param', 'param', 'opt_state', 'batch']
    """
    if isinstance(roles, str):
        return [roles] * len(jax.tree.leaves(tree))
    per_leaf = jax.tree.map(
        lambda role, sub: [role] * len(jax.tree.leaves(sub)),
        roles,
        tree,
        is_leaf=lambda x: isinstance(x, str),
    )
    return [r for lst in jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, list)) for r in lst]


def _avals_match(a: Any, b: Any) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        tuple(x.shape) == tuple(y.shape) and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _guess_out_roles(args: tuple, roles: Sequence[Any], out_shape: Any) -> list[str]:
    """An output element with exactly the shapes of a state argument (params,
    optimizer state, model state) takes that argument's role, preferring the argument at
    the same position: ``(params, opt_state, loss)`` for ``(params, opt_state, batch)``,
    also ``(train, opt_state, loss)`` for ``(train, frozen, opt_state, batch)``. The
    rest are ``"output"``."""
    if not isinstance(out_shape, (tuple, list)):
        return ["output"] * len(jax.tree.leaves(out_shape))
    state_args = [j for j, r in enumerate(roles) if isinstance(r, str) and r in _STATE_ROLES]
    used: set[int] = set()
    result: list[str] = []
    for i, o in enumerate(out_shape):
        n = len(jax.tree.leaves(o))
        candidates = ([i] if i in state_args else []) + [j for j in state_args if j != i]
        match = next((j for j in candidates if j not in used and _avals_match(o, args[j])), None)
        if match is None or n == 0:
            result += ["output"] * n
        else:
            used.add(match)
            result += [roles[match]] * n
    return result


@dataclasses.dataclass(frozen=True)
class Plan:
    """A planned step.

    Attributes:
      report: the liveness :class:`~pockjax.memory.MemoryReport`.
      budget_bytes: the device memory asked about, or None.
      trace_seconds: time spent tracing the step.
      analyze_seconds: time spent in the liveness analysis.
      closed_jaxpr: the traced step (flat inputs -> flat outputs).
      in_roles: one role per flat input.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> p = plan(jnp.sin, (jax.ShapeDtypeStruct((256,), jnp.float32),), roles="batch", budget_bytes=4096)
      >>> p.peak_bytes, p.fits, p.in_roles
      (2048, True, ('batch',))
    """

    report: MemoryReport
    budget_bytes: float | None
    trace_seconds: float
    analyze_seconds: float
    closed_jaxpr: Any
    in_roles: tuple[str, ...]

    @property
    def peak_bytes(self) -> int:
        """The planned peak in bytes."""
        return self.report.peak_bytes

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits in ``budget_bytes`` (None without a budget)."""
        return None if self.budget_bytes is None else self.report.fits(self.budget_bytes)

    def summary(self) -> str:
        """The report's summary, with the budget verdict and timings.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> p = plan(lambda w, x: x @ w, (jax.ShapeDtypeStruct((4, 4), jnp.float32),
          ...                               jax.ShapeDtypeStruct((2, 4), jnp.float32)), budget_gb=1)
          >>> print(p.summary().splitlines()[0])
          peak 128 B at eqn 0 (dot_general ...); fits in 1.00 GiB
        """
        s = self.report.summary(self.budget_bytes)
        return f"{s}\n  ({self.report.n_eqns} eqns; traced in {self.trace_seconds:.1f} s, analysed in {self.analyze_seconds:.1f} s)"


def _to_abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def plan(
    step_fn: Callable[..., Any],
    abstract_args: Sequence[Any],
    *,
    roles: Any = None,
    out_roles: Any = None,
    donate_argnums: int | Sequence[int] = (),
    budget_gb: float | None = None,
    budget_bytes: float | None = None,
    **analyze_kwargs: Any,
) -> Plan:
    """Plan the memory of ``step_fn(*abstract_args)`` without allocating its arguments.

    Args:
      step_fn: the step, e.g. ``step(params, opt_state, batch) -> (params, opt_state, loss)``.
      abstract_args: its positional arguments as pytrees of ``jax.ShapeDtypeStruct``
        (concrete arrays are turned into their shapes).
      roles: role of each argument (``"param"``, ``"opt_state"``, ``"batch"``,
        ``"model_state"``), or a prefix pytree of roles. Default for 3 arguments:
        ``("param", "opt_state", "batch")``; for 2: ``("param", "batch")``.
      out_roles: roles of the outputs, like ``roles``. Default: an output element with
        exactly the shapes of a state argument takes its role (``(params, opt_state,
        loss)``), the rest count as ``"output"``.
      donate_argnums: arguments whose buffers may be reused (as in ``jax.jit``):
        their leaves may die at their last use.
      budget_gb: device memory to compare against, in GiB (2**30 bytes).
      budget_bytes: the same in bytes.
      **analyze_kwargs: passed on to :func:`~pockjax.memory.analyze` (``schedule``,
        ``fuse_elementwise``, ``donate`` by role, ...).

    Returns:
      A :class:`Plan`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)   # 4 MiB, never allocated
      >>> x = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
      >>> p = plan(lambda w, x: jnp.tanh(x @ w), (w, x), budget_gb=1)
      >>> p.peak_bytes == 4 * 2**20 + 3 * 32 * 1024, p.fits
      (True, True)
    """
    args = tuple(jax.tree.map(_to_abstract, tuple(abstract_args)))
    if roles is None:
        roles = _default_roles(len(args))
    if isinstance(roles, str):
        roles = (roles,) * len(args)
    in_roles = flat_roles(args, tuple(roles))
    t0 = time.perf_counter()
    closed, out_shape = jax.make_jaxpr(step_fn, return_shape=True)(*args)
    t1 = time.perf_counter()
    if out_roles is None:
        o_roles = _guess_out_roles(args, roles, out_shape)
    else:
        o_roles = flat_roles(out_shape, out_roles)
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    if "donate" not in analyze_kwargs:
        mask = []
        for i, a in enumerate(args):
            mask += [i in donate_argnums] * len(jax.tree.leaves(a))
        analyze_kwargs["donate"] = mask
    report = analyze(closed, in_roles, out_roles=o_roles, **analyze_kwargs)
    t2 = time.perf_counter()
    if budget_bytes is None and budget_gb is not None:
        budget_bytes = budget_gb * 2**30
    return Plan(report, budget_bytes, t1 - t0, t2 - t1, closed, tuple(in_roles))


_XLA_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "peak_memory_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_generated_code_size_in_bytes",
)


def xla_memory(compiled: Any) -> dict[str, int]:
    """The figures of ``compiled.memory_analysis()`` as a dict, plus ``total``.

    ``total = argument + output + temp - alias`` (device side), the figure the planner's
    peak is compared with. Only the fields this JAX/XLA build reports are included
    (JAX 0.10 on CPU: the argument/output/alias/temp/generated-code sizes, their
    ``host_`` twins, and ``peak_memory_in_bytes``).

    Args:
      compiled: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*args).compile()``).

    Returns:
      A dict from field name to bytes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> c = jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((256,), jnp.float32)).compile()
      >>> m = xla_memory(c)
      >>> m["argument_size_in_bytes"], m["output_size_in_bytes"], m["total"] >= 2048
      (1024, 1024, True)
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend returns no memory_analysis()")
    out: dict[str, int] = {}
    for f in _XLA_FIELDS:
        v = getattr(stats, f, None)
        if v is not None:
            out[f] = int(v)
    out["total"] = (
        out.get("argument_size_in_bytes", 0)
        + out.get("output_size_in_bytes", 0)
        + out.get("temp_size_in_bytes", 0)
        - out.get("alias_size_in_bytes", 0)
    )
    return out


@dataclasses.dataclass(frozen=True)
class XlaComparison:
    """The planner's peak next to XLA's figures for the same step.

    Attributes:
      plan: the :class:`Plan`.
      xla: :func:`xla_memory` of the compiled step.
      ratio: planner peak / XLA total.
      compile_seconds: time XLA took to compile.
    """

    plan: Plan
    xla: dict[str, int]
    ratio: float
    compile_seconds: float

    def table(self) -> str:
        """A small text table of both figures.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> c = compare_with_xla(jnp.sin, (jax.ShapeDtypeStruct((256,), jnp.float32),), roles=("batch",))
          >>> print(c.table().splitlines()[0])
          planner peak ...
        """
        x = self.xla
        rows = [
            f"planner peak          {format_bytes(self.plan.peak_bytes):>12}",
            f"XLA argument          {format_bytes(x.get('argument_size_in_bytes', 0)):>12}",
            f"XLA output            {format_bytes(x.get('output_size_in_bytes', 0)):>12}",
            f"XLA temp              {format_bytes(x.get('temp_size_in_bytes', 0)):>12}",
            f"XLA alias             {format_bytes(x.get('alias_size_in_bytes', 0)):>12}",
            f"XLA total (a+o+t-al)  {format_bytes(x['total']):>12}",
            f"ratio planner / XLA   {self.ratio:12.3f}",
        ]
        return "\n".join(rows)


def compare_with_xla(
    step_fn: Callable[..., Any],
    abstract_args: Sequence[Any],
    *,
    compiled: Any = None,
    donate_argnums: int | Sequence[int] = (),
    **plan_kwargs: Any,
) -> XlaComparison:
    """Plan ``step_fn`` and compile it with XLA (from abstract shapes, nothing is run).

    Args:
      step_fn: the step function.
      abstract_args: its arguments (``jax.ShapeDtypeStruct`` pytrees).
      compiled: an already compiled ``jax.stages.Compiled`` for the same step; by
        default the step is compiled with ``jax.jit(step_fn, donate_argnums=...)``.
      donate_argnums: donated arguments, for both the planner and XLA.
      **plan_kwargs: passed to :func:`plan`.

    Returns:
      An :class:`XlaComparison`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda w, x: jnp.tanh(x @ w).sum()
      >>> args = (jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((8, 64), jnp.float32))
      >>> c = compare_with_xla(f, args)
      >>> 0.5 < c.ratio < 2.0
      True
    """
    p = plan(step_fn, abstract_args, donate_argnums=donate_argnums, **plan_kwargs)
    t0 = time.perf_counter()
    if compiled is None:
        args = tuple(jax.tree.map(_to_abstract, tuple(abstract_args)))
        compiled = jax.jit(step_fn, donate_argnums=donate_argnums).lower(*args).compile()
    t1 = time.perf_counter()
    x = xla_memory(compiled)
    return XlaComparison(p, x, p.peak_bytes / max(x["total"], 1), t1 - t0)


def compare_report(report: MemoryReport | Plan, compiled: Any) -> dict[str, float]:
    """A planner report next to XLA's figures for the same (already compiled) step.

    For a ``CompiledStep.memory_report()``: analyse the step's graph with the donation
    it was compiled with, then compare with the executable it was compiled to.

    Args:
      report: a :class:`~pockjax.memory.MemoryReport` (or a :class:`Plan`).
      compiled: the ``jax.stages.Compiled`` of the same step.

    Returns:
      :func:`xla_memory`'s fields plus ``planner_peak_bytes`` and ``ratio``
      (planner peak / XLA total).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from pockjax.memory import analyze
      >>> f = lambda x: jnp.cos(jnp.sin(x))
      >>> x = jax.ShapeDtypeStruct((1024,), jnp.float32)
      >>> d = compare_report(analyze(jax.make_jaxpr(f)(x)), jax.jit(f).lower(x).compile())
      >>> d["planner_peak_bytes"], d["total"], d["ratio"]
      (8192, 8192, 1.0)
    """
    peak = report.peak_bytes
    x = xla_memory(compiled)
    return {**x, "planner_peak_bytes": peak, "ratio": peak / max(x["total"], 1)}
