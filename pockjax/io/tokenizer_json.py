"""Validated readers of Hugging Face ``tokenizer.json`` and ``tokenizer_config.json``.

The JSON is parsed and checked here before the ``tokenizers`` library sees it,
and the library's own failures become :class:`~pockjax.errors.TokenizerFileError`
naming the file.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> _ = open(os.path.join(d, "tokenizer.json"), "w").write('{"model": ')
    >>> read_tokenizer_json(os.path.join(d, "tokenizer.json"))
    Traceback (most recent call last):
    ...
    pockjax.errors.TokenizerFileError: ...tokenizer.json:1: invalid JSON (Expecting value at column 11)
"""

from __future__ import annotations

import json
import os
from typing import Any

from pockjax.errors import TokenizerFileError
from pockjax.io.jsonfile import read_json_object

__all__ = ["read_tokenizer_config", "read_tokenizer_json"]


def read_tokenizer_json(path: str | os.PathLike) -> Any:
    """Loads ``tokenizer.json`` as a ``tokenizers.Tokenizer``.

    Raises:
        FileMissingError: no such file.
        TokenizerFileError: not JSON, not an object with a ``model``, or
            rejected by the ``tokenizers`` library.
    """
    from tokenizers import Tokenizer as HFTokenizer

    path = os.fspath(path)
    spec = read_json_object(path, error=TokenizerFileError, what="tokenizer.json")
    model = spec.get("model")
    if not isinstance(model, dict):
        raise TokenizerFileError(f"{path}: no tokenizer 'model' object; this is not a"
                                 f" Hugging Face tokenizer.json")
    try:
        return HFTokenizer.from_str(json.dumps(spec))
    except Exception as e:  # the Rust library raises a bare Exception
        raise TokenizerFileError(f"{path}: the tokenizers library rejects it:"
                                 f" {str(e).strip() or type(e).__name__}") from None


def read_tokenizer_config(path: str | os.PathLike) -> dict[str, Any]:
    """Reads ``tokenizer_config.json`` and checks the fields pockjax uses.

    Returns:
        The config, with ``bos_token``/``eos_token``/``pad_token`` as strings
        or ``None``, ``chat_template`` a string or ``None`` and
        ``add_bos_token`` a bool.

    Raises:
        FileMissingError, TokenizerFileError.
    """
    path = os.fspath(path)
    cfg = read_json_object(path, error=TokenizerFileError, what="tokenizer_config.json")
    out = dict(cfg)
    for name in ("bos_token", "eos_token", "pad_token"):
        tok = cfg.get(name)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok is not None and not isinstance(tok, str):
            raise TokenizerFileError(f"{path}: {name} must be a string, got {tok!r}")
        out[name] = tok
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = [t for t in template if isinstance(t, dict)]
        if len(named) != len(template) or not all(
                isinstance(t.get("template"), str) for t in named):
            raise TokenizerFileError(f"{path}: chat_template must be a string or a list of"
                                     f" {{'name', 'template'}} objects")
        template = next((t["template"] for t in named if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise TokenizerFileError(f"{path}: chat_template must be a string, got"
                                 f" {type(template).__name__}")
    out["chat_template"] = template
    add_bos = cfg.get("add_bos_token", False)
    if not isinstance(add_bos, bool) and add_bos is not None:
        raise TokenizerFileError(f"{path}: add_bos_token must be true or false, got {add_bos!r}")
    out["add_bos_token"] = bool(add_bos)
    return out
