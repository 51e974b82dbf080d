"""TrainGraph: a whole train step (forward, backward, optimizer) as one jaxpr.

:func:`trace_step` traces ``step(params, opt_state, *batch) -> (params,
opt_state, *aux)`` once into a closed jaxpr over flat leaves, and records for
every input leaf its role (``param``, ``opt_state``, ``batch``, or
``model_state`` for non-parameter model variables), its dotted path, and for
every output leaf which input it is the new value of. Parameter gradients are
marked with ``pockjax_grad_tag`` equations (see :mod:`pockjax.tags`), so passes
can find them wherever autodiff put them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np

from pockjax import _compat as C
from pockjax import tags
from pockjax._src.jaxpr import contains, subjaxprs
from pockjax.errors import PockjaxError, StepSignatureError, some
from pockjax.paths import leaf_paths

PARAM = "param"
OPT_STATE = "opt_state"
BATCH = "batch"
MODEL_STATE = "model_state"
AUX = "aux"


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What one pass did to a graph: an entry of :attr:`TrainGraph.history`.

    A pass with nothing to report records this base with its name; a pass that
    measures or decides something records a subclass with typed fields
    (:class:`~pockjax.transforms.sparse_grad.SparseGradRecord`,
    :class:`~pockjax.transforms.inplace_update.InplaceUpdateRecord`...), found
    again with :meth:`TrainGraph.record`.
    """

    name: str


RecordT = TypeVar("RecordT", bound=PassRecord)


_tagging_verified = False


def check_tagging_works() -> None:
    """Check once per process that ``jax.grad`` still goes through the tagging hook.

    If a JAX release routes autodiff around ``ad.linearize``, no gradient tag
    would be emitted, no parameter would look differentiated, and a sparse
    step would silently prune nothing: fail here instead, loudly.
    """
    global _tagging_verified
    if _tagging_verified:
        return

    def probe(x):
        with C.tagging_params([x], tags.tag_param):
            return jax.grad(lambda y: (y * y).sum())(x)

    jaxpr = jax.make_jaxpr(probe)(jax.ShapeDtypeStruct((2,), "float32")).jaxpr
    if not contains(jaxpr, lambda eqn: eqn.primitive is tags.grad_tag_p):
        raise PockjaxError(
            f"pockjax's gradient tagging does not work with JAX {jax.__version__}: jax.grad no longer "
            "goes through jax._src.interpreters.ad.linearize, so pockjax cannot find which gradient "
            "belongs to which parameter and would prune nothing. Install a JAX in the verified range "
            f"{C.VERIFIED_JAX} (see pyproject.toml), or report this JAX version."
        )
    _tagging_verified = True


