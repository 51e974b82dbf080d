"""``sparse_grad``: train only what a scheme says, and compute only what that needs.

The pass rewrites a :class:`~pockjax.graph.TrainGraph` so that

* a frozen parameter's new value is its old value and its optimizer state is
  untouched; its gradient (the ``pockjax_grad_tag`` equation autodiff left
  for it) becomes zero, so every backward op that fed only that gradient is
  dead code for :func:`pockjax.dce`;
* a channel-ruled parameter's gradient is ``pad(g[sel])``: the weight-gradient
  op computes only the selected channels (see :mod:`pockjax.transforms.slicing`),
  the optimizer runs on the selected slice of parameter, gradient and state,
  and the result is written back into the old tensor.

This is the reference semantics: the full step run with the gradient of every
frozen entry set to zero, after which every frozen entry of params and
optimizer state is put back to its old value.

How: a backward *demand* analysis decides, for every value, whether it is
needed whole or only as a channel slice; then the jaxpr is re-traced, each
equation computing the form that is needed. Zero gradients are propagated
symbolically through the ops in ``ZERO_RULES`` (so, for example, a global
gradient norm does not square and sum the zeros of frozen parameters).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax import tags
from pockjax.errors import PockjaxError, SchemeError, some
from pockjax.graph import MODEL_STATE, OPT_STATE, PARAM, PassRecord, TrainGraph, gradient_tag_indices
from pockjax.scheme import ChannelSelect, Frozen, Full, UpdateScheme
from pockjax._src import jaxpr as _interp
from pockjax._src.jaxpr import PrimitiveTable, prims
from pockjax.transforms import slicing
from pockjax.transforms.base import Pass
from pockjax.transforms.dce import DCE_RULES
from pockjax.transforms.slicing import PUSH_RULES


# -- symbolic zeros ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ZeroValue:
    """A value known to be all zeros (a frozen parameter's gradient)."""

    shape: tuple
    dtype: Any

    def materialize(self):
        return jnp.zeros(self.shape, self.dtype)


def _zero_like_out(eqn):
    aval = eqn.outvars[0].aval
    return [ZeroValue(tuple(aval.shape), aval.dtype)]


def _zero_if_any(eqn, vals):
    return _zero_like_out(eqn) if any(isinstance(v, ZeroValue) for v in vals) else None


def _zero_if_all(eqn, vals):
    return _zero_like_out(eqn) if all(isinstance(v, ZeroValue) for v in vals) else None


def _zero_add(eqn, vals):
    a, b = vals
    out = tuple(eqn.outvars[0].aval.shape)
    za, zb = isinstance(a, ZeroValue), isinstance(b, ZeroValue)
    if za and zb:
        return _zero_like_out(eqn)
    other = b if za else a if zb else None
    if other is not None and tuple(np.shape(other)) == out:
        if eqn.primitive is C.primitives.sub_p and za:
            return [jax.lax.neg(other)]
        return [jax.lax.convert_element_type(other, eqn.outvars[0].aval.dtype)]
    return None


# rule(eqn, invals) -> outputs, or None to materialize zeros and bind normally.
# Keyed by Primitive objects.
_P = C.primitives
ZERO_RULES = PrimitiveTable({
    _P.add_p: _zero_add,
    _P.add_jaxvals_p: _zero_add,  # "add_any"
    _P.sub_p: _zero_add,
    _P.mul_p: _zero_if_any,
    _P.dot_general_p: _zero_if_any,
    _P.div_p: lambda eqn, vals: _zero_like_out(eqn) if isinstance(vals[0], ZeroValue) else None,
    _P.integer_pow_p: lambda eqn, vals: _zero_like_out(eqn) if eqn.params["y"] > 0 else None,
})
for _prim in prims(
    "neg", "square", "abs", "sqrt", "sign", "convert_element_type", "reduce_sum",
    "reduce_max", "reduce_min", "transpose", "reshape", "broadcast_in_dim", "squeeze",
    "expand_dims", "copy", "slice", "reduce_precision", "real", "imag",
    "pockjax_param_tag", "pockjax_tangent_tag", "pockjax_grad_tag",
):
    ZERO_RULES[_prim] = _zero_if_all
ZERO_RULES[_P.select_n_p] = lambda eqn, vals: _zero_if_all(eqn, vals[1:])
_FORWARD_TAGS = (tags.param_tag_p, tags.tangent_tag_p)


def _materialize(x):
    return x.materialize() if isinstance(x, ZeroValue) else x


# -- resolving the scheme ---------------------------------------------------------
RuleOf = Any  # Full | Frozen | ChannelSelect


#: Primitives through which a parameter reaches ``jax.grad`` as another value (a cast,
#: ``with_sharding_constraint``, ``ravel_pytree``'s reshape and concatenation) or is carried
#: through a loop of updates: a parameter read by one of them, never differentiated itself,
#: and changed by the step likely got its update from a gradient pockjax could not see.
_HIDING_PRIMITIVES = frozenset({"convert_element_type", "sharding_constraint", "copy", "copy_p", "reshape",
                                "concatenate", "scan", "while"})


def _returned_unchanged(graph: TrainGraph) -> set[int]:
    """The inputs the step returns as they came: forwarded as is, or through their parameter tag.

    An NNX variable holds the tagged value after ``nnx.grad``, so an
    untouched one comes back through its tag (:attr:`TrainGraph.out_sources`
    sees only the first kind).
    """
    jaxpr = graph.jaxpr
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    tagged = {e.outvars[0]: e.invars[0] for e in jaxpr.eqns if e.primitive is tags.param_tag_p}
    return {i for v, i in zip(jaxpr.outvars, graph.out_to_in)
            if i is not None and not isinstance(v, C.Literal) and index.get(tagged.get(v, v)) == i}


def _refuse_hidden_gradients(graph: TrainGraph, scheme: UpdateScheme) -> None:
    """Refuses a step that changes a parameter through a gradient pockjax cannot see.

    pockjax sees a parameter's gradient where autodiff linearizes with
    respect to the parameter itself. A gradient taken of a value computed
    from it (``p.astype(bf16)``, ``with_sharding_constraint``,
    ``ravel_pytree``), or inside a ``lax.scan`` / ``while_loop`` that carries
    the parameters (several updates per call), is invisible: the parameter
    is updated as model state, as the step computes it, so a scheme that
    freezes it (or trains some of its channels) would not be followed, and
    it would train without a word. Refused: a float parameter
    (:attr:`TrainGraph.ungraded`) the step changes, that one of
    :data:`_HIDING_PRIMITIVES` reads, and that the scheme does not train in
    full. Weights updated without any gradient (an EMA, lookahead's slow
    weights, ``p + 0``) are read by none of them and stay model state, as
    under ``jax.jit``.
    """
    if not graph.ungraded:
        return
    changed = (set(graph.ungraded) & set(graph.out_to_in)) - _returned_unchanged(graph)
    index = {v: i for i, v in enumerate(graph.jaxpr.invars) if i in changed}
    if not index:
        return
    read = {index[v] for e in graph.jaxpr.eqns if e.primitive.name in _HIDING_PRIMITIVES
            for v in e.invars if not isinstance(v, C.Literal) and v in index}
    hidden = [graph.in_paths[i] for i in sorted(changed & read)
              if not isinstance(scheme.rule_for(graph.in_paths[i])[0], Full)]
    if not hidden:
        return
    raise SchemeError(
        f"{graph.step_name} changes the parameter(s) {some(hidden)}, which the scheme does not train in full, but"
        " takes no gradient with respect to them that pockjax can see, so it cannot follow the scheme for"
        " them: the gradient seems taken of a value computed from them (a cast such as"
        " p.astype(jnp.bfloat16), with_sharding_constraint, ravel_pytree), or inside a lax.scan /"
        " while_loop that carries the parameters. Take the gradient of the parameters themselves and do"
        " the cast inside the loss (jax.grad(lambda p: loss(cast(p), batch))(params)), and close over the"
        " parameters in a loop rather than carrying them; if they are weights the step updates without a"
        " gradient (an EMA), keep them in a TrainState field, or pass them to an NNX step as an argument"
        " of their own.")


def _untagged_gradient_outputs(graph: TrainGraph) -> list[int]:
    """Inputs whose new value (or optimizer state) depends on a gradient pockjax did not tag.

    pockjax tags a parameter's gradient where autodiff linearizes with
    respect to the parameter itself (:func:`~pockjax.graph.trace_step`).
    A gradient taken at a value computed from the parameters (SAM's second
    gradient at ``p + rho * g / |g|``, one of ``p + 0`` or ``p.astype(bf16)``)
    is a backward pass whose results reach no ``grad_tag``. Here a value is
    *untagged* when a backward-pass equation (``transpose`` in its name
    stack) computed it, or it was computed from an untagged value, and no
    ``grad_tag`` stands between: a tagged gradient is the sanctioned way out
    of a backward pass (an adversarial batch ``x + eps * sign(grad_x)``
    reaches the parameters only through the tagged gradient of the loss at
    it). A loop or branch passes on what its bodies return untagged
    (:func:`_untagged_values`).
    Returns the input indices of parameters (and of float leaves passed as
    parameters that the step never differentiates) and optimizer-state
    leaves whose output holds an untagged value.
    """
    jaxpr = graph.jaxpr
    untagged = _untagged_values(jaxpr)
    if not untagged:
        return []
    watched = set(graph.inputs_with_role(PARAM)) | set(graph.ungraded)
    return [i for v, i, r in zip(jaxpr.outvars, graph.out_to_in, graph.out_roles)
            if i is not None and (i in watched or r == OPT_STATE) and not isinstance(v, C.Literal)
            and v in untagged]


def _untagged_values(jaxpr, outer: str = "") -> set:
    """The variables of ``jaxpr`` that hold an untagged gradient (see :func:`_untagged_gradient_outputs`).

    A loop or branch (``scan``, ``while``, ``cond``, ``remat``) whose body
    computes one and returns it gives that output untagged: its bodies return
    what the equation returns, position by position (SAM's second gradient
    accumulated over micro-batches in a ``scan``).
    """
    untagged: set = set()
    for e in jaxpr.eqns:
        if e.primitive is tags.grad_tag_p:
            continue
        phase = _interp.phase(e, outer)
        # A forward pass computes values, not gradients: the loss at an adversarial batch
        # x + eps * sign(grad_x) is a value (reduce_on_plateau may read it), and the
        # gradients taken at that batch are tagged.
        if phase == _interp.Phase.FORWARD:
            continue
        if phase == _interp.Phase.BACKWARD or any(not isinstance(v, C.Literal) and v in untagged for v in e.invars):
            untagged.update(v for v in e.outvars if not isinstance(v, C.DropVar))
            continue
        stack = f"{outer}/{_interp.eqn_name_stack(e)}" if outer else _interp.eqn_name_stack(e)
        for sub in _interp.sub_jaxprs(e, strict=False):
            body = _interp.open_jaxpr(sub)
            if len(body.outvars) != len(e.outvars):  # a while's cond: a predicate, not a value
                continue
            inner = _untagged_values(body, stack)
            untagged.update(o for o, b in zip(e.outvars, body.outvars)
                            if not isinstance(o, C.DropVar) and not isinstance(b, C.Literal) and b in inner)
    return untagged


def _refuse_overwritten_parameters(graph: TrainGraph, idx, resolved) -> None:
    """Refuses a step that sets a parameter the scheme does not train in full from other values
    than its gradient.

    The loss reads it, so it has a gradient and is a parameter; but the step
    overwrites it with a value that does not read that gradient and does read
    something else (a running statistic: ``0.9 * p["mean"] + 0.1 * h.mean(0)``).
    That is model state used by the loss: under ``jax.jit`` it keeps updating,
    while a scheme that freezes it would keep its old value, without a word.
    So does a value the step makes from the parameter alone other than by
    applying an update to it (``p * 0.9``, ``p * schedule(count)``, a reset;
    :func:`_update_applied`). A gradient that reaches the value only through a
    scalar (a finite check of all the gradients guarding the statistic) does
    not count as its gradient.
    """
    kept = {i for i, r in zip(idx, resolved) if not isinstance(r, Full)} & gradient_tag_indices(graph.jaxpr)
    if not kept:
        return
    jaxpr = graph.jaxpr
    scalar_params = frozenset(i for i, r in enumerate(graph.in_roles) if r == PARAM and not jaxpr.invars[i].aval.shape)
    out_deps = _dependencies(jaxpr, [frozenset({("in", i)}) for i in range(len(jaxpr.invars))], scalar_params)
    unchanged = _returned_unchanged(graph)
    # what may feed a frozen parameter's new value besides itself: optimizer state, and scalars
    # (a learning rate passed to the step)
    other = {i for i, (r, v) in enumerate(zip(graph.in_roles, jaxpr.invars)) if r != OPT_STATE and v.aval.shape}
    state = {v for r, v in zip(graph.in_roles, jaxpr.invars) if r == OPT_STATE}
    hit = [graph.in_paths[i] for d, v, i in zip(out_deps, jaxpr.outvars, graph.out_to_in)
           if i in kept and i not in unchanged and ("grad", i) not in d
           and (any(("in", j) in d for j in other - {i}) or not _update_applied(v, {jaxpr.invars[i]}, jaxpr, state))]
    if hit:
        raise SchemeError(
            f"{graph.step_name} sets {some(hit)}, which the loss reads (so it has a gradient) and the scheme"
            " does not train in full, from other values than its gradient (a running statistic, or a"
            " value annealed from itself, p * 0.9?): pockjax would keep its old value where jax.jit"
            " updates it. If it is model state, read it under jax.lax.stop_gradient in the loss (it is"
            " then updated as the step computes it); if it is a parameter, update it from its gradient.")


def _update_applied(v, leaves: set, jaxpr, optimizer: set) -> bool:
    """Whether ``v`` is the leaf itself or an update applied to it: what an optimizer does to a
    parameter (``p + u``, ``p - lr * u``, ``p * (1 - lr * wd) + u``, ``p + f(p)`` for decay, a
    clip of such a value), through lossless casts, selects, the branches of a ``cond``, the
    body of a call, and a ``scan`` that hands the leaf back (``nnx.scan`` over stacked layers
    returns them as its stacked outputs, slice by slice).

    ``leaves``: the variables of ``jaxpr`` that hold the leaf; ``optimizer``: those that hold
    optimizer state. The update ``u`` must be zero (set_to_zero's ``p + 0``) or read the
    optimizer's state, a gradient or the leaf: a frozen parameter with such a new value is
    kept (weight decay moves no frozen parameter). Anything else is the step's own rule, which
    a scheme that freezes it would silently drop: ``p * 0.9``, ``p * schedule(count)``,
    ``0.9 * p + 0.1``, ``max(p * 0.9, 0.5)``, ``0.9 * p + 0.1 * std(h)``, a reset.
    """
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    reads = set(leaves)  # computed from the leaf
    updating = set(leaves) | set(optimizer)  # computed from the leaf, the state or a gradient
    for e in jaxpr.eqns:
        ins = [a for a in e.invars if not isinstance(a, C.Literal)]
        if any(a in reads for a in ins):
            reads.update(e.outvars)
        if e.primitive is tags.grad_tag_p or any(a in updating for a in ins):
            updating.update(e.outvars)
    dtype = next(iter(leaves)).aval.dtype

    def var(a) -> bool:
        return not isinstance(a, C.Literal)

    def zero(a) -> bool:  # a holds 0 everywhere
        if not var(a):
            return bool(np.all(np.asarray(a.val) == 0))
        e = producer.get(a)
        if e is None:
            return False
        name = e.primitive.name
        if name in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
                    "convert_element_type", "neg", "div", "sign", "abs"):
            return zero(e.invars[0])
        if name == "mul":
            return any(zero(b) for b in e.invars)
        if name in ("add", "add_any", "sub", "select_n"):
            return all(zero(b) for b in e.invars[name == "select_n":])
        if name in ("max", "min", "clamp"):  # a clip of a zero update whose bounds hold 0 (optax.clip)
            x = e.invars[1] if name == "clamp" else next((b for b in e.invars if zero(b)), None)
            bounds = [constant(b) for b in e.invars if b is not x]
            if x is None or not zero(x) or any(c is None for c in bounds):
                return False
            if name == "clamp":
                return bool(np.all(bounds[0] <= 0) and np.all(bounds[1] >= 0))
            return bool(np.all(bounds[0] <= 0)) if name == "max" else bool(np.all(bounds[0] >= 0))
        return False

    def constant(a):  # the value of a literal, or of a broadcast or cast of one; else None
        while var(a):
            e = producer.get(a)
            if e is None or e.primitive.name not in ("broadcast_in_dim", "convert_element_type", "reshape"):
                return None
            a = e.invars[0]
        return np.asarray(a.val)

    def scaled(a) -> bool:  # p * s, s a scalar not computed from p (decay written by hand)
        e = producer.get(a) if var(a) else None
        if e is None or e.primitive.name != "mul":
            return False
        x, y = e.invars
        return any(applied(b) and not c.aval.shape and not (var(c) and c in reads) for b, c in ((x, y), (y, x)))

    def applied(a) -> bool:
        if var(a) and a in leaves:
            return True
        e = producer.get(a) if var(a) else None
        if e is None:
            return False
        name = e.primitive.name
        if e.primitive is tags.param_tag_p or name in ("copy", "copy_p"):
            return applied(e.invars[0])
        if name == "convert_element_type":  # exact when the new dtype holds every value of the leaf's
            new = e.params["new_dtype"]
            return jnp.promote_types(dtype, new) == new and applied(e.invars[0])
        if name == "select_n":
            return all(applied(b) for b in e.invars[1:])
        if name in ("add", "add_any", "sub"):
            x, y = e.invars
            pairs = ((x, y),) if name == "sub" else ((x, y), (y, x))
            return any((applied(b) or scaled(b)) and (zero(u) or (var(u) and u in updating)) for b, u in pairs)
        if name in ("clamp", "max", "min"):
            from_leaf = [b for b in e.invars if var(b) and b in reads]
            return bool(from_leaf) and all(applied(b) for b in from_leaf)
        if name == "scan":  # the leaf handed back by a scan over it (nnx.scan over stacked layers)
            nc, ncar = e.params["num_consts"], e.params["num_carry"]
            body = _interp.open_jaxpr(e.params["jaxpr"])
            k = e.outvars.index(a)
            if k < ncar:  # a carry the loop passes on unchanged
                return body.outvars[k] is body.invars[nc + k] and applied(e.invars[nc + k])
            # a stacked output made, slice by slice, as an update of the leaf's slices (xs)
            inner = {b for b, x in zip(body.invars[nc + ncar:], e.invars[nc + ncar:])
                     if var(x) and (x in leaves or (x in reads and applied(x)))}
            # state: a constant or a slice as it comes in; a carry only if the loop hands it back
            # unchanged (inside the loop it holds what the body passes on, not its first value)
            state = {b for j, (b, x) in enumerate(zip(body.invars, e.invars))
                     if var(x) and (x in updating or zero(x))
                     and not (nc <= j < nc + ncar and body.outvars[j - nc] is not b)}
            return bool(inner) and _update_applied(body.outvars[k], inner, body, state)
        bodies = (e.params["branches"], 1) if name == "cond" else (
            ([e.params[_interp.CALL_BODY[e.primitive]]], 0) if e.primitive in _interp.CALL_BODY else None)
        if bodies is None:
            return False
        subs, offset = bodies
        k = e.outvars.index(a)
        for sub in subs:
            body = _interp.open_jaxpr(sub)
            pairs = [(b, x) for b, x in zip(body.invars, e.invars[offset:]) if var(x)]
            inner = {b for b, x in pairs if x in leaves or (x in reads and applied(x))}
            state = {b for b, x in pairs if x in updating or zero(x)}
            if not inner or not _update_applied(body.outvars[k], inner, body, state):
                return False
        return True

    return applied(v)


