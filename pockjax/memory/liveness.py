"""Liveness analysis over a closed jaxpr: peak bytes, what is live there, a timeline.

The model is deliberately simple and documented, so that its numbers can be
checked by hand:

* Every value is a buffer of ``prod(shape) * dtype.itemsize`` bytes (from its aval).
* A value lives from the equation that defines it to its last use, inclusive: during
  an equation its operands and its results are live together (nothing is in place).
* Program inputs live from the start. A *donated* input may die at its last use; a
  non-donated one lives to the end (the caller still owns it). Inputs that are also
  outputs, program outputs and closed-over constants live to the end.
* A value that is defined and never used lives only during its defining equation.
* Call-like primitives (``jit``, ``remat``/``checkpoint``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``closed_call``) are inlined by default, so their inner values
  die at their own last use, as they do after XLA inlines them. With
  ``inline_calls=False`` they are treated like the control-flow primitives below.
* Control flow is counted by recursion: the peak of the inner program, with the
  buffers it shares with the outside (operands, results, loop-carried state) counted
  as zero, adds to what is live outside during that equation. ``scan``: the body's
  temporaries once (one iteration) plus the stacked operands and results, which are
  ordinary outer values. ``while``: the larger of body and condition. ``cond``: the
  largest branch. Any other primitive carrying jaxprs: the largest of them.
* Fusion (``fusion="xla"``, the default): XLA computes chains of elementwise operations
  inside their consumers instead of writing every intermediate to memory. An
  elementwise result read only by fusible equations (elementwise, reductions) is counted
  as never materialised when XLA would fuse it: always with a single reader; with several
  readers only for cheap operations whose operands are no larger than the result (XLA's
  rule for duplicating a producer). The operands of a fused-away result then live until
  its readers run. ``fusion="none"`` gives the plain equation-order estimate.
* Identity primitives that do not copy (``optimization_barrier`` and the pockjax tags
  ``pockjax_param_tag`` / ``pockjax_grad_tag``) alias their operands.

Categories. Inputs take their role (``param`` -> ``weights``, ``opt_state`` ->
``optimizer_state``, ``batch``, ``model_state``). Intermediates are classified by the
phase of the equation that defines them, read from JAX's name stack, which marks every
equation that ``jax.grad``/``jax.vjp`` emits for the backward pass with ``transpose(``:

* ``saved_activation``: defined in the forward part (name stack has ``jvp(`` but not
  ``transpose(``) and used by a backward equation.
* ``gradient``: defined by a backward equation and used after the backward part (by
  the optimizer) or returned; also every value tagged with ``pockjax_grad_tag`` or
  passed in ``grad_vars``.
* ``temporary``: everything else (forward values the backward does not need,
  activation cotangents, optimizer temporaries, inner temporaries of control flow).
* Program outputs take their output role when ``out_roles`` is given (``output``
  otherwise, e.g. the loss).

When the jaxpr carries no name stacks (a rebuilt graph), pass ``split_index``: flat
equations before it count as forward, the rest as backward.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from jax.extend import core as jex_core

from pockjax import tags
from pockjax._src import jaxpr as J
from pockjax._src.jaxpr import prims

__all__ = [
    "CATEGORIES",
    "FUSION_MODES",
    "SCHEDULES",
    "ROLE_CATEGORY",
    "LiveValue",
    "MemoryReport",
    "analyze",
    "aval_bytes",
    "greedy_schedule",
    "format_bytes",
]

#: Every category a byte can be counted in, in plotting order (bottom to top).
CATEGORIES: tuple[str, ...] = (
    "weights",
    "optimizer_state",
    "model_state",
    "batch",
    "saved_activation",
    "gradient",
    "temporary",
    "output",
)

#: How an input (or output) role maps to a category.
ROLE_CATEGORY: dict[str, str] = {
    "param": "weights",
    "weights": "weights",
    "opt_state": "optimizer_state",
    "optimizer_state": "optimizer_state",
    "model_state": "model_state",
    "batch": "batch",
}

_CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}

# Primitives whose results are their operands (no new buffer).
# Primitive-object tables (names only to build them).
_ALIAS_PRIMITIVES = prims("optimization_barrier", "pockjax_param_tag", "pockjax_tangent_tag", "pockjax_grad_tag")
_GRAD_TAG = tags.grad_tag_p

# Phases of an equation, read from its name stack.
_OTHER, _FORWARD, _BACKWARD = J.Phase.OTHER, J.Phase.FORWARD, J.Phase.BACKWARD


def aval_bytes(aval: Any) -> int:
    """Bytes of one buffer with this abstract value (shape x dtype itemsize).

    Tokens and other non-array avals count as zero; extended dtypes (PRNG keys) use
    their ``itemsize``.

    Args:
      aval: a JAX abstract value (``jax.core.ShapedArray``), or anything with
        ``shape`` and ``dtype`` such as ``jax.ShapeDtypeStruct``.

    Returns:
      The size in bytes.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> aval_bytes(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16))
      64
    """
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = int(np.dtype(dtype).itemsize)
    except TypeError:
        itemsize = int(getattr(dtype, "itemsize", 0) or 0)
    n = 1
    for d in shape:
        n *= int(d)
    return n * itemsize


def format_bytes(n: float) -> str:
    """Human-readable bytes with binary units.

    Args:
      n: a number of bytes.

    Returns:
      A short string such as ``"1.50 GiB"``.

    Example:
      >>> format_bytes(3 * 2**29)
      '1.50 GiB'
      >>> format_bytes(512)
      '512 B'
    """
    n = float(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------------------
# Flat program: values and nodes (equations after inlining calls).


@dataclasses.dataclass
class _Value:
    size: int
    aval: Any
    kind: str  # "input" | "const" | "inter"
    role_category: str | None = None  # for inputs / consts
    input_index: int = -1
    def_node: int = -1  # -1 for inputs and consts
    dropped: bool = False
    alias_of: int = -1  # the result of a non-copying identity of this value


@dataclasses.dataclass
class _Node:
    primitive: str
    path: str  # names of inlined calls, "jit(step)/jit(g)"
    name_stack: str
    source_info: Any
    ins: tuple[int, ...]  # unique value ids read
    outs: tuple[int, ...]  # value ids defined
    extra: int = 0  # peak bytes of nested temporaries during this node
    phase: int = _OTHER
    prim: Any = None  # the Primitive object (None for a "literal" node)


# Call-like primitives inlined with ``inline_calls`` (Primitive -> body param).
_CALL_JAXPR_PARAM = {
    p: J.CALL_BODY[p]
    for p in (
        J.P.jit_p, J.P.closed_call_p, J.P.remat_p, J.P.custom_jvp_call_p, J.P.custom_vjp_call_p,
    )
}


def _open(jaxpr_like: Any) -> tuple[Any, Sequence[Any]]:
    """(Jaxpr, consts) from a Jaxpr or ClosedJaxpr."""
    if hasattr(jaxpr_like, "jaxpr") and hasattr(jaxpr_like, "consts"):
        return jaxpr_like.jaxpr, jaxpr_like.consts
    return jaxpr_like, ()


def _name_stack_str(source_info: Any) -> str:
    try:
        return str(source_info.name_stack)
    except Exception:  # noqa: BLE001 - an eqn built without source info
        return ""


def _call_label(eqn: Any) -> str:
    name = eqn.params.get("name")
    return f"{eqn.primitive.name}({name})" if name else eqn.primitive.name


class _Flattener:
    """Turns a (closed) jaxpr into a flat list of nodes over integer value ids."""

    def __init__(self, inline_calls: bool, fuse: str, alias_nodes: bool = False):
        self.inline_calls = inline_calls
        self.fuse = fuse
        self.alias_nodes = alias_nodes  # one node per equation, also for identities
        self.values: list[_Value] = []
        self.nodes: list[_Node] = []
        self.var_ids: dict[int, int] = {}  # id(Var) -> value id, for hints
        self._extra_cache: dict[tuple, int] = {}
        self.grad_tagged: set[int] = set()

    def new_value(self, aval: Any, kind: str, **kw: Any) -> int:
        self.values.append(_Value(size=aval_bytes(aval), aval=aval, kind=kind, **kw))
        return len(self.values) - 1

    def bind(self, env: dict, var: Any, vid: int | None) -> None:
        env[var] = vid
        if vid is not None:
            self.var_ids.setdefault(id(var), vid)

    @staticmethod
    def read(env: dict, atom: Any) -> int | None:
        if isinstance(atom, jex_core.Literal):
            return None
        return env[atom]

    def add_const(self, env: dict, constvar: Any, value: Any, category: str) -> None:
        vid = self.new_value(constvar.aval, "const", role_category=category)
        self.bind(env, constvar, vid)

    def literal_value(self, var: Any, path: str, ns: str, source_info: Any) -> int:
        """A node materialising a literal that a call or alias returns."""
        vid = self.new_value(var.aval, "inter", def_node=len(self.nodes))
        self.nodes.append(_Node("literal", path, ns, source_info, (), (vid,), phase=J.name_stack_phase(ns)))
        return vid

    def run(
        self, jaxpr: Any, env: dict, path: str, name_stack: str, const_category: str, sources: tuple = ()
    ) -> None:
        for eqn in jaxpr.eqns:
            prim = eqn.primitive.name
            p_obj = eqn.primitive
            ins = [self.read(env, v) for v in eqn.invars]
            ns_local = _name_stack_str(eqn.source_info)
            src = (eqn.source_info,) + sources
            ns = f"{name_stack}/{ns_local}" if name_stack and ns_local else (name_stack or ns_local)
            if p_obj in _ALIAS_PRIMITIVES and len(eqn.invars) == len(eqn.outvars) and self.alias_nodes:
                node_index = len(self.nodes)
                outs = []
                for ov, vid in zip(eqn.outvars, ins):
                    if p_obj is _GRAD_TAG and vid is not None:
                        self.grad_tagged.add(vid)
                    o = self.new_value(
                        ov.aval, "inter", def_node=node_index, alias_of=-1 if vid is None else vid
                    )
                    outs.append(o)
                    if not isinstance(ov, jex_core.DropVar):
                        self.bind(env, ov, o)
                uniq = tuple(dict.fromkeys(v for v in ins if v is not None))
                self.nodes.append(
                    _Node(prim, path, ns, src, uniq, tuple(outs), phase=J.name_stack_phase(ns), prim=p_obj)
                )
                continue
            if p_obj in _ALIAS_PRIMITIVES and len(eqn.invars) == len(eqn.outvars):
                for ov, vid in zip(eqn.outvars, ins):
                    if vid is None:  # a literal passed through: give it a real value
                        vid = self.literal_value(ov, path, ns, src)
                    if p_obj is _GRAD_TAG:
                        self.grad_tagged.add(vid)
                    self.bind(env, ov, vid)
                continue
            param = _CALL_JAXPR_PARAM.get(p_obj)
            if self.inline_calls and param is not None and param in eqn.params:
                inner, consts = _open(eqn.params[param])
                inner_env: dict = {}
                for cv, c in zip(inner.constvars, consts):
                    self.add_const(inner_env, cv, c, const_category)
                for iv, vid in zip(inner.invars, ins):
                    self.bind(inner_env, iv, vid)
                label = _call_label(eqn)
                self.run(inner, inner_env, f"{path}/{label}" if path else label, ns, const_category, src)
                for ov, iov in zip(eqn.outvars, inner.outvars):
                    vid = self.read(inner_env, iov)
                    if vid is None:  # the call returns a literal
                        vid = self.literal_value(ov, path, ns, src)
                    if not isinstance(ov, jex_core.DropVar):
                        self.bind(env, ov, vid)
                continue
            node_index = len(self.nodes)
            outs = []
            for ov in eqn.outvars:
                vid = self.new_value(
                    ov.aval, "inter", def_node=node_index, dropped=isinstance(ov, jex_core.DropVar)
                )
                outs.append(vid)
                if not isinstance(ov, jex_core.DropVar):
                    self.bind(env, ov, vid)
            uniq_ins = tuple(dict.fromkeys(v for v in ins if v is not None))
            self.nodes.append(
                _Node(
                    primitive=prim,
                    path=path,
                    name_stack=ns,
                    source_info=src,
                    ins=uniq_ins,
                    outs=tuple(outs),
                    extra=self.nested_extra(eqn),
                    phase=J.name_stack_phase(ns),
                    prim=p_obj,
                )
            )

    # -- nested programs: the peak of their own temporaries ----------------------------

    def nested_extra(self, eqn: Any) -> int:
        prim = eqn.primitive
        p = eqn.params
        if prim is J.P.scan_p:
            body, _ = _open(p["jaxpr"])
            n_alias = p["num_consts"] + p["num_carry"]
            return self.inner_peak(body, n_alias, alias_outs=0)
        if prim is J.P.while_p:
            body, _ = _open(p["body_jaxpr"])
            cond, _ = _open(p["cond_jaxpr"])
            return max(
                self.inner_peak(body, len(body.invars), alias_outs=0),
                self.inner_peak(cond, len(cond.invars), alias_outs=len(cond.outvars)),
            )
        if prim is J.P.cond_p:
            return max(
                (self.inner_peak(_open(b)[0], 10**9, alias_outs=10**9) for b in p["branches"]),
                default=0,
            )
        subs = list(jex_core.jaxprs_in_params(p))
        if not subs:
            return 0
        return max(self.inner_peak(_open(j)[0], 10**9, alias_outs=10**9) for j in subs)

    def inner_peak(self, jaxpr: Any, n_alias_ins: int, alias_outs: int) -> int:
        """Peak bytes of an inner program, its first ``n_alias_ins`` inputs and first
        ``alias_outs`` outputs counted as zero (they are outer buffers)."""
        key = (id(jaxpr), n_alias_ins, alias_outs, self.inline_calls, self.fuse)
        if key in self._extra_cache:
            return self._extra_cache[key]
        sub = _Flattener(self.inline_calls, self.fuse)
        sub._extra_cache = self._extra_cache
        env: dict = {}
        for cv in jaxpr.constvars:
            sub.bind(env, cv, sub.new_value(cv.aval, "const", role_category="temporary"))
        in_ids = []
        for i, iv in enumerate(jaxpr.invars):
            vid = sub.new_value(iv.aval, "input", role_category="temporary", input_index=i)
            if i < n_alias_ins:
                sub.values[vid].size = 0
            in_ids.append(vid)
            sub.bind(env, iv, vid)
        sub.run(jaxpr, env, "", "", "temporary")
        out_ids = []
        for j, ov in enumerate(jaxpr.outvars):
            vid = sub.read(env, ov)
            if vid is None:
                continue
            if j < alias_outs and sub.values[vid].kind == "inter":
                sub.values[vid].size = 0
            out_ids.append(vid)
        donated = [True] * len(in_ids)
        prog = _Program(sub.values, sub.nodes, in_ids, out_ids, donated, sub.fuse)
        order = list(range(len(sub.nodes)))
        total = prog.totals(order)
        peak = int(total.max()) if len(total) else sum(v.size for v in sub.values)
        self._extra_cache[key] = peak
        return peak


# --------------------------------------------------------------------------------------
# Liveness over a flat program in a given order.

#: Schedules :func:`analyze` can estimate under: the given order; a greedy list
#: schedule; and the given order with every optimizer-side equation run as soon as its
#: operands are ready (each update right after its gradient, as an in-place update
#: pass orders them; an optimizer that couples all gradients gains nothing).
SCHEDULES = ("program", "greedy", "eager_update")

#: Fusion models: "none" (every equation result is a buffer), "single" (an elementwise
#: result read by exactly one fusible equation is not materialised), "xla" (also cheap
#: elementwise results read by several fusible equations, when recomputing them in each
#: reads no more bytes than they write: XLA's rule for duplicating a producer).
FUSION_MODES = ("none", "single", "xla")

# An elementwise result that is fused away is computed inside its consumers; its
# operands then live until those consumers run.
_CHEAP_ELEMENTWISE = prims(
    "add", "sub", "mul", "neg", "max", "min", "abs", "sign", "select_n", "clamp",
    "convert_element_type", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
    "add_any", "square", "integer_pow", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
    "not", "xor", "iota", "copy", "transpose", "stop_gradient", "slice", "pad",
    "concatenate", "rev", "floor", "ceil", "round", "is_finite", "nextafter", "real", "imag",
)
_EXPENSIVE_ELEMENTWISE = prims(
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan",
    "sqrt", "rsqrt", "cbrt", "pow", "div", "rem", "erf", "erfc", "erf_inv", "atan2",
    "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma",
)
_FUSIBLE_PRODUCERS = _CHEAP_ELEMENTWISE | _EXPENSIVE_ELEMENTWISE
_FUSIBLE_CONSUMERS = _FUSIBLE_PRODUCERS | prims(
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin"
)


@dataclasses.dataclass(eq=False)
class _Program:
    """A flattened program with its inputs, outputs and donation, and the facts liveness needs."""

    values: list
    nodes: list
    in_ids: list
    out_ids: list
    donated: list
    fuse: Any

    def __post_init__(self):
        values, nodes, in_ids, out_ids, donated, fuse = (
            self.values, self.nodes, self.in_ids, self.out_ids, self.donated, self.fuse)
        self.consumers: list[list[int]] = [[] for _ in values]
        for ni, node in enumerate(nodes):
            for v in node.ins:
                self.consumers[v].append(ni)
        self.pinned = set(out_ids)  # live to the end
        for vid, don in zip(in_ids, donated):
            if not don:
                self.pinned.add(vid)
        for vid, v in enumerate(values):
            if v.kind == "const":
                self.pinned.add(vid)
        self.sizes = np.array([v.size for v in values], dtype=np.int64)
        self.fused = np.zeros(len(values), dtype=bool)
        for vid in range(len(values) - 1, -1, -1):
            src = values[vid].alias_of
            if src >= 0:
                # an identity's result is its operand's buffer, kept alive by its readers
                self.fused[vid] = True
                self.sizes[vid] = 0
                if vid in self.pinned:
                    self.pinned.add(src)
        if fuse not in FUSION_MODES:
            raise ValueError(f"fusion must be one of {FUSION_MODES}, got {fuse!r}")
        if fuse != "none":
            for vid, v in enumerate(values):
                if v.kind != "inter" or vid in self.pinned or v.def_node < 0 or self.fused[vid]:
                    continue
                prim = nodes[v.def_node].prim
                cons = self.consumers[vid]
                if not (
                    cons
                    and prim in _FUSIBLE_PRODUCERS
                    and all(nodes[c].prim in _FUSIBLE_CONSUMERS for c in cons)
                ):
                    continue
                if len(cons) > 1:
                    # duplicated into every consumer: only cheap ops, and (XLA's rule)
                    # only when that does not read more bytes than it writes
                    if fuse == "single" or prim not in _CHEAP_ELEMENTWISE:
                        continue
                    read = sum(values[u].size for u in nodes[v.def_node].ins)
                    if read > v.size:
                        continue
                if True:
                    self.fused[vid] = True
                    self.sizes[vid] = 0
        self.any_fused = bool(self.fused.any())

    def intervals(self, order: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Start and end position (inclusive) of every value under ``order``."""
        n = len(order)
        pos = np.empty(len(self.nodes), dtype=np.int64)
        pos[np.asarray(order, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        start = np.zeros(len(self.values), dtype=np.int64)
        end = np.zeros(len(self.values), dtype=np.int64)
        last = max(n - 1, 0)
        # ext[c]: the last position at which node c's work happens (later than pos[c]
        # when one of its results is fused into consumers that run later).
        ext = pos.copy()
        if self.any_fused:
            for ni in range(len(self.nodes) - 1, -1, -1):
                for o in self.nodes[ni].outs:
                    if self.fused[o]:
                        e = max((ext[c] for c in self.consumers[o]), default=ext[ni])
                        if e > ext[ni]:
                            ext[ni] = e
        for vid, v in enumerate(self.values):
            s = pos[v.def_node] if v.def_node >= 0 else 0
            cons = self.consumers[vid]
            e = max((ext[c] for c in cons), default=s)
            if vid in self.pinned:
                e = last
            start[vid] = s
            end[vid] = max(e, s)
        return start, end

    def totals(self, order: Sequence[int]) -> np.ndarray:
        start, end = self.intervals(order)
        n = max(len(order), 1)
        diff = np.zeros(n + 1, dtype=np.int64)
        np.add.at(diff, start, self.sizes)
        np.add.at(diff, end + 1, -self.sizes)
        total = np.cumsum(diff)[:n]
        if len(order):
            extras = np.array([self.nodes[i].extra for i in order], dtype=np.int64)
            total = total + extras
        return total

    def _dependencies(self) -> tuple[list[int], list[list[int]]]:
        """Per node, how many distinct nodes it reads from, and which nodes read from it."""
        nodes, values = self.nodes, self.values
        deps = [0] * len(nodes)
        users: list[list[int]] = [[] for _ in nodes]
        for ni, node in enumerate(nodes):
            producers = {values[v].def_node for v in node.ins if values[v].def_node >= 0}
            deps[ni] = len(producers)
            for p in producers:
                users[p].append(ni)
        return deps, users

    def priority_order(self, priority: Sequence[int]) -> list[int]:
        """The topological order that always runs the ready node with the smallest
        ``(priority, program index)``."""
        nodes = self.nodes
        n = len(nodes)
        deps, users = self._dependencies()
        heap = [(priority[ni], ni) for ni in range(n) if deps[ni] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            _, ni = heapq.heappop(heap)
            order.append(ni)
            for u in users[ni]:
                deps[u] -= 1
                if deps[u] == 0:
                    heapq.heappush(heap, (priority[u], u))
        return order

    def greedy_order(self) -> list[int]:
        """A topological order that greedily picks the ready node whose execution
        grows memory the least (results allocated minus operands freed). Nodes whose
        results are all fused away cost nothing and run as soon as they are ready; the
        operands they read are freed by the nodes that really read them."""
        nodes, values = self.nodes, self.values
        n = len(nodes)
        virtual = [bool(nd.outs) and all(self.fused[o] for o in nd.outs) for nd in nodes]
        # effective readers, computed in reverse program order (a topological order)
        readers: list[list[int]] = [[] for _ in values]
        reach: list[tuple[int, ...]] = [()] * n
        for ni in range(n - 1, -1, -1):
            nd = nodes[ni]
            r = set() if virtual[ni] else {ni}
            for o in nd.outs:
                if self.fused[o]:
                    r.update(readers[o])
            reach[ni] = tuple(r)
            # values defined here are complete once all their consumers (later) are done
            for o in nd.outs:
                acc: set[int] = set()
                for c in self.consumers[o]:
                    acc.update(reach[c])
                readers[o] = sorted(acc)
        for vid, v in enumerate(values):
            if v.def_node < 0:
                acc = set()
                for c in self.consumers[vid]:
                    acc.update(reach[c])
                readers[vid] = sorted(acc)
        reads: list[list[int]] = [[] for _ in range(n)]
        for vid, rs in enumerate(readers):
            if vid in self.pinned or self.sizes[vid] == 0:
                continue
            for r in rs:
                reads[r].append(vid)
        remaining = [len(rs) for rs in readers]

        deps, users = self._dependencies()
        sizes = self.sizes
        free_node = -(2**62)

        def score(ni: int) -> int:
            if virtual[ni]:
                return free_node
            alloc = int(sum(sizes[v] for v in nodes[ni].outs))
            freed = sum(int(sizes[v]) for v in reads[ni] if remaining[v] == 1)
            return alloc - freed

        cur: dict[int, int] = {}
        heap: list[tuple[int, int]] = []

        def push(ni: int) -> None:
            cur[ni] = score(ni)
            heapq.heappush(heap, (cur[ni], ni))

        for ni in range(n):
            if deps[ni] == 0:
                push(ni)
        order = []
        done = [False] * n
        while heap:
            sc, ni = heapq.heappop(heap)
            if done[ni] or cur.get(ni) != sc:
                continue
            done[ni] = True
            order.append(ni)
            if not virtual[ni]:
                for v in reads[ni]:
                    remaining[v] -= 1
                    if remaining[v] == 1:
                        # its last real reader now frees it: re-score that one if ready
                        for c in readers[v]:
                            if not done[c] and c in cur:
                                new = score(c)
                                if new != cur[c]:
                                    cur[c] = new
                                    heapq.heappush(heap, (new, c))
            for u in users[ni]:
                deps[u] -= 1
                if deps[u] == 0:
                    push(u)
        if len(order) != n:  # pragma: no cover - a cycle cannot happen in a jaxpr
            raise RuntimeError("greedy schedule did not cover the program")
        return order


# --------------------------------------------------------------------------------------
# Report.


@dataclasses.dataclass(frozen=True)
class LiveValue:
    """One buffer live at the peak.

    Attributes:
      size: bytes.
      category: one of :data:`CATEGORIES`.
      aval: its abstract value as a string (``"bf16[4096,4096]"``).
      origin: the input path, or the primitive that defined it and where.
    """

    size: int
    category: str
    aval: str
    origin: str


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """The result of :func:`analyze`.

    Attributes:
      peak_bytes: the highest total of live bytes over the program.
      peak_index: position (in the analysed schedule) of the node at the peak.
      peak_eqn: primitive at the peak, with its call path and source line.
      peak_breakdown: bytes live at the peak per category (all of :data:`CATEGORIES`).
      timeline: int64 array ``[len(CATEGORIES), n_nodes]``: bytes live per category
        during each node.
      categories: the row names of ``timeline``.
      primitives: primitive name of each node, in schedule order.
      schedule: one of :data:`SCHEDULES`.
      input_bytes: bytes of all program inputs and constants.
      output_bytes: bytes of all program outputs (distinct buffers).
      live_at_peak: the largest buffers live at the peak, largest first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> r = analyze(jax.make_jaxpr(lambda x: jnp.cos(jnp.sin(x)))(jnp.ones(256)), fusion="none")
      >>> r.n_eqns, r.total.tolist(), r.peak_breakdown["batch"], r.peak_breakdown["output"]
      (2, [2048, 3072], 1024, 1024)
    """

    peak_bytes: int
    peak_index: int
    peak_eqn: str
    peak_breakdown: dict[str, int]
    timeline: np.ndarray
    categories: tuple[str, ...]
    primitives: tuple[str, ...]
    schedule: str
    input_bytes: int
    output_bytes: int
    live_at_peak: tuple[LiveValue, ...]

    @property
    def n_eqns(self) -> int:
        """Number of (flat) equations analysed."""
        return int(self.timeline.shape[1])

    @property
    def total(self) -> np.ndarray:
        """Bytes live during each node, all categories together."""
        return self.timeline.sum(axis=0)

    def fits(self, budget_bytes: float) -> bool:
        """Whether the peak fits in ``budget_bytes``.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> r = analyze(jax.make_jaxpr(jnp.sin)(jnp.ones(256, jnp.float32)))
          >>> r.fits(2048), r.fits(1024)
          (True, False)
        """
        return self.peak_bytes <= budget_bytes

    def summary(self, budget_bytes: float | None = None) -> str:
        """A few lines: peak, where, by category, and fits/does not fit.

        Args:
          budget_bytes: optional device memory to compare against.

        Returns:
          A multi-line string.

        Example:
          >>> import jax, jax.numpy as jnp
          >>> r = analyze(jax.make_jaxpr(jnp.sin)(jnp.ones(256, jnp.float32)))
          >>> print(r.summary(budget_bytes=2**30).splitlines()[0])
          peak 2.00 KiB at eqn 0 (sin ...); fits in 1.00 GiB
        """
        head = f"peak {format_bytes(self.peak_bytes)} at eqn {self.peak_index} ({self.peak_eqn})"
        if budget_bytes is not None:
            verdict = "fits" if self.fits(budget_bytes) else "does NOT fit"
            head += f"; {verdict} in {format_bytes(budget_bytes)}"
        lines = [head]
        for cat in self.categories:
            b = self.peak_breakdown.get(cat, 0)
            if b:
                lines.append(f"  {cat:<17} {format_bytes(b):>12}  {100 * b / max(self.peak_bytes, 1):5.1f}%")
        return "\n".join(lines)


_BIT = {_OTHER: 1, _FORWARD: 2, _BACKWARD: 4}


def _reader_phases(prog: "_Program", phases: np.ndarray) -> np.ndarray:
    """Bitmask of the phases of the equations that really read each value: a reader
    whose result is fused away reads it where that result's own readers run."""
    bits = np.array([_BIT[int(p)] for p in phases], dtype=np.int8)
    readers = np.zeros(len(prog.values), dtype=np.int8)

    def contribution(c: int) -> int:
        node = prog.nodes[c]
        m = 0
        for o in node.outs:
            m |= int(readers[o]) if prog.fused[o] else int(bits[c])
        return m if node.outs else int(bits[c])

    for ni in range(len(prog.nodes) - 1, -1, -1):
        for o in prog.nodes[ni].outs:
            m = 0
            for c in prog.consumers[o]:
                m |= contribution(c)
            readers[o] = m
    return readers


def _describe_source(sources: tuple) -> str:
    """File:line of the first user frame, from the equation outwards through the
    calls it was inlined from (JAX's own jitted helpers have no user frame)."""
    from pockjax._compat import summarize_source_info

    for si in sources:
        try:
            text = summarize_source_info(si)
        except Exception:  # noqa: BLE001 - source info is best effort
            continue
        if text and "site-packages/jax/" not in text:
            return text
    return "?"


def _aval_str(aval: Any) -> str:
    try:
        return aval.str_short()
    except Exception:  # noqa: BLE001
        return str(aval)


def _normalise_donation(donate: Any, roles: Sequence[str], n: int) -> list[bool]:
    if donate is None or donate is False:
        return [False] * n
    if donate is True:
        return [True] * n
    if isinstance(donate, str):
        donate = (donate,)
    donate = list(donate)
    if all(isinstance(d, str) for d in donate):
        wanted = set(donate)
        return [r in wanted for r in roles]
    if len(donate) != n:
        raise ValueError(f"donate has {len(donate)} entries, the program has {n} inputs")
    return [bool(d) for d in donate]


def _build(
    jaxpr: Any,
    in_roles: Sequence[str] | None,
    out_roles: Sequence[str] | None,
    donate: Any,
    fusion: str,
    inline_calls: bool,
    const_role: str,
    alias_nodes: bool = False,
    in_bytes: Sequence[int | None] | None = None,
) -> tuple[_Flattener, _Program, list[int], dict[int, str]]:
    """Flatten a (closed) jaxpr into a program over value ids."""
    inner, consts = _open(jaxpr)
    n_in = len(inner.invars)
    roles = list(in_roles) if in_roles is not None else ["batch"] * n_in
    if len(roles) != n_in:
        raise ValueError(f"in_roles has {len(roles)} entries, the jaxpr has {n_in} inputs")
    if out_roles is not None and len(out_roles) != len(inner.outvars):
        raise ValueError(
            f"out_roles has {len(out_roles)} entries, the jaxpr has {len(inner.outvars)} outputs"
        )
    donated = _normalise_donation(donate, roles, n_in)
    if in_bytes is not None and len(in_bytes) != n_in:
        raise ValueError(f"in_bytes has {len(in_bytes)} entries, the jaxpr has {n_in} inputs")

    fl = _Flattener(inline_calls, fusion, alias_nodes)
    env: dict = {}
    const_cat = ROLE_CATEGORY.get(const_role, "weights")
    for cv, c in zip(inner.constvars, consts):
        fl.add_const(env, cv, c, const_cat)
    in_ids = []
    for i, (iv, role) in enumerate(zip(inner.invars, roles)):
        vid = fl.new_value(iv.aval, "input", role_category=ROLE_CATEGORY.get(role, "batch"), input_index=i)
        if in_bytes is not None and in_bytes[i] is not None:
            if in_bytes[i] < 0:
                raise ValueError(f"in_bytes[{i}] must be >= 0, got {in_bytes[i]}")
            fl.values[vid].size = int(in_bytes[i])  # held in another format than its aval
        in_ids.append(vid)
        fl.bind(env, iv, vid)
    fl.run(inner, env, "", "", const_cat)

    out_ids: list[int] = []
    out_cat: dict[int, str] = {}
    for j, ov in enumerate(inner.outvars):
        vid = fl.read(env, ov)
        if vid is None:
            continue
        out_ids.append(vid)
        role = out_roles[j] if out_roles is not None else None
        out_cat.setdefault(vid, ROLE_CATEGORY.get(role, "output") if role else "output")
    prog = _Program(fl.values, fl.nodes, in_ids, out_ids, donated, fusion)
    return fl, prog, out_ids, out_cat


def greedy_schedule(
    jaxpr: Any,
    in_roles: Sequence[str] | None = None,
    *,
    donate: bool | Iterable[str] | Sequence[bool] | None = None,
    fusion: str = "xla",
    keep_if_worse: bool = True,
) -> tuple[list[int], int, int]:
    """A memory-lowering order of a jaxpr's top-level equations.

    List scheduling: among the equations whose operands are ready, run the one that
    grows live memory the least (bytes of its results minus bytes of operands it reads
    last). Nested calls and control flow stay single steps; the peak is the one
    :func:`analyze` reports with ``inline_calls=False``.

    Args:
      jaxpr: a ``ClosedJaxpr`` / ``Jaxpr`` (or a TrainGraph-like object with
        ``closed_jaxpr`` and ``in_roles``).
      in_roles: one role per input (used for ``donate`` by role).
      donate: as in :func:`analyze`.
      fusion: as in :func:`analyze`.
      keep_if_worse: return the given order when the greedy one has a higher peak, so
        that the result never makes the peak worse.

    Returns:
      ``(order, peak_before, peak_after)``: a permutation of
      ``range(len(jaxpr.eqns))`` that is a valid topological order, and the peaks (bytes)
      of the given order and of the returned one.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x):       # two big temporaries, each reduced to a scalar
      ...     a = jnp.broadcast_to(x, (64, 256)); b = jnp.broadcast_to(x * 2.0, (64, 256))
      ...     return a.sum() + b.sum()
      >>> cj = jax.make_jaxpr(f)(jnp.ones(256, jnp.float32))
      >>> order, before, after = greedy_schedule(cj, fusion="none")
      >>> [cj.jaxpr.eqns[i].primitive.name for i in order]
      ['mul', 'broadcast_in_dim', 'reduce_sum', 'broadcast_in_dim', 'reduce_sum', 'add']
      >>> before, after
      (133120, 67584)
    """
    if hasattr(jaxpr, "closed_jaxpr"):
        in_roles = in_roles if in_roles is not None else getattr(jaxpr, "in_roles", None)
        jaxpr = jaxpr.closed_jaxpr
    _, prog, _, _ = _build(jaxpr, in_roles, None, donate, fusion, False, "param", alias_nodes=True)
    given = list(range(len(prog.nodes)))
    order = prog.greedy_order()
    before = int(prog.totals(given).max())
    after = int(prog.totals(order).max())
    if keep_if_worse and after > before:
        return given, before, before
    return order, before, after


def analyze(
    jaxpr: Any,
    in_roles: Sequence[str] | None = None,
    *,
    out_roles: Sequence[str] | None = None,
    in_paths: Sequence[str] | None = None,
    donate: bool | Iterable[str] | Sequence[bool] | None = None,
    grad_vars: Iterable[Any] | None = None,
    split_index: int | None = None,
    schedule: str = "program",
    inline_calls: bool = True,
    fusion: str = "xla",
    const_role: str = "param",
    top_k: int = 12,
    in_bytes: Sequence[int | None] | None = None,
) -> MemoryReport:
    """Liveness analysis of a closed jaxpr: peak bytes, what is live there, timeline.

    See the module docstring for the exact memory model and the categories.

    Args:
      jaxpr: a ``ClosedJaxpr`` (from ``jax.make_jaxpr``), a ``Jaxpr``, or any object
        with ``closed_jaxpr`` and optionally ``in_roles``/``out_roles``/``in_paths``
        attributes (a pockjax ``TrainGraph``).
      in_roles: one role per flat input: ``"param"``, ``"opt_state"``, ``"batch"``,
        ``"model_state"``; unknown roles count as ``"batch"``. Default: all ``"batch"``.
      out_roles: one role per flat output (``"param"``, ``"opt_state"``, ...; anything
        else such as ``"loss"`` counts as ``"output"``).
      in_paths: names of the inputs, used in :attr:`MemoryReport.live_at_peak`.
      donate: which inputs may die at their last use: ``True`` (all), ``False``/None
        (none), an iterable of roles (``{"param", "opt_state"}``) or one bool per input.
      grad_vars: ``Var`` objects of the jaxpr holding complete gradients (counted as
        ``"gradient"``); ``pockjax_grad_tag`` equations are detected by themselves.
      split_index: when the jaxpr has no name stacks: flat equations before this index
        are the forward part, the rest the backward part.
      schedule: ``"program"`` (the given equation order), ``"greedy"`` (a topological
        order that greedily keeps memory low), or ``"eager_update"`` (the given order,
        but every optimizer-side equation, i.e. neither forward nor backward, runs as
        soon as its operands are ready: the order an in-place update pass produces).
      inline_calls: inline ``jit``/``remat``/custom-derivative calls (default) instead
        of treating them as nested programs.
      fusion: how elementwise fusion is modelled: ``"xla"`` (default: an elementwise
        result that XLA would fuse into all its readers is never materialised, see
        :data:`FUSION_MODES`), ``"single"``, or ``"none"`` (every equation result is a
        buffer: the plain equation-order estimate).
      const_role: role of closed-over constants (frozen weights, typically).
      top_k: how many of the largest buffers live at the peak to list.
      in_bytes: one entry per flat input: the bytes it is held in, where that is not
        its aval's (``None``: the aval's). For inputs held in another format than the
        program reads them in, e.g. a frozen matrix kept block-quantized
        (:mod:`pockjax.quant`) or in bfloat16 while the program is traced in float32.

    Returns:
      A :class:`MemoryReport`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> def f(x):               # x: 1 KiB; y and z: 1 KiB each
      ...     y = jnp.sin(x)
      ...     z = jnp.cos(y)
      ...     return z
      >>> cj = jax.make_jaxpr(f)(jnp.ones(256, jnp.float32))
      >>> analyze(cj, fusion="none").peak_bytes                # x lives on (not donated)
      3072
      >>> analyze(cj, fusion="none", donate=True).peak_bytes   # x dies after sin
      2048
      >>> analyze(cj).peak_bytes     # XLA fuses sin into cos: y is never materialised
      2048
    """
    graph = None
    if hasattr(jaxpr, "closed_jaxpr"):
        graph = jaxpr
        jaxpr = graph.closed_jaxpr
        in_roles = in_roles if in_roles is not None else getattr(graph, "in_roles", None)
        out_roles = out_roles if out_roles is not None else getattr(graph, "out_roles", None)
        in_paths = in_paths if in_paths is not None else getattr(graph, "in_paths", None)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    fl, prog, out_ids, out_cat = _build(jaxpr, in_roles, out_roles, donate, fusion, inline_calls, const_role,
                                        in_bytes=in_bytes)
    values, nodes = fl.values, fl.nodes

    # ---- categories ------------------------------------------------------------------
    phases = np.array([n.phase for n in nodes], dtype=np.int8)
    if split_index is not None and not (phases == _BACKWARD).any():
        phases = np.where(np.arange(len(nodes)) < split_index, _FORWARD, _BACKWARD).astype(np.int8)
    grad_ids = set(fl.grad_tagged)
    for var in grad_vars or ():
        vid = fl.var_ids.get(id(var))
        if vid is not None:
            grad_ids.add(vid)
    out_set = set(out_ids)
    readers = _reader_phases(prog, phases)
    cat = np.empty(len(values), dtype=np.int64)
    for vid, v in enumerate(values):
        if v.kind in ("input", "const"):
            c = v.role_category or "batch"
        elif vid in grad_ids:
            c = "gradient"
        elif vid in out_set:
            c = out_cat[vid]
        else:
            c = "temporary"
            dphase = phases[v.def_node] if v.def_node >= 0 else _OTHER
            if dphase == _FORWARD and readers[vid] & _BIT[_BACKWARD]:
                c = "saved_activation"
            elif dphase == _BACKWARD and readers[vid] & (_BIT[_OTHER] | _BIT[_FORWARD]):
                c = "gradient"
        cat[vid] = _CAT_INDEX[c]
    for vid in grad_ids:
        cat[vid] = _CAT_INDEX["gradient"]

    # ---- liveness under the schedule -------------------------------------------------
    if schedule == "greedy":
        order = prog.greedy_order()
    elif schedule == "eager_update":
        # optimizer-side equations (neither forward nor backward) as soon as they can
        order = prog.priority_order([0 if p == _OTHER else 1 for p in phases])
    else:
        order = list(range(len(nodes)))
    start, end = prog.intervals(order)
    n = max(len(order), 1)
    ncat = len(CATEGORIES)
    diff = np.zeros((ncat, n + 1), dtype=np.int64)
    np.add.at(diff, (cat, start), prog.sizes)
    np.add.at(diff, (cat, end + 1), -prog.sizes)
    timeline = np.cumsum(diff, axis=1)[:, :n]
    if order:
        timeline[_CAT_INDEX["temporary"]] += np.array([nodes[i].extra for i in order], dtype=np.int64)
    total = timeline.sum(axis=0)
    peak_index = int(total.argmax()) if order else 0
    peak_bytes = int(total[peak_index])
    breakdown = {c: int(timeline[i, peak_index]) for i, c in enumerate(CATEGORIES)}

    if order:
        pnode = nodes[order[peak_index]]
        where = f"{pnode.path}/{pnode.primitive}" if pnode.path else pnode.primitive
        peak_eqn = f"{where} at {_describe_source(pnode.source_info)}"
    else:
        peak_eqn = "(no equations)"

    live = np.nonzero((start <= peak_index) & (end >= peak_index) & (prog.sizes > 0))[0]
    live = sorted(live.tolist(), key=lambda v: -int(prog.sizes[v]))[:top_k]
    live_values = []
    for vid in live:
        v = values[vid]
        if v.kind == "input":
            origin = f"input {in_paths[v.input_index]}" if in_paths else f"input #{v.input_index}"
        elif v.kind == "const":
            origin = "constant"
        else:
            dn = nodes[v.def_node]
            origin = f"{dn.path + '/' if dn.path else ''}{dn.primitive} at {_describe_source(dn.source_info)}"
        live_values.append(LiveValue(int(prog.sizes[vid]), CATEGORIES[cat[vid]], _aval_str(v.aval), origin))

    input_bytes = int(sum(values[v].size for v in prog.in_ids)) + int(
        sum(v.size for v in values if v.kind == "const")
    )
    output_bytes = int(sum(values[v].size for v in set(out_ids)))
    return MemoryReport(
        peak_bytes=peak_bytes,
        peak_index=peak_index,
        peak_eqn=peak_eqn,
        peak_breakdown=breakdown,
        timeline=timeline,
        categories=CATEGORIES,
        primitives=tuple(nodes[i].primitive for i in order),
        schedule=schedule,
        input_bytes=input_bytes,
        output_bytes=output_bytes,
        live_at_peak=tuple(live_values),
    )
