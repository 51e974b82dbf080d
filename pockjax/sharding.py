"""Placing a train step's arrays on a device mesh: data parallel, FSDP, tensor parallel.

A compiled step honours the shardings of its inputs as ``jax.jit`` does: the
passes rewrite the whole step first, then XLA's SPMD partitioner splits the
rewritten program over the mesh and inserts the collectives. A frozen tensor
has no gradient in the rewritten step, so it is neither computed nor
all-reduced; optimizer state exists only for what the scheme trains. The new
parameters and optimizer state come back with the shardings they came in
with, so an FSDP step stays sharded from one call to the next.

This module places the arrays. Rules map the same dotted-path globs an
:class:`~pockjax.UpdateScheme` uses to a ``PartitionSpec``; the first rule
that matches a leaf wins. ``fsdp=`` shards every leaf no rule matched along
one mesh axis (its largest dimension that the axis divides), and
:func:`shard_like` gives the optimizer state the layout of the parameters
it mirrors.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np
  >>> from jax.sharding import Mesh, PartitionSpec as P
  >>> mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  >>> params = {"dense": {"kernel": jnp.ones((4, 2)), "bias": jnp.zeros(2)}}
  >>> placed = shard(params, mesh, {"dense.kernel": P(None, "data")})
  >>> placed["dense"]["kernel"].sharding.spec
  P(None, 'data')
  >>> placed["dense"]["bias"].sharding.spec  # no rule: replicated
  P()
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pockjax.errors import PockjaxError
from pockjax.paths import leaf_paths
from pockjax.scheme import glob_match

__all__ = ["ShardingError", "batch_axes", "make_mesh", "parse_mesh", "partition_specs", "request_host_devices",
           "shard", "shard_batch", "shard_like", "shard_train_state", "training_mesh_axes"]

#: Mesh axes that split the model's tensors, never the batch.
MODEL_AXES = ("model",)


class ShardingError(PockjaxError, ValueError):
    """A sharding rule that cannot apply to the leaf it names."""


def parse_mesh(spec: str) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (the ``--mesh`` syntax).

    Raises:
      ShardingError: a malformed entry, a repeated axis or a size below 1.

    Example:
      >>> parse_mesh("data=2,fsdp=4")
      {'data': 2, 'fsdp': 4}
    """
    axes: dict[str, int] = {}
    for entry in (e.strip() for e in spec.split(",")):
        name, eq, size = entry.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier() or not size.strip().isdigit() or int(size) < 1:
            raise ShardingError(
                f"mesh {spec!r}: {entry!r} is not AXIS=SIZE with a positive size (e.g. --mesh data=2,fsdp=4)"
            )
        if name in axes:
            raise ShardingError(f"mesh {spec!r}: axis {name!r} appears twice")
        axes[name] = int(size)
    return axes


def training_mesh_axes(spec: str) -> dict[str, int]:
    """:func:`parse_mesh` of a ``--mesh`` that ``pockjax finetune`` and ``pockjax plan`` shard a
    LLaMA step over: only the ``data`` and ``fsdp`` axes (another name would be split
    as a batch axis without a word, a ``model`` axis replicated rather than split).

    Raises:
      ShardingError: a malformed mesh, or an axis other than ``data`` and ``fsdp``.

    Example:
      >>> training_mesh_axes("data=2,fsdp=4")
      {'data': 2, 'fsdp': 4}
      >>> training_mesh_axes("foo=2")
      Traceback (most recent call last):
      ...
      pockjax.sharding.ShardingError: --mesh foo=2: a fine-tuning mesh knows the axes data and fsdp, not foo
    """
    axes = parse_mesh(spec)
    unknown = [a for a in axes if a not in ("data", "fsdp")]
    if unknown:
        hint = " (tensor parallel: use pockjax.shard rules)" if set(unknown) & set(MODEL_AXES) else ""
        raise ShardingError(f"--mesh {spec}: a fine-tuning mesh knows the axes data and fsdp, not"
                            f" {', '.join(unknown)}{hint}")
    return axes


def make_mesh(spec: str | Mapping[str, int], devices: Any = None) -> Mesh:
    """A device mesh from ``"data=2,fsdp=4"`` (or a dict) over the first devices.

    Raises:
      ShardingError: the mesh needs more devices than there are; the message
        says how to get more host devices on a CPU.

    Example:
      >>> import jax
      >>> dict(make_mesh("data=1").shape)
      {'data': 1}
    """
    axes = parse_mesh(spec) if isinstance(spec, str) else dict(spec)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(axes.values())
    if need > len(devices):
        raise ShardingError(
            f"the mesh {axes} needs {need} devices; this process has {len(devices)} ({devices[0].platform})."
            f" On a CPU, start it with XLA_FLAGS=--xla_force_host_platform_device_count={need}"
            " (pockjax finetune --mesh/--devices sets this itself)"
        )
    return Mesh(np.array(devices[:need]).reshape(tuple(axes.values())), tuple(axes))