def _dependencies(jaxpr, in_deps: list, scalar_params: frozenset = frozenset(), adjust=None) -> list:
    """What each output of ``jaxpr`` reads: ``("in", i)`` for input ``i`` (as ``in_deps``
    gives the inputs'), ``("grad", k)`` for parameter ``k``'s gradient tag.

    A scalar passes on only the gradients of the scalar parameters in ``scalar_params``
    (its own value): a learning rate, a global norm, a finite check or a loss that
    scales or guards every update (``reduce_on_plateau``, ``apply_if_finite``) neither
    makes a frozen parameter's ``p + scale * 0`` read the batch, nor gives a statistic
    its gradient. A ``scan``, ``while`` or ``cond`` is followed position by position
    (loop carries to a fixed point, a branch's outputs with its index's), and so is a
    call (``remat``, a custom derivative's function: :func:`_positional_body`); another
    primitive with a body gives each output all its inputs and the gradients taken
    inside it. ``adjust(var, deps)`` may change a top-level variable's.
    """
    deps: dict = dict(zip(jaxpr.invars, in_deps))
    empty = frozenset()

    def scalar(d):
        return frozenset(x for x in d if x[0] == "grad" and x[1] in scalar_params)

    for e in jaxpr.eqns:
        ins = [empty if isinstance(v, C.Literal) else deps.get(v, empty) for v in e.invars]
        every = empty.union(*ins)
        if e.primitive is tags.grad_tag_p:
            outs = [every | {("grad", e.params["index"])}]
        elif e.primitive.name == "scan":
            outs = _scan_dependencies(e, ins, scalar_params)
        elif e.primitive.name == "while":
            outs = _while_dependencies(e, ins, scalar_params)
        elif e.primitive.name == "cond":
            index = scalar(ins[0])
            outs = [index.union(*col) for col in zip(*(
                _dependencies(_interp.open_jaxpr(b), ins[1:], scalar_params) for b in e.params["branches"]))]
        elif e.primitive in _interp.CALL_BODY and _positional_body(e) is not None:
            outs = _dependencies(_positional_body(e), ins, scalar_params)
        elif _interp.sub_jaxprs(e, strict=False):
            outs = [every | {("grad", k) for sub in _interp.sub_jaxprs(e, strict=False)
                             for k in gradient_tag_indices(_interp.open_jaxpr(sub))}] * len(e.outvars)
        else:
            outs = [every] * len(e.outvars)
        for o, d in zip(e.outvars, outs):
            deps[o] = d if o.aval.shape else scalar(d)
            if adjust is not None:
                deps[o] = adjust(o, deps[o])
    return [empty if isinstance(v, C.Literal) else deps.get(v, empty) for v in jaxpr.outvars]


