"""In-place update: apply each parameter's optimizer update right after its gradient.

In the order autodiff emits a train step, the backward pass computes *every*
gradient before the optimizer runs, so at the end of the backward pass a full
copy of the trained weights exists as gradients. PockEngine instead applies each
gradient to its parameter as soon as it is complete, so a gradient buffer dies
right after it is made. :func:`inplace_update` reorders the step's top-level
equations that way, and pins the order for the backend.

How the order is built:

* The *backward side* ``B`` is every equation the parameter gradients depend on
  (forward, backward, and the ``pockjax_grad_tag`` equations that mark complete
  gradients). It keeps its program order, except that each gradient tag (an
  identity) moves right after the equation that completes its operand: autodiff
  emits all tags together at the end of the backward pass.
* Every other equation (the optimizer, the loss value, ...) is the *update
  side* ``U``. A ``U`` equation is *released* once every ``B`` equation it
  depends on has run, and is placed right after that point. ``U`` equations that
  depend on no ``B`` equation at all (Adam's step counter, ``weight_decay *
  param``) are placed just before their earliest consumer, so they do not hold
  memory from the start of the step.
* Where a group of updates is released before the backward pass is over, an
  ``optimization_barrier`` joins the group's new parameter / optimizer-state
  values with the backward values still needed later (the activation
  cotangents that cross that point); the rest of the backward pass reads the
  barrier's results. XLA may otherwise schedule the updates at the end (its
  scheduler does not know that finishing an update frees a gradient);
  ``tests/test_memory_passes.py`` checks on the compiled executable that the
  order held (XLA's temporary memory drops by about the trained weights' size
  and the scheduled HLO interleaves parameter outputs with the backward pass).

Optimizers that couple all gradients. ``optax.clip_by_global_norm`` (or any
update that reads more than one gradient) makes every update depend on every
gradient. Such updates are released only when the *last* gradient they read is
complete, which is where they already were: the pass then does not reorder them,
and inserts no barrier. The memory consequence is that all gradients of the
coupled parameters are live together at the end of the backward pass, exactly
as without the pass (one full gradient copy of the trained weights: for
LLaMA-2-7B in bf16, 12.6 GiB). The parameters that are coupled are listed in
``graph.record(InplaceUpdateRecord).coupled``. (A two-pass scheme, running the
backward pass once for the norm and again for the updates, would trade one extra
backward pass for that memory; it is not implemented.)

Parameters and optimizer state are donated by :func:`pockjax.compile` itself,
so the new values are written into the old buffers.
"""

from __future__ import annotations

import dataclasses

import jax

from pockjax import _compat as C
from pockjax import tags
from pockjax._src import jaxpr as _interp
from pockjax._src.jaxpr import Phase
from pockjax.graph import PassRecord, TrainGraph
from pockjax.transforms.base import Pass

__all__ = ["InplaceUpdateRecord", "inplace_update", "update_schedule"]


_is_var = _interp.is_var


@dataclasses.dataclass(frozen=True, kw_only=True)
class InplaceUpdateRecord(PassRecord):
    """What :func:`inplace_update` did.

    Attributes:
      groups: update groups released during the backward pass.
      barriers: ``optimization_barrier`` equations inserted to pin the order.
      coupled: paths of the parameters whose update reads more than one
        gradient (global-norm clipping): their updates could not move earlier.
    """

    name: str = "inplace_update"
    groups: int
    barriers: int
    coupled: tuple[str, ...]


