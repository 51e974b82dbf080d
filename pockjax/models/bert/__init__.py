"""BERT-family encoders (BERT, MiniLM, sentence-transformers) in Flax NNX.

Importing this package registers the ``bert`` scheme family
(:mod:`pockjax.models.bert.schemes`).

Typical use::

    from pockjax.models import bert

    model, tok = bert.load_pretrained("all-minilm-l6-v2")         # the encoder
    ids, mask = tok.encode_batch(["a sentence", "another one"], max_len=128)
    sentence = bert.mean_pool(model(ids, mask), mask)             # (2, 384)

    clf, tok = bert.load_pretrained("all-minilm-l6-v2", num_classes=2)
    logits = clf(ids, mask)                                       # (2, 2)
    scheme = pockjax.schemes.get_scheme("paper", clf.config)

Example:
    >>> import numpy as np
    >>> from flax import nnx
    >>> m = BertClassifier(BertConfig.tiny(), 2, rngs=nnx.Rngs(0))
    >>> m(np.array([[1, 4, 2]]), np.array([[1, 1, 1]])).shape
    (1, 2)
"""

from pockjax.errors import (
    CheckpointError,
    FileMissingError,
    SafetensorsError,
    TokenizerFileError,
    UnknownModelError,
    UnsupportedModelError,
)
from pockjax.models.bert import schemes  # noqa: F401  (registers the 'bert' schemes)
from pockjax.models.bert.config import SUPPORTED_ARCHITECTURES, BertConfig
from pockjax.models.bert.model import (
    BertClassifier,
    BertModel,
    build_model,
    flatten_params,
    mean_pool,
    sentence_embedding,
    unflatten_params,
)
from pockjax.models.bert.pretrained import (
    PRETRAINED,
    checkpoint_params,
    expected_shapes,
    load_pretrained,
    pretrained_path,
    read_checkpoint,
)
from pockjax.models.bert.schemes import encoder_blocks
from pockjax.models.bert.tokenizer import BertTokenizer

__all__ = [
    "BertClassifier",
    "BertConfig",
    "BertModel",
    "BertTokenizer",
    "CheckpointError",
    "FileMissingError",
    "PRETRAINED",
    "SUPPORTED_ARCHITECTURES",
    "SafetensorsError",
    "TokenizerFileError",
    "UnknownModelError",
    "UnsupportedModelError",
    "build_model",
    "checkpoint_params",
    "encoder_blocks",
    "expected_shapes",
    "flatten_params",
    "load_pretrained",
    "mean_pool",
    "pretrained_path",
    "read_checkpoint",
    "sentence_embedding",
    "unflatten_params",
]
