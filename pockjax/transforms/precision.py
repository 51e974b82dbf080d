"""Mixed precision, declared once: matrix products in bfloat16, everything else as traced.

:func:`mixed_precision` rewrites every ``dot_general`` and
``conv_general_dilated`` of the whole train step (forward, backward and
whatever the optimizer multiplies) whose operands are wider floats than the
compute dtype: the operands are cast to it and the product accumulates and
returns in the dtype it had (``preferred_element_type``), so the graph's
types do not change anywhere else:

* parameters, optimizer state and the updates stay in their own dtype
  (float32 master copies of the trained parameters);
* normalisation, softmax, the loss and its reductions stay in float32;
* a parameter's gradient leaves its product in float32, cast once;
* each value is cast once per scope however many products read it, so an
  activation kept for the backward pass is kept as its bfloat16 copy when
  only products read it later (half the memory of those residuals).

The same rewrite applies to functional and NNX steps, on XLA and on IREE
targets (it runs on the graph before the backend). On a CPU without native
bfloat16 matrix units the products are converted and may not be faster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax._src import jaxpr as core
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

P = C.primitives

__all__ = ["POLICIES", "PrecisionRecord", "compute_dtype", "mixed_precision"]

#: Policy names -> compute dtype (None: as traced).
POLICIES = {"fp32": None, "float32": None, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
            "fp16": jnp.float16, "float16": jnp.float16}

_PRODUCTS = frozenset({P.dot_general_p, P.conv_general_dilated_p})


def compute_dtype(policy: Any):
    """The compute dtype of a policy name (``"fp32"``, ``"bf16"``), a dtype, or None.

    Example:
        >>> compute_dtype("bf16"), compute_dtype("fp32")
        (<class 'jax.numpy.bfloat16'>, None)
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown precision {policy!r}; choose one of {sorted(set(POLICIES))}")
        return POLICIES[policy]
    dt = np.dtype(policy)
    if dt == np.float32:
        return None
    if dt.name not in ("bfloat16", "float16"):
        raise ValueError(f"compute dtype must be bfloat16, float16 or float32, got {dt.name}")
    return jnp.bfloat16 if dt.name == "bfloat16" else jnp.float16


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionRecord(PassRecord):
    """What :func:`mixed_precision` did.

    Attributes:
      dtype: the compute dtype's name (``"bfloat16"``).
      products: how many matrix products (nested jaxprs included) it cast.
    """

    dtype: str
    products: int


def _wider(dtype, target) -> bool:
    dt = np.dtype(dtype)
    return jnp.issubdtype(dt, jnp.floating) and dt.itemsize > np.dtype(target).itemsize


def _make_rule(target, counter: list):
    casts: dict[int, tuple[Any, Any]] = {}  # id(value) -> (value, its cast): once per value

    def cast(x):
        hit = casts.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        y = jax.lax.convert_element_type(x, target)
        casts[id(x)] = (x, y)
        return y

    def rule(eqn, invals):
        if eqn.primitive is P.convert_element_type_p:
            (x,) = invals
            if np.dtype(jnp.result_type(x)) == np.dtype(target) and _wider(eqn.outvars[0].aval.dtype, target):
                # a value held in the compute dtype and widened for the product
                # (a bfloat16 frozen weight promoted to float32): the product
                # reads the value itself, not a narrowed copy of the widened one
                (y,) = core.bind_eqn(eqn, invals)
                casts[id(y)] = (y, x)
                return [y]
            return None
        if eqn.primitive in _PRODUCTS:
            lhs, rhs = invals[0], invals[1]
            out_dtype = eqn.outvars[0].aval.dtype
            if not (_wider(jnp.result_type(lhs), target) or _wider(jnp.result_type(rhs), target)):
                return None
            if not jnp.issubdtype(out_dtype, jnp.floating):
                return None
            new = [cast(lhs) if _wider(jnp.result_type(lhs), target) else lhs.astype(target),
                   cast(rhs) if _wider(jnp.result_type(rhs), target) else rhs.astype(target)]
            params = dict(eqn.params, preferred_element_type=out_dtype)
            counter[0] += 1
            return core.bind_eqn(eqn, new + list(invals[2:]), params)
        return core.rewrite_nested(eqn, invals, rule, lambda e: e.primitive in _PRODUCTS)

    return rule


def mixed_precision(dtype: Any = "bf16") -> Pass:
    """The pass that computes the step's matrix products in ``dtype`` (default bfloat16).

    Args:
      dtype: ``"bf16"`` (or ``jnp.bfloat16``), ``jnp.float16``; ``"fp32"``
        gives a pass that changes nothing.

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> def step(p, s, x):
        ...     g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p)))(p)
        ...     return p - 0.1 * g, s, None
        >>> g = pockjax.trace_step(step, (jnp.ones((4, 2)), (), jnp.ones((3, 4))))
        >>> h = pockjax.mixed_precision("bf16")(g)
        >>> h.history[-1]
        PrecisionRecord(name='mixed_precision', dtype='bfloat16', products=2)
        >>> [v.aval.dtype.name for v in h.jaxpr.outvars]  # the parameter stays float32
        ['float32']
    """
    target = compute_dtype(dtype)

    def run(graph: TrainGraph) -> TrainGraph:
        if target is None or not core.contains(graph.jaxpr, lambda e: e.primitive in _PRODUCTS):
            return graph
        counter = [0]
        closed = core.retrace(graph.closed_jaxpr, _make_rule(target, counter))
        return graph.recorded(PrecisionRecord(name="mixed_precision", dtype=np.dtype(target).name, products=counter[0]), closed_jaxpr=closed)

    return Pass("mixed_precision", run)