def _positional_body(eqn):
    """The body of a call (``remat``, ``jit``, a custom derivative's primal function) whose inputs
    and outputs are the equation's, position by position; None for another form."""
    body = eqn.params.get(_interp.CALL_BODY[eqn.primitive])
    inner = _interp.open_jaxpr(body) if body is not None else None
    if inner is None or len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
        return None
    return inner


def _scan_dependencies(eqn, ins: list, scalar_params: frozenset) -> list:
    body = _interp.open_jaxpr(eqn.params["jaxpr"])
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    carry = ins[n_consts:n_consts + n_carry]
    for _ in range(8):  # an iteration's carry feeds the next: to a fixed point
        outs = _dependencies(body, ins[:n_consts] + carry + ins[n_consts + n_carry:], scalar_params)
        grown = [c | o for c, o in zip(carry, outs[:n_carry])]
        if grown == carry:
            break
        carry = grown
    return [c | o for c, o in zip(carry, outs[:n_carry])] + outs[n_carry:]


def _while_dependencies(eqn, ins: list, scalar_params: frozenset) -> list:
    cond = _interp.open_jaxpr(eqn.params["cond_jaxpr"])
    body = _interp.open_jaxpr(eqn.params["body_jaxpr"])
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    carry = ins[nc + nb:]
    for _ in range(8):  # to a fixed point, as a scan's carry
        grown = [c | o for c, o in zip(carry, _dependencies(body, ins[nc:nc + nb] + carry, scalar_params))]
        if grown == carry:
            break
        carry = grown
    # how often the body runs: the predicate, a scalar, passes on what scalars pass on
    pred = _dependencies(cond, ins[:nc] + carry, scalar_params)[0]
    return [c | pred for c in carry]


