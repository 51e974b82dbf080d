"""Dotted parameter paths (``layers.3.attn.wq.kernel``) for pytrees.

Every part of pockjax names a leaf by its dotted path: schemes match on it,
reports print it, exported metadata records it. This module is the one place
that turns JAX key paths into those strings.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

# nnx.Variable flattens to its value under this attribute name; the attribute
# is an implementation detail, not part of the parameter's name.
_VARIABLE_VALUE_ATTRS = ("value", "raw_value")


def key_to_str(key: Any) -> str:
    """One key-path entry as a path component."""
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, GetAttrKey):
        return str(key.name)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(getattr(key, "key", getattr(key, "name", key))).strip(".[]'\"")


def keypath_to_parts(keypath: Sequence[Any]) -> tuple[str, ...]:
    """Path components of a JAX key path, without nnx's ``.value`` attribute."""
    # the value may itself be a pytree (a LoRA tensor's base and adapters):
    # ``kernel.value.lora_a`` is named ``kernel.lora_a``
    return tuple(key_to_str(k) for k in keypath
                 if not (isinstance(k, GetAttrKey) and k.name in _VARIABLE_VALUE_ATTRS))


def leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of ``tree``, in ``jax.tree.leaves`` order.

    Example:
        >>> import numpy as np
        >>> leaf_paths({"layers": [{"w": np.zeros(2)}, {"w": np.zeros(2)}], "b": np.zeros(1)})
        ['b', 'layers.0.w', 'layers.1.w']
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    out = []
    for keypath, _leaf in flat:
        path = ".".join(keypath_to_parts(keypath))
        out.append(f"{prefix}.{path}" if prefix and path else (prefix or path))
    return out


def flatten_params(params: dict) -> dict[str, Any]:
    """A nested dict of parameters as ``{dotted path: leaf}`` (the models' checkpoint naming).

    Example:
        >>> flatten_params({"layers": {0: {"attn": {"q": {"bias": 1}}}}})
        {'layers.0.attn.q.bias': 1}
    """
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = node

    walk("", params)
    return flat


def unflatten_params(flat: dict[str, Any]) -> dict:
    """Inverse of :func:`flatten_params` (digit path parts become int keys).

    Example:
        >>> unflatten_params({"layers.0.mlp.up.bias": 1})
        {'layers': {0: {'mlp': {'up': {'bias': 1}}}}}
    """
    out: dict = {}
    for path, value in flat.items():
        node = out
        parts = [int(p) if p.isdigit() else p for p in path.split(".")]
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out
