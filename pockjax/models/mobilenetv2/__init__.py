"""MobileNetV2 (Flax NNX, NHWC) with torchvision's ImageNet weights.

Typical use::

    from pockjax.models import mobilenetv2

    model = mobilenetv2.load_pretrained(num_classes=10)   # fresh 10-way head, eval mode
    logits = model(mobilenetv2.normalize(images_uint8))   # (batch, 10)
    model.train()                                         # batch statistics + dropout

Importing this package registers the family's named schemes (``paper``,
``channels``, ``bias-only``, ``last-blocks``, ``head-only``; see
:mod:`pockjax.models.mobilenetv2.schemes`).

Example:
    >>> import numpy as np
    >>> normalize(np.zeros((1, 32, 32, 3), np.uint8)).shape, MobileNetV2Config().n_blocks
    ((1, 32, 32, 3), 17)
"""

from pockjax.models.mobilenetv2.model import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MobileNetV2,
    MobileNetV2Config,
    make_divisible,
    normalize,
    replace_head,
)
from pockjax.models.mobilenetv2.pretrained import (
    load_pretrained,
    load_torch_state_dict,
    pretrained_path,
    torch_to_pockjax,
)
from pockjax.models.mobilenetv2 import schemes  # noqa: F401  (registers the named schemes)

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "MobileNetV2",
    "MobileNetV2Config",
    "load_pretrained",
    "load_torch_state_dict",
    "make_divisible",
    "normalize",
    "pretrained_path",
    "replace_head",
    "torch_to_pockjax",
]