def update_schedule(jaxpr: C.Jaxpr) -> dict:
    """The in-place update order of a jaxpr's top-level equations (no rewriting).

    Args:
      jaxpr: the step's ``Jaxpr`` with ``pockjax_grad_tag`` equations at the top level.

    Returns:
      A dict with ``order`` (a permutation of the equation indices, a valid
      topological order), ``cuts`` (``{position in order: [equation indices of the
      update group released there]}``), ``backward`` (the equation indices of the
      backward side in their new order), ``grad_sets`` (per equation, a bitmask of
      the gradient tags it depends on) and ``tag_index`` (per grad-tag equation,
      the parameter index it marks). Empty ``cuts`` and the program order when the
      jaxpr has no gradient tags.

    Example:
      >>> import jax, jax.numpy as jnp, optax, pockjax
      >>> tx = optax.sgd(0.1)
      >>> def step(p, s, x):
      ...     g = jax.grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(p)
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s, None
      >>> p = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))}
      >>> g = pockjax.trace_step(step, (p, tx.init(p), jnp.ones((2, 4))))
      >>> s = update_schedule(g.jaxpr)
      >>> sorted(s["order"]) == list(range(len(g.jaxpr.eqns))), len(s["cuts"])
      (True, 3)
    """
    eqns = list(jaxpr.eqns)
    n = len(eqns)
    producer = _interp.producers(eqns)
    preds = [sorted({producer[v] for v in e.invars if _is_var(v) and v in producer}) for e in eqns]
    tag_eqns = [i for i, e in enumerate(eqns) if e.primitive is tags.grad_tag_p]
    if not tag_eqns:
        return {"order": list(range(n)), "cuts": {}, "backward": [], "grad_sets": [0] * n, "tag_index": {}}

    # B: ancestors of the gradient tags (closed under predecessors)
    in_b = [False] * n
    stack = list(tag_eqns)
    while stack:
        i = stack.pop()
        if in_b[i]:
            continue
        in_b[i] = True
        stack.extend(preds[i])

    # B order: program order, each tag right after the producer of its operand
    tag_after: dict[int, list[int]] = {}
    early_tags = []
    for t in tag_eqns:
        src = eqns[t].invars[0]
        p = producer.get(src) if _is_var(src) else None
        if p is None:
            early_tags.append(t)
        else:
            tag_after.setdefault(p, []).append(t)
    b_seq = list(early_tags)
    for i in range(n):
        if in_b[i] and eqns[i].primitive is not tags.grad_tag_p:
            b_seq.append(i)
            b_seq.extend(tag_after.get(i, ()))
    pos_b = {i: k for k, i in enumerate(b_seq)}

    # gradient dependence bitmasks
    bit = {t: 1 << k for k, t in enumerate(tag_eqns)}
    grad_sets = [0] * n
    for i in range(n):
        m = bit.get(i, 0)
        for p in preds[i]:
            m |= grad_sets[p]
        grad_sets[i] = m

    # U: release time r (last B position it depends on), placement t
    u_idx = [i for i in range(n) if not in_b[i]]
    r: dict[int, int] = {}
    for i in u_idx:
        rr = -1
        for p in preds[i]:
            rr = max(rr, pos_b[p] if in_b[p] else r[p])
        r[i] = rr
    consumers: dict[int, list[int]] = {i: [] for i in u_idx}
    for i in u_idx:
        for p in preds[i]:
            if not in_b[p]:
                consumers[p].append(i)
    last = len(b_seq) - 1
    t: dict[int, int] = {}
    for i in reversed(u_idx):
        cs = consumers[i]
        if cs:
            t[i] = max(r[i], min(t[c] for c in cs))
        else:
            t[i] = r[i] if r[i] >= 0 else last
    groups: dict[int, list[int]] = {}
    for i in u_idx:
        groups.setdefault(t[i], []).append(i)

    order: list[int] = []
    cuts: dict[int, list[int]] = {}
    for k, b in enumerate(b_seq):
        order.append(b)
        g = groups.get(k)
        if g:
            order.extend(g)
            cuts[len(order) - 1] = g
    return {
        "order": order,
        "cuts": cuts,
        "backward": b_seq,
        "grad_sets": grad_sets,
        "tag_index": {i: eqns[i].params["index"] for i in tag_eqns},
    }