def _refuse_untagged_gradients(graph: TrainGraph, resolved) -> None:
    """Refuses a step that updates with a gradient pockjax cannot restrict to the scheme.

    Such a gradient (:func:`_untagged_gradient_outputs`) is computed in full,
    frozen entries included, and pockjax cannot prune it: frozen entries are
    put back after the update, but until then they count in every reduction
    over the gradients (``clip_by_global_norm``, a global norm, a
    non-elementwise optimizer), so the trained entries would not get
    ``jax.jit``'s update with the frozen gradients absent. Only when the
    scheme trains every parameter in full is there nothing to restrict.
    """
    if all(isinstance(r, Full) for r in resolved):
        return
    hit = _untagged_gradient_outputs(graph)
    if not hit:
        return
    raise SchemeError(
        f"{graph.step_name} updates {some([graph.in_paths[i] for i in hit])} from a gradient taken at a value"
        " computed from the parameters (such as SAM's perturbed point p + rho * g / |g|, p.astype(jnp.bfloat16)"
        " or p + 0), not at the parameters themselves, so pockjax cannot see which of its entries the scheme"
        " freezes: they would be computed and would count in every reduction over the gradients"
        " (clip_by_global_norm, a global norm), and the trained parameters would get another update than"
        " under jax.jit with the frozen ones untrained. Take every gradient at the parameters and move the"
        " shift into the loss: jax.grad(lambda p: loss(jax.tree.map(jnp.add, p, shift), batch))(params) with"
        " shift = jax.lax.stop_gradient(rho * g / norm) gives SAM's second gradient, and casts belong inside"
        " the loss too. optax.contrib.sam in opaque mode takes its gradients at perturbed parameters: use"
        " opaque_mode=False. Or train every parameter in full (no frozen or channels rules).")


def resolve_rules(graph: TrainGraph, scheme: UpdateScheme, *, allow_nothing_trained: bool = False) -> dict[int, RuleOf]:
    """``{param input index: Full() | Frozen() | ChannelSelect}`` for a graph.

    Raises :class:`~pockjax.SchemeError` when the step differentiates no
    parameter, when a pattern names only model state, and (unless
    ``allow_nothing_trained``) when the scheme freezes every parameter.
    """
    idx = graph.inputs_with_role(PARAM)
    step = graph.step_name
    if not idx:
        raise SchemeError(
            f"{step} differentiates none of its parameters: pockjax found no gradient of any leaf of "
            "its first argument, so a scheme has nothing to train. Compute the gradient with "
            "jax.grad / jax.value_and_grad / nnx.grad of the parameters inside the step (a gradient "
            "of a value computed from them, such as p.astype(jnp.bfloat16), with_sharding_constraint or "
            "ravel_pytree, one taken inside a lax.scan / fori_loop that carries the parameters, or a "
            "forward-mode jax.jacfwd, is not one pockjax can see: do the cast inside the loss, close over "
            "the parameters in a loop rather than carrying them, and use reverse mode: jax.grad / jax.jacrev)."
        )
    _refuse_hidden_gradients(graph, scheme)
    avals = graph.in_avals
    state = [graph.in_paths[i] for i in graph.inputs_with_role(MODEL_STATE)]
    resolved = scheme.resolve([graph.in_paths[i] for i in idx], [avals[i].shape for i in idx], non_gradient=state)
    if not allow_nothing_trained and all(isinstance(r, Frozen) for r in resolved):
        raise SchemeError(
            f"the scheme {scheme!r} freezes every parameter of {step}: the step would train nothing. "
            f"Give some parameters a 'full' or channels(...) rule (parameters: "
            f"{some([graph.in_paths[i] for i in idx], 6)})."
        )
    _refuse_trained_but_unchanged(graph, scheme, idx, resolved)
    _refuse_unread_adapters(graph, scheme)
    _refuse_untagged_gradients(graph, resolved)
    _refuse_overwritten_parameters(graph, idx, resolved)
    return dict(zip(idx, resolved))


def _refuse_unread_adapters(graph: TrainGraph, scheme: UpdateScheme) -> None:
    """Refuses LoRA adapters the loss never reads: their gradient is zero, they would never train.

    The usual cause is a loss that reads a copy of the original weights (a
    closure, a model bound before :func:`pockjax.add_adapters`) instead of
    the params the step receives: then none is read. When some are, the
    others are a warning (a pattern that also matches a module the loss does
    not use).
    """
    if not scheme.has_lora:
        return
    read = gradient_tag_indices(graph.jaxpr)
    adapters = {i: graph.in_paths[i].rsplit(".", 1)[0] for i, path in enumerate(graph.in_paths)
                if path.rsplit(".", 1)[-1] in ("lora_a", "lora_b") and scheme.lora_part(path) is not None}
    unread = sorted({t for i, t in adapters.items() if i not in read})
    if unread and len(unread) < len(set(adapters.values())):
        # some read: a pattern that also matches a module this loss does not use (a pooler)
        warnings.warn(f"the LoRA adapters on {some(unread)} are never read by {graph.step_name}'s loss:"
                      " they will not train", stacklevel=2)
    elif unread:
        raise SchemeError(
            f"the scheme puts LoRA adapters on {some(unread)}, but {graph.step_name}'s loss never reads"
            " them (no gradient reaches them: they would never train). Read the parameters the step"
            " receives, the tree pockjax.add_adapters returned, not a copy of the original weights;"
            " or drop the lora rule for these tensors.")


def _refuse_trained_but_unchanged(graph: TrainGraph, scheme: UpdateScheme, idx, resolved) -> None:
    """Refuses a scheme that trains a parameter the step returns exactly as it came.

    The step differentiates it but never updates it: an ``nnx.Optimizer``
    whose ``wrt`` filter leaves it out (``nnx.jit`` leaves it unchanged
    too). The scheme and the optimizer disagree, and the step would spend
    the parameter's gradient for nothing, or train nothing at all.
    """
    kept = _returned_unchanged(graph)
    unchanged = [graph.in_paths[i] for i, r in zip(idx, resolved)
                 if isinstance(r, (Full, ChannelSelect)) and i in kept]
    if unchanged:
        raise SchemeError(
            f"the scheme{' ' + scheme.name if scheme.name else ''} trains {some(unchanged)}, but {graph.step_name} returns them unchanged: the"
            " optimizer never updates them (an nnx.Optimizer whose wrt filter leaves them out, or an"
            " update that skips them). Make the optimizer follow the scheme"
            " (nnx.Optimizer(model, tx, wrt=scheme.nnx_wrt())), or freeze them in the scheme.")


def _grad_tag_rule(rule: RuleOf, x):
    """The value of a grad tag under ``rule`` given its input (whole form)."""
    if isinstance(rule, Frozen):
        return ZeroValue(tuple(np.shape(x)), x.dtype)
    if isinstance(rule, ChannelSelect):
        if isinstance(x, ZeroValue):
            return x
        return slicing.pad(rule, slicing.take(rule, x), x.shape)
    return x