@dataclasses.dataclass(frozen=True)
class TrainGraph:
    """A traced train step and what every input and output leaf is.

    Attributes:
      closed_jaxpr: flat inputs -> flat outputs of the whole step.
      in_tree: pytree def of the step's argument tuple.
      out_tree: pytree def of the step's output tuple.
      in_roles / in_paths: per flat input, its role and dotted path.
      out_roles / out_paths: per flat output, its role and dotted path.
      out_to_in: per flat output, the index of the input it is the new value
        of (params, optimizer state and model state), else ``None``.
      param_of: per flat input, for optimizer-state leaves that mirror a
        parameter (Adam's ``mu``/``nu``...), the index of that parameter input.
      step_name: the user's name for the step (``train_step``), for messages.
      history: what each pass did, in the order they ran (:class:`PassRecord`s).
      ungraded: float inputs passed as parameters that the step never
        differentiates (model state now), outside a Linen ``variables`` dict's
        other collections: ``sparse_grad`` refuses a scheme over a step that
        changes one (its gradient was taken of a value computed from it).
    """

    closed_jaxpr: C.ClosedJaxpr
    in_tree: Any
    out_tree: Any
    in_roles: tuple[str, ...]
    in_paths: tuple[str, ...]
    out_roles: tuple[str, ...]
    out_paths: tuple[str, ...]
    out_to_in: tuple[int | None, ...]
    param_of: tuple[int | None, ...]
    step_name: str = "the step"
    history: tuple[PassRecord, ...] = ()
    ungraded: tuple[int, ...] = ()

    @property
    def jaxpr(self) -> C.Jaxpr:
        return self.closed_jaxpr.jaxpr

    @property
    def in_avals(self) -> list:
        return [v.aval for v in self.jaxpr.invars]

    @property
    def out_avals(self) -> list:
        return [v.aval for v in self.jaxpr.outvars]

    @property
    def out_sources(self) -> tuple[int | None, ...]:
        """Per flat output, the index of the input it forwards unchanged, else None.

        A frozen parameter after ``sparse_grad`` (and state a step returns as
        it came) is such an output: the backends return the input for it.
        """
        index = {v: i for i, v in enumerate(self.jaxpr.invars)}
        return tuple(None if isinstance(v, C.Literal) else index.get(v) for v in self.jaxpr.outvars)

    def inputs_with_role(self, role: str) -> list[int]:
        return [i for i, r in enumerate(self.in_roles) if r == role]

    def replace(self, **changes) -> "TrainGraph":
        """A copy with some fields changed (graphs are immutable)."""
        return dataclasses.replace(self, **changes)

    def with_jaxpr(self, closed_jaxpr: C.ClosedJaxpr, **changes) -> "TrainGraph":
        return dataclasses.replace(self, closed_jaxpr=closed_jaxpr, **changes)

    def recorded(self, record: PassRecord, **changes) -> "TrainGraph":
        """A copy with ``record`` appended to the history (and some fields changed)."""
        return dataclasses.replace(self, history=self.history + (record,), **changes)

    def record(self, kind: type[RecordT]) -> RecordT | None:
        """The latest record of type ``kind`` in the history, or ``None``.

        Example:
            >>> import jax.numpy as jnp, pockjax
            >>> from pockjax.transforms.fold_dot_transpose import FoldDotTransposeRecord
            >>> g = pockjax.trace_step(lambda p, s, x: (p, s, x @ p), (jnp.ones((2, 2)), (), jnp.ones(2)))
            >>> pockjax.fold_dot_transpose()(g).record(FoldDotTransposeRecord)
            FoldDotTransposeRecord(name='fold_dot_transpose', folded=0)
        """
        for r in reversed(self.history):
            if isinstance(r, kind):
                return r
        return None

    @property
    def pass_names(self) -> tuple[str, ...]:
        """The names of the passes that ran on this graph, in order."""
        return tuple(r.name for r in self.history)

    def __str__(self) -> str:
        n_params = len(self.inputs_with_role(PARAM))
        return (
            f"TrainGraph({len(self.jaxpr.eqns)} eqns, {n_params} param leaves, "
            f"{len(self.in_roles)} inputs, {len(self.out_roles)} outputs)"
        )


def optstate_param_map(opt_paths: Sequence[str], opt_shapes, param_paths, param_shapes,
                       mirror_paths: Sequence[str] | None = None) -> list[int | None]:
    """For each optimizer-state leaf, the parameter it mirrors, or None.

    A state leaf mirrors the parameter whose dotted path is the longest suffix
    of the state leaf's path and whose shape is the same (``mu.layers.0.w``
    mirrors ``layers.0.w``). Optax states, ``nnx.Optimizer`` states and
    ``MaskedState`` all lay out per-parameter state this way. A parameter path
    under a Linen ``params`` collection also matches without that prefix.

    The part of the state path before the parameter's (``mu``) must hold a
    mirror of the parameters: every state leaf under it is named by a path of
    ``mirror_paths`` (every leaf of the step's parameters, differentiated or
    not; default ``param_paths``). So a field of another state that happens to share a
    parameter's name and shape (``reduce_on_plateau``'s ``scale`` beside a
    parameter ``scale``; a step counter ``1`` beside the second parameter of
    a tuple) mirrors nothing: it is the optimizer's own state, updated as
    the step computes it.

    Example:
        >>> optstate_param_map(["0.mu.scale", "0.mu.w", "1.scale", "1.count"], [(), (3,), (), ()],
        ...                    ["scale", "w"], [(), (3,)])
        [0, 1, None, None]
    """
    by_parts = {}
    for j, (p, s) in enumerate(zip(param_paths, param_shapes)):
        parts = tuple(p.split(".")) if p else ()
        by_parts.setdefault(parts, []).append((j, s))
        if len(parts) > 1 and parts[0] == "params":
            # a Linen ``variables`` dict as the step's params: the optimizer
            # state was made from ``variables["params"]``
            by_parts.setdefault(parts[1:], []).append((j, s))
    all_parts = [tuple(path.split(".")) if path else () for path in opt_paths]
    named = set()
    for p in (param_paths if mirror_paths is None else mirror_paths):
        parts = tuple(p.split(".")) if p else ()
        named.add(parts)
        if len(parts) > 1 and parts[0] == "params":
            named.add(parts[1:])
    mirrors: dict[tuple, bool] = {}

    def is_mirror(prefix: tuple) -> bool:
        # every state leaf under ``prefix`` is named by a parameter path
        if prefix not in mirrors:
            n = len(prefix)
            mirrors[prefix] = all(q[n:] in named for q in all_parts if q[:n] == prefix)
        return mirrors[prefix]

    out = []
    for parts, shape in zip(all_parts, opt_shapes):
        found = None
        # longest param path that is a suffix of this state path
        for cut in range(0, len(parts) + 1):
            for j, s in by_parts.get(parts[cut:], ()):
                if tuple(s) == tuple(shape) and is_mirror(parts[:cut]):
                    found = j
                    break
            if found is not None:
                break
        out.append(found)
    return out