def request_host_devices(mesh: str) -> bool:
    """Split the CPU into as many JAX devices as ``mesh`` needs; call it before JAX starts.

    Sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` unless the
    flag is already there; only the CPU platform reads it, so on a GPU host the
    mesh uses the GPUs (and :func:`make_mesh` refuses a mesh larger than their
    count by name). A malformed ``mesh`` is left for :func:`make_mesh` to report.
    Returns whether the flag was set.
    """
    import os

    try:
        need = math.prod(parse_mesh(mesh).values())
    except ShardingError:
        return False
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return False
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={need}".strip()
    return True


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch's leading dimension is split over: all but the model axes.

    Data parallel and FSDP both split the batch; a ``"model"`` (tensor
    parallel) axis does not.

    Example:
      >>> import jax
      >>> batch_axes(make_mesh("data=1,model=1"))
      ('data',)
    """
    return tuple(a for a in mesh.axis_names if a not in MODEL_AXES)


def _place(leaf: Any, sharding: NamedSharding) -> Any:
    """``leaf`` on ``sharding``: an array is moved there, a ``jax.ShapeDtypeStruct`` annotated with it.

    Abstract leaves let a partitioned step be compiled and measured
    (``memory_analysis()``) without allocating it.
    """
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type)
    return jax.device_put(leaf, sharding)


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry splits a dimension over."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _parts(entry, mesh: Mesh) -> int:
    """How many pieces one ``PartitionSpec`` entry splits a dimension into."""
    return math.prod(mesh.shape[a] for a in _axes(entry))


def _fsdp_spec(shape: tuple[int, ...], axis: str, size: int) -> PartitionSpec:
    """The leaf's largest dimension that ``size`` divides, sharded along ``axis``; else replicated."""
    dims = sorted((d for d in range(len(shape)) if shape[d] % size == 0 and shape[d] >= size),
                  key=lambda d: (-shape[d], d))
    if not dims:
        return PartitionSpec()
    spec = [None] * len(shape)
    spec[dims[0]] = axis
    return PartitionSpec(*spec)