def _nested_rule(rules: dict[int, RuleOf]):
    """Rule used inside nested jaxprs: apply grad-tag rules, drop other tags."""

    def rule(eqn, invals):
        if eqn.primitive is tags.grad_tag_p:
            sel = rules.get(eqn.params["index"], Full())
            if isinstance(sel, ChannelSelect) and not sel.is_contiguous:
                raise PockjaxError(
                    "a channel rule with an explicit index set applies to a gradient computed "
                    "inside a nested jaxpr (scan/cond/...); use a count k (first k channels) there"
                )
            return [_materialize(_grad_tag_rule(sel, invals[0]))]
        if eqn.primitive in _FORWARD_TAGS:
            return [invals[0]]
        return _interp.rewrite_nested(eqn, invals, rule, _is_tag)

    return rule


def _is_exact_update(eqn, out_demand) -> bool:
    """Whether ``out_demand`` selects exactly the region a dynamic_update_slice wrote."""
    if eqn.primitive is not C.primitives.dynamic_update_slice_p or not isinstance(out_demand, ChannelSelect):
        return False
    if not out_demand.is_contiguous:
        return False
    operand, update, *starts = eqn.invars
    expected = slicing.sliced_shape(out_demand, operand.aval.shape)
    if tuple(update.aval.shape) != tuple(expected) or not all(isinstance(v, C.Literal) for v in starts):
        return False
    want = [0] * len(starts)
    want[out_demand.axis] = out_demand.start
    return [int(v.val) for v in starts] == want


def _is_tag(eqn) -> bool:
    return eqn.primitive in tags.TAG_PRIMITIVES


def _scan_first_iterations(eqn, out_demands):
    """Run only the first iterations of a scan when only their outputs are needed.

    The backward scan of ``lax.scan``-ed layers (stacked on a leading axis)
    visits the layers last to first. When a scheme trains only the last
    layers (``channels(indices=[6, 7], axis=0)`` on the stacked kernels) and
    nothing needs the scan's final carry (the activation gradient below them
    feeds only frozen parameters), the per-layer outputs that are needed are
    those of the scan's *first* iterations: the same scan over ``length=k``
    and the matching slice of its ``xs`` computes exactly them, and the
    backward of the frozen iterations is never run.

    Returns ``(operand forms, params, output forms)`` or ``None``.
    """
    if eqn.primitive is not C.scan_p or eqn.effects:
        return None
    params = eqn.params
    n_consts, n_carry, length = params["num_consts"], params["num_carry"], params["length"]
    if any(d != "dead" for d in out_demands[:n_carry]):
        return None
    sel = None
    for d in out_demands[n_carry:]:
        if d == "dead":
            continue
        if not isinstance(d, ChannelSelect) or d.axis != 0 or not d.is_contiguous:
            return None
        if sel is not None and d.indices != sel.indices:
            return None
        sel = d
    if sel is None or sel.count == length:
        return None
    first = sel.start + sel.count == length if params["reverse"] else sel.start == 0
    if not first:
        return None
    rows = ChannelSelect(axis=0, size=length, indices=sel.indices)
    forms = [None] * (n_consts + n_carry) + [rows] * (len(eqn.invars) - n_consts - n_carry)
    out_forms = ["dead"] * n_carry + [rows if d != "dead" else "dead" for d in out_demands[n_carry:]]
    return forms, dict(params, length=sel.count), out_forms


class _Requests:
    """The demand analysis' record: the forms each value is requested in.

    A form is ``None`` (the whole value) or a :class:`ChannelSelect`; a value
    with no request is dead, one requested in several forms is needed whole.
    """

    def __init__(self):
        self.forms: dict = {}

    def add(self, v, form) -> None:
        if not isinstance(v, C.Literal):
            self.forms.setdefault(v, []).append(form)

    def of(self, v):
        forms = self.forms.get(v)
        if not forms:
            return "dead"
        first = forms[0]
        return first if all(f == first for f in forms) else None


def _plan(eqns, req: _Requests, rules: dict, param_shapes: dict) -> list:
    """Walk ``eqns`` backwards; choose how each computes its demanded outputs.

    Returns one mode per equation: ``("dead",)``, ``("zero",)`` (a frozen
    gradient), ``("grad_select", sel, out)`` / ``("identity", out)`` (a
    gradient tag), ``("forward_update",)``, ``("scan_first", ...)`` (see
    :func:`_scan_first_iterations`), ``("call_body", ...)`` (a ``remat``
    body rewritten with the demands of its outputs), ``("sliced", forms,
    params, sel)`` (a push rule), ``("pruned", eqn)`` (a ``cond`` without the
    outputs nobody reads) or ``("full",)``. Requests for the
    equations' operands are added to ``req`` on the way.
    """
    modes = [None] * len(eqns)
    for k in range(len(eqns) - 1, -1, -1):
        modes[k] = _plan_eqn(eqns[k], req, rules, param_shapes)
    return modes


def _plan_eqn(eqn, req: _Requests, rules: dict, param_shapes: dict) -> tuple:
    """The mode of one equation (see :func:`_plan`); requests its operands' forms."""
    outs = [req.of(v) if not isinstance(v, C.DropVar) else "dead" for v in eqn.outvars]
    if all(d == "dead" for d in outs) and not eqn.effects:
        return ("dead",)
    if eqn.primitive is tags.grad_tag_p:
        return _plan_grad_tag(eqn, outs[0], req, rules, param_shapes)
    if _is_exact_update(eqn, outs[0]):
        # the selected channels of dynamic_update_slice(x, update) are `update`
        req.add(eqn.invars[1], None)
        return ("forward_update",)
    first_iterations = _scan_first_iterations(eqn, outs)
    if first_iterations is not None:
        forms, params, out_forms = first_iterations
        for v, f in zip(eqn.invars, forms):
            req.add(v, f)
        return ("scan_first", forms, params, out_forms)
    if eqn.primitive is C.primitives.remat_p and any(isinstance(d, ChannelSelect) for d in outs):
        return _plan_remat_body(eqn, outs, req, rules, param_shapes)
    if len(outs) == 1 and isinstance(outs[0], ChannelSelect) and eqn.primitive in PUSH_RULES:
        pushed = PUSH_RULES[eqn.primitive](eqn, outs[0])
        if pushed is not None:
            forms, params = pushed
            for v, f in zip(eqn.invars, forms):
                req.add(v, f)
            return ("sliced", forms, params, outs[0])
    if eqn.primitive is _interp.P.cond_p and "dead" in outs:
        # a branch computing what nobody reads (apply_if_finite's update of a frozen parameter's
        # state, which a sparse state does not hold): pruned, so that its operands are not read;
        # the outputs read come out whole (a reader of some channels slices them)
        used_ins, pruned = DCE_RULES[eqn.primitive]([d != "dead" for d in outs], eqn)
        for v, used in zip(eqn.invars, used_ins):
            if used:
                req.add(v, None)
        return ("pruned", pruned)
    for v in eqn.invars:
        req.add(v, None)
    return ("full",)


def _plan_grad_tag(eqn, out_demand, req: _Requests, rules: dict, param_shapes: dict) -> tuple:
    """A gradient tag: zero (frozen), the selected channels, or the gradient as is."""
    rule = rules.get(eqn.params["index"], Full())
    # per-example gradients (jax.vmap of jax.grad) keep the rule: a frozen parameter's are zeros
    # too, and _refuse_per_example_channels has refused a channels rule
    shape = tuple(eqn.invars[0].aval.shape)
    if not _per_example(eqn, param_shapes) and shape != param_shapes.get(eqn.params["index"]):
        rule = Full()  # already sliced by an earlier sparse_grad: leave as is
    if isinstance(rule, Frozen):
        return ("zero",)
    if isinstance(rule, ChannelSelect):
        req.add(eqn.invars[0], rule)
        return ("grad_select", rule, out_demand)
    req.add(eqn.invars[0], out_demand if out_demand != "dead" else None)
    return ("identity", out_demand)