def leaf_dtype(x):
    """A leaf's dtype, typed PRNG key dtypes (``key<fry>``) included."""
    dt = getattr(x, "dtype", None)
    if C.is_key_dtype(dt):
        return dt
    return jax.dtypes.result_type(x)


def _avals(leaves):
    return [jax.ShapeDtypeStruct(np.shape(x), leaf_dtype(x)) for x in leaves]


def is_linen_variables(x) -> bool:
    """Whether ``x`` is a Linen ``variables`` dict (a mapping with a ``params`` collection):
    its parameters' paths then start with ``params.``, and its other collections
    (``batch_stats``) are model state."""
    return isinstance(x, Mapping) and "params" in x


def is_train_state(x) -> bool:
    """Whether ``x`` is a Flax ``TrainState`` (or a subclass, or a look-alike).

    A train state carries ``params``, ``opt_state`` and ``tx`` and updates them
    with ``apply_gradients``: the step then takes ``(state, *batch)`` and
    returns ``(new_state, *aux)``.
    """
    return all(hasattr(x, name) for name in ("params", "opt_state", "tx", "apply_gradients"))


def _train_state_leaves(state) -> tuple[list[str], list[str]]:
    """Roles and dotted paths of a train state's leaves.

    Leaves under ``.params`` are parameters named by their path inside
    ``params`` (so a scheme reads the same as for a functional step), leaves
    under ``.opt_state`` optimizer state, and every other field (``step``,
    ``batch_stats``...) model state named ``state.<field>...``.
    """
    from pockjax.paths import keypath_to_parts

    roles, paths = [], []
    for keypath, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
        parts = keypath_to_parts(keypath)
        head, rest = (parts[0], ".".join(parts[1:])) if parts else ("", "")
        if head == "params":
            roles.append(PARAM)
            paths.append(rest)
        elif head == "opt_state":
            roles.append(OPT_STATE)
            paths.append(f"opt_state.{rest}" if rest else "opt_state")
        else:
            roles.append(MODEL_STATE)
            paths.append("state." + ".".join(parts))
    return roles, paths


def default_layout(args: Sequence[Any]) -> tuple[int, list[str], list[str]]:
    """How many leading arguments a step returns updated, and each input leaf's role and path.

    ``(state, *batch)`` when the first argument is a Flax ``TrainState``
    (see :func:`is_train_state`), else ``(params, opt_state, *batch)``.
    Roles here are provisional: :func:`trace_step` turns a parameter that the
    step never differentiates into model state.
    """
    if args and is_train_state(args[0]):
        roles, paths = _train_state_leaves(args[0])
        for a, arg in enumerate(args[1:]):
            n = len(jax.tree.leaves(arg))
            roles += [BATCH] * n
            paths += leaf_paths(arg, prefix=f"batch{a}")
        return 1, roles, paths
    roles, paths = [], []
    default_roles = [PARAM, OPT_STATE] + [BATCH] * (len(args) - 2)
    for a, (arg, role) in enumerate(zip(args, default_roles)):
        n = len(jax.tree.leaves(arg))
        roles += [role] * n
        paths += leaf_paths(arg, prefix="" if role == PARAM else f"{role}" if a < 2 else f"batch{a - 2}")
    return 2, roles, paths


