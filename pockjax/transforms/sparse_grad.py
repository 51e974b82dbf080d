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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pockjax import _compat as C
from pockjax import tags
from pockjax.errors import PockjaxError, SchemeError
from pockjax.graph import MODEL_STATE, OPT_STATE, PARAM, TrainGraph
from pockjax.scheme import ChannelSelect, Frozen, Full, UpdateScheme
from pockjax._src import jaxpr as _interp
from pockjax._src.jaxpr import PrimitiveTable, prims
from pockjax.transforms import slicing
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


# -- the pass ---------------------------------------------------------------
RuleOf = Any  # Full | Frozen | ChannelSelect


def resolve_rules(graph: TrainGraph, scheme: UpdateScheme, *, allow_nothing_trained: bool = False) -> dict[int, RuleOf]:
    """``{param input index: Full() | Frozen() | ChannelSelect}`` for a graph.

    Raises :class:`~pockjax.SchemeError` when the step differentiates no
    parameter, when a pattern names only model state, and (unless
    ``allow_nothing_trained``) when the scheme freezes every parameter.
    """
    idx = graph.inputs_with_role(PARAM)
    step = graph.meta.get("step_name", "the step")
    if not idx:
        raise SchemeError(
            f"{step} differentiates none of its parameters: pockjax found no gradient of any leaf of "
            "its first argument, so a scheme has nothing to train. Compute the gradient with "
            "jax.grad / jax.value_and_grad / nnx.grad of the parameters inside the step."
        )
    avals = graph.in_avals
    state = [graph.in_paths[i] for i in graph.inputs_with_role(MODEL_STATE)]
    resolved = scheme.resolve([graph.in_paths[i] for i in idx], [avals[i].shape for i in idx], non_gradient=state)
    if not allow_nothing_trained and all(isinstance(r, Frozen) for r in resolved):
        raise SchemeError(
            f"the scheme {scheme!r} freezes every parameter of {step}: the step would train nothing. "
            f"Give some parameters a 'full' or channels(...) rule (parameters: "
            f"{[graph.in_paths[i] for i in idx][:6]}{'...' if len(idx) > 6 else ''})."
        )
    return dict(zip(idx, resolved))


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
    params, sel)`` (a push rule) or ``("full",)``. Requests for the
    equations' operands are added to ``req`` on the way.
    """
    modes = [None] * len(eqns)
    for k in range(len(eqns) - 1, -1, -1):
        eqn = eqns[k]
        outs = [req.of(v) if not isinstance(v, C.DropVar) else "dead" for v in eqn.outvars]
        if all(d == "dead" for d in outs) and not eqn.effects:
            modes[k] = ("dead",)
            continue
        if eqn.primitive is tags.grad_tag_p:
            rule = rules.get(eqn.params["index"], Full())
            if tuple(eqn.invars[0].aval.shape) != param_shapes.get(eqn.params["index"]):
                rule = Full()  # already sliced by an earlier sparse_grad: leave as is
            if isinstance(rule, Frozen):
                modes[k] = ("zero",)
                continue
            if isinstance(rule, ChannelSelect):
                modes[k] = ("grad_select", rule, outs[0])
                req.add(eqn.invars[0], rule)
                continue
            modes[k] = ("identity", outs[0])
            req.add(eqn.invars[0], outs[0] if outs[0] != "dead" else None)
            continue
        if _is_exact_update(eqn, outs[0]):
            # the selected channels of dynamic_update_slice(x, update) are `update`
            modes[k] = ("forward_update",)
            req.add(eqn.invars[1], None)
            continue
        first_iterations = _scan_first_iterations(eqn, outs)
        if first_iterations is not None:
            forms, params, out_forms = first_iterations
            modes[k] = ("scan_first", forms, params, out_forms)
            for v, f in zip(eqn.invars, forms):
                req.add(v, f)
            continue
        if eqn.primitive is C.primitives.remat_p and any(isinstance(d, ChannelSelect) for d in outs):
            # jax.checkpoint: the backward (weight gradients included) sits in the
            # remat body; plan the body with its outputs' demands
            body = eqn.params["jaxpr"]
            inner = _Requests()
            for v, d in zip(body.outvars, outs):
                if d != "dead":
                    inner.add(v, d)
            modes[k] = ("call_body", inner, _plan(body.eqns, inner, rules, param_shapes), outs)
            for v in eqn.invars:
                req.add(v, None)
            continue
        if len(outs) == 1 and isinstance(outs[0], ChannelSelect) and eqn.primitive in PUSH_RULES:
            pushed = PUSH_RULES[eqn.primitive](eqn, outs[0])
            if pushed is not None:
                forms, params = pushed
                modes[k] = ("sliced", forms, params, outs[0])
                for v, f in zip(eqn.invars, forms):
                    req.add(v, f)
                continue
        modes[k] = ("full",)
        for v in eqn.invars:
            req.add(v, None)
    return modes


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


def _evaluate(eqns, modes, env: dict, req: _Requests, nested) -> None:
    """Run ``eqns`` on tracers in ``env``, each computing its planned form."""
    for eqn, mode in zip(eqns, modes):
        kind = mode[0]
        if kind == "dead":
            continue
        if kind == "zero":
            _write(env, eqn.outvars[0], None, _zero_like_out(eqn)[0])
        elif kind == "grad_select":
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
        elif kind == "forward_update":
            _write(env, eqn.outvars[0], req.of(eqn.outvars[0]), _read(env, eqn.invars[1], None))
        elif kind == "identity":
            form = mode[1] if mode[1] != "dead" else None
            value = _read(env, eqn.invars[0], form)
            if not isinstance(value, ZeroValue):
                value = tags.grad_tag_p.bind(value, **eqn.params)
            _write(env, eqn.outvars[0], form, value)
        elif kind == "scan_first":
            forms, params, out_forms = mode[1], mode[2], mode[3]
            invals = [_materialize(_read(env, v, f)) for v, f in zip(eqn.invars, forms)]
            if _interp.contains(params["jaxpr"], _is_tag):
                params = dict(params, jaxpr=_interp.retrace(params["jaxpr"], nested))
            outs = _interp.bind_eqn(eqn, invals, params)
            for v, f, x in zip(eqn.outvars, out_forms, outs):
                if f != "dead":
                    _write(env, v, f, x)
        elif kind == "call_body":
            _evaluate_call_body(eqn, mode, env, nested)
        elif kind == "sliced":
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
        else:
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


def _evaluate_call_body(eqn, mode, env: dict, nested) -> None:
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


def sparse_grad(scheme: UpdateScheme, *, sparse_opt_state: bool = False, allow_nothing_trained: bool = False):
    """The sparse-update pass for ``scheme``: a function ``TrainGraph -> TrainGraph``.

    Args:
      scheme: which parameters / channels are trained.
      sparse_opt_state: the optimizer state inputs hold only trainable entries
        (frozen parameters' state dropped, channel-ruled state sliced), as made
        by :func:`pockjax.init_opt_state`.

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
        >>> sparse = pockjax.dce(pockjax.sparse_grad(pockjax.UpdateScheme({"b": "full"}))(graph))
        >>> pockjax.count_primitives(graph)["dot_general"], pockjax.count_primitives(sparse)["dot_general"]
        (5, 3)
    """

    def apply(graph: TrainGraph) -> TrainGraph:
        return _sparse_grad(graph, scheme, sparse_opt_state, allow_nothing_trained)

    apply.__name__ = "sparse_grad"
    apply.scheme = scheme
    return apply


def _sparse_grad(graph: TrainGraph, scheme: UpdateScheme, sparse_opt_state: bool,
                 allow_nothing_trained: bool = False) -> TrainGraph:
    rules = resolve_rules(graph, scheme, allow_nothing_trained=allow_nothing_trained)
    jaxpr = graph.jaxpr
    invars, outvars = jaxpr.invars, jaxpr.outvars

    def rule_of_input(i: int):
        if graph.in_roles[i] == PARAM:
            return rules[i]
        if graph.in_roles[i] == OPT_STATE and graph.param_of[i] is not None:
            return rules[graph.param_of[i]]
        return Full()

    # 1. What each output becomes.
    #    ("keep", i): the old input i; ("select", i, sel): old input i with the
    #    selected channels from the new value; ("part", sel): only the slice
    #    (sparse optimizer state); ("whole",): the new value.
    out_plan = []
    for o, v in enumerate(outvars):
        i = graph.out_to_in[o]
        rule = rule_of_input(i) if i is not None else Full()
        if isinstance(rule, Frozen):
            out_plan.append(("keep", i))
        elif isinstance(rule, ChannelSelect):
            sparse = sparse_opt_state and graph.in_roles[i] == OPT_STATE
            out_plan.append(("part", rule) if sparse else ("select", i, rule))
        else:
            out_plan.append(("whole",))

    # Inputs as given to the rewritten graph.
    in_form: dict = {}
    dropped_inputs = set()
    for i, v in enumerate(invars):
        rule = rule_of_input(i)
        if sparse_opt_state and graph.in_roles[i] == OPT_STATE and not isinstance(rule, Full):
            if isinstance(rule, Frozen):
                dropped_inputs.add(i)
            else:
                in_form[v] = rule
        else:
            in_form[v] = None

    # 2. Demand analysis (backwards): the form every value is needed in.
    req = _Requests()
    for v, plan in zip(outvars, out_plan):
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
    param_shapes = {i: tuple(v.aval.shape) for i, v in enumerate(invars)}
    modes = _plan(jaxpr.eqns, req, rules, param_shapes)
    _check_sparse_state_use(graph, req, in_form, dropped_inputs)

    # 3. Re-trace, computing each value in the form demanded.
    kept_inputs = [i for i in range(len(invars)) if i not in dropped_inputs]
    nested = _nested_rule(rules)

    def run(*args):
        env: dict = {}
        for i, x in zip(kept_inputs, args):
            env[invars[i]] = (in_form[invars[i]], x)
        for v, c in zip(jaxpr.constvars, graph.closed_jaxpr.consts):
            env[v] = (None, c)
        _evaluate(jaxpr.eqns, modes, env, req, nested)

        results = []
        for v, plan in zip(outvars, out_plan):
            if plan[0] == "keep" and plan[1] in dropped_inputs:
                continue  # sparse optimizer state of a frozen parameter: not an output
            if plan[0] == "keep":
                results.append(_read(env, invars[plan[1]], None))
            elif plan[0] == "select":
                sel = plan[2]
                old = _read(env, invars[plan[1]], None)
                results.append(slicing.put(sel, old, _materialize(_read(env, v, sel))))
            elif plan[0] == "part":
                results.append(_materialize(_read(env, v, plan[1])))
            else:
                results.append(_materialize(_read(env, v, None)))
        return results

    in_structs = []
    for i in kept_inputs:
        aval = invars[i].aval
        sel = in_form[invars[i]]
        shape = slicing.sliced_shape(sel, aval.shape) if sel is not None else aval.shape
        in_structs.append(jax.ShapeDtypeStruct(shape, aval.dtype, weak_type=aval.weak_type))
    new_closed = jax.make_jaxpr(run)(*in_structs)

    # 4. Bookkeeping: drop removed state from roles, paths and maps.
    kept_outputs = [o for o, plan in enumerate(out_plan) if not (plan[0] == "keep" and plan[1] in dropped_inputs)]
    new_index = {old: new for new, old in enumerate(kept_inputs)}
    meta = dict(graph.meta)
    meta.setdefault("passes", [])
    meta["passes"] = meta["passes"] + ["sparse_grad"]
    meta["scheme"] = scheme
    meta["rules"] = {graph.in_paths[i]: r for i, r in rules.items()}
    meta["sparse_opt_state"] = sparse_opt_state
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
        meta=meta,
    )
