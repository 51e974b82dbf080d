"""Optimizer state for trainable entries only.

``tx.init(params)`` allocates state (Adam's ``mu`` and ``nu``...) for every
parameter. Under a sparse scheme most of it is never read:
:func:`init_opt_state` keeps state only for trained parameters, and only the
trained channels of channel-ruled ones. A step compiled by
:func:`pockjax.compile` accepts the result in place of ``tx.init(params)`` and
returns it updated in the same form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pockjax import quant
from pockjax.errors import SchemeError, UnmatchedPatternError
from pockjax.graph import optstate_param_map
from pockjax.paths import leaf_paths
from pockjax.scheme import ChannelSelect, Frozen, UpdateScheme
from pockjax.transforms import slicing


@dataclasses.dataclass(frozen=True)
class SparseLayout:
    """How a full optimizer state maps onto its sparse form (static data)."""

    full_treedef: Any
    full_avals: tuple  # ShapeDtypeStruct per full leaf
    modes: tuple  # per full leaf: None (kept whole), "drop", or ChannelSelect
    scheme: UpdateScheme

    def __hash__(self):
        return hash((self.full_treedef, tuple((a.shape, str(a.dtype)) for a in self.full_avals), self.modes))

    def __eq__(self, other):
        return isinstance(other, SparseLayout) and hash(self) == hash(other) and self.scheme == other.scheme


@jax.tree_util.register_pytree_node_class
class SparseOptState:
    """Optimizer state holding only the trainable entries (a pytree).

    Its leaves are the kept leaves of the full state, in order; the frozen
    parameters' state is absent and channel-ruled state is sliced.
    """

    def __init__(self, leaves, layout: SparseLayout):
        self.leaves = list(leaves)
        self.layout = layout

    def tree_flatten(self):
        return self.leaves, self.layout

    @classmethod
    def tree_unflatten(cls, layout, leaves):
        return cls(leaves, layout)

    @property
    def nbytes(self) -> int:
        return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in self.leaves))

    def full_abstract(self):
        """The full state's structure with ``ShapeDtypeStruct`` leaves."""
        return jax.tree_util.tree_unflatten(self.layout.full_treedef, list(self.layout.full_avals))

    def __repr__(self) -> str:
        kept = sum(1 for m in self.layout.modes if m != "drop")
        return f"SparseOptState({kept}/{len(self.layout.modes)} leaves, {self.nbytes} bytes)"