def step_name(step: Callable) -> str:
    """The user's name for a step (``train_step``), for error messages."""
    step = unwrap_jit(step)
    return getattr(step, "__qualname__", None) or getattr(step, "__name__", None) or type(step).__name__


def gradient_tag_indices(jaxpr) -> set[int]:
    """Indices of the parameters whose gradient carries a ``pockjax_grad_tag`` (any depth)."""
    return _tag_indices(jaxpr, tags.grad_tag_p)


def _tag_indices(jaxpr, primitive) -> set[int]:
    found: set[int] = set()

    def visit(eqn):
        if eqn.primitive is primitive:
            found.add(eqn.params["index"])
        return False

    contains(jaxpr, visit)
    return found


def _optimizer_driven(jaxpr, own_state: set, stateless: set, in_roles, n_state_leaves: int) -> set[int]:
    """Of the differentiated inputs with no gradient tag, those the optimizer updates.

    Such a leaf is in the tree a ``jax.grad`` linearized, but the loss does
    not read it, so its gradient is a zero autodiff leaves untagged. The
    optimizer still moves it: AdamW's weight decay through the leaf's own
    state (``own_state``, :func:`_updated_by_own_state`), or a stateless
    optimizer's decay (``chain(add_decayed_weights(wd), sgd(lr))``; the
    candidates in ``stateless``), which must scale the leaf on the way
    (``wd * p``). Either way its new value is ``leaf + update``
    (``optax.apply_updates``) and reads the leaf itself and nothing else but
    constants, optimizer state, gradients and scalars: under its own state
    any scalar (a learning rate, ``reduce_on_plateau``'s scale), under a
    stateless optimizer those computed from the parameters with this one
    among them (a global norm over the updates). Then it is a parameter, and
    a scheme that freezes it keeps it.
    Everything else stays model state, updated as the step computes it: a
    scalar (a loss average, a counter), a leaf the step shifts but never
    scales (``c + 1``) or rebuilds from constants (a reset), and one whose
    new value mixes in anything else (the batch, an EMA of the new weights
    kept in the tree, a statistic of other weights), even if the optimizer
    updated it first. ``jaxpr`` has its branches as selects
    (``inline_calls(..., branches="select")``); a loop counts as one equation.
    """
    stateless = {i for i in stateless if jaxpr.invars[i].aval.shape}
    if not own_state and not stateless:
        return set()
    clean = {i for i, r in enumerate(in_roles) if r == OPT_STATE}
    params = frozenset(i for i, r in enumerate(in_roles) if r == PARAM)
    found = set()
    outs = [(i, v) for i, v in zip(range(n_state_leaves), jaxpr.outvars)
            if not isinstance(v, C.Literal) and v is not jaxpr.invars[i]]
    if own_state:
        # its own state reads the gradient: any scalar (a learning rate, a global norm, the
        # loss reduce_on_plateau scales by) is a hyperparameter of that update
        sources, _, producer = _input_sources(jaxpr, clean, lambda got: True)
        found |= {i for i, v in outs if i in own_state and sources.get(v) == frozenset({i})
                  and _applied_update(v, jaxpr.invars[i], i, sources, producer, scaled=False)}
    if stateless:
        sources, scalars, producer = _input_sources(jaxpr, clean, lambda got: got <= params)
        found |= {i for i, v in outs if i in stateless and sources.get(v) == frozenset({i})
                  and (not scalars.get(v) or i in scalars[v])
                  and _applied_update(v, jaxpr.invars[i], i, sources, producer, scaled=True)}
    return found


def _input_sources(jaxpr, clean: set, free_scalar: Callable[[frozenset], bool]) -> tuple[dict, dict, dict]:
    """``(sources, scalars, producer)`` over ``jaxpr``'s top level: for each variable, the
    input indices it reads; those read through the scalars ``free_scalar`` of their
    sources exempts (a global norm over the updates), which ``sources`` leaves out; and
    the equation computing it. Inputs in ``clean`` and gradient tags' outputs read nothing.
    """
    sources: dict = {v: frozenset() if i in clean else frozenset({i}) for i, v in enumerate(jaxpr.invars)}
    scalars: dict = {}
    producer: dict = {}
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, C.Literal)]
        got, via = frozenset(), frozenset()
        if e.primitive is not tags.grad_tag_p:
            got = frozenset().union(*(sources.get(v, frozenset()) for v in ins))
            via = frozenset().union(*(scalars.get(v, frozenset()) for v in ins))
        for o in e.outvars:
            if not o.aval.shape and free_scalar(got):
                sources[o], scalars[o] = frozenset(), via | got
            else:
                sources[o], scalars[o] = got, via
            producer[o] = e
    return sources, scalars, producer