def partition_specs(tree: Any, mesh: Mesh, rules: Mapping[str, PartitionSpec] | None = None, *,
                    fsdp: str | None = None) -> Any:
    """The ``PartitionSpec`` of every leaf of ``tree``: a tree of the same structure.

    Args:
      tree: parameters (or a batch) whose leaves have ``.shape``.
      mesh: the device mesh the specs refer to.
      rules: ``{glob: PartitionSpec}`` over the leaves' dotted paths, first match
        wins (``"layers.*.attn.w[qkv].kernel": P(None, "model")``).
      fsdp: a mesh axis to shard every leaf no rule matched along (its largest
        dimension the axis size divides; leaves with none stay replicated).

    Raises:
      ShardingError: a rule names a mesh axis the mesh lacks, has more entries
        than the leaf has dimensions, or splits a dimension the axes do not divide.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:1]), ("fsdp",))
      >>> partition_specs({"w": jnp.ones((3, 8)), "b": jnp.ones(())}, mesh, fsdp="fsdp")
      {'b': P(), 'w': P(None, 'fsdp')}
    """
    rules = dict(rules or {})
    for axis in [fsdp] if fsdp is not None else []:
        if axis not in mesh.shape:
            raise ShardingError(f"fsdp axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    specs = []
    for path, leaf in zip(leaf_paths(tree), leaves):
        shape = tuple(np.shape(leaf))
        rule = next((pattern for pattern in rules if glob_match(pattern, path)), None)
        if rule is None:
            specs.append(_fsdp_spec(shape, fsdp, mesh.shape[fsdp]) if fsdp is not None else PartitionSpec())
            continue
        spec = rules[rule]
        if not isinstance(spec, PartitionSpec):
            raise ShardingError(f"sharding rule {rule!r}: {spec!r} is not a jax.sharding.PartitionSpec")
        if len(spec) > len(shape):
            raise ShardingError(
                f"sharding rule {rule!r} gives {path} (shape {shape}) the spec {spec} with {len(spec)} entries;"
                f" the leaf has {len(shape)} dimension(s)"
            )
        for dim, entry in enumerate(spec):
            for axis in _axes(entry):
                if axis not in mesh.shape:
                    raise ShardingError(
                        f"sharding rule {rule!r} names mesh axis {axis!r}; the mesh has {dict(mesh.shape)}"
                    )
            parts = _parts(entry, mesh)
            if shape[dim] % parts:
                raise ShardingError(
                    f"sharding rule {rule!r} splits dimension {dim} of {path} (shape {shape}) {parts} ways;"
                    f" {shape[dim]} is not divisible by {parts}: change the rule or the mesh"
                )
        specs.append(spec)
    return jax.tree_util.tree_unflatten(treedef, specs)


def shard(tree: Any, mesh: Mesh, rules: Mapping[str, PartitionSpec] | None = None, *,
          fsdp: str | None = None) -> Any:
    """``tree`` placed on ``mesh`` by :func:`partition_specs` (``jax.device_put``).

    ``jax.ShapeDtypeStruct`` leaves come back annotated with their sharding
    instead (nothing is allocated): ``pockjax.compile(step).lower(*placed)``
    then compiles the partitioned step for its memory analysis.

    Data parallel: parameters with no rules (replicated) and the batch with
    ``{"**": P("data")}``. FSDP: parameters with ``fsdp="fsdp"``. Tensor
    parallel: rules per weight. Then :func:`shard_like` for the optimizer state.
    """
    specs = partition_specs(tree, mesh, rules, fsdp=fsdp)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    placed = [_place(leaf, NamedSharding(mesh, spec)) for leaf, spec in zip(leaves, treedef.flatten_up_to(specs))]
    return jax.tree_util.tree_unflatten(treedef, placed)


def _fits(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> bool:
    """Whether ``spec`` splits ``shape`` evenly over ``mesh``."""
    return len(spec) <= len(shape) and all(shape[d] % _parts(entry, mesh) == 0 for d, entry in enumerate(spec))


def shard_like(state: Any, params: Any) -> Any:
    """Optimizer state placed as the parameters it mirrors.

    A state leaf that mirrors a parameter (Adam's ``mu``/``nu``, momentum: the
    same rule :func:`pockjax.graph.optstate_param_map` applies everywhere)
    gets the parameter's ``PartitionSpec``; every other leaf (step counts,
    scalars) is replicated on the parameters' mesh. A
    :class:`~pockjax.SparseOptState` keeps its form: each kept leaf follows its
    parameter, and a channel-sliced leaf keeps the spec where the trained
    channels still divide evenly (else it is replicated: it is small).
    ``params`` must already be placed (see :func:`shard`).

    Raises:
      ShardingError: the parameters are not placed on one mesh.
    """
    from pockjax.graph import optstate_param_map
    from pockjax.optim.state import SparseOptState

    param_leaves = jax.tree.leaves(params)
    meshes = {getattr(getattr(x, "sharding", None), "mesh", None) for x in param_leaves}
    if len(meshes) != 1 or None in meshes:
        raise ShardingError(
            "shard_like needs parameters placed on one mesh (NamedSharding): place them with pockjax.shard first"
        )
    mesh = meshes.pop()
    param_paths, param_shapes = leaf_paths(params), [np.shape(x) for x in param_leaves]
    if isinstance(state, SparseOptState):
        layout = state.layout
        full = jax.tree_util.tree_unflatten(layout.full_treedef, list(layout.full_avals))
        mapping = optstate_param_map(leaf_paths(full), [a.shape for a in layout.full_avals], param_paths, param_shapes)
        mapping = [m for m, mode in zip(mapping, layout.modes) if mode != "drop"]
        leaves = list(state.leaves)
    else:
        leaves, treedef = jax.tree_util.tree_flatten(state)
        mapping = optstate_param_map(leaf_paths(state), [np.shape(x) for x in leaves], param_paths, param_shapes)
    placed = []
    for leaf, m in zip(leaves, mapping):
        spec = param_leaves[m].sharding.spec if m is not None else PartitionSpec()
        if not _fits(spec, tuple(np.shape(leaf)), mesh):
            spec = PartitionSpec()
        placed.append(_place(leaf, NamedSharding(mesh, spec)))
    if isinstance(state, SparseOptState):
        return SparseOptState(placed, state.layout)
    return jax.tree_util.tree_unflatten(treedef, placed)


def shard_train_state(params: Any, opt_state: Any, mesh: Mesh) -> tuple[Any, Any]:
    """Parameters and optimizer state placed for ``mesh``, the way ``pockjax finetune --mesh`` places them.

    Split over the mesh's ``"fsdp"`` axis if it has one (FSDP, :func:`shard`
    with ``fsdp="fsdp"``), else replicated (data parallel); the optimizer
    state follows its parameters (:func:`shard_like`).
    """
    params = shard(params, mesh, fsdp="fsdp" if "fsdp" in mesh.shape else None)
    return params, shard_like(opt_state, params)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """A batch split along its leading dimension over the mesh's :func:`batch_axes`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> shard_batch({"tokens": jnp.zeros((4, 8))}, make_mesh("data=1"))["tokens"].sharding.spec
      P('data',)
    """
    return shard(batch, mesh, {"**": PartitionSpec(batch_axes(mesh))})