def init_opt_state(tx, params, scheme: UpdateScheme, *, prefix: str = "") -> SparseOptState:
    """``tx.init(params)`` restricted to what ``scheme`` trains.

    ``prefix``: where ``params`` sit in the step's first argument, when the
    scheme names them from there. A Flax Linen step that takes the whole
    ``variables`` dict names its parameters ``params.dense.kernel`` while the
    optimizer updates ``variables["params"]``:
    ``init_opt_state(tx, variables["params"], scheme, prefix="params")``.

    Example:
        >>> import jax.numpy as jnp, optax, pockjax
        >>> params = {"a": jnp.ones((4, 8)), "b": jnp.ones((8, 2))}
        >>> scheme = pockjax.UpdateScheme({"a": pockjax.channels(2), "b": "frozen"})
        >>> state = pockjax.init_opt_state(optax.adam(1e-3), params, scheme)
        >>> [x.shape for x in state.leaves]  # count, mu["a"][:, :2], nu["a"][:, :2]
        [(), (4, 2), (4, 2)]
    """
    # a quantized (frozen) tensor stands for its float value: its state is
    # dropped, so the state is laid out for that value and never allocated
    params = quant.abstract(params)
    full = jax.eval_shape(tx.init, params)
    full_leaves, full_def = jax.tree_util.tree_flatten(full)
    param_leaves = jax.tree.leaves(params)
    param_paths = leaf_paths(params)
    try:
        rules = scheme.resolve([f"{prefix}.{p}" if prefix else p for p in param_paths],
                               [np.shape(p) for p in param_leaves])
    except UnmatchedPatternError as e:
        lead = {str(pattern).split(".", 1)[0] for pattern, _ in scheme.rules if "." in str(pattern)}
        if prefix or lead != {"params"}:
            raise
        # a Linen variables-dict step's scheme, given variables["params"]
        raise UnmatchedPatternError(
            f"{e}\nThe scheme names params.… paths, as for a step that takes a Linen variables dict:"
            " pass those parameters with their place in it, pockjax.init_opt_state(tx, variables['params'],"
            " scheme, prefix='params').") from None
    for path, p, rule in zip(param_paths, param_leaves, rules):
        if isinstance(p, jax.ShapeDtypeStruct) and not isinstance(rule, Frozen):
            raise quant.QuantizationError(
                f"{path} is quantized, but the scheme trains it ({rule}): a quantized tensor cannot be"
                " trained. Freeze it in the scheme ('frozen'), or load it unquantized to train it")
    mapping = optstate_param_map(
        leaf_paths(full), [x.shape for x in full_leaves], param_paths, [np.shape(p) for p in param_leaves]
    )
    modes = []
    for m in mapping:
        rule = rules[m] if m is not None else None
        if isinstance(rule, Frozen):
            modes.append("drop")
        elif isinstance(rule, ChannelSelect):
            modes.append(rule)
        else:
            modes.append(None)
    layout = SparseLayout(full_def, tuple(full_leaves), tuple(modes), scheme)

    # Optax initialises elementwise state from the parameters' shapes only, so
    # initialising from the sliced parameters gives the sliced state.
    def sliced_params():
        out = []
        for p, r in zip(param_leaves, rules):
            out.append(slicing.take(r, p) if isinstance(r, ChannelSelect) else p)
        return jax.tree_util.tree_unflatten(jax.tree.structure(params), out)

    # Under jit, the state of frozen parameters is dead code: never allocated
    # (nor are the zeros standing in for quantized ones).
    sliced = sliced_params()
    sliced_leaves, sliced_def = jax.tree.flatten(sliced)
    abstract_at = [isinstance(p, jax.ShapeDtypeStruct) for p in sliced_leaves]

    def kept_state(concrete):
        it = iter(concrete)
        leaves = [jax.numpy.zeros(p.shape, p.dtype) if a else next(it) for p, a in zip(sliced_leaves, abstract_at)]
        state = jax.tree.leaves(tx.init(jax.tree_util.tree_unflatten(sliced_def, leaves)))
        return [x for x, mode in zip(state, modes) if mode != "drop"]

    kept = jax.jit(kept_state)([p for p, a in zip(sliced_leaves, abstract_at) if not a])
    state_paths = leaf_paths(full)
    kept_at = [k for k, m in enumerate(modes) if m != "drop"]
    for value, k in zip(kept, kept_at):
        mode, aval = modes[k], full_leaves[k]
        expected = slicing.sliced_shape(mode, aval.shape) if isinstance(mode, ChannelSelect) else aval.shape
        if tuple(np.shape(value)) != tuple(expected):
            owner = (f" (the state of {param_paths[mapping[k]]!r}, ruled {rules[mapping[k]]})"
                     if mapping[k] is not None else "")
            raise SchemeError(
                f"optimizer state {state_paths[k]!r}{owner} comes out of tx.init with shape"
                f" {tuple(np.shape(value))} once the channels rules slice the parameters, where the scheme's layout needs"
                f" {tuple(expected)}: this optimizer's state is not elementwise in the parameters (a factored"
                " second moment, as optax.adafactor keeps), so it cannot be kept channel by channel. Initialise"
                " the full state with tx.init(params), or train that parameter in full"
            )
    return SparseOptState(kept, layout)


def to_full(state: SparseOptState, reference_full=None):
    """Expand a sparse state to the full optimizer state.

    Frozen entries take their values from ``reference_full`` (default: zeros),
    which is what ``tx.init`` gives for most optimizers.
    """
    full_avals = state.layout.full_avals
    ref = jax.tree.leaves(reference_full) if reference_full is not None else [np.zeros(a.shape, a.dtype) for a in full_avals]
    it = iter(state.leaves)
    out = []
    for mode, base in zip(state.layout.modes, ref):
        if mode == "drop":
            out.append(base)
        elif isinstance(mode, ChannelSelect):
            out.append(slicing.put(mode, jax.numpy.asarray(base), next(it)))
        else:
            out.append(next(it))
    return jax.tree_util.tree_unflatten(state.layout.full_treedef, out)
