"""fold_dot_transpose: weight gradients computed in the parameter's orientation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax
from pockjax import _compat as C
from pockjax._src import jaxpr as J
from pockjax.transforms.fold_dot_transpose import FoldDotTransposeRecord, fold_dot_transpose_jaxpr
from toy_models import Transformer, make_step


def _transposed_dots(jaxpr) -> int:
    """transpose equations whose operand a dot_general makes (nested jaxprs included)."""
    made_by = {v: e for e in jaxpr.eqns for v in e.outvars}
    n = 0
    for e in jaxpr.eqns:
        for _, sub in J.subjaxprs(e, strict=False):
            for s in (sub if isinstance(sub, (tuple, list)) else [sub]):
                n += _transposed_dots(s.jaxpr if isinstance(s, C.ClosedJaxpr) else s)
        p = made_by.get(e.invars[0]) if e.primitive.name == "transpose" else None
        n += p is not None and p.primitive.name == "dot_general"
    return n


def _run(closed, *args):
    return C.jaxpr_as_fun(closed)(*args)


def _fold(fn, *args):
    closed = jax.make_jaxpr(fn)(*args)
    new, n = fold_dot_transpose_jaxpr(closed.jaxpr)
    C.check_jaxpr(new)
    return closed, C.ClosedJaxpr(new, closed.consts), n


def test_weight_gradient_dots_are_folded_and_agree():
    x = jax.random.normal(jax.random.key(0), (4, 7, 3))  # x narrower than dy: folded
    w = jax.random.normal(jax.random.key(1), (3, 5))

    def grad_w(w, x):
        return jax.grad(lambda w: jnp.sum(jax.nn.silu(x @ w) ** 2))(w)

    closed, folded, n = _fold(grad_w, w, x)
    assert _transposed_dots(closed.jaxpr) == 1  # what JAX emits: transpose(dot_general(dy, x))
    assert n == 1 and _transposed_dots(folded.jaxpr) == 0
    dots = [e for e in folded.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == len([e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"])
    np.testing.assert_allclose(_run(folded, w, x)[0], _run(closed, w, x)[0], rtol=1e-6, atol=1e-6)


def test_batch_dimensions_stay_in_place():
    a = jax.random.normal(jax.random.key(0), (2, 5, 4))
    b = jax.random.normal(jax.random.key(1), (2, 4, 3))

    def f(a, b):
        return jnp.swapaxes(jnp.einsum("bik,bkj->bij", a, b), 1, 2)  # (2, 3, 5)

    closed, folded, n = _fold(f, a, b)
    assert n == 1
    np.testing.assert_allclose(_run(folded, a, b)[0], _run(closed, a, b)[0], rtol=1e-6)


def test_wider_input_stays_on_the_right():
    # XLA copies the left operand transposed: swapping would put the wider x there
    x = jax.random.normal(jax.random.key(0), (4, 7, 5))
    w = jax.random.normal(jax.random.key(1), (5, 3))

    def grad_w(w, x):
        return jax.grad(lambda w: jnp.sum(jax.nn.silu(x @ w) ** 2))(w)

    closed, folded, n = _fold(grad_w, w, x)
    assert _transposed_dots(closed.jaxpr) == 1 and n == 0 and folded.jaxpr is closed.jaxpr
    narrow, _, m = _fold(grad_w, jnp.swapaxes(w, 0, 1), x[..., :3])  # the same pair, x narrower
    assert _transposed_dots(narrow.jaxpr) == 1 and m == 1


def test_leaves_pairs_it_cannot_fold():
    a = jax.random.normal(jax.random.key(0), (2, 3, 4))
    b = jax.random.normal(jax.random.key(1), (4, 5))

    def used_twice(a, b):  # folding would compute the matmul twice
        y = a @ b
        return jnp.transpose(y, (2, 0, 1)) + 0.0, y

    def other_order(a, b):  # (5, 3, 2) reverses the left operand's free axes too
        return jnp.transpose(a @ b, (2, 1, 0))

    for fn in (used_twice, other_order):
        closed, folded, n = _fold(fn, a, b)
        assert n == 0 and folded.jaxpr is closed.jaxpr


def test_nested_jaxprs_are_rewritten():
    xs = jax.random.normal(jax.random.key(0), (3, 6, 4))
    w = jax.random.normal(jax.random.key(1), (4, 4))

    def loss(w):
        def body(h, x):
            h = jnp.tanh((x + h) @ w)
            return h, jnp.sum(h)
        _, ys = jax.lax.scan(body, jnp.zeros((6, 4)), xs)
        return jnp.sum(ys)

    fn = jax.jit(jax.grad(jax.checkpoint(loss)))
    closed, folded, n = _fold(fn, w)
    assert n >= 1 and _transposed_dots(folded.jaxpr) < _transposed_dots(closed.jaxpr)
    np.testing.assert_allclose(_run(folded, w)[0], _run(closed, w)[0], rtol=1e-5, atol=1e-6)


def test_compiled_step_folds_by_default_and_matches_the_unfolded_step():
    model = Transformer()
    tx = optax.adamw(1e-2)
    step = make_step(model, tx)
    params = model.init(jax.random.key(0))
    batches = [model.batch(jax.random.key(i)) for i in range(3)]
    scheme = pockjax.UpdateScheme({"layers.1.**": "full"})
    folded = pockjax.compile(step, scheme=scheme)
    plain = pockjax.compile(step, scheme=scheme, 
                           passes=pockjax.chain(pockjax.sparse_grad(scheme, sparse_opt_state=True), pockjax.dce()))
    opt = pockjax.init_opt_state(tx, params, scheme)
    lowered = folded.lower(params, opt, batches[0])
    n = lowered.graph.record(FoldDotTransposeRecord).folded
    # the trained block's weight gradients but the FFN's down projection (its input, 12 wide,
    # is wider than its output gradient, 8 wide); attention's transposes stay
    assert n >= 6
    assert fold_dot_transpose_jaxpr(lowered.jaxpr.jaxpr)[1] == 0
    unfolded = plain.lower(params, opt, batches[0]).jaxpr.jaxpr
    assert fold_dot_transpose_jaxpr(unfolded)[1] == n
    assert _transposed_dots(unfolded) - _transposed_dots(lowered.jaxpr.jaxpr) == n
    a = (params, opt)
    b = jax.tree.map(jnp.copy, (params, opt))
    for batch in batches:
        *a, la = folded(*a, batch)
        *b, lb = plain(*b, batch)
        np.testing.assert_allclose(la, lb, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("passes", ["default", "fold"])
def test_graph_history_records_the_pass(passes):
    def step(params, opt_state, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum((x @ w) ** 2))(params)
        return params - 0.1 * g, opt_state, loss

    args = (jnp.ones((2, 3)), (), jnp.ones((4, 2)))
    if passes == "default":
        graph = pockjax.default_passes(None)(pockjax.trace_step(step, args))
    else:
        graph = pockjax.fold_dot_transpose()(pockjax.trace_step(step, args))
    assert graph.pass_names[-1] == "fold_dot_transpose"
    assert graph.record(FoldDotTransposeRecord) == FoldDotTransposeRecord(folded=1)