def _applied_update(v, leaf, i: int, sources: dict, producer: dict, *, scaled: bool) -> bool:
    """Whether ``v`` is ``leaf + update`` (``optax.apply_updates``; the leaf maybe cast first),
    with ``scaled`` the update a scaling of the leaf (weight decay's ``-lr * wd * p``): not
    the step's own rule (``p * 0.9``, ``p * 0.9 + 1``, ``new_p + 1``)."""
    e = producer.get(v)
    while e is not None and e.primitive.name == "convert_element_type":  # apply_updates casts back
        e = producer.get(e.invars[0]) if not isinstance(e.invars[0], C.Literal) else None
    if e is None or e.primitive.name not in ("add", "add_any") or len(e.invars) != 2:
        return False

    def is_leaf(a):
        while not isinstance(a, C.Literal) and a is not leaf:
            c = producer.get(a)
            if c is None or c.primitive.name != "convert_element_type":
                return False
            a = c.invars[0]
        return a is leaf

    for a, b in (e.invars, e.invars[::-1]):
        if is_leaf(a) and not isinstance(b, C.Literal) and (not scaled or _scaled_on_the_way(b, i, sources, producer)):
            return True
    return False


def _scaled_on_the_way(v, i: int, sources: dict, producer: dict) -> bool:
    """Whether ``v`` is computed through a ``mul`` of (a value of) input ``i`` by a scalar."""
    seen, todo = set(), [v]
    while todo:
        e = producer.get(todo.pop())
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        reads = [a for a in e.invars if not isinstance(a, C.Literal) and i in sources.get(a, ())]
        if e.primitive.name == "mul" and reads and any(
                isinstance(b, C.Literal) or not b.aval.shape for b in e.invars):
            return True
        todo += reads
    return False


def _updated_by_own_state(jaxpr, ungraded: set, in_roles, in_paths, shapes, candidates,
                          n_state_args: int, per_arg_counts) -> tuple[set[int], set[int]]:
    """Of the ``ungraded`` inputs, those whose new value reads their own optimizer state,
    and those that have optimizer state of their own.

    The step linearized the whole parameter tree, but the loss does not read
    these leaves: their gradient is a zero autodiff leaves untagged. The
    optimizer still updates them (AdamW's weight decay) through their own
    state leaves (paired under the parameters' mirror,
    :func:`optstate_param_map`). An EMA or lookahead's slow weights, updated
    by the step's own rule, read no state of their own and stay model state.
    """
    if not ungraded:
        return set(), set()
    opt_idx = [i for i, r in enumerate(in_roles) if r == OPT_STATE]
    cand_idx = [i for i, r in enumerate(in_roles) if r == PARAM]
    if not opt_idx:
        return set(), set()
    mapping = optstate_param_map(
        [in_paths[i].split(".", 1)[1] if "." in in_paths[i] else "" for i in opt_idx],
        [shapes[i] for i in opt_idx], [in_paths[i] for i in cand_idx], [shapes[i] for i in cand_idx],
        mirror_paths=candidates)
    label = {}
    for i, m in zip(opt_idx, mapping):
        if m is not None and cand_idx[m] in ungraded:
            label[jaxpr.invars[i]] = frozenset({cand_idx[m]})
    with_state = set().union(*label.values()) if label else set()
    if not label:
        return set(), with_state
    # Elementwise only: a label passes to an output of its value's shape. A reduction over
    # all the updates (clip_by_global_norm, apply_if_finite's check) would otherwise carry
    # every leaf's label into every update, and an EMA of the new weights would look
    # updated by its own state.
    for e in jaxpr.eqns:
        if subjaxprs(e, strict=False):  # a loop or branch: not followed
            continue
        for o in e.outvars:
            got = frozenset().union(*(label.get(v, frozenset()) for v in e.invars
                                      if not isinstance(v, C.Literal) and v.aval.shape == o.aval.shape))
            if got:
                label[o] = got
    n_state_leaves = sum(per_arg_counts[:n_state_args])
    return {i for i, v in zip(range(n_state_leaves), jaxpr.outvars)
            if i in ungraded and not isinstance(v, C.Literal) and i in label.get(v, frozenset())}, with_state


