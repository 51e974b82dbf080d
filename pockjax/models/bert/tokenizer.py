"""A BERT WordPiece tokenizer over a Hugging Face ``tokenizer.json``.

Wraps the ``tokenizers`` library; the JSON is validated first (as
:func:`pockjax.io.tokenizer_json.read_tokenizer_json` does), and every input
gets ``[CLS] ... [SEP]`` from the file's post-processor, as Hugging Face's
``BertTokenizerFast`` does.

Example:
    >>> tok = BertTokenizer.from_json_text(_TINY_JSON)
    >>> ids, mask = tok.encode_batch(["hello world", "hello"], max_len=8)
    >>> ids.tolist(), mask.tolist()
    ([[1, 3, 4, 2], [1, 3, 2, 0]], [[1, 1, 1, 1], [1, 1, 1, 0]])
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

import numpy as np

from pockjax.errors import TokenizerFileError
from pockjax.io.jsonfile import loads_checked
from pockjax.io.tokenizer_json import read_tokenizer_json

__all__ = ["BertTokenizer"]

# A five-token WordPiece tokenizer.json for the examples.
_TINY_JSON = json.dumps({
    "version": "1.0", "truncation": None, "padding": None, "added_tokens": [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, t in enumerate(["[PAD]", "[CLS]", "[SEP]"])] + [
        {"id": 5, "content": "[UNK]", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}],
    "normalizer": {"type": "BertNormalizer", "clean_text": True, "handle_chinese_chars": True,
                   "strip_accents": None, "lowercase": True},
    "pre_tokenizer": {"type": "BertPreTokenizer"},
    "post_processor": {"type": "TemplateProcessing",
                       "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                                  {"Sequence": {"id": "A", "type_id": 0}},
                                  {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                       "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
                       "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [1], "tokens": ["[CLS]"]},
                                          "[SEP]": {"id": "[SEP]", "ids": [2], "tokens": ["[SEP]"]}}},
    "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": True},
    "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
              "max_input_chars_per_word": 100,
              "vocab": {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "hello": 3, "world": 4, "[UNK]": 5}},
})


class BertTokenizer:
    """WordPiece tokenizer of a BERT model, with ``[CLS]``/``[SEP]`` and padding.

    Build it with :meth:`from_file` or :meth:`from_json_text` (or
    :func:`pockjax.models.bert.load_pretrained`). The file's own truncation and
    padding settings are switched off; :meth:`encode_batch` applies its own.

    Attributes:
        pad_id, cls_id, sep_id, unk_id: ids of the special tokens.
        vocab_size: Size of the vocabulary (with added tokens).
        source: The file it was read from (for messages).
    """

    def __init__(self, hf_tokenizer: Any, source: str = "tokenizer.json"):
        self._tok = hf_tokenizer
        self.source = source
        self._tok.no_truncation()
        self._tok.no_padding()
        ids = {}
        for name, token in (("pad", "[PAD]"), ("cls", "[CLS]"), ("sep", "[SEP]"),
                            ("unk", "[UNK]")):
            i = self._tok.token_to_id(token)
            if i is None:
                raise TokenizerFileError(f"{source}: no {token} token; this is not a BERT"
                                         f" WordPiece tokenizer")
            ids[name] = i
        self.pad_id, self.cls_id, self.sep_id, self.unk_id = (
            ids["pad"], ids["cls"], ids["sep"], ids["unk"])
        probe = self._tok.encode("a").ids
        if not probe or probe[0] != self.cls_id or probe[-1] != self.sep_id:
            raise TokenizerFileError(f"{source}: its post-processor does not wrap inputs in"
                                     f" [CLS] ... [SEP] (got ids {probe}); not a BERT tokenizer")

    @property
    def vocab_size(self) -> int:
        """Number of token ids (with added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BertTokenizer":
        """Reads a ``tokenizer.json`` file.

        Raises:
            FileMissingError: no such file.
            TokenizerFileError: invalid JSON, not a tokenizer, or not a BERT one.
        """
        return cls(read_tokenizer_json(path), os.fspath(path))

    @classmethod
    def from_json_text(cls, text: str, source: str = "tokenizer.json") -> "BertTokenizer":
        """Builds the tokenizer from the text of a ``tokenizer.json``.

        Raises:
            TokenizerFileError: naming ``source``: invalid JSON, no ``model``
                object, rejected by the ``tokenizers`` library, or not BERT.

        Example:
            >>> BertTokenizer.from_json_text('{"version": "1.0"}', "m.zip:tokenizer.json")
            Traceback (most recent call last):
            ...
            pockjax.errors.TokenizerFileError: m.zip:tokenizer.json: no tokenizer 'model' object; this is not a Hugging Face tokenizer.json
        """
        from tokenizers import Tokenizer as HFTokenizer

        spec = loads_checked(text, source, TokenizerFileError)
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerFileError(f"{source}: no tokenizer 'model' object; this is not a"
                                     f" Hugging Face tokenizer.json")
        try:
            tok = HFTokenizer.from_str(json.dumps(spec))
        except Exception as e:  # the Rust library raises a bare Exception
            raise TokenizerFileError(f"{source}: the tokenizers library rejects it:"
                                     f" {str(e).strip() or type(e).__name__}") from None
        return cls(tok, source)

    def encode(self, text: str, max_len: int | None = None) -> list[int]:
        """Ids of one text, ``[CLS] ... [SEP]``, truncated to ``max_len`` ids
        (keeping the final ``[SEP]``).

        Example:
            >>> tok = BertTokenizer.from_json_text(_TINY_JSON)
            >>> tok.encode("Hello hello world"), tok.encode("Hello hello world", max_len=3)
            ([1, 3, 3, 4, 2], [1, 3, 2])
        """
        return self.encode_batch([text], max_len, pad_to_max=False)[0][0].tolist()

    def encode_batch(self, texts: Sequence[str], max_len: int | None = 128, *,
                     pad_to_max: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Token ids and attention mask of a batch, padded on the right.

        Args:
            texts: The texts.
            max_len: Longest sequence (with ``[CLS]``/``[SEP]``); longer texts are
                truncated keeping the final ``[SEP]``. ``None``: no truncation.
            pad_to_max: Pad every row to ``max_len`` (else to the longest row).

        Returns:
            ``(input_ids, attention_mask)``: int32 ``(batch, seq)``; padding
            slots hold ``pad_id`` and mask 0.

        Example:
            >>> tok = BertTokenizer.from_json_text(_TINY_JSON)
            >>> tok.encode_batch(["world"], max_len=5, pad_to_max=True)[0].tolist()
            [[1, 4, 2, 0, 0]]
        """
        if isinstance(texts, str):
            raise TypeError("encode_batch takes a list of texts, not one string")
        texts = list(texts)
        if max_len is not None and max_len < 2:
            raise ValueError(f"max_len must be at least 2 ([CLS] and [SEP]), got {max_len}")
        if pad_to_max and max_len is None:
            raise ValueError("pad_to_max needs a max_len")
        if max_len is None:
            self._tok.no_truncation()
        else:
            self._tok.enable_truncation(max_length=max_len)
        try:
            rows = [e.ids for e in self._tok.encode_batch(texts)]
        finally:
            self._tok.no_truncation()
        width = max_len if pad_to_max else max((len(r) for r in rows), default=0)
        ids = np.full((len(rows), width), self.pad_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = r
            mask[i, :len(r)] = 1
        return ids, mask

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of some ids (special tokens dropped unless asked for).

        Example:
            >>> tok = BertTokenizer.from_json_text(_TINY_JSON)
            >>> tok.decode([1, 3, 4, 2, 0])
            'hello world'
        """
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"BertTokenizer({self.source!r}, vocab_size={self.vocab_size})"