def _plan_remat_body(eqn, outs, req: _Requests, rules: dict, param_shapes: dict) -> tuple:
    """``jax.checkpoint``: the backward (weight gradients included) sits in the
    remat body; plan the body with its outputs' demands."""
    body = eqn.params["jaxpr"]
    inner = _Requests()
    for v, d in zip(body.outvars, outs):
        if d != "dead":
            inner.add(v, d)
    modes = _plan(body.eqns, inner, rules, param_shapes)
    for v in eqn.invars:
        req.add(v, None)
    return ("call_body", inner, modes, outs)


def _per_example(eqn, param_shapes: dict) -> bool:
    """Whether a gradient tag holds per-example gradients: ``jax.vmap`` (``jacrev``) batched it,
    adding axes to the parameter's shape (a slice of an earlier ``sparse_grad`` keeps the rank)."""
    shape = param_shapes.get(eqn.params["index"])
    return shape is not None and len(eqn.invars[0].aval.shape) > len(shape)


def _refuse_per_example_channels(graph: TrainGraph, rules: dict, param_shapes: dict) -> None:
    """A channels rule cannot select the channels of per-example gradients (their axes moved)."""
    hit = []

    def visit(e):
        if e.primitive is tags.grad_tag_p and _per_example(e, param_shapes) \
                and isinstance(rules.get(e.params["index"]), ChannelSelect):
            hit.append(graph.in_paths[e.params["index"]])
        return False

    _interp.contains(graph.jaxpr, visit)
    if hit:
        raise SchemeError(
            f"{graph.step_name} takes per-example gradients (jax.vmap of jax.grad, or jax.jacrev) of"
            f" {some(sorted(set(hit)))}, which the scheme trains by a channels rule: pockjax cannot select"
            " channels of a batched gradient. Compute the per-example gradients with jax.lax.map"
            " (one example at a time), or give these parameters a \"full\" or \"frozen\" rule.")


def _check_sparse_state_use(graph: TrainGraph, req: _Requests, in_form: dict, dropped_inputs: set) -> None:
    """A sparse optimizer state must be read only where it exists, in its stored form."""
    invars = graph.jaxpr.invars
    for i in range(len(invars)):
        if i in dropped_inputs and req.forms.get(invars[i]):
            raise PockjaxError(
                f"optimizer state {graph.in_paths[i]!r} of a frozen parameter is read by the step; "
                "this optimizer needs the full state: initialise it with tx.init(params) instead"
            )
        sel = in_form.get(invars[i])
        if isinstance(sel, ChannelSelect) and any(f != sel for f in req.forms.get(invars[i], [])):
            raise PockjaxError(
                f"optimizer state {graph.in_paths[i]!r} is used whole, not channel by channel; "
                "this optimizer needs the full state: initialise it with tx.init(params)"
            )


def _read(env: dict, v, form):
    """Value ``v`` in ``form``, slicing a whole value when a slice is asked for."""
    if isinstance(v, C.Literal):
        return v.val
    have, x = env[v]
    if have == form:
        return x
    if have is None and form is not None:
        if isinstance(x, ZeroValue):
            return ZeroValue(slicing.sliced_shape(form, x.shape), x.dtype)
        return slicing.take(form, x)
    raise AssertionError(f"value {v} is held as {have}, needed as {form}")


def _write(env: dict, v, form, x) -> None:
    if not isinstance(v, C.DropVar):
        env[v] = (form, x)


def _evaluate(eqns, modes, env: dict, req: _Requests, nested, kept: dict | None = None,
              selected: dict | None = None) -> None:
    """Run ``eqns`` on tracers in ``env``, each computing its planned form; a variable in
    ``kept`` (a frozen parameter's new value) takes its input's value (``kept[var]``), and one in
    ``selected`` (a channel-ruled parameter's new value, ``(input, selection)``), computed whole,
    its input's values outside the trained channels."""
    for eqn, mode in zip(eqns, modes):
        if mode[0] != "dead":
            _EVALUATE[mode[0]](eqn, mode, env, req, nested)
            for v in eqn.outvars if kept else ():
                if v in kept and v in env:
                    form = env[v][0]
                    env[v] = (form, _read(env, kept[v], form))
            for v in eqn.outvars if selected else ():
                if v in selected and v in env and env[v][0] is None:  # a reader needs it whole
                    old, sel = selected[v]
                    env[v] = (None, slicing.put(sel, _read(env, old, None), _materialize(_read(env, v, sel))))


def _eval_zero(eqn, mode, env, req, nested) -> None:
    _write(env, eqn.outvars[0], None, _zero_like_out(eqn)[0])


def _eval_grad_select(eqn, mode, env, req, nested) -> None:
    sel, out_demand = mode[1], mode[2]
    part = _read(env, eqn.invars[0], sel)
    if not isinstance(part, ZeroValue):  # keep the gradient findable
        part = tags.grad_tag_p.bind(part, **eqn.params)
    if out_demand == sel:
        _write(env, eqn.outvars[0], sel, part)
    elif isinstance(part, ZeroValue):
        _write(env, eqn.outvars[0], None, ZeroValue(tuple(eqn.outvars[0].aval.shape), part.dtype))
    else:
        _write(env, eqn.outvars[0], None, slicing.pad(sel, part, eqn.outvars[0].aval.shape))


def _eval_forward_update(eqn, mode, env, req, nested) -> None:
    _write(env, eqn.outvars[0], req.of(eqn.outvars[0]), _read(env, eqn.invars[1], None))


def _eval_identity(eqn, mode, env, req, nested) -> None:
    form = mode[1] if mode[1] != "dead" else None
    value = _read(env, eqn.invars[0], form)
    if not isinstance(value, ZeroValue):
        value = tags.grad_tag_p.bind(value, **eqn.params)
    _write(env, eqn.outvars[0], form, value)


def _eval_scan_first(eqn, mode, env, req, nested) -> None:
    forms, params, out_forms = mode[1], mode[2], mode[3]
    invals = [_materialize(_read(env, v, f)) for v, f in zip(eqn.invars, forms)]
    if _interp.contains(params["jaxpr"], _is_tag):
        params = dict(params, jaxpr=_interp.retrace(params["jaxpr"], nested))
    outs = _interp.bind_eqn(eqn, invals, params)
    for v, f, x in zip(eqn.outvars, out_forms, outs):
        if f != "dead":
            _write(env, v, f, x)


def _eval_sliced(eqn, mode, env, req, nested) -> None:
    forms, params, sel = mode[1], mode[2], mode[3]
    invals = [_read(env, v, f) for v, f in zip(eqn.invars, forms)]
    zrule = ZERO_RULES.get(eqn.primitive)
    outs = zrule(eqn, invals) if zrule and any(isinstance(x, ZeroValue) for x in invals) else None
    if outs is not None and isinstance(outs[0], ZeroValue):
        outs = [ZeroValue(slicing.sliced_shape(sel, outs[0].shape), outs[0].dtype)]
    if outs is None and eqn.primitive in _FORWARD_TAGS:
        outs = [invals[0]]
    if outs is None:
        outs = _interp.bind_eqn(eqn, [_materialize(x) for x in invals], params)
    _write(env, eqn.outvars[0], sel, outs[0])


def _eval_full(eqn, mode, env, req, nested) -> None:
    invals = [_read(env, v, None) for v in eqn.invars]
    outs = None
    if any(isinstance(x, ZeroValue) for x in invals):
        zrule = ZERO_RULES.get(eqn.primitive)
        outs = zrule(eqn, invals) if zrule else None
        if outs is None:
            invals = [_materialize(x) for x in invals]
    if outs is None and eqn.primitive in _FORWARD_TAGS:
        outs = [invals[0]]
    if outs is None:
        outs = nested(eqn, invals)
    if outs is None:
        outs = _interp.bind_eqn(eqn, invals)
    for v, x in zip(eqn.outvars, outs):
        _write(env, v, None, x)