def trace_step(
    step: Callable,
    args: Sequence[Any],
    *,
    roles: Sequence[str] | None = None,
    paths: Sequence[str] | None = None,
    n_state_args: int | None = None,
    kwargs: dict | None = None,
) -> TrainGraph:
    """Trace a train step into a :class:`TrainGraph`.

    The step is ``step(params, opt_state, *batch) -> (params, opt_state, *aux)``,
    or, with a Flax ``TrainState`` first, ``step(state, *batch) -> (state, *aux)``.

    A leaf of ``params`` that the step differentiates (``jax.grad``,
    ``value_and_grad``, ``vjp``) is a *parameter*: schemes decide whether it
    is trained. Every other leaf the step returns updated (BatchNorm
    statistics in a Linen ``variables`` dict, counters, RNG keys) is *model
    state*: it is updated exactly as the step computes it, under any scheme.

    Args:
      step: the train step. It must return its state arguments updated, with
        the structure, shapes and dtypes they came in with.
      args: example arguments: arrays or ``jax.ShapeDtypeStruct``.
      roles: per flat input leaf roles, to override the default.
      paths: per flat input leaf dotted paths, to override the default.
      n_state_args: how many leading arguments the step returns updated
        (default: 1 for a ``TrainState``, else 2).

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> tx = optax.sgd(0.1)
        >>> def step(params, opt_state, x):
        ...     loss, g = jax.value_and_grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
        ...     updates, opt_state = tx.update(g, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, loss
        >>> params = {"w": jnp.ones((3, 2))}
        >>> g = pockjax.trace_step(step, (params, tx.init(params), jnp.ones((4, 3))))
        >>> g.in_roles, g.in_paths[0], g.out_to_in
        (('param', 'batch'), 'w', (0, None))
    """
    kwargs = kwargs or {}
    args = tuple(args)
    name = step_name(step)
    step = unwrap_jit(step)
    default_n, in_roles, in_paths = default_layout(args)
    n_state_args = default_n if n_state_args is None else n_state_args
    if len(args) < n_state_args:
        raise StepSignatureError(
            f"{name}: a train step takes (params, opt_state, *batch) or (train_state, *batch); "
            f"got {len(args)} positional argument(s)"
        )
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    per_arg_counts = [len(jax.tree.leaves(arg)) for arg in args]
    if roles is not None:
        if len(roles) != len(flat_args):
            raise ValueError(f"roles has {len(roles)} entries for {len(flat_args)} input leaves")
        in_roles = list(roles)
    if paths is not None:
        if len(paths) != len(flat_args):
            raise ValueError(f"paths has {len(paths)} entries for {len(flat_args)} input leaves")
        in_paths = list(paths)
    check_leaves(name, flat_args, in_paths)
    avals = _avals(flat_args)
    param_idx = [i for i, r in enumerate(in_roles) if r == PARAM]
    check_tagging_works()

    out_store = {}

    def flat_step(*leaves):
        leaves = list(leaves)
        # A parameter's gradient is tagged where autodiff produces it (see _compat).
        is_param = set(param_idx)
        tracer_list = [x if i in is_param else None for i, x in enumerate(leaves)]
        with C.tagging_params(tracer_list, tags.tag_param):
            out = step(*jax.tree_util.tree_unflatten(in_tree, leaves), **kwargs)
        out_store["out"] = out
        flat_out, out_tree = jax.tree_util.tree_flatten(out)
        out_store["tree"] = out_tree
        return flat_out

    # JAX's own messages name the traced function: let them name the user's.
    flat_step.__name__ = flat_step.__qualname__ = name
    closed = inline_calls(jax.make_jaxpr(flat_step)(*avals))
    out = out_store["out"]
    out_tree = out_store["tree"]
    _check_outputs(out, args, n_state_args, name)

    # A "parameter" the step never differentiates is model state (BatchNorm
    # statistics, counters): it keeps the value the step computes for it.
    differentiated = gradient_tag_indices(closed.jaxpr)
    # Float leaves that could have had a gradient pockjax did not see (TrainGraph.ungraded); a
    # Linen ``variables`` dict's other collections (batch_stats) are model state by design,
    # and an integer counter cannot have a gradient.
    linen = is_linen_variables(args[0])
    candidates = [in_paths[i] for i, r in enumerate(in_roles) if r == PARAM]
    ungraded = tuple(i for i, r in enumerate(in_roles) if r == PARAM and i not in differentiated
                     and not (linen and not in_paths[i].startswith("params."))
                     and jax.numpy.issubdtype(avals[i].dtype, jax.numpy.inexact))
    # ... unless its optimizer state updates it: a parameter the loss does not read has a zero
    # gradient that autodiff leaves untagged, and AdamW's decay still moves it (a scheme that
    # freezes it must then keep it, as PyTorch's requires_grad=False does).
    # (looked at with branches as selects: apply_if_finite and MultiSteps update inside a cond)
    view = inline_calls(closed, branches="select") if ungraded else closed
    own, with_state = _updated_by_own_state(view.jaxpr, set(ungraded), in_roles, in_paths,
                                            [a.shape for a in avals], candidates, n_state_args, per_arg_counts)
    # ... or, under an optimizer with no state for it, its weight decay alone moves it; either
    # way only when its new value mixes in nothing else (an EMA kept in the tree stays model state)
    linearized = _tag_indices(closed.jaxpr, tags.param_tag_p)
    driven = _optimizer_driven(view.jaxpr, own, {i for i in ungraded if i in linearized and i not in with_state},
                               in_roles, sum(per_arg_counts[:n_state_args]))
    differentiated = set(differentiated) | driven
    ungraded = tuple(i for i in ungraded if i not in driven)
    in_roles = [MODEL_STATE if r == PARAM and i not in differentiated else r for i, r in enumerate(in_roles)]
    param_idx = [i for i, r in enumerate(in_roles) if r == PARAM]

    out_roles: list[str] = []
    out_paths: list[str] = []
    out_to_in: list[int | None] = []
    for a, arg_out in enumerate(out):
        n = len(jax.tree.leaves(arg_out))
        if a < n_state_args:
            in_start = sum(per_arg_counts[:a])
            out_to_in += list(range(in_start, in_start + n))
            out_roles += [in_roles[in_start + k] for k in range(n)]
            out_paths += [in_paths[in_start + k] for k in range(n)]
        else:
            out_to_in += [None] * n
            out_roles += [AUX] * n
            out_paths += leaf_paths(arg_out, prefix=f"aux{a - n_state_args}")

    shapes = [a.shape for a in avals]
    opt_idx = [i for i, r in enumerate(in_roles) if r == OPT_STATE]
    mapping = optstate_param_map(
        [in_paths[i].split(".", 1)[1] if "." in in_paths[i] else "" for i in opt_idx],
        [shapes[i] for i in opt_idx],
        [in_paths[i] for i in param_idx],
        [shapes[i] for i in param_idx],
        mirror_paths=candidates,
    )
    param_of: list[int | None] = [None] * len(in_roles)
    for i, m in zip(opt_idx, mapping):
        param_of[i] = None if m is None else param_idx[m]

    return TrainGraph(
        closed_jaxpr=closed,
        in_tree=in_tree,
        out_tree=out_tree,
        in_roles=tuple(in_roles),
        in_paths=tuple(in_paths),
        out_roles=tuple(out_roles),
        out_paths=tuple(out_paths),
        out_to_in=tuple(out_to_in),
        param_of=tuple(param_of),
        step_name=name,
        ungraded=ungraded,
    )


