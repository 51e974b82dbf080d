"""SentencePiece-BPE tokenization from a GGUF vocabulary, as llama.cpp does it.

GGUF files of SentencePiece models (``tokenizer.ggml.model == "llama"``:
LLaMA-2, Gemma 3, ...) hold the pieces, their scores and types but no merge
list. :class:`SentencePieceBPE` encodes the way llama.cpp's SPM tokenizer does:

1. control, user-defined and unknown tokens written in the text are cut out
   first, the longest token first (so ``<start_of_turn>`` or a run of
   newlines becomes its own token);
2. each remaining piece of text (with a space in front when
   ``add_space_prefix`` and the piece follows a special token or starts the
   text) has its spaces replaced by ``▁`` and is split into characters;
3. the adjacent pair whose concatenation is a vocabulary piece with the
   highest score is merged, the leftmost first among equal scores, until no
   pair is a piece;
4. a symbol that is no piece is written as its UTF-8 bytes (the ``<0xXX>``
   byte-fallback tokens).

It offers the part of the ``tokenizers.Tokenizer`` interface that
:class:`~pockjax.models.llama.tokenizer.Tokenizer` uses, so it is a drop-in
backend, and :meth:`SentencePieceBPE.to_str` writes an equivalent Hugging
Face ``tokenizer.json`` (BPE with byte fallback).

Example:
  >>> spm = SentencePieceBPE.for_tests()
  >>> spm.encode("ab ab").ids
  [9, 10]
  >>> spm.decode(spm.encode("ab ab\\u00e9").ids)
  'ab abé'
"""

from __future__ import annotations

import gc
import heapq
import json
import math
from typing import Iterable, NamedTuple, Sequence

__all__ = ["SentencePieceBPE", "SPACE"]

#: SentencePiece's visible space (U+2581), which stands for " " inside pieces.
SPACE = "\u2581"

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class Encoding(NamedTuple):
    """The result of :meth:`SentencePieceBPE.encode` (``tokenizers``' ``Encoding.ids``)."""

    ids: list


