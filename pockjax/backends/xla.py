"""The in-process XLA backend: ``jax.jit`` of the transformed step, state donated.

:func:`pockjax.compile` without ``target=`` builds an :class:`XlaExecutable`
from the rewritten :class:`~pockjax.graph.TrainGraph`. Calls go through
``jax.jit``'s C++ dispatch; a call with arguments of another signature makes
the jit retrace, which raises :class:`SignatureChanged` so that the caller
compiles (or finds) the step for that signature instead.
"""

from __future__ import annotations

import math
from typing import Callable, TYPE_CHECKING, Sequence

import jax

from pockjax import _compat as C
from pockjax.errors import BackendError

if TYPE_CHECKING:
    from pockjax.graph import TrainGraph

__all__ = ["SignatureChanged", "XlaExecutable", "xla_compile_options"]


#: XLA compiler options that turn off XLA's YNNPACK fusions on CPU: every dot
#: runs on XLA's own kernels (applied on the CPU platform only).
XLA_OWN_DOT_KERNELS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def xla_compile_options(platform: str, xla_options: dict | None = None) -> dict:
    """The XLA compiler options that apply to a step compiled on ``platform``.

    ``xla_cpu_*`` options are dropped off the CPU platform (so one options dict
    serves CPU and GPU runs), and so are options whose value is ``None``.

    Example:
      >>> opts = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_gpu_autotune_level": None}
      >>> xla_compile_options("cpu", opts)
      {'xla_cpu_experimental_ynn_fusion_type': ''}
      >>> xla_compile_options("gpu", opts)
      {}
    """
    return {
        key: value
        for key, value in (xla_options or {}).items()
        if value is not None and (platform == "cpu" or not key.startswith("xla_cpu_"))
    }


def _mesh_key(sharding) -> tuple:
    """The axis sizes of the mesh a sharding (or a traced type's sharding) spans; () for one device.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> _mesh_key(None), _mesh_key(NamedSharding(Mesh(np.array(jax.devices()[:1]), ("d",)), P()))
      ((), ())
    """
    mesh = getattr(sharding, "mesh", None)
    sizes = tuple(dict(mesh.shape).items()) if mesh is not None else ()
    return sizes if math.prod(n for _, n in sizes) > 1 else ()


class SignatureChanged(Exception):
    """Raised while jax.jit retraces an XLA step for arguments of another signature."""


def _placed_as(call: Callable, shardings: Sequence, flat: bool) -> Callable:
    """``call`` (a sharded step's ``jax.jit``), refusing inputs placed otherwise than it was
    compiled for with :class:`SignatureChanged`, so that the caller compiles the step for them.

    A traced type carries only the mesh's axis sizes: without this check ``jax.jit`` reuses the
    trace for another partition spec or other devices of the same mesh shape, and its fixed
    ``out_shardings`` gave every later call the first call's placement (FSDP state came back
    replicated). Arguments on other devices than ``in_shardings`` name are not even safe to
    pass to that ``jax.jit`` (moved once, a crash the next time), so they never reach it.
    """
    expected = [(i, s) for i, s in enumerate(shardings) if s is not None]

    def placed(*args):
        leaves = args if flat else jax.tree_util.tree_leaves(args)
        if len(leaves) != len(shardings):
            raise SignatureChanged()
        for i, s in expected:
            got = getattr(leaves[i], "sharding", None)
            if got is not s and got != s:
                raise SignatureChanged()
        return call(*args)

    return placed


def _donated_args(in_tree, donate: Sequence[int]) -> tuple[int, ...] | None:
    """The whole arguments whose leaves are exactly the donated flat inputs, or None.

    A step whose donated leaves are whole arguments (``params`` and
    ``opt_state``, an NNX state list) can be called as ``jax.jit`` is, with
    the argument trees as they are; any other pattern keeps the flat call.

    Example:
      >>> import jax
      >>> tree = jax.tree.structure(({"a": 0, "b": 0}, [0], 0))
      >>> _donated_args(tree, [0, 1, 2]), _donated_args(tree, []), _donated_args(tree, [0])
      ((0, 1), (), None)
    """
    if in_tree is None or in_tree.num_nodes == 1:
        return None
    want, args, start = set(donate), [], 0
    for i, child in enumerate(in_tree.children()):
        leaves = set(range(start, start + child.num_leaves))
        start += child.num_leaves
        if leaves and leaves <= want:
            args.append(i)
            want -= leaves
    return tuple(args) if not want else None