def check_leaves(name: str, flat_args, paths) -> None:
    """Every input leaf must be an array (or a Python number): say which is not."""
    for x, path in zip(flat_args, paths):
        if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int, float, complex)):
            continue
        if hasattr(x, "shape") and hasattr(x, "dtype"):
            continue
        raise StepSignatureError(
            f"{name}: input leaf {path!r} is a {type(x).__name__} ({str(x)[:40]!r}), not an array; "
            "pass arrays (jnp.asarray(...)) or mark static configuration outside the step's arguments"
        )


def inline_calls(closed: C.ClosedJaxpr, branches: str = "constant") -> C.ClosedJaxpr:
    """Inline ``jit`` calls at the top level (and the top level of inlined bodies).

    A jitted helper (``jnp`` functions are jitted) is a call with no effect on
    what is computed; inlining it lets passes see through it, so, for
    example, a channel slice reaches a weight-gradient ``dot_general`` that
    autodiff placed inside one. So is a ``cond`` whose index is a constant
    (its chosen branch). Other control flow (``scan``...) is kept.

    With ``branches="select"`` every top-level ``cond`` is inlined: each output
    selects among its branches' values by the index. That view computes what the
    step computes, for analysis only (the rules that classify leaves); it is never
    compiled, since it runs every branch.
    """
    from pockjax._src import jaxpr as core

    if branches not in ("constant", "select"):
        raise ValueError(f"inline_calls: branches must be 'constant' or 'select', not {branches!r}")

    def has_call(eqn):
        return eqn.primitive in (C.primitives.jit_p, C.primitives.closed_call_p)

    def inlined_branch(eqn):
        return (eqn.primitive is core.P.cond_p and not eqn.effects
                and (branches == "select" or isinstance(eqn.invars[0], C.Literal)))

    if not any(has_call(e) or inlined_branch(e) for e in closed.jaxpr.eqns):
        return closed

    def rule(eqn, invals):
        if inlined_branch(eqn):
            cases = eqn.params["branches"]
            if isinstance(eqn.invars[0], C.Literal):  # a branch picked by a constant (optax.MultiSteps' skip test)
                chosen = cases[int(np.clip(int(invals[0]), 0, len(cases) - 1))]
                with C.source_context(eqn):
                    return core.eval_jaxpr_with(chosen.jaxpr, chosen.consts, invals[1:], rule)
            outs = [core.eval_jaxpr_with(b.jaxpr, b.consts, invals[1:], rule) for b in cases]
            try:
                return [jax.lax.select_n(invals[0], *vals) for vals in zip(*outs)]
            except (TypeError, ValueError):  # a case select_n cannot take (an opaque dtype): as it is
                return None
        if has_call(eqn):
            body = eqn.params[core.CALL_BODY[eqn.primitive]]
            inner = body.jaxpr if hasattr(body, "jaxpr") else body
            consts = list(body.consts) if hasattr(body, "consts") else []
            # under the call's own name stack: an inlined equation of a backward pass stays one
            with C.source_context(eqn):
                return core.eval_jaxpr_with(inner, consts, invals, rule)
        return None

    return core.retrace(closed, rule)


