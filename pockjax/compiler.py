"""``pockjax.compile``: trace the whole train step once, rewrite it, compile it.

::

    @pockjax.compile(scheme=pockjax.UpdateScheme({"layers.*.attn.*": "full"}))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

The decorated function has the signature of ``train_step``. On the first call
with a new input signature (tree structure, shapes, dtypes) it traces the
step into a :class:`~pockjax.graph.TrainGraph`, runs the passes
(``sparse_grad(scheme)``, ``dce`` and ``fold_dot_transpose`` by default), strips pockjax's tags and
compiles the result with the backend; later calls with that signature reuse
the :class:`CompiledStep`. The two stages are also reachable one by one, as
with ``jax.jit``: ``step.lower(*args)`` is the :class:`Lowered` step (the
rewritten graph, its jaxpr and prune summary, nothing compiled) and
``step.lower(*args).compile()`` the :class:`CompiledStep`. The backends are
:mod:`pockjax.backends.xla` (in process) and :mod:`pockjax.backends.iree`
(``target=...``).

Flax NNX steps ``step(model, optimizer, *batch) -> aux`` are supported too:
the model and optimizer are updated in place, as with ``nnx.jit``, and so is
every NNX object passed as an argument of its own (``nnx.MultiMetric``,
``nnx.Rngs``): the Flax tutorial's ``train_step(model, optimizer, metrics, x, y)``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

from pockjax import _compat as C
from pockjax import quant
from pockjax.analysis import PruneSummary, summarize
from pockjax.backends.xla import SignatureChanged, XlaExecutable
from pockjax.errors import BackendError, StepSignatureError, some
from pockjax.graph import (MODEL_STATE, OPT_STATE, PARAM, TrainGraph, is_linen_variables, is_train_state, step_name,
                           trace_step, unwrap_jit)
from pockjax.optim.state import SparseOptState
from pockjax.paths import keypath_to_parts
from pockjax.scheme import UpdateScheme
from pockjax.transforms.base import Pass, chain
from pockjax.transforms.dce import dce
from pockjax.transforms.fold_dot_transpose import fold_dot_transpose
from pockjax.transforms.sparse_grad import SparseGradRecord, sparse_grad
from pockjax.transforms.strip_tags import strip_tags


def default_passes(scheme: UpdateScheme | None, sparse_opt_state: bool = False, *,
                   allow_nothing_trained: bool = False, rank_first_barrier: bool | None = None,
                   check: bool = True) -> Pass:
    """``sparse_grad(scheme)``, ``dce()``, then ``fold_dot_transpose()`` (no ``sparse_grad`` without a scheme).

    A scheme with :func:`~pockjax.lora` rules also gets :func:`~pockjax.low_rank`
    (and a second ``dce``) after the first ``dce``; ``rank_first_barrier`` is its
    option.

    ``check`` is passed to :func:`~pockjax.dce` and
    :func:`~pockjax.fold_dot_transpose`: ``False`` skips their ``check_jaxpr``
    of each rewritten program, for graphs that are only analysed (FLOPs,
    liveness) and never compiled (the search's candidates, the planner's steps);
    :func:`pockjax.compile` always checks.

    The memory passes (:func:`~pockjax.inplace_update`,
    :func:`~pockjax.reorder_for_memory`) are not in the default pipeline: measured
    on XLA and IREE (``benchmarks/memory_passes.py``, docs/memory.md), neither
    lowered a process's peak memory without slowing the step by more than 2%.
    Chain them after these passes where the gradients set the peak.

    Example:
        >>> import pockjax
        >>> pockjax.default_passes(pockjax.UpdateScheme.full()).name
        'chain(sparse_grad, dce, fold_dot_transpose)'
    """
    if scheme is None:
        return chain(dce(check=check), fold_dot_transpose(check=check))
    grads = sparse_grad(scheme, sparse_opt_state=sparse_opt_state, allow_nothing_trained=allow_nothing_trained)
    if scheme.has_lora:
        from pockjax.transforms.low_rank import low_rank

        return chain(grads, dce(check=check), low_rank(rank_first_barrier=rank_first_barrier), dce(check=check),
                     fold_dot_transpose(check=check))
    return chain(grads, dce(check=check), fold_dot_transpose(check=check))


# -- the compiled step ----------------------------------------------------------
class _RewrittenGraph:
    """The views of a rewritten step that :class:`Lowered` and :class:`CompiledStep` share.

    Needs the attributes ``traced`` and ``graph`` (:class:`TrainGraph`) and
    ``_summary`` (the cached :class:`PruneSummary`, or None).
    """

    traced: TrainGraph
    graph: TrainGraph
    _summary: PruneSummary | None

    @property
    def jaxpr(self) -> C.ClosedJaxpr:
        """The transformed closed jaxpr."""
        return self.graph.closed_jaxpr

    def summary(self) -> PruneSummary:
        """Equations and FLOPs of the traced full step versus the rewritten one."""
        if self._summary is None:
            self._summary = summarize(chain(strip_tags(), dce())(self.traced), self.graph)
        return self._summary


@dataclasses.dataclass
class CompiledStep(_RewrittenGraph):
    """One train step, traced, transformed and compiled for one input signature.

    Attributes:
      traced: the graph as traced (full step, with tags).
      graph: the graph after the passes (what the backend compiled).
      executable: the backend's callable over flat arrays.
      backend: the backend's name (``"xla"``).
    """

    traced: TrainGraph
    graph: TrainGraph
    executable: Any
    backend: str
    in_tree: Any
    out_builder: Callable
    passthrough: tuple  # per graph output: input index it forwards, or None
    _summary: PruneSummary | None = None
    donated: tuple = ()  # graph inputs whose buffers the step may reuse

    def _xla(self):
        if not isinstance(self.executable, XlaExecutable):
            raise BackendError(f"{self.backend!r} steps have no XLA analysis; compile without target= for it")
        return self.executable.compiled

    def export(self, path, *, with_weights: bool = True, state: Sequence[np.ndarray] | None = None) -> str:
        """Write the compiled module and its metadata to directory ``path``.

        Only IREE targets export (``pockjax.compile(..., target="cpu")``); the
        directory holds ``module.vmfb``, ``module.json`` (tree structure,
        shapes, dtypes, scheme, target, versions) and, with weights, a
        parameter archive. Load it with ``pockjax.runtime.load(path)``.

        The weights are ``state`` (host arrays, in the module's state order)
        if given (the device's state is left as it is), else the state on the
        device after the last call. A step that has not run, or one compiled
        for a device this machine lacks (``cuda`` on a build machine), has no
        device state: give ``state``, export through :meth:`Step.export` with
        example arguments, or pass ``with_weights=False``.
        """
        if getattr(self.executable, "name", None) != "iree":
            raise BackendError("only IREE-compiled steps export: compile with target='cpu' (or arm64, vulkan, ...)")
        sparse = self.graph.record(SparseGradRecord)
        scheme = sparse.scheme if sparse is not None else None
        extra = {
            "in_tree": str(self.in_tree),
            "scheme": scheme.to_dict() if scheme is not None else None,
            "in_paths": list(self.graph.in_paths),
        }
        from pockjax.backends.iree.executable import export_module

        exe = self.executable.exe
        module = exe.compiled if self.executable.runs_here else exe
        if state is not None:
            if not with_weights:
                raise BackendError("state= is the weights to write: drop with_weights=False, or drop state=")
            if isinstance(state, Mapping) or isinstance(state, (str, bytes)):
                raise BackendError("state= takes the state arrays in the module's state order (a list), not "
                                   f"a {type(state).__name__}")
            return export_module(module, path, weights=list(state), extra=extra)
        if not with_weights:
            return export_module(module, path, extra=extra)
        if not self.executable.runs_here:  # compiled for a device this machine lacks
            raise BackendError(
                f"this machine has no {self.executable.target} device holding the weights: export with"
                " step.export(path, *example_args) to write them from the example arguments, pass state=,"
                " or pass with_weights=False")
        if not exe.has_state:
            raise BackendError("the step has not run yet, so it holds no weights to export: export with"
                               " step.export(path, *example_args), pass state=, or pass with_weights=False")
        return exe.export(path, with_weights=True, extra=extra)

    def cost_analysis(self) -> dict:
        """XLA's cost analysis of the compiled program (``flops``, ``bytes accessed``...)."""
        ca = self._xla().cost_analysis()
        return ca[0] if isinstance(ca, (list, tuple)) else ca

    def memory_analysis(self):
        """XLA's memory analysis of the compiled program."""
        return self._xla().memory_analysis()

    def memory_report(self):
        """The planner's memory figures next to XLA's (see :mod:`pockjax.memory`)."""
        from pockjax.memory import memory_report

        return memory_report(self)

    def call_flat(self, flat_args: Sequence) -> list:
        if self.tree_call is not None:  # forwarded inputs may be donated: they come back as outputs
            return self.executable.call_all(flat_args)
        computed = self.executable(*flat_args)
        if self._forwards_nothing:
            return computed
        it = iter(computed)
        return [flat_args[src] if src is not None else next(it) for src in self.passthrough]

    @functools.cached_property
    def _forwards_nothing(self) -> bool:
        return all(src is None for src in self.passthrough)

    @functools.cached_property
    def tree_call(self) -> Callable | None:
        """``tree_call(*args)`` -> the output trees in one ``jax.jit`` dispatch, or None.

        Set for XLA steps whose outputs are all computed and whose donated
        inputs are whole arguments (see :class:`~pockjax.backends.xla.XlaExecutable`);
        it raises :class:`~pockjax.backends.xla.SignatureChanged` for arguments
        of another structure or signature.
        """
        return getattr(self.executable, "tree_call", None)

    def __call__(self, *args):
        flat, tree = jax.tree_util.tree_flatten(args)
        if tree != self.in_tree:
            raise StepSignatureError(f"arguments have structure {tree}, expected {self.in_tree}")
        if self.tree_call is not None:
            return self.tree_call(*args)
        return self.out_builder(self.call_flat(flat))


@dataclasses.dataclass
class Lowered(_RewrittenGraph):
    """One train step traced and rewritten for one input signature, not compiled yet.

    What :meth:`CompiledFunction.lower` returns, as ``jax.jit(f).lower(*args)``
    does: inspect the rewritten graph (:attr:`jaxpr`, :meth:`summary`) without
    compiling, and :meth:`compile` it for the backend. Lowering and compiling
    are cached per input signature: ``step.lower(*args).compile()`` returns
    the :class:`CompiledStep` that ``step(*args)`` runs.

    Attributes:
      traced: the graph as traced (full step, with tags).
      graph: the graph after the passes (what the backend compiles).
      in_tree: the pytree structure of the arguments.
    """

    traced: TrainGraph
    graph: TrainGraph
    in_tree: Any
    out_builder: Callable
    _backend_compile: Callable[["Lowered"], CompiledStep] = dataclasses.field(repr=False)
    _compiled: CompiledStep | None = dataclasses.field(default=None, repr=False)
    _summary: PruneSummary | None = dataclasses.field(default=None, repr=False)
    #: per flat input: its sharding when it spans several devices, else None
    in_shardings: tuple | None = dataclasses.field(default=None, repr=False)

    def compile(self) -> CompiledStep:
        """The :class:`CompiledStep` for this signature (compiled on the first call)."""
        if self._compiled is None:
            self._compiled = self._backend_compile(self)
            self._compiled._summary = self._summary
        return self._compiled


# -- the decorator ----------------------------------------------------------------
_ARRAY_TYPE = type(jax.numpy.zeros(()))


def _signature(flat):
    """Shapes, canonical dtypes and weak types of the step's leaves: the compile cache key.

    Runs on every call (over 800 leaves for SmolLM2's step with AdamW): a
    ``jax.Array`` already holds a canonical dtype and its weak type, so it is
    read directly; other leaves (NumPy arrays, Python scalars) go through
    JAX's dtype rules.
    """
    try:
        if all(type(x) is _ARRAY_TYPE for x in flat):
            return tuple([(x.shape, x.dtype, x.weak_type) for x in flat])
    except TypeError:
        pass
    out = []
    for x in flat:
        if type(x) is _ARRAY_TYPE:
            out.append((x.shape, x.dtype, x.weak_type))
            continue
        dt = getattr(x, "dtype", None)
        if dt is None:
            dt = jax.dtypes.result_type(x)
        elif not C.is_key_dtype(dt):  # typed PRNG keys stay as they are
            dt = jax.dtypes.canonicalize_dtype(dt)
        shape = tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
        out.append((shape, dt if C.is_key_dtype(dt) else np.dtype(dt), bool(getattr(x, "weak_type", False))))
    return tuple(out)


def _shardings(flat) -> tuple | None:
    """Per flat input its sharding where it spans several devices (else None); None if none does.

    A step over sharded inputs is compiled for those shardings (as ``jax.jit``
    compiles for its inputs'), so they are part of the compile cache key.
    """
    out = [None] * len(flat)
    for i, x in enumerate(flat):
        sharding = getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
        if sharding is not None and len(sharding.device_set) > 1:
            out[i] = sharding
    return tuple(out) if any(s is not None for s in out) else None


def _checked_signature(flat, args, name: str):
    """:func:`_signature`, or an error naming the leaf that is not an array."""
    try:
        return _signature(flat)
    except (TypeError, ValueError):
        from pockjax.graph import check_leaves, default_layout

        check_leaves(name, flat, default_layout(args)[2])
        raise


_NNX_TYPES: tuple | None = None


def _is_nnx_module(x) -> bool:
    # on every call of a compiled step: answered per type from a cache, since
    # isinstance against NNX's metaclass costs a third of a microsecond
    kind = type(x)
    hit = _NNX_KINDS.get(kind)
    if hit is None:
        global _NNX_TYPES
        if _NNX_TYPES is None:
            try:
                from flax import nnx
            except ImportError:  # pragma: no cover
                _NNX_TYPES = ()
            else:
                _NNX_TYPES = (nnx.Module, nnx.Optimizer) if hasattr(nnx, "Optimizer") else (nnx.Module,)
        hit = _NNX_KINDS[kind] = isinstance(x, _NNX_TYPES)
    return hit


@functools.lru_cache(maxsize=None)
def _nnx_node_kinds() -> tuple:
    """NNX's graph-node base classes (``nnx.Pytree`` / ``nnx.Object``): Module, Optimizer, Metric, Rngs."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover
        return ()
    # a State of Variables is a value, not a node
    return tuple(k for k in (getattr(nnx, "Pytree", None), getattr(nnx, "Object", None)) if isinstance(k, type))


def _nnx_parts(args: Sequence) -> tuple[tuple, tuple, tuple[int, ...]]:
    """An NNX step's arguments as ``(nodes, values, positions)``.

    ``nodes`` are the model (the first argument) and every further argument
    that is itself an NNX object (an ``nnx.Optimizer``, ``nnx.MultiMetric``,
    ``nnx.Rngs``, a second model, an ``nnx.Variable``): the step updates them in place, so they
    are carried as state, as ``nnx.jit`` carries them. ``positions`` are
    those further arguments' indices among ``args[1:]``; ``values`` are the
    other arguments (arrays, and pytrees such as an Optax state the step
    returns).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
        >>> nodes, values, pos = _nnx_parts((model, jnp.ones(2), metrics))
        >>> len(nodes), len(values), pos
        (2, 1, (1,))
    """
    kinds = _nnx_argument_kinds()
    rest = args[1:]
    pos = tuple(i for i, a in enumerate(rest) if kinds and isinstance(a, kinds))
    nodes = (args[0],) + tuple(rest[i] for i in pos)
    values = tuple(a for i, a in enumerate(rest) if i not in pos)
    return nodes, values, pos


@functools.lru_cache(maxsize=None)
def _nnx_argument_kinds() -> tuple:
    """What :func:`_nnx_parts` carries as state: NNX's graph nodes, and a bare ``nnx.Variable``
    the step writes into (``v[...] *= 0.5``). Looked up once: an NNX step's every call splits its arguments."""
    kinds = _nnx_node_kinds()
    if not kinds:  # pragma: no cover
        return ()
    from flax import nnx

    return kinds + (nnx.Variable,)


def _with_nodes(values: Sequence, nodes: Sequence, pos: tuple[int, ...]) -> list:
    """The arguments after the model: ``values`` with the NNX ``nodes`` put back at ``pos`` (inverse of :func:`_nnx_parts`).

    Example:
        >>> _with_nodes(["x", "y"], ["optimizer", "metrics"], (0, 1))
        ['optimizer', 'metrics', 'x', 'y']
    """
    out, it_v, it_n = [], iter(values), iter(nodes)
    for i in range(len(values) + len(nodes)):
        out.append(next(it_n) if i in pos else next(it_v))
    return out


def _refuse_nnx_objects_in_batch(name: str, batch: Sequence, first: int, *, nnx_step: bool = False) -> None:
    """Refuses NNX objects (``nnx.MultiMetric``, ``nnx.Rngs``, a second model) inside the batch arguments.

    A compiled step treats its batch arguments as values: the updates a
    step makes to such an object in place (``metrics.update(loss=...)``)
    would be lost without a word, where ``nnx.jit`` keeps them. An NNX step
    (``step(model, optimizer, *batch)``) carries an NNX object passed as an
    argument of its own (:func:`_nnx_parts`); one nested inside another
    argument (a dict, a list), or any in a functional step, is refused.
    """
    kinds = _nnx_node_kinds()
    if not kinds:  # pragma: no cover
        return
    for i, arg in enumerate(batch):
        if nnx_step and isinstance(arg, kinds):
            continue  # an argument of its own: carried as state (_nnx_parts)
        found = [x for x in jax.tree_util.tree_leaves(arg, is_leaf=lambda x: isinstance(x, kinds))
                 if isinstance(x, kinds)]
        if not found:
            continue
        if nnx_step:
            raise StepSignatureError(
                f"{name}: argument {first + i} holds an NNX object ({type(found[0]).__name__}) inside a"
                f" {type(arg).__name__}; a compiled NNX step carries an NNX object that is an argument of"
                " its own (step(model, optimizer, metrics, x, y)) and updates it in place, as nnx.jit"
                " does, but not one nested in another argument, whose updates would be lost. Pass it as"
                " an argument of its own.")
        raise StepSignatureError(
            f"{name}: argument {first + i} holds an NNX object ({type(found[0]).__name__}); a compiled"
            " functional step carries only its state arguments (params and opt_state) from call to call"
            " and takes the rest as arrays, so what the step writes into that object in place (such as"
            " metrics.update(...)) would be lost. Return the values instead (e.g. the loss) and update"
            " the object outside the compiled step, or write the step as step(model, optimizer, *batch)"
            " with NNX, which carries NNX arguments as state; for random numbers pass a jax.random key"
            " array.")


_NNX_KINDS: dict[type, bool] = {}


def _arg_leaves(args: Sequence) -> list[tuple[str, Any]]:
    """``(args[...] path, leaf)`` of every leaf of a call's arguments, for error messages."""
    return [(f"args{jax.tree_util.keystr(k)}", leaf) for k, leaf in jax.tree_util.tree_flatten_with_path(args)[0]]


def _aliased_donation_message(name: str, args: Sequence) -> str:
    """Why XLA refused to donate: one array passed as two leaves, which are named."""
    seen: dict[int, str] = {}
    for path, leaf in _arg_leaves(args):
        if isinstance(leaf, jax.Array) and id(leaf) in seen:
            where = f"as {seen[id(leaf)]} and {path}"
            break
        seen[id(leaf)] = path
    else:
        where = "as two of its leaves"
    return (f"{name}: the same array is passed {where}; a compiled step donates its state arguments'"
            " buffers (their memory is reused for the results), and XLA cannot donate one buffer twice."
            " Pass a copy for one of them (jnp.copy; optax.LookaheadParams.init_synced shares the fast"
            " and slow parameters), or compile with pockjax.compile(..., donate=False).")


def _refuse_shared_donation(compiled: "CompiledStep", flat: Sequence, name: str, args: Sequence) -> None:
    """Refuses one array passed as a donated leaf and another leaf, before the first call.

    XLA refuses it when both reach the program; a frozen leaf the step only hands back never
    does, and came back as the donated (deleted) array, without a word.
    """
    if not compiled.donated or len(flat) != len(compiled.graph.in_roles):
        return
    where: dict[int, list[int]] = {}
    for i, x in enumerate(flat):
        if isinstance(x, jax.Array):
            where.setdefault(id(x), []).append(i)
    donated = set(compiled.donated)
    if any(len(pos) > 1 and donated.intersection(pos) for pos in where.values()):
        raise StepSignatureError(_aliased_donation_message(name, args))


def _deleted_arrays_message(name: str, args: Sequence, donate: bool) -> str | None:
    """Which arguments are deleted arrays (donated to an earlier call), or None."""
    gone = [path for path, leaf in _arg_leaves(args)
            if isinstance(leaf, jax.Array) and not isinstance(leaf, C.Tracer) and leaf.is_deleted()]
    if not gone:
        return None
    was = "was" if len(gone) == 1 else "were"
    if not donate:  # not by this step: another jitted function's donation, or .delete()
        return f"{name}: {some(gone, quote=False)} {was} deleted before this call: pass live arrays."
    return (f"{name}: {some(gone, quote=False)} {was} donated to an earlier call of the compiled step,"
            " whose memory now holds its results: pass the state that call returned"
            " (params, opt_state = step(params, opt_state, batch)), a copy made before it (jnp.copy), or"
            " compile with pockjax.compile(..., donate=False).")


class CompiledFunction:
    """What :func:`compile` returns: a train step with the original signature."""

    def __init__(self, step, scheme, passes, target, target_options, donate, xla_options=None,
                 precision=None):
        functools.update_wrapper(self, step)
        self.precision = precision
        self.step = step
        self.scheme = scheme
        self.passes = passes
        self.target = target
        self.target_options = dict(target_options or {})
        self.backend = "xla" if target is None else f"iree:{target}"
        self.donate = donate
        self.xla_options = dict(xla_options or {})
        self._cache: dict = {}
        self._hot: dict = {}
        # the last compiled XLA step callable over the argument trees (tree_call)
        self._fast: Callable | None = None

    # -- public helpers ---------------------------------------------------------
    def lower(self, *args) -> Lowered:
        """The step traced and rewritten for these arguments: a :class:`Lowered`.

        ``lower(*args).compile()`` is the :class:`CompiledStep` that a call
        with these arguments runs; both are cached per input signature.
        """
        if args and _is_nnx_module(args[0]):
            return self._nnx_lowered(*args)[0]
        return self._functional_lowered(args)

    def jaxpr(self, *args) -> C.ClosedJaxpr:
        """The transformed jaxpr for these arguments."""
        return self.lower(*args).jaxpr

    def summary(self, *args) -> PruneSummary:
        """What the passes pruned for these arguments (equations, FLOPs)."""
        return self.lower(*args).summary()

    def export(self, path, *example_args, with_weights: bool = True) -> str:
        """Compile for these example arguments and export them as initial weights.

        IREE targets only. The state leaves of ``example_args`` (parameters,
        optimizer state) become the module's initial weights, so the runtime
        continues training from them.
        """
        compiled = self.lower(*example_args).compile()
        if with_weights and getattr(compiled.executable, "name", None) == "iree":
            if example_args and _is_nnx_module(example_args[0]):
                # The NNX step's flat inputs: the state leaves of nnx.split((model, optimizer, *NNX
                # arguments)), then the other batch arguments.
                from flax import nnx

                nodes, values, _ = _nnx_parts(example_args)
                _, state = nnx.split(nodes)
                flat = jax.tree.leaves(state) + jax.tree.leaves(values)
            else:
                flat = jax.tree.leaves(example_args)
            exe = compiled.executable.exe
            # Typed PRNG keys (an NNX model's dropout stream) cross the module boundary as their key data.
            flat = [jax.random.key_data(x) if C.is_key_dtype(getattr(x, "dtype", None)) else x for x in flat]
            state = [np.asarray(flat[i]) for i in exe.metadata.state_inputs]
            return compiled.export(path, with_weights=True, state=state)
        return compiled.export(path, with_weights=with_weights)

    def _rank_first_barrier(self) -> bool | None:
        """``low_rank``'s option: an IREE module gets the barrier, whatever machine compiles it
        (measured only on CPUs, where it pays); XLA decides by JAX's default backend (None)."""
        return True if self.target is not None else None

    def __call__(self, *args, **kwargs):
        if kwargs:
            raise StepSignatureError(
                f"{step_name(self.step)}: a compiled step takes its arguments by position, got keyword"
                f" argument(s) {', '.join(sorted(kwargs))}: pass them positionally, in the step's order")
        try:
            return self._call(*args)
        except (ValueError, RuntimeError) as e:  # JaxRuntimeError is a RuntimeError
            if "has been deleted" in str(e):
                message = _deleted_arrays_message(step_name(self.step), args, self.donate)
                if message is not None:
                    raise StepSignatureError(message) from None
            if not isinstance(e, jax.errors.JaxRuntimeError) or (
                    "donate the same buffer twice" not in str(e) and "donate a buffer which is also used" not in str(e)
                    and "previously donated in the same call" not in str(e)):
                raise
            raise StepSignatureError(_aliased_donation_message(step_name(self.step), args)) from None

    def _call(self, *args):
        if args and _is_nnx_module(args[0]):
            return self._call_nnx(*args)
        # Hottest path: the last compiled step as one jax.jit over the argument
        # trees, whose C++ dispatch flattens them, checks the signature and
        # builds the outputs. Another tree structure or signature makes it
        # retrace, which raises SignatureChanged, and the paths below find
        # (or compile) the step for these arguments.
        # A leaf that is not an array (a str) is a TypeError there: the slow path below
        # names it (check_leaves), as on a first call.
        fast = self._fast
        if fast is not None:
            try:
                return fast(*args)
            except (SignatureChanged, TypeError):
                pass
        flat, tree = jax.tree_util.tree_flatten(args)
        # Hot path: the step last compiled for this tree structure (flat jit).
        hot = self._hot.get(tree)
        if hot is not None:
            try:
                return hot.out_builder(hot.call_flat(flat))
            except (SignatureChanged, TypeError):
                pass
        compiled = self._functional_compiled(args)
        _refuse_shared_donation(compiled, flat, step_name(self.step), args)
        if isinstance(compiled.executable, XlaExecutable):
            self._hot[tree] = compiled
            self._fast = compiled.tree_call
            if compiled.tree_call is not None:
                return compiled.tree_call(*args)
        return compiled.out_builder(compiled.call_flat(flat))

    # -- functional steps -------------------------------------------------------
    def _functional_compiled(self, args) -> CompiledStep:
        return self._functional_lowered(args).compile()

    def _functional_lowered(self, args) -> Lowered:
        name = step_name(self.step)
        if len(args) < 1 or (len(args) < 2 and not is_train_state(args[0])):
            raise StepSignatureError(
                f"{name}: a compiled step is called as step(params, opt_state, *batch) or "
                f"step(train_state, *batch); got {len(args)} argument(s)"
            )
        flat, tree = jax.tree_util.tree_flatten(args)
        in_shardings = _shardings(flat)
        key = (tree, _checked_signature(flat, args, name), in_shardings)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        n_state_args = 1 if is_train_state(args[0]) else 2
        _refuse_nnx_objects_in_batch(name, args[n_state_args:], n_state_args)
        trace_args, sparse_states = self._full_state_args(args, name)
        quantized = {i: x for i, x in enumerate(jax.tree.leaves(args, is_leaf=quant.is_qtensor))
                     if quant.is_qtensor(x)}
        if quantized:
            trace_args = quant.abstract(trace_args)
        traced = trace_step(self.step, trace_args, n_state_args=n_state_args)
        passes = self.passes or default_passes(self.scheme, bool(sparse_states),
                                               rank_first_barrier=self._rank_first_barrier())
        graph = self._precision(strip_tags()(passes(traced)))
        if quantized:
            graph = _with_quantized_inputs(graph, quantized, self.scheme, tree)
        if sparse_states:
            expected = [tuple(np.shape(x)) for state in sparse_states for x in state.leaves]
            opt = [i for i, r in enumerate(graph.in_roles) if r == OPT_STATE]
            got = [tuple(graph.in_avals[i].shape) for i in opt]
            if expected != got:
                k = next((k for k, (e, g) in enumerate(zip(expected, got)) if e != g), min(len(expected), len(got)))
                first = (f"leaf {k}{f' ({graph.in_paths[opt[k]]})' if k < len(opt) else ''} has shape"
                         f" {expected[k] if k < len(expected) else 'none (the state ends there)'}, the step needs"
                         f" {got[k] if k < len(got) else 'none'}")
                hint = ("" if self.passes is None else " With passes=, build the pipeline with"
                        " default_passes(scheme, sparse_opt_state=True) (or sparse_grad(scheme,"
                        " sparse_opt_state=True)), as pockjax.compile does.")
                if len(got) > len(expected) and self.passes is None:  # model state reads its optimizer state
                    hint += (" If it was made so, the step updates a leaf the scheme freezes as model state"
                             " (it sets the leaf itself, from the batch or other weights) and reads that"
                             " leaf's optimizer state: pass the full state, tx.init(params).")
                raise StepSignatureError(
                    f"{name}: the sparse optimizer state does not fit the step: it has {len(expected)} leaves,"
                    f" the step reads {len(got)} ({first}; the state's leaf shapes: {some(expected)}; the"
                    f" step's: {some(got)}). Pass the state pockjax.init_opt_state(tx, params, scheme) made"
                    f" for this scheme and these parameters.{hint}"
                )
        # The state arguments come back with the structure they came in with
        # (a SparseOptState stays sparse); aux outputs as traced.
        state_defs = [jax.tree.structure(a) for a in args[:n_state_args]]
        aux_trees = traced.out_tree.children()[n_state_args:]
        out_def = jax.tree_util.treedef_tuple([*state_defs, *aux_trees])

        def build(flat_out):
            return jax.tree_util.tree_unflatten(out_def, flat_out)

        lowered = Lowered(traced, graph, tree, build, self._finish, in_shardings=in_shardings)
        self._cache[key] = lowered
        return lowered

    def _precision(self, graph: TrainGraph) -> TrainGraph:
        if self.precision is None:
            return graph
        from pockjax.transforms.precision import mixed_precision

        return mixed_precision(self.precision)(graph)

    def _full_state_args(self, args, name: str):
        """``args`` with every :class:`SparseOptState` replaced by its full abstract form.

        The step is traced against the full optimizer state; ``sparse_grad``
        then drops the frozen parameters' state. Returns ``(args, the sparse
        states found, in leaf order)``.
        """
        is_sparse = lambda x: isinstance(x, SparseOptState)  # noqa: E731
        found = [x for x in jax.tree.leaves(args, is_leaf=is_sparse) if is_sparse(x)]
        if not found:
            return args, []
        if self.scheme is None:
            raise StepSignatureError(f"{name}: a SparseOptState needs the step to be compiled with a scheme")
        linen = is_linen_variables(args[0])
        for state in found:
            if state.layout.scheme != self.scheme:
                hint = (" (this step takes a Linen variables dict, so the scheme names its parameters"
                        " params.…: pockjax.init_opt_state(tx, variables['params'], scheme, prefix='params'))"
                        if linen else "")
                raise StepSignatureError(
                    f"{name}: the SparseOptState was initialised for another scheme than the step's; "
                    f"make it with pockjax.init_opt_state(tx, params, scheme) using the same scheme{hint}"
                )
        full = jax.tree.map(lambda x: x.full_abstract() if is_sparse(x) else x, args, is_leaf=is_sparse)
        return full, found

    def _finish(self, lowered: Lowered) -> CompiledStep:
        """Compile a lowered step with the backend."""
        traced, graph = lowered.traced, lowered.graph
        passthrough = graph.out_sources
        computed = tuple(o for o, src in enumerate(passthrough) if src is None)
        forwarded = {src for src in passthrough if src is not None}
        donate, alias = [], []
        if self.donate:
            donate = [
                i
                for i, role in enumerate(graph.in_roles)
                if role in (PARAM, OPT_STATE, MODEL_STATE) and i not in forwarded
            ]
            # state an output forwards unchanged may be donated with the rest of
            # its argument (it comes back aliased); a frozen parameter may not
            alias = [i for i in forwarded if graph.in_roles[i] in (OPT_STATE, MODEL_STATE)]
        if self.target is None:
            executable = XlaExecutable(graph, computed, donate, self.xla_options, in_tree=lowered.in_tree,
                                       out_builder=lowered.out_builder, alias=alias,
                                       in_shardings=lowered.in_shardings)
        elif lowered.in_shardings is not None:
            sharded = [graph.in_paths[i] for i, s in enumerate(lowered.in_shardings) if s is not None]
            raise BackendError(
                f"{graph.step_name}: IREE target {self.target!r} runs the step on one device, but"
                f" {len(sharded)} input(s) span several devices ({', '.join(sharded[:3])}...):"
                " pass arrays on one device (jax.device_put(x, jax.devices()[0])), or compile without target="
            )
        else:
            from pockjax.backends.iree.step import IreeStepExecutable

            executable = IreeStepExecutable(graph, computed, self.target, self.target_options)
        return CompiledStep(
            traced=traced,
            graph=graph,
            executable=executable,
            backend=self.backend,
            in_tree=lowered.in_tree,
            out_builder=lowered.out_builder,
            passthrough=passthrough,
            donated=tuple(sorted(set(donate) | set(alias))),
        )

    # -- Flax NNX steps -------------------------------------------------------------
    def _nnx_lowered(self, *args, split=None):
        """``(Lowered, state_def, graphdef)`` of an NNX step for ``args`` (model, *rest).

        The state is that of ``nnx.split(nodes)`` (:func:`_nnx_parts`): the
        model's and that of every NNX object passed as an argument of its own
        (the optimizer, metrics, rngs); ``split`` is that split when the
        caller has it. The model's ``nnx.Param`` leaves are parameters under
        their own paths (``dense.kernel``), the leaves of an ``nnx.Optimizer``
        right after the model optimizer state (``opt_state.…``), and the rest,
        every other NNX argument's included, model state (``argN.…``):
        updated as the step computes it, never pruned.
        """
        from flax import nnx

        from pockjax.adapters import is_lora

        nodes, batch, pos = _nnx_parts(args)
        graphdef, state = nnx.split(nodes) if split is None else split
        leaves, state_def = jax.tree_util.tree_flatten(state)
        batch_flat, batch_def = jax.tree_util.tree_flatten(batch)
        in_shardings = _shardings(list(leaves) + batch_flat)
        key = ("nnx", pos, graphdef, state_def, _signature(leaves), batch_def, _signature(batch_flat), in_shardings)
        hit = self._cache.get(key)
        if hit is not None:
            return hit, state_def, graphdef
        _refuse_nnx_objects_in_batch(step_name(self.step), args[1:], 1, nnx_step=True)
        if any(isinstance(x, SparseOptState) for x in jax.tree.leaves(batch, is_leaf=lambda x: isinstance(x, SparseOptState))):
            raise StepSignatureError(
                f"{step_name(self.step)}: a SparseOptState (pockjax.init_opt_state) is an argument of an NNX"
                " step, which takes an Optax state as a plain value: pockjax neither prunes nor restores it."
                " Use nnx.Optimizer(model, tx, wrt=scheme.nnx_wrt()), which holds state only for what the"
                " scheme trains, or the functional form step(params, opt_state, *batch)")
        flat_vars = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
        for keypath, var in flat_vars:
            if quant.is_qtensor(var.get_raw_value()):
                raise StepSignatureError(
                    f"{step_name(self.step)}: NNX variable {'.'.join(keypath_to_parts(keypath))} holds a"
                    " quantized QTensor; quantized frozen weights are compiled in functional steps"
                    " (step(params, opt_state, *batch) with llama.split(model)), not yet in NNX steps")
            if is_lora(var.get_raw_value()):
                raise StepSignatureError(
                    f"{step_name(self.step)}: NNX variable {'.'.join(keypath_to_parts(keypath))} holds a LoRA"
                    " adapter (pockjax.add_adapters); LoRA is compiled in functional steps"
                    " (step(params, opt_state, *batch), with the parameters from nnx.split or llama.split),"
                    " not yet in NNX steps: nnx.Optimizer cannot update an adapted tensor either")
            n = len(jax.tree_util.tree_leaves(var))
            if n != 1:
                raise StepSignatureError(
                    f"{step_name(self.step)}: NNX variable {'.'.join(keypath_to_parts(keypath))} holds {n}"
                    " arrays; pockjax compiles NNX steps whose variables hold one array each (split it"
                    " into one variable per array)")
        roles, paths = [], []
        optimizer_types = tuple(k for k in (getattr(nnx, "Optimizer", None),) if isinstance(k, type))
        # nnx.ModelAndOptimizer (deprecated in Flax 0.12): the model rides inside the optimizer,
        # under .model; its parameters keep the model's own paths (those of scheme.nnx_wrt()).
        inside = (bool(optimizer_types) and isinstance(nodes[0], optimizer_types)
                  and isinstance(getattr(nodes[0], "model", None), nnx.Module))
        for keypath, var in flat_vars:
            parts = keypath_to_parts(keypath)
            owner, rest = int(parts[0]), ".".join(parts[1:])
            arg = 0 if owner == 0 else 1 + pos[owner - 1]  # the argument the leaf came in
            if owner == 0 and inside and parts[1] != "model":  # the optimizer's own state
                roles.append(OPT_STATE)
                paths.append(f"opt_state.{rest}")
            elif owner == 0:
                rest = ".".join(parts[2:]) if inside else rest
                roles.append(PARAM if isinstance(var, nnx.Param) else MODEL_STATE)
                paths.append(rest if isinstance(var, nnx.Param) else f"model_state.{rest}")
            elif arg == 1 and optimizer_types and isinstance(nodes[owner], optimizer_types):
                # the model's optimizer: its state mirrors the model's parameters (a second model's
                # optimizer, anywhere else, would be paired with the wrong parameters)
                roles.append(OPT_STATE)
                paths.append(f"opt_state.{rest}")
            else:  # metrics, rngs, another optimizer or model (an EMA teacher): updated as the step computes
                roles.append(MODEL_STATE)
                paths.append(f"arg{arg}.{rest}" if rest else f"arg{arg}")
        step = unwrap_jit(self.step)  # nnx.jit's tracers would hide the parameters from the gradient tags

        def functional(state_leaves, *batch_args):
            st = jax.tree_util.tree_unflatten(state_def, state_leaves)
            objs = nnx.merge(graphdef, st)
            aux = step(objs[0], *_with_nodes(batch_args, objs[1:], pos))
            _, new_state = nnx.split(objs)
            new_leaves = jax.tree.leaves(new_state)
            return new_leaves, aux

        functional.__name__ = functional.__qualname__ = step_name(step)  # messages name the user's step

        batch_roles = ["batch"] * len(batch_flat)
        traced = trace_step(
            functional,
            (list(leaves), *batch),
            roles=roles + batch_roles,
            paths=paths + [f"batch.{i}" for i in range(len(batch_flat))],
            n_state_args=1,
        )
        passes = self.passes or default_passes(self.scheme, rank_first_barrier=self._rank_first_barrier())
        graph = self._precision(strip_tags()(passes(traced)))
        n_state = len(leaves)
        aux_tree = traced.out_tree.children()[1]

        def build(flat_out):
            return flat_out[:n_state], jax.tree_util.tree_unflatten(aux_tree, flat_out[n_state:])

        in_tree = jax.tree_util.tree_structure((list(leaves), *batch))
        lowered = Lowered(traced, graph, in_tree, build, self._finish, in_shardings=in_shardings)
        self._cache[key] = lowered
        return lowered, state_def, graphdef

    @staticmethod
    def _run(compiled: CompiledStep, leaves: list, batch: tuple):
        """An NNX step's ``(new state leaves, aux)`` for its state leaves and batch."""
        if compiled.tree_call is not None:
            return compiled.tree_call(leaves, *batch)
        return compiled.out_builder(compiled.call_flat(leaves + jax.tree.leaves(batch)))

    def _call_nnx(self, *args):
        from flax import nnx

        nodes, batch, pos = _nnx_parts(args)
        graphdef, state = nnx.split(nodes)
        leaves, state_def = jax.tree_util.tree_flatten(state)
        hot_key = ("nnx", pos, graphdef, state_def)
        hot = self._hot.get(hot_key)
        result = None
        if hot is not None:
            try:
                result = self._run(hot, leaves, batch)
            except SignatureChanged:
                pass
        if result is None:
            compiled = self._nnx_lowered(*args, split=(graphdef, state))[0].compile()
            _refuse_shared_donation(compiled, list(leaves) + jax.tree.leaves(batch), step_name(self.step), args)
            if isinstance(compiled.executable, XlaExecutable):
                self._hot[hot_key] = compiled
            result = self._run(compiled, leaves, batch)
            if not isinstance(compiled.executable, XlaExecutable):
                # IREE state comes back as device buffers: the variables get JAX arrays, which any
                # JAX code (nnx.jit, metrics.reset()) takes, and the next call takes without an upload
                result = (compiled.executable.adopt_host_copies(list(result[0])), result[1])
        new_leaves, aux = result
        _write_back(state, new_leaves)
        return aux


def _with_quantized_inputs(graph: TrainGraph, quantized: dict, scheme, in_tree) -> TrainGraph:
    """``graph`` (traced for the float values) taking each :class:`~pockjax.quant.QTensor`'s arrays instead.

    Every quantized input must come back unchanged (a frozen parameter):
    otherwise the step trains it, which a quantized tensor cannot be, and
    this raises :class:`~pockjax.quant.QuantizationError` naming it.
    """
    from pockjax.transforms.dequantize import dequantize_inputs

    sources = graph.out_sources
    forward = {}
    for o, i in enumerate(graph.out_to_in):
        if i not in quantized:
            continue
        if sources[o] != i:
            why = ("with no scheme, pockjax.compile trains every parameter" if scheme is None
                   else "the scheme trains it")
            raise quant.QuantizationError(
                f"{graph.step_name}: {graph.in_paths[i]} is quantized ({quantized[i].qtype}) but the step"
                f" updates it ({why}): a quantized tensor cannot be trained. Freeze it in the"
                " scheme ('frozen'), or load it unquantized to train it")
        forward[o] = i
    closed = dequantize_inputs(graph.closed_jaxpr, quantized, forward)
    new_index, in_roles, in_paths = [], [], []
    for i, (role, path) in enumerate(zip(graph.in_roles, graph.in_paths)):
        new_index.append(len(in_roles))
        if i in quantized:
            fields = [k.name for k, _ in quantized[i].tree_flatten_with_keys()[0]]
            in_roles += [role] * len(fields)
            in_paths += [f"{path}.{f}" for f in fields]
        else:
            in_roles.append(role)
            in_paths.append(path)
    param_of = [None] * len(in_roles)
    for i, p in enumerate(graph.param_of):
        if p is not None and i not in quantized:
            param_of[new_index[i]] = new_index[p]
    out_roles, out_paths, out_to_in = [], [], []
    for o, (role, path, src) in enumerate(zip(graph.out_roles, graph.out_paths, graph.out_to_in)):
        if o in forward:
            fields = [k.name for k, _ in quantized[src].tree_flatten_with_keys()[0]]
            out_roles += [role] * len(fields)
            out_paths += [f"{path}.{f}" for f in fields]
            out_to_in += [new_index[src] + k for k in range(len(fields))]
        else:
            out_roles.append(role)
            out_paths.append(path)
            out_to_in.append(None if src is None else new_index[src])
    return graph.with_jaxpr(closed, in_tree=in_tree, in_roles=tuple(in_roles), in_paths=tuple(in_paths),
                            param_of=tuple(param_of), out_roles=tuple(out_roles), out_paths=tuple(out_paths),
                            out_to_in=tuple(out_to_in))


def _write_back(state, new_leaves: list) -> None:
    """Puts an NNX step's new state leaves into the model's and optimizer's variables.

    ``nnx.split`` hands out the nodes' own ``Variable`` objects, and a compiled
    NNX step holds one leaf per variable (:meth:`_nnx_lowered` refuses others):
    setting their values as ``nnx.update`` does (:func:`pockjax._compat.set_variable_values`),
    without walking the object graph a second time (about a third of a millisecond
    per call for a small CNN).
    """
    from flax import nnx

    variables = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(variables) != len(new_leaves):  # pragma: no cover - guarded at compile time
        raise StepSignatureError(f"{len(new_leaves)} new state leaves for {len(variables)} variables")
    C.set_variable_values(variables, new_leaves)


def compile(
    step: Callable | None = None,
    *,
    scheme: UpdateScheme | None = None,
    passes: Pass | None = None,
    target: str | None = None,
    target_options: dict | None = None,
    donate: bool = True,
    xla_options: dict | None = None,
    precision: Any = None,
):
    """Compile a whole train step with pockjax's passes.

    Usable as ``@pockjax.compile`` or ``@pockjax.compile(scheme=...)``.

    Args:
      step: ``step(params, opt_state, *batch) -> (params, opt_state, *aux)``,
        or a Flax NNX step ``step(model, optimizer, *batch) -> aux``.
      scheme: the :class:`~pockjax.UpdateScheme`; ``None`` trains everything.
      passes: a pass pipeline to use instead of :func:`default_passes`
        (``sparse_grad(scheme)`` + ``dce`` + ``fold_dot_transpose``).
      target: ``None`` compiles in process with XLA; a name from
        :mod:`pockjax.backends.iree.targets` (``"cpu"``, ``"arm64"``, ``"vulkan"``,
        ``"cuda"``, ``"dsp"``) compiles ahead of time with IREE.
      target_options: IREE target options (``cpu=``, ``arch=``, ``features=``...).
      donate: donate parameters and optimizer state buffers to the step (XLA).
      xla_options: XLA compiler options for the in-process step (see
        :func:`pockjax.backends.xla.xla_compile_options`), e.g.
        :func:`pockjax.train.steps.answer_step_xla_options`.
      precision: ``None`` or ``"fp32"`` computes as traced; ``"bf16"``
        computes every matrix product of the step in bfloat16 with float32
        accumulation, parameters, optimizer state, loss and reductions in
        their own dtype (:func:`~pockjax.mixed_precision`).

    Parameters may hold :class:`~pockjax.quant.QTensor` leaves (frozen
    matrices kept block-quantized): the step is traced for their float values
    and each is dequantized right before each use (:mod:`pockjax.quant`).

    Example:
        >>> import jax, jax.numpy as jnp, optax, pockjax
        >>> tx = optax.adam(1e-2)
        >>> scheme = pockjax.UpdateScheme({"out.*": "full"})
        >>> @pockjax.compile(scheme=scheme)
        ... def step(params, opt_state, x, y):
        ...     def loss_fn(p):
        ...         h = jnp.tanh(x @ p["hidden"]["w"])
        ...         return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - y) ** 2)
        ...     loss, grads = jax.value_and_grad(loss_fn)(params)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, loss
        >>> k1, k2 = jax.random.split(jax.random.key(0))
        >>> params = {"hidden": {"w": jax.random.normal(k1, (3, 8))},
        ...           "out": {"w": jax.random.normal(k2, (8, 1)), "b": jnp.zeros(1)}}
        >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
        >>> hidden_before = params["hidden"]["w"]
        >>> params, opt_state, loss = step(params, tx.init(params), x, y)
        >>> bool((params["hidden"]["w"] == hidden_before).all())  # frozen: bitwise unchanged
        True
        >>> summary = step.summary(params, opt_state, x, y)
        >>> summary.flops_after < summary.flops_before
        True
    """

    def wrap(fn):
        if target is not None:
            from pockjax.backends.iree import targets as _targets

            if target not in _targets.names():
                raise BackendError(f"unknown target {target!r}; available: {sorted(_targets.names())}")
        if xla_options is not None and target is not None:
            raise BackendError("xla_options apply to the in-process XLA step; IREE targets take target_options")
        from pockjax.transforms.precision import compute_dtype

        options = xla_options
        if compute_dtype(precision) is not None and target is None:
            # XLA's CPU YNNPACK fusions hand some bfloat16 x bfloat16 -> float32
            # products to a kernel that has none ("Unsupported element type for
            # DotThunk"); XLA's own kernels run them (dropped off the CPU platform)
            from pockjax.backends.xla import XLA_OWN_DOT_KERNELS

            options = {**XLA_OWN_DOT_KERNELS, **(xla_options or {})}
        return CompiledFunction(fn, scheme, passes, target, target_options, donate, options, precision)

    if step is None:
        return wrap
    return wrap(step)