def _eval_pruned(eqn, mode, env, req, nested) -> None:
    _eval_full(mode[1], ("full",), env, req, nested)  # its operands and outputs are eqn's, fewer


def _eval_call_body(eqn, mode, env: dict, req, nested) -> None:
    """Re-bind a ``remat`` equation whose body computes its outputs in their demanded forms.

    Outputs nobody needs come out as zeros (``dce`` then prunes them inside
    the body); needed ones come out whole or as the demanded channel slice,
    so a weight-gradient op under ``jax.checkpoint`` computes only the
    trained channels.
    """
    _, inner_req, inner_modes, out_forms = mode
    body = eqn.params["jaxpr"]
    invals = [_materialize(_read(env, v, None)) for v in eqn.invars]

    def fun(*args):
        inner_env = {v: (None, x) for v, x in zip(body.invars, args)}
        _evaluate(body.eqns, inner_modes, inner_env, inner_req, nested)
        outs = []
        for v, form in zip(body.outvars, out_forms):
            if form == "dead":
                outs.append(jnp.zeros(v.aval.shape, v.aval.dtype))
            else:
                outs.append(_materialize(_read(inner_env, v, form)))
        return outs

    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in body.invars]
    closed = jax.make_jaxpr(fun)(*structs)
    new_body, consts = closed.jaxpr, list(closed.consts)
    if consts:  # remat takes an open jaxpr: constants become leading operands
        new_body = C.convert_constvars_jaxpr(new_body)
        invals = consts + invals
    outs = _interp.bind_eqn(eqn, invals, dict(eqn.params, jaxpr=new_body))
    for v, form, x in zip(eqn.outvars, out_forms, outs):
        if form != "dead":
            _write(env, v, form, x)


#: How each planned mode (see :func:`_plan`) is evaluated.
_EVALUATE = {
    "zero": _eval_zero,
    "grad_select": _eval_grad_select,
    "forward_update": _eval_forward_update,
    "identity": _eval_identity,
    "scan_first": _eval_scan_first,
    "call_body": _eval_call_body,
    "sliced": _eval_sliced,
    "pruned": _eval_pruned,
    "full": _eval_full,
}


# -- the pass ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseGradRecord(PassRecord):
    """What :func:`sparse_grad` did.

    Attributes:
      scheme: the scheme applied.
      rules: ``(path, rule)`` per parameter, in input order: the rule the path
        resolved to (``Full()``, ``Frozen()`` or a ``ChannelSelect``);
        ``dict(record.rules)`` looks one up.
      sparse_opt_state: whether the optimizer state inputs hold only the
        trainable entries (:func:`pockjax.init_opt_state`).
    """

    name: str = "sparse_grad"
    scheme: UpdateScheme
    rules: tuple[tuple[str, RuleOf], ...]
    sparse_opt_state: bool


def sparse_grad(scheme: UpdateScheme, *, sparse_opt_state: bool = False, allow_nothing_trained: bool = False) -> Pass:
    """The sparse-update pass for ``scheme``.

    Args:
      scheme: which parameters / channels are trained.
      sparse_opt_state: the optimizer state inputs hold only trainable entries
        (frozen parameters' state dropped, channel-ruled state sliced), as made
        by :func:`pockjax.init_opt_state`.
      allow_nothing_trained: accept a scheme that freezes every parameter
        (otherwise a :class:`~pockjax.SchemeError`).

    Returns:
      A :class:`~pockjax.Pass` that records a :class:`SparseGradRecord`.

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> tx = optax.adam(0.1)
        >>> def step(params, opt_state, x):
        ...     loss_fn = lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"])
        ...     loss, g = jax.value_and_grad(loss_fn)(params)
        ...     updates, opt_state = tx.update(g, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, loss
        >>> params = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 2))}
        >>> graph = pockjax.trace_step(step, (params, tx.init(params), jnp.ones((5, 3))))
        >>> prune = pockjax.chain(pockjax.sparse_grad(pockjax.UpdateScheme({"b": "full"})), pockjax.dce())
        >>> sparse = prune(graph)
        >>> pockjax.count_primitives(graph)["dot_general"], pockjax.count_primitives(sparse)["dot_general"]
        (5, 3)
        >>> dict(sparse.record(pockjax.transforms.SparseGradRecord).rules)
        {'a': Frozen(), 'b': Full()}
    """
    if not isinstance(scheme, UpdateScheme):
        raise TypeError(
            f"sparse_grad takes an UpdateScheme (pockjax.UpdateScheme({{pattern: rule}})); "
            f"got {type(scheme).__name__}"
        )

    def rewrite(graph: TrainGraph) -> TrainGraph:
        return _sparse_grad(graph, scheme, sparse_opt_state, allow_nothing_trained)

    return Pass("sparse_grad", rewrite)


def _sparse_grad(graph: TrainGraph, scheme: UpdateScheme, sparse_opt_state: bool,
                 allow_nothing_trained: bool = False) -> TrainGraph:
    """The pass in named steps: rules, what each output becomes, demands, re-trace, bookkeeping."""
    rules = resolve_rules(graph, scheme, allow_nothing_trained=allow_nothing_trained)
    input_rules = _input_rules(graph, rules)
    kept_new = _kept_new_values(graph, input_rules)
    out_plan = _output_plan(graph, input_rules, sparse_opt_state, kept_new)
    in_form, dropped_inputs = _input_forms(graph, input_rules, sparse_opt_state)

    req = _seed_demands(graph, out_plan, dropped_inputs)
    param_shapes = {i: tuple(v.aval.shape) for i, v in enumerate(graph.jaxpr.invars)}
    _refuse_per_example_channels(graph, rules, param_shapes)
    modes = _plan(graph.jaxpr.eqns, req, rules, param_shapes)
    _check_sparse_state_use(graph, req, in_form, dropped_inputs)

    new_closed = _retrace(graph, out_plan, in_form, dropped_inputs, modes, req, _nested_rule(rules),
                          kept_new)
    record = SparseGradRecord(
        scheme=scheme,
        rules=tuple((graph.in_paths[i], r) for i, r in rules.items()),
        sparse_opt_state=sparse_opt_state,
    )
    return _drop_removed_state(graph, new_closed, out_plan, dropped_inputs).recorded(record)


def _input_rules(graph: TrainGraph, rules: dict[int, RuleOf]) -> list[RuleOf]:
    """Per input: a parameter's rule, the rule of the parameter an optimizer-state
    leaf mirrors, else ``Full()`` (batch, model state, unmirrored state)."""
    out = []
    for i, role in enumerate(graph.in_roles):
        if role == PARAM:
            out.append(rules[i])
        elif role == OPT_STATE and graph.param_of[i] is not None:
            out.append(rules[graph.param_of[i]])
        else:
            out.append(Full())
    return out


def _output_plan(graph: TrainGraph, input_rules: list[RuleOf], sparse_opt_state: bool,
                 kept_new: dict) -> list[tuple]:
    """What each output becomes.

    ``("keep", i)``: the old input ``i``; ``("select", i, sel)``: old input
    ``i`` with the selected channels from the new value; ``("part", sel)``:
    only the slice (sparse optimizer state); ``("whole",)``: the new value.
    """
    out_plan = []
    averages = _averages_of_parameters(graph, input_rules, kept_new)
    for o, i in enumerate(graph.out_to_in):
        rule = input_rules[i] if i is not None else Full()
        if o in averages:  # computed as the step computes it, from the kept parameter
            if sparse_opt_state:
                raise PockjaxError(
                    f"optimizer state {graph.in_paths[i]!r} of the frozen parameter"
                    f" {graph.in_paths[graph.param_of[i]]!r} is computed from the parameter (an average of the"
                    " weights, optax.ema?), so it changes though the parameter is kept: pass"
                    " the full state, tx.init(params), instead of pockjax.init_opt_state")
            out_plan.append(("whole",))
        elif isinstance(rule, Frozen):
            out_plan.append(("keep", i))
        elif isinstance(rule, ChannelSelect):
            sparse = sparse_opt_state and graph.in_roles[i] == OPT_STATE
            out_plan.append(("part", rule) if sparse else ("select", i, rule))
        else:
            out_plan.append(("whole",))
    return out_plan