def inplace_update(*, barrier: bool = True) -> Pass:
    """A pass: run each parameter's optimizer update right after its gradient.

    See the module docstring for the order, the barriers, and how optimizers that
    couple gradients (global-norm clipping) are handled. Run it after
    ``sparse_grad``/``dce`` and before ``strip_tags`` (it needs the gradient tags):
    ``passes=pockjax.chain(sparse_grad(scheme), dce(), inplace_update())``.

    Args:
      barrier: pin the order on the backend with ``optimization_barrier`` (default).
        Without it only the jaxpr's equation order changes, which XLA is free to
        ignore.

    Returns:
      A :class:`~pockjax.Pass`. It records an :class:`InplaceUpdateRecord`:
      ``groups`` (update groups released during the backward pass),
      ``barriers`` (barriers inserted), ``coupled`` (paths of parameters
      whose update reads more than one gradient).

    Example:
      >>> import jax, jax.numpy as jnp, optax, pockjax
      >>> from pockjax.transforms.inplace_update import inplace_update
      >>> tx = optax.adam(1e-2)
      >>> def step(p, s, x):
      ...     loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["a"]) @ p["b"]))(p)
      ...     u, s = tx.update(g, s, p)
      ...     return optax.apply_updates(p, u), s, loss
      >>> p = {"a": jnp.ones((4, 4)), "b": jnp.ones((4, 2))}
      >>> g = inplace_update()(pockjax.trace_step(step, (p, tx.init(p), jnp.ones((2, 4)))))
      >>> g.record(pockjax.transforms.InplaceUpdateRecord)
      InplaceUpdateRecord(name='inplace_update', groups=2, barriers=1, coupled=())
    """

    def inplace_update_pass(graph: TrainGraph) -> TrainGraph:
        jaxpr = graph.jaxpr
        sched = update_schedule(jaxpr)
        eqns = jaxpr.eqns
        if not sched["cuts"]:
            return graph.recorded(InplaceUpdateRecord(groups=0, barriers=0, coupled=()))

        # coupled parameters: state outputs whose value reads more than one gradient
        producer = _interp.producers(eqns)
        coupled = []
        for o, (v, src) in enumerate(zip(jaxpr.outvars, graph.out_to_in)):
            if src is None or graph.in_roles[src] != "param" or not _is_var(v) or v not in producer:
                continue
            m = sched["grad_sets"][producer[v]]
            if m & (m - 1):
                coupled.append(graph.out_paths[o])

        order = sched["order"]
        state_out = {v for v, src in zip(jaxpr.outvars, graph.out_to_in) if src is not None and _is_var(v)}
        position = {i: k for k, i in enumerate(order)}
        last_b_read: dict = {}  # var -> last position a backward-side eqn reads it
        b_set = set(sched["backward"])
        for i in sched["backward"]:
            for v in eqns[i].invars:
                if _is_var(v):
                    last_b_read[v] = max(last_b_read.get(v, -1), position[i])
        last_b_pos = max(position[i] for i in b_set)

        barriers: dict[int, tuple[list, list]] = {}
        if barrier:
            defined_at: dict = {}
            for k, i in enumerate(order):
                for v in eqns[i].outvars:
                    if not isinstance(v, C.DropVar):
                        defined_at[v] = k
            # backward-side values that cross some cut (defined at k, read after it), in
            # definition order, with the last position read
            live = [(v, k, last_b_read[v]) for v, k in defined_at.items()
                    if producer[v] in b_set and last_b_read.get(v, -1) > k]
            named = {v: _interp.phase(eqns[producer[v]]) is not Phase.FORWARD for v, _, _ in live}
            by_end = sorted(live, key=lambda t: t[2])
            # The values crossing a cut (k <= cut < last read), swept over the cuts in
            # increasing order: added once defined, dropped once read for the last time.
            # Dicts keep insertion order, so each cut lists its values in definition order.
            crossing: dict = {}
            crossing_named: dict = {}
            added = dropped = 0
            for cut in sorted(sched["cuts"]):
                if cut >= last_b_pos:
                    continue  # nothing of the backward pass is left after it
                upd = [v for i in sched["cuts"][cut] for v in eqns[i].outvars if v in state_out]
                if not upd:
                    continue
                while added < len(live) and live[added][1] <= cut:
                    v = live[added][0]
                    crossing[v] = None
                    if named[v]:
                        crossing_named[v] = None
                    added += 1
                while dropped < len(by_end) and by_end[dropped][2] <= cut:
                    v = by_end[dropped][0]
                    crossing.pop(v)
                    crossing_named.pop(v, None)
                    dropped += 1
                # no name stacks: carry every crossing value
                cross = list(crossing_named or crossing)
                if cross:
                    barriers[cut] = (upd, cross)

        next_backward: dict[int, int] = {}
        upcoming = None
        for k in range(len(order) - 1, -1, -1):
            next_backward[k] = upcoming if upcoming is not None else order[k]
            if order[k] in b_set:
                upcoming = order[k]
        consts = list(graph.closed_jaxpr.consts)

        def pin(position, env):
            if position in barriers:
                vs = barriers[position][0] + barriers[position][1]
                # named like the backward equation that follows, so the liveness
                # analysis keeps counting the cotangents it carries as backward values
                with C.source_context(eqns[next_backward[position]]):
                    new = jax.lax.optimization_barrier([env[v] for v in vs])
                for v, x in zip(vs, new):
                    env[v] = x

        def fun(*args):
            return _interp.eval_jaxpr_with(jaxpr, consts, args, lambda e, vals: None, order=order, after=pin)

        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in jaxpr.invars]
        closed = jax.make_jaxpr(fun)(*avals)
        record = InplaceUpdateRecord(
            groups=sum(1 for c in sched["cuts"] if c < last_b_pos),
            barriers=len(barriers),
            coupled=tuple(coupled),
        )
        return graph.recorded(record, closed_jaxpr=closed)

    return Pass("inplace_update", inplace_update_pass)