class SentencePieceBPE:
    """A SentencePiece-BPE vocabulary: pieces, scores and token types.

    Args:
      tokens: The pieces, index = token id (``▁`` for a space).
      scores: One float per piece; merges producing higher scores come first.
      types: llama.cpp token types (1 normal, 2 unknown, 3 control, 4
        user-defined, 5 unused, 6 byte); ``None``: all normal.
      add_space_prefix: Put a space before the text (LLaMA-2: yes, Gemma: no).
      unk_id: The unknown token (decoded as ``▅``, as llama.cpp does).

    Example:
      >>> SentencePieceBPE.for_tests().get_vocab_size()
      12
    """

    def __init__(self, tokens: Sequence[str], scores: Sequence[float], types: Sequence[int] | None = None,
                 *, add_space_prefix: bool = False, unk_id: int | None = None):
        self.tokens = list(tokens)
        self.scores = [float(s) for s in scores]
        self.types = list(types) if types is not None else [_NORMAL] * len(self.tokens)
        # (the file loaders check these first, naming the file and key; this guards direct use)
        if not self.tokens or not all(isinstance(t, str) for t in self.tokens) \
                or len(set(self.tokens)) != len(self.tokens):
            raise ValueError("tokens must be a non-empty list of distinct strings")
        if len(self.scores) != len(self.tokens) or not all(map(math.isfinite, self.scores)):
            # a NaN would scramble the merge order of tokenizer.json, silently
            raise ValueError(f"scores must be {len(self.tokens)} finite numbers, one per token")
        if len(self.types) != len(self.tokens) or not all(type(t) is int for t in self.types):
            raise ValueError(f"types must be {len(self.tokens)} integers, one per token")
        if unk_id is not None and not (type(unk_id) is int and 0 <= unk_id < len(self.tokens)):
            raise ValueError(f"unk_id {unk_id!r} is not a token id")
        self.add_space_prefix = bool(add_space_prefix)
        self.unk_id = unk_id
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.pre_tokenizer = None  # no tokenizers pre-tokenizer: :mod:`.export` checks it
        # cut out before the merges, longest first (llama.cpp's cache_special_tokens)
        self._special = sorted((i for i, ty in enumerate(self.types) if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)
                                and self.tokens[i]), key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self._bytes = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]

    # -- the tokenizers.Tokenizer interface -------------------------------------

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        """Number of token ids."""
        return len(self.tokens)

    def control_tokens(self) -> dict[str, int]:
        """``{text: id}`` of the control pieces (``<start_of_turn>``), which :meth:`encode` parses
        out of the text.

        Example:
          >>> SentencePieceBPE.for_tests().control_tokens()["<eos>"]
          1
        """
        return {self.tokens[i]: i for i, ty in enumerate(self.types) if ty == _CONTROL and self.tokens[i]}

    def token_to_id(self, token: str) -> int | None:
        """Id of a piece, or ``None``.

        Example:
          >>> SentencePieceBPE.for_tests().token_to_id("<eos>")
          1
        """
        return self.vocab.get(token)

    def id_to_token(self, tid: int) -> str | None:
        """The piece of an id, or ``None``."""
        return self.tokens[tid] if 0 <= tid < len(self.tokens) else None

    def encode(self, text: str, add_special_tokens: bool = False) -> Encoding:
        """Token ids of ``text`` (special tokens written in it are parsed); no BOS.

        Example:
          >>> spm = SentencePieceBPE.for_tests()
          >>> spm.encode("<eos>ab").ids
          [1, 9]
        """
        ids: list[int] = []
        prev_special = True
        for piece, tid in self._partition(text):
            if tid is not None:
                ids.append(tid)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                piece = " " + piece
            self._merge(piece.replace(" ", SPACE), ids)
            prev_special = False
        return Encoding(ids)

    def encode_batch(self, texts: Iterable[str], add_special_tokens: bool = False) -> list[Encoding]:
        """:meth:`encode` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (byte tokens joined into UTF-8, ``▁`` as spaces).

        Example:
          >>> SentencePieceBPE.for_tests().decode([1, 9, 10], skip_special_tokens=True)
          'ab ab'
        """
        out = bytearray()
        for n, tid in enumerate(int(i) for i in ids):
            ty = self.types[tid]
            if ty == _BYTE:
                out.append(int(self.tokens[tid][3:5], 16))
            elif ty == _CONTROL:
                if not skip_special_tokens:
                    out += self.tokens[tid].encode("utf-8")
            elif ty == _UNKNOWN or tid == self.unk_id:
                out += "\u2585".encode("utf-8")
            elif ty == _USER_DEFINED:
                out += self.tokens[tid].encode("utf-8")
            else:
                piece = self.tokens[tid].replace(SPACE, " ")
                if n == 0 and self.add_space_prefix and piece.startswith(" "):
                    piece = piece[1:]  # the space encode() put in front
                out += piece.encode("utf-8")
        return out.decode("utf-8", errors="replace")

    def to_str(self) -> str:
        """An equivalent Hugging Face ``tokenizer.json`` (a BPE model with byte fallback).

        The merges are every split of a piece into two pieces, ranked by the
        piece's score (as ``transformers`` converts SentencePiece models).

        Example:
          >>> from tokenizers import Tokenizer as HF
          >>> spm = SentencePieceBPE.for_tests()
          >>> HF.from_str(spm.to_str()).encode("ab ab", add_special_tokens=False).ids
          [9, 10]
        """
        merges = self._merges()
        added = [{"id": i, "content": self.tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": self.types[i] != _USER_DEFINED} for i in sorted(self._special)]
        normalizers = [{"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]
        decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
                    {"type": "ByteFallback"}, {"type": "Fuse"}]
        if self.add_space_prefix:
            normalizers.insert(0, {"type": "Prepend", "prepend": SPACE})
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": normalizers}, "pre_tokenizer": None,
            "post_processor": None, "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": None,
                      "unk_token": None if self.unk_id is None else self.tokens[self.unk_id],
                      "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": True,
                      "byte_fallback": True, "ignore_merges": False, "vocab": self.vocab,
                      "merges": merges},
        }
        return json.dumps(spec, ensure_ascii=False)

    def _merges(self) -> list[list[str]]:
        """Every split of a normal piece into two pieces, ``[left, right]``, ordered by the
        piece's score (highest first), then by the two halves' ids."""
        get, scores, types = self.vocab.get, self.scores, self.types
        ranked = []  # (-score, left id, right id, left, right): no two entries share the ids
        # (Gemma 3's 262,144 pieces give half a million merges: the collector, left on, would
        # walk them all again and again as they are made: 3x the time)
        collecting = gc.isenabled()
        gc.disable()
        try:
            for tid, piece in enumerate(self.tokens):
                if len(piece) < 2 or types[tid] != _NORMAL:
                    continue
                score = -scores[tid]
                for k in range(1, len(piece)):
                    left = get(piece[:k])
                    if left is not None:
                        right = get(piece[k:])
                        if right is not None:
                            ranked.append((score, left, right, piece[:k], piece[k:]))
            ranked.sort()
            return [[m[3], m[4]] for m in ranked]
        finally:
            if collecting:
                gc.enable()

    # -- the algorithm ----------------------------------------------------------

    def _partition(self, text: str) -> list[tuple[str, int | None]]:
        # [(raw text, None) or (token text, id)]: each special token cut out of
        # the raw fragments, the longest token first (llama.cpp's tokenizer_st_partition)
        frags: list[tuple[str, int | None]] = [(text, None)] if text else []
        for tid in (i for i in self._special if self.tokens[i] in text):
            tok = self.tokens[tid]
            out = []
            for frag, fid in frags:
                if fid is not None or tok not in frag:
                    out.append((frag, fid))
                    continue
                start = 0
                while (at := frag.find(tok, start)) >= 0:
                    if at > start:
                        out.append((frag[start:at], None))
                    out.append((tok, tid))
                    start = at + len(tok)
                if start < len(frag):
                    out.append((frag[start:], None))
            frags = out
        return frags

    def _merge(self, text: str, ids: list[int]) -> None:
        # llama.cpp's llm_tokenizer_spm_session: best-score bigram merges over characters
        sym = list(text)
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            merged = sym[left] + sym[right]
            tid = self.vocab.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-self.scores[tid], left, right, merged))

        for i in range(1, len(sym)):
            push(i - 1, i)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue  # a side was merged since
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        i = 0 if sym else -1
        while i != -1:
            tid = self.vocab.get(sym[i])
            if tid is not None:
                ids.append(tid)
            else:  # no piece: its UTF-8 bytes
                for b in sym[i].encode("utf-8"):
                    bid = self._bytes[b]
                    if bid is None:
                        bid = self.vocab.get(chr(b), self.unk_id)
                    if bid is None:
                        raise ValueError(f"the vocabulary has no byte token <0x{b:02X}> and no unknown token")
                    ids.append(bid)
            i = nxt[i]

    @classmethod
    def for_tests(cls) -> "SentencePieceBPE":
        """A 12-piece vocabulary (specials, two byte tokens, a few pieces), for docs and tests.

        Example:
          >>> SentencePieceBPE.for_tests().tokens[9]
          'ab'
        """
        tokens = ["<unk>", "<eos>", "<0xC3>", "<0xA9>", "a", "b", SPACE, "\n", "\n\n", "ab", SPACE + "ab", "ba"]
        scores = [0, 0, 0, 0, -1, -2, -3, 0, 0, -4, -5, -9]
        types = [_UNKNOWN, _CONTROL, _BYTE, _BYTE, 1, 1, 1, _USER_DEFINED, _USER_DEFINED, 1, 1, 1]
        return cls(tokens, scores, types, unk_id=0)