def unwrap_jit(fn: Callable) -> Callable:
    """The Python function under ``jax.jit`` / ``nnx.jit`` wrappers.

    pockjax compiles the step itself; tracing through the user's ``jit`` would
    hide the parameters from the gradient tags behind the jit's own tracers.
    """
    while hasattr(fn, "__wrapped__") and (hasattr(fn, "lower") or type(fn).__name__.lower().startswith("jit")):
        fn = fn.__wrapped__
    return fn


def _describe_tree(tree) -> str:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return f"{treedef} with shapes {some([tuple(np.shape(x)) for x in leaves], 6)}"


def _check_outputs(out, args, n_state_args: int, step: str = "the step") -> None:
    names = ["train_state"] if n_state_args == 1 and is_train_state(args[0]) else ["params", "opt_state"]
    expected = "(new_state, *aux)" if names == ["train_state"] else "(new_params, new_opt_state, *aux)"
    if not isinstance(out, (tuple, list)) or len(out) < n_state_args:
        raise StepSignatureError(
            f"{step}: the train step must return {expected}; "
            f"it returned {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
        )
    for a in range(n_state_args):
        name = names[a] if a < 2 else f"argument {a}"
        in_leaves, in_def = jax.tree_util.tree_flatten(args[a])
        out_leaves, out_def = jax.tree_util.tree_flatten(out[a])
        if in_def != out_def:
            raise StepSignatureError(
                f"{step}: output {a} of the step must have the structure of its input {name}:\n"
                f"  input  {name}: {_describe_tree(args[a])}\n"
                f"  output {a}: {_describe_tree(out[a])}\n"
                f"Return {expected} in the order of the arguments."
            )
        for x, y, path in zip(in_leaves, out_leaves, leaf_paths(args[a])):
            xs, ys = np.shape(x), np.shape(y)
            xd, yd = leaf_dtype(x), leaf_dtype(y)
            if xs != ys or xd != yd:
                raise StepSignatureError(
                    f"{step}: {name} leaf {path!r}: the step returns shape {ys} {yd} for an input of "
                    f"shape {xs} {xd}; the new value must keep the old shape and dtype"
                )


__all__ = ["TrainGraph", "PassRecord", "trace_step", "PARAM", "OPT_STATE", "BATCH", "MODEL_STATE", "AUX"]