def _averages_of_parameters(graph: TrainGraph, input_rules: list[RuleOf], new_of: dict) -> set[int]:
    """The outputs of optimizer state mirroring a frozen parameter that average the parameter
    (``optax.ema`` of the weights, old or updated, kept in the optimizer state).

    Gradient optimizer state (moments, momentum) of a frozen parameter is kept, as
    PyTorch keeps the state of a parameter without a gradient. An average of the
    weights is not: under ``jax.jit`` it keeps following the (kept) parameter, and its
    count advances anyway, so keeping it would debias a stale average towards 0. Such
    state reads the parameter's value (its input, or its new value, which the rewritten
    step holds at the kept value: :func:`_kept_new_values`) and not its gradient.
    """
    jaxpr = graph.jaxpr
    # a parameter the loss reads (one it does not read has no gradient to tell its momentum
    # under L2 decay, g + wd * p + m * trace, from an average)
    read = gradient_tag_indices(jaxpr)
    frozen = {i for i, r in enumerate(graph.in_roles)
              if r == PARAM and isinstance(input_rules[i], Frozen) and i in read}
    wanted = {o: graph.param_of[j] for o, j in enumerate(graph.out_to_in) if j is not None
              and graph.in_roles[j] == OPT_STATE and graph.param_of[j] in frozen}
    if not wanted:
        return set()

    def kept(v, d):  # the new value holds the kept parameter: it reads the parameter, not its gradient
        i = new_of.get(v)
        return d if i is None else (d - {("grad", i)}) | {("in", i)}

    deps = _dependencies(jaxpr, [frozenset({("in", i)}) for i in range(len(jaxpr.invars))], adjust=kept)
    return {o for o, i in wanted.items() if ("in", i) in deps[o] and ("grad", i) not in deps[o]}


def _kept_new_values(graph: TrainGraph, input_rules: list[RuleOf]) -> dict:
    """``{new value variable: frozen parameter index}``: the values a frozen parameter's update
    computes, which the rewritten step replaces by the kept parameter for every other reader
    (an average of the weights reads the weights as they are: decay moves no frozen one)."""
    jaxpr = graph.jaxpr
    out = {}
    whole = set()
    for o, i in enumerate(graph.out_to_in):
        v = jaxpr.outvars[o]
        if isinstance(v, C.Literal):
            continue
        if i is not None and graph.in_roles[i] == PARAM and isinstance(input_rules[i], Frozen):
            if v is not jaxpr.invars[i]:
                out.setdefault(v, i)
        elif i is not None and graph.in_roles[i] == PARAM:  # also a trained leaf's value: left as is
            whole.add(v)
    return {v: i for v, i in out.items() if v not in whole}


def _input_forms(graph: TrainGraph, input_rules: list[RuleOf], sparse_opt_state: bool) -> tuple[dict, set]:
    """The form each input has in the rewritten graph, and the inputs it drops.

    With a sparse optimizer state, a frozen parameter's state is not an input
    and a channel-ruled parameter's state comes in sliced.
    """
    in_form: dict = {}
    dropped_inputs = set()
    for i, v in enumerate(graph.jaxpr.invars):
        rule = input_rules[i]
        if sparse_opt_state and graph.in_roles[i] == OPT_STATE and not isinstance(rule, Full):
            if isinstance(rule, Frozen):
                dropped_inputs.add(i)
            else:
                in_form[v] = rule
        else:
            in_form[v] = None
    return in_form, dropped_inputs


def _seed_demands(graph: TrainGraph, out_plan: list[tuple], dropped_inputs: set) -> _Requests:
    """The demands the outputs put on the values they read (where the analysis starts)."""
    invars = graph.jaxpr.invars
    req = _Requests()
    for v, plan in zip(graph.jaxpr.outvars, out_plan):
        if plan[0] == "keep":
            if plan[1] not in dropped_inputs:
                req.add(invars[plan[1]], None)
        elif plan[0] == "select":
            req.add(v, plan[2])
            req.add(invars[plan[1]], None)
        elif plan[0] == "part":
            req.add(v, plan[1])
        else:
            req.add(v, None)
    return req


def _retrace(graph: TrainGraph, out_plan, in_form: dict, dropped_inputs: set, modes, req: _Requests,
             nested, kept_values: dict) -> C.ClosedJaxpr:
    """Re-trace the step, each value computed in its demanded form, outputs as planned.

    Every reader of a frozen parameter's new value reads the kept parameter (``kept_values``),
    and every reader of a channel-ruled one's the value the step returns: the untrained channels
    kept (an EMA teacher of the weights follows the weights as they come back)."""
    jaxpr = graph.jaxpr
    invars, outvars = jaxpr.invars, jaxpr.outvars
    kept_inputs = [i for i in range(len(invars)) if i not in dropped_inputs]
    kept = {v: invars[i] for v, i in kept_values.items()}
    whole = {v for v, plan in zip(outvars, out_plan) if plan[0] == "whole"}
    selected = {v: (invars[plan[1]], plan[2]) for v, plan in zip(outvars, out_plan)
                if plan[0] == "select" and not isinstance(v, C.Literal) and v not in invars and v not in whole}

    def run(*args):
        env: dict = {}
        for i, x in zip(kept_inputs, args):
            env[invars[i]] = (in_form[invars[i]], x)
        for v, c in zip(jaxpr.constvars, graph.closed_jaxpr.consts):
            env[v] = (None, c)
        _evaluate(jaxpr.eqns, modes, env, req, nested, kept, selected)
        return [_output_value(env, invars, v, plan) for v, plan in zip(outvars, out_plan)
                if not (plan[0] == "keep" and plan[1] in dropped_inputs)]

    in_structs = []
    for i in kept_inputs:
        aval = invars[i].aval
        sel = in_form[invars[i]]
        shape = slicing.sliced_shape(sel, aval.shape) if sel is not None else aval.shape
        in_structs.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    return jax.make_jaxpr(run)(*in_structs)


def _output_value(env: dict, invars, v, plan: tuple):
    """One output of the rewritten step, as its plan says (see :func:`_output_plan`)."""
    if plan[0] == "keep":
        return _read(env, invars[plan[1]], None)
    if plan[0] == "select":
        sel = plan[2]
        old = _read(env, invars[plan[1]], None)
        return slicing.put(sel, old, _materialize(_read(env, v, sel)))
    if plan[0] == "part":
        return _materialize(_read(env, v, plan[1]))
    return _materialize(_read(env, v, None))


def _drop_removed_state(graph: TrainGraph, new_closed: C.ClosedJaxpr, out_plan, dropped_inputs: set) -> TrainGraph:
    """The rewritten graph, with dropped optimizer state gone from roles, paths and maps."""
    kept_inputs = [i for i in range(len(graph.in_roles)) if i not in dropped_inputs]
    kept_outputs = [o for o, plan in enumerate(out_plan) if not (plan[0] == "keep" and plan[1] in dropped_inputs)]
    new_index = {old: new for new, old in enumerate(kept_inputs)}
    return graph.replace(
        closed_jaxpr=new_closed,
        in_roles=tuple(graph.in_roles[i] for i in kept_inputs),
        in_paths=tuple(graph.in_paths[i] for i in kept_inputs),
        out_roles=tuple(graph.out_roles[o] for o in kept_outputs),
        out_paths=tuple(graph.out_paths[o] for o in kept_outputs),
        out_to_in=tuple(
            None if graph.out_to_in[o] is None else new_index[graph.out_to_in[o]] for o in kept_outputs
        ),
        param_of=tuple(
            None if graph.param_of[i] is None else new_index.get(graph.param_of[i]) for i in kept_inputs
        ),
    )
