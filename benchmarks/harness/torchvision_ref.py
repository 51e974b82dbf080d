"""torchvision's MobileNetV2 as a reference, imported from outside the virtual environment.

torchvision (0.28.0) is not installed into the venv: the registry's wheel is
built against CUDA torch, so its compiled ops library fails to load against
the venv's CPU torch, and ``import torchvision`` then raises ``operator
torchvision::nms does not exist`` -- which also breaks every ``transformers``
import that probes for torchvision. ``make setup`` therefore installs it with
``pip install --target .venv/torchvision-ref``, and :func:`import_torchvision`
imports it from there after defining the schemas of torchvision's operators
(``nms``, ``roi_align``, ...) itself, so that the Python side of torchvision
loads; the operators have no kernels, which the classification models never
need.

Because that leaves a torchvision in ``sys.modules`` whose operators cannot
run, use it only in a process of its own, never in one that imports
``transformers``: the tests run this module as a script::

    python -m benchmarks.harness.torchvision_ref --inputs x.npy --out ref.npz

which writes torchvision's ``mobilenet_v2`` eval-mode logits for the NCHW
float32 images of ``x.npy`` (key ``eval_logits``) and, after one train-mode
forward pass of a copy on the same images, the BatchNorm running statistics
(``running_mean/<torch name>``, ``running_var/<torch name>``) and that pass's
logits with dropout off (``train_logits``).

Example:
    >>> TORCHVISION_SCHEMAS[0]
    'nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor'
    >>> torchvision_ref_dir().endswith("torchvision-ref")
    True
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pockjax.errors import FileMissingError, PockjaxError

__all__ = ["TORCHVISION_SCHEMAS", "import_torchvision", "reference_outputs", "torchvision_ref_dir"]

#: The operator schemas torchvision's C++ library would register (torchvision 0.28).
TORCHVISION_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size,"
    " SymInt channels, SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels,"
    " SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels,"
    " SymInt height, SymInt width) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias,"
    " SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h,"
    " SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset,"
    " Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w,"
    " SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups,"
    " bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_HINT = "run `make setup` (it installs torchvision with pip install --target .venv/torchvision-ref)"

# the Library that holds the schemas: they are dropped when it is garbage collected
_LIBRARY: Any = None


class TorchvisionRefError(PockjaxError, RuntimeError):
    """torchvision could not be imported from its folder outside the venv."""


def torchvision_ref_dir() -> str:
    """``<venv>/torchvision-ref``, where ``make setup`` installs torchvision (``sys.prefix``)."""
    return os.path.join(sys.prefix, "torchvision-ref")


def import_torchvision():
    """Imports torchvision from :func:`torchvision_ref_dir`, its operator schemas defined first.

    Run it only in a process that never imports ``transformers`` (see the
    module doc). Returns the ``torchvision`` module.

    Raises:
      FileMissingError: the folder is missing (run ``make setup``).
      TorchvisionRefError: torchvision failed to import from it.
    """
    global _LIBRARY
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    folder = torchvision_ref_dir()
    if not os.path.isdir(os.path.join(folder, "torchvision")):
        raise FileMissingError(f"torchvision is not installed in {folder}; {_HINT}")
    import torch

    if _LIBRARY is None:
        lib = torch.library.Library("torchvision", "DEF")
        for schema in TORCHVISION_SCHEMAS:
            lib.define(schema)
        _LIBRARY = lib
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        import torchvision
    except Exception as e:
        raise TorchvisionRefError(f"importing torchvision from {folder} failed"
                                  f" ({type(e).__name__}: {e}); {_HINT}") from e
    return torchvision


def reference_outputs(images_nchw, weights: str) -> dict[str, Any]:
    """torchvision ``mobilenet_v2`` outputs for float32 NCHW images (see the module doc).

    ``weights`` is read with ``torch.load(..., weights_only=True)``.
    """
    import copy

    import numpy as np
    import torch

    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.mobilenet_v2()
    model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    x = torch.from_numpy(np.ascontiguousarray(images_nchw, dtype=np.float32))
    out: dict[str, Any] = {}
    with torch.no_grad():
        model.eval()
        out["eval_logits"] = model(x).numpy()
        trained = copy.deepcopy(model)
        trained.train()
        trained.classifier[0].p = 0.0  # BatchNorm in train mode, no dropout
        out["train_logits"] = trained(x).numpy()
    for name, module in trained.named_modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            out[f"running_mean/{name}"] = module.running_mean.numpy().copy()
            out[f"running_var/{name}"] = module.running_var.numpy().copy()
    return out


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", required=True, help=".npy of float32 NCHW images")
    parser.add_argument("--out", required=True, help=".npz to write")
    parser.add_argument("--weights", default=None,
                        help="torchvision mobilenet_v2 .pth (default: the packaged ImageNet weights)")
    args = parser.parse_args(argv)
    weights = args.weights
    if weights is None:
        from pockjax.models.mobilenetv2.pretrained import pretrained_path

        weights = pretrained_path()
    out = reference_outputs(np.load(args.inputs), weights)
    with open(args.out, "wb") as f:
        np.savez(f, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
