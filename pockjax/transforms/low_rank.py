"""``low_rank``: LoRA-adapted products without the dense delta or the dense gradient.

A tensor with a LoRA adapter reads as ``V = pockjax_lora(W, A, B) = W + s A B``
(:mod:`pockjax.adapters`), and autodiff gives the adapters' gradients from
the tensor's dense cotangent: ``pockjax_lora_ct(G, A, B) = (s G B^T, s A^T G)``
with ``G = X^T dY`` summed over the readers. Run as is, the step forms the
``m x n`` delta, multiplies by it, and computes the full weight gradient ``G``
that a frozen tensor never needs: full fine-tuning's cost.

The pass re-traces the graph with both kept symbolic:

* ``V`` stays ``(W, A, B, s)``; a ``dot_general`` reading it becomes
  ``X W + s (X A) B`` (or ``X W^T + s (X B^T) A^T`` when it contracts the
  other axis, as the input gradient ``dY V^T`` does), through ``transpose``;
* ``G`` stays the list of products ``P^T Q`` (and scalings, transposes and
  sums of them) that autodiff added up, when nothing but adapter gradients
  reads it; each then becomes ``s P^T (Q B^T)`` and ``s (A^T P^T) Q``.

Any other reader gets the dense value, formed once (the result is the same,
only slower); the :class:`LowRankRecord` counts both kinds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax._src import jaxpr as core
from pockjax.adapters import LORA_PRIMITIVES, lora_ct_p, lora_p
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

P = C.primitives

__all__ = ["LowRankRecord", "low_rank"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class LowRankRecord(PassRecord):
    """What :func:`low_rank` did.

    Attributes:
      adapters: adapted tensors read in the step (``pockjax_lora`` equations).
      factored_products: products with an adapted tensor rewritten to ``X W + s (X A) B``.
      factored_gradients: adapter gradients computed from the factors
        (no dense ``X^T dY``).
      dense: values formed densely after all (a delta read by something
        other than a product, or a gradient with other readers), each once.
    """

    adapters: int
    factored_products: int
    factored_gradients: int
    dense: int


# -- symbolic values ----------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Adapted:
    """``w + scale * a @ b`` (2-D), kept factored."""

    w: Any
    a: Any
    b: Any
    scale: float
    dense: Any = None

    def materialize(self, stats):
        if self.dense is None:
            stats["dense"] += 1
            self.dense = lora_p.bind(self.w, self.a, self.b, scale=self.scale)
        return self.dense

    def transposed(self):
        return _Adapted(jnp.transpose(self.w), jnp.transpose(self.b), jnp.transpose(self.a), self.scale)


@dataclasses.dataclass(frozen=True)
class _Term:
    """``coef * (P ._c Q)`` as a 2-D matrix (``transposed``: its transpose).

    ``p`` and ``q`` have one free axis each (``p_free``, ``q_free``); the
    product contracts ``p_contract`` with ``q_contract``.
    """

    p: Any
    q: Any
    p_contract: tuple
    q_contract: tuple
    precision: Any
    dtype: Any
    coef: Any = 1.0
    transposed: bool = False

    @property
    def p_free(self) -> int:
        return next(i for i in range(np.ndim(self.p)) if i not in self.p_contract)

    @property
    def q_free(self) -> int:
        return next(i for i in range(np.ndim(self.q)) if i not in self.q_contract)

    def dense(self):
        out = jax.lax.dot_general(self.p, self.q, ((self.p_contract, self.q_contract), ((), ())),
                                  precision=self.precision, preferred_element_type=self.dtype)
        out = out.T if self.transposed else out
        return out if isinstance(self.coef, float) and self.coef == 1.0 else (self.coef * out).astype(self.dtype)


@dataclasses.dataclass(eq=False)
class _Gradient:
    """A sum of :class:`_Term` (an adapted tensor's weight gradient), kept unformed."""

    terms: list
    dtype: Any
    dense_value: Any = None

    def materialize(self, stats):
        if self.dense_value is None:
            stats["dense"] += 1
            out = self.terms[0].dense()
            for t in self.terms[1:]:
                out = out + t.dense()
            self.dense_value = out.astype(self.dtype)
        return self.dense_value


_SYMBOLIC = (_Adapted, _Gradient)

def _rank_first_barrier(given: bool | None = None) -> bool:
    """Whether to pin the rank-first order of the adapter-A gradient (``_adapter_grads``):
    ``given``, or when not told, on JAX's CPU backend, where it pays. On a GPU it bought
    nothing in two runs on an H100 (a llama-1b LoRA step took 20.71 against 20.64 ms with
    it, then 20.58 against 20.02 ms); ``benchmarks/lora_barrier.py`` measures both."""
    return bool(given) if given is not None else jax.default_backend() == "cpu"


# -- which values are only adapter gradients ------------------------------------------
_GRAD_FLOW = frozenset({P.add_jaxvals_p, P.add_p, P.transpose_p, P.mul_p, P.neg_p, P.convert_element_type_p})


def _gradient_only_vars(jaxpr) -> set:
    """Variables whose every reader is an adapter-gradient equation (or leads only to one)."""
    uses: dict = {}
    for eqn in jaxpr.eqns:
        for k, v in enumerate(eqn.invars):
            if core.is_var(v):
                uses.setdefault(v, []).append((eqn, k))
    outs = {v for v in jaxpr.outvars if core.is_var(v)}
    only: set = set()
    for eqn in reversed(jaxpr.eqns):
        for v in eqn.outvars:
            if isinstance(v, C.DropVar) or v in outs or v not in uses:
                continue
            ok = True
            for reader, k in uses[v]:
                if reader.primitive is lora_ct_p:
                    ok = k == 0
                elif reader.primitive in _GRAD_FLOW:
                    ok = reader.outvars[0] in only
                    if reader.primitive is P.mul_p:  # scaling by a scalar only
                        other = reader.invars[1 - k]
                        ok = ok and np.ndim(other.aval) == 0 if hasattr(other, "aval") else ok
                else:
                    ok = False
                if not ok:
                    break
            if ok:
                only.add(v)
    return only


# -- the rewrite ------------------------------------------------------------------------
def _dot_with_adapted(eqn, x, v: _Adapted, x_is_lhs: bool):
    """``dot_general(x, w + s a b)`` as ``x w + s (x a) b`` (None if the shapes do not fit)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb or np.ndim(v.w) != 2:
        return None
    v_contract = rc if x_is_lhs else lc
    x_contract = lc if x_is_lhs else rc
    if len(v_contract) != 1:
        return None
    params = dict(eqn.params)
    out_dtype = eqn.outvars[0].aval.dtype
    base = core.bind_eqn(eqn, [x, v.w] if x_is_lhs else [v.w, x], params)[0]
    # contracting w's axis 0 reads a then b; axis 1 reads b^T then a^T
    first, second = (v.a, v.b) if v_contract[0] == 0 else (jnp.transpose(v.b), jnp.transpose(v.a))
    dt = jnp.result_type(first)
    prec = eqn.params.get("precision")
    xa = jax.lax.dot_general(x, first, ((tuple(x_contract), (0,)), ((), ())), precision=prec,
                             preferred_element_type=dt)
    xa = v.scale * xa
    low = jax.lax.dot_general(xa, second, (((np.ndim(xa) - 1,), (0,)), ((), ())), precision=prec,
                              preferred_element_type=dt)
    if not x_is_lhs:  # dot_general(V, x) puts V's free axis first
        low = jnp.moveaxis(low, -1, 0)
    return [base + low.astype(out_dtype)]


def _adapter_grads(g: _Gradient, a, b, scale, pin: bool):
    """``(s G b^T, s a^T G)`` with ``G = sum of terms``, never forming ``G``."""
    ga, gb = None, None
    for t in g.terms:
        # in G, rows come from P's free axis and columns from Q's (swapped if transposed)
        rows, cols, r_contract, c_contract = (t.p, t.q, t.p_contract, t.q_contract)
        r_free, c_free = t.p_free, t.q_free
        if t.transposed:
            rows, cols, r_contract, c_contract, r_free, c_free = cols, rows, c_contract, r_contract, c_free, r_free
        dt = jnp.result_type(a, b)
        # G b^T: cols . b over n, then rows . that over the contracted axes
        cb = jax.lax.dot_general(cols, b, (((c_free,), (1,)), ((), ())), precision=t.precision,
                                 preferred_element_type=dt)  # (cols contracted axes..., r)
        kept = [i for i in range(np.ndim(cols)) if i != c_free]
        # (that . rows)^T: with the rank-r operand first, XLA's CPU dot is ~3x faster
        # than rows . that at LLaMA's shapes (measured: 75 vs 227 us for 512 x 576 x 8).
        # The barrier keeps XLA's simplifier from folding the transpose back into the
        # product (swapped operands, the slow order): without it SmolLM2's LoRA step
        # ran its 118 adapter-A gradients at 19 GFLOP/s, 2% of the step.
        ta = jax.lax.dot_general(cb, rows, ((tuple(kept.index(i) for i in c_contract), tuple(r_contract)),
                                            ((), ())), precision=t.precision, preferred_element_type=dt)
        ta = (jax.lax.optimization_barrier(ta) if pin else ta).T
        # a^T G: a . rows over m, then that . cols over the contracted axes
        ar = jax.lax.dot_general(rows, a, (((r_free,), (0,)), ((), ())), precision=t.precision,
                                 preferred_element_type=dt)  # (rows contracted axes..., r)
        kept = [i for i in range(np.ndim(rows)) if i != r_free]
        tb = jax.lax.dot_general(ar, cols, ((tuple(kept.index(i) for i in r_contract), tuple(c_contract)),
                                            ((), ())), precision=t.precision, preferred_element_type=dt)
        # ar . cols gives (r, n); rows . cb gives (m, r)
        coef = t.coef * scale
        ta, tb = coef * ta, coef * tb
        ga = ta if ga is None else ga + ta
        gb = tb if gb is None else gb + tb
    return ga.astype(a.dtype), gb.astype(b.dtype)


class _Rewrite:
    """The re-trace rule; ``only`` holds the current jaxpr's gradient-only variables."""

    def __init__(self, stats: dict, only: set, pin: bool):
        self.stats, self.only, self.pin = stats, only, pin

    def dense(self, x):
        return x.materialize(self.stats) if isinstance(x, _SYMBOLIC) else x

    def __call__(self, eqn, invals):
        prim = eqn.primitive
        symbolic = any(isinstance(x, _SYMBOLIC) for x in invals)
        if prim is lora_p:
            self.stats["adapters"] += 1
            w, a, b = invals
            if np.ndim(w) == 2 and not symbolic:
                return [_Adapted(w, a, b, eqn.params["scale"])]
            return core.bind_eqn(eqn, [self.dense(x) for x in invals])
        if prim is P.dot_general_p and symbolic:
            lhs, rhs = invals[:2]
            out = None
            if isinstance(rhs, _Adapted) and not isinstance(lhs, _SYMBOLIC):
                out = _dot_with_adapted(eqn, lhs, rhs, x_is_lhs=True)
            elif isinstance(lhs, _Adapted) and not isinstance(rhs, _SYMBOLIC):
                out = _dot_with_adapted(eqn, rhs, lhs, x_is_lhs=False)
            if out is not None:
                self.stats["factored_products"] += 1
                return out
        elif prim is P.dot_general_p and eqn.outvars[0] in self.only:
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            lhs, rhs = invals[:2]
            if not lb and not rb and np.ndim(lhs) - len(lc) == 1 and np.ndim(rhs) - len(rc) == 1:
                dtype = eqn.outvars[0].aval.dtype
                term = _Term(lhs, rhs, tuple(lc), tuple(rc), eqn.params.get("precision"), dtype)
                return [_Gradient([term], dtype)]
            return None
        elif symbolic:
            if prim is P.transpose_p and isinstance(invals[0], _Adapted):
                return [invals[0].transposed()]
            if prim is lora_ct_p and isinstance(invals[0], _Gradient):
                _, a, b = invals
                self.stats["factored_gradients"] += 1
                return list(_adapter_grads(invals[0], a, b, eqn.params["scale"], self.pin))
            out = self._gradient_flow(eqn, invals)
            if out is not None:
                return out
        if symbolic:
            invals = [self.dense(x) for x in invals]
        # nested jaxprs: adapted values are factored inside too; gradients stay dense there
        nested = _Rewrite(self.stats, set(), self.pin)
        out = core.rewrite_nested(eqn, invals, nested, lambda e: e.primitive in LORA_PRIMITIVES,
                                  finish=lambda outs: [nested.dense(x) for x in outs])
        if out is None and symbolic:
            out = core.bind_eqn(eqn, invals)
        return out

    def _gradient_flow(self, eqn, invals):
        """Sums, transposes, negations, scalar scalings and casts of gradients, kept symbolic."""
        prim = eqn.primitive
        if eqn.outvars[0] not in self.only:
            return None
        if prim in (P.add_jaxvals_p, P.add_p):
            x, y = invals
            if isinstance(x, _Gradient) and isinstance(y, _Gradient):
                return [_Gradient(x.terms + y.terms, eqn.outvars[0].aval.dtype)]
            return None
        g = next((x for x in invals if isinstance(x, _Gradient)), None)
        if g is None:
            return None
        if prim is P.transpose_p:
            return [_Gradient([dataclasses.replace(t, transposed=not t.transposed) for t in g.terms], g.dtype)]
        if prim is P.neg_p:
            return [_Gradient([dataclasses.replace(t, coef=-t.coef) for t in g.terms], g.dtype)]
        if prim is P.mul_p:
            other = invals[1] if invals[0] is g else invals[0]
            if isinstance(other, _SYMBOLIC) or np.ndim(other) != 0:
                return None
            return [_Gradient([dataclasses.replace(t, coef=t.coef * other) for t in g.terms], g.dtype)]
        if prim is P.convert_element_type_p:
            return [_Gradient(g.terms, eqn.params["new_dtype"])]
        return None


def low_rank(*, rank_first_barrier: bool | None = None) -> Pass:
    """The pass that computes LoRA-adapted products and adapter gradients from the factors.

    :func:`pockjax.compile` runs it after ``sparse_grad`` and ``dce`` when the
    scheme has a :func:`pockjax.lora` rule. See :mod:`pockjax.transforms.low_rank`.

    ``rank_first_barrier``: pin the faster order of the adapter-A gradient on
    a CPU with an ``optimization_barrier`` (:func:`pockjax.compile` gives True
    for an IREE target, whatever machine compiles it; measured on CPUs only);
    None: when JAX's default backend is the CPU.

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> scheme = pockjax.UpdateScheme({"w": pockjax.lora(2)})
        >>> params = pockjax.add_adapters({"w": jnp.ones((8, 4))}, scheme)
        >>> tx = optax.sgd(0.1)
        >>> def step(p, s, x):
        ...     g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(p)
        ...     u, s = tx.update(g, s, p)
        ...     return optax.apply_updates(p, u), s, None
        >>> g = pockjax.trace_step(step, (params, tx.init(params), jnp.ones((3, 8))))
        >>> g = pockjax.chain(pockjax.sparse_grad(scheme), pockjax.dce(), pockjax.low_rank())(g)
        >>> g.history[-1]
        LowRankRecord(name='low_rank', adapters=1, factored_products=1, factored_gradients=1, dense=0)
    """

    def run(graph: TrainGraph) -> TrainGraph:
        if not core.contains(graph.jaxpr, lambda e: e.primitive is lora_p):
            return graph
        stats = {"adapters": 0, "factored_products": 0, "factored_gradients": 0, "dense": 0}
        inner = graph.closed_jaxpr.jaxpr
        rule = _Rewrite(stats, _gradient_only_vars(inner), _rank_first_barrier(rank_first_barrier))

        def fun(*args):
            outs = core.eval_jaxpr_with(inner, list(graph.closed_jaxpr.consts), args, rule)
            return [rule.dense(x) for x in outs]

        closed = jax.make_jaxpr(fun)(*[jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inner.invars])
        return graph.recorded(LowRankRecord(name="low_rank", **stats), closed_jaxpr=closed)

    return Pass("low_rank", run)