class XlaExecutable:
    """The XLA backend: ``jax.jit`` of the transformed jaxpr, state donated.

    When the donated inputs are whole arguments and every input that a graph
    output forwards unchanged is donated too (it then comes back aliased, not
    copied), the step is a ``jax.jit`` over the argument trees themselves
    (:attr:`tree_call`): flattening the arguments and building the output
    trees then happen in jit's C++ dispatch, and a call costs what a call of
    the user's own ``jax.jit`` costs. Otherwise it is a ``jax.jit`` over the
    flat inputs that computes only the outputs that forward nothing.

    Args:
      graph: the rewritten step.
      computed_outputs: indices of the graph outputs the executable computes
        (the others forward an input unchanged and are not returned).
      donate: flat input indices whose buffers the step may reuse.
      in_shardings: per flat input its sharding (None: one device), or None
        for a step on one device. The program is compiled for these shardings
        by XLA's SPMD partitioner, and each new state leaf comes back with the
        sharding of the input it replaces.
      alias: forwarded flat inputs the tree call may donate as well, so that
        the whole argument they belong to is donated, as ``jax.jit`` with
        ``donate_argnums`` does (optimizer and model state, never parameters:
        a frozen parameter stays valid after the step).
      xla_options: XLA compiler options (see :func:`xla_compile_options`).
      in_tree: the argument trees' structure (for :attr:`tree_call`).
      out_builder: flat outputs -> the output trees (for :attr:`tree_call`).
    """

    name = "xla"

    def __init__(self, graph: "TrainGraph", computed_outputs: Sequence[int], donate: Sequence[int],
                 xla_options: dict | None = None, *, in_tree=None, out_builder=None,
                 alias: Sequence[int] = (), in_shardings: Sequence | None = None):
        closed = graph.closed_jaxpr
        inner = closed.jaxpr.replace(outvars=[closed.jaxpr.outvars[o] for o in computed_outputs])
        C.check_jaxpr(inner)
        run = C.jaxpr_as_fun(C.ClosedJaxpr(inner, closed.consts))
        shardings = list(in_shardings) if in_shardings is not None else [None] * len(graph.in_avals)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
                 for a, s in zip(graph.in_avals, shardings)]
        # new state keeps its input's sharding (an FSDP step stays sharded); the rest XLA chooses
        out_shardings = None
        if in_shardings is not None:
            out_shardings = [shardings[i] if i is not None else None for i in graph.out_to_in]
        expected = [(tuple(a.shape), a.dtype, _mesh_key(s)) for a, s in zip(avals, shardings)]

        def checked(args):
            # traced once per signature: the graph is valid for this one only
            # (a weak type changes nothing in an already typed jaxpr)
            # the mesh an input lives on is in its traced type: a step compiled
            # for one device retraced for sharded inputs (or the reverse) is
            # another signature, compiled for those shardings by the caller
            got = [(tuple(x.aval.shape), x.aval.dtype, _mesh_key(getattr(x.aval, "sharding", None))) for x in args]
            if got != expected:
                raise SignatureChanged()
            return run(*args)

        def fun(*args):
            return checked(args)

        self.options = xla_compile_options(jax.default_backend(), xla_options)
        compiler_options = self.options or None
        # Calls go through jax.jit's C++ dispatch (the same per-call cost as the
        # user's own jax.jit); the ahead-of-time compile below fills its
        # compilation cache and serves cost and memory analysis.
        jit_options = {"compiler_options": compiler_options}
        if out_shardings is not None:
            jit_options["out_shardings"] = [out_shardings[o] for o in computed_outputs]
        jitted = jax.jit(fun, donate_argnums=tuple(donate), **jit_options)
        self.jitted = jitted if in_shardings is None else _placed_as(jitted, shardings, flat=True)
        self.in_tree = in_tree
        #: ``tree_call(*args)``: the step over the argument trees (None: flat calls only).
        self.tree_call = None
        self.computed_outputs = tuple(computed_outputs)
        sources = graph.out_sources
        forwarded = {src for src in sources if src is not None}
        tree_donate = sorted(set(donate) | (set(alias) & forwarded))
        donated_args = _donated_args(in_tree, tree_donate)
        if out_builder is not None and donated_args is not None and forwarded <= set(tree_donate):
            def tree_fun(*args):
                flat, tree = jax.tree_util.tree_flatten(args)
                if tree != in_tree:
                    raise SignatureChanged()
                it = iter(checked(flat))
                return out_builder([flat[src] if src is not None else next(it) for src in sources])

            tree_options = {"compiler_options": compiler_options}
            if out_shardings is not None:
                tree_options["out_shardings"] = out_builder(out_shardings)
            tree_jit = jax.jit(tree_fun, donate_argnums=donated_args, **tree_options)
            self.tree_call = tree_jit if in_shardings is None else _placed_as(tree_jit, shardings, flat=False)
            lowered = tree_jit.lower(*jax.tree_util.tree_unflatten(in_tree, avals))
        else:
            lowered = jitted.lower(*avals)
        try:
            self.compiled = lowered.compile()
        except Exception as e:  # pragma: no cover - XLA failure reporting
            bad = [k for k in self.options if k in str(e)]
            if bad:
                raise BackendError(
                    f"XLA rejected compiler option(s) {bad}: {e}. Drop them with"
                    f" pockjax.compile(..., xla_options={{{bad[0]!r}: None}})"
                ) from e
            raise BackendError(f"XLA failed to compile the transformed step: {e}") from e

    def __call__(self, *flat_args):
        """The computed outputs (those that forward no input) for flat inputs.

        A tree-call step donates the inputs its outputs forward: call
        :meth:`call_all` for every output instead of reusing those inputs.
        """
        if self.tree_call is not None:
            leaves = self.call_all(flat_args)
            return [leaves[o] for o in self.computed_outputs]
        return self.jitted(*flat_args)

    def call_all(self, flat_args: Sequence) -> list:
        """Every graph output for flat inputs, through :attr:`tree_call` (which must be set)."""
        out = self.tree_call(*jax.tree_util.tree_unflatten(self.in_tree, flat_args))
        return jax.tree_util.tree_leaves(out)
