"""Turning chat examples into fixed-shape training batches.

A training row is the chat prompt (rendered by the tokenizer's chat template,
ending with the assistant header), then the answer, then the end-of-turn token
(``<|im_end|>`` for ChatML models, else EOS), right-padded to ``seq_len``:

* ``tokens``    int32 ``(batch, seq_len)``: the model input;
* ``targets``   int32 ``(batch, seq_len)``: ``tokens`` shifted left by one
  (position ``t`` predicts ``targets[t]``);
* ``loss_mask`` float32 ``(batch, seq_len)``: 1 where ``targets[t]`` is a
  token of an assistant turn (the answer, and in a conversation each earlier
  reply) or the end-of-turn token closing one; 0 on the rest of the prompt and
  on padding;
* ``mask``      int32 ``(batch, seq_len)``: 1 on real tokens, 0 on padding;
* ``loss_start`` int32 ``(batch,)``: first position where ``loss_mask`` is 1
  (for a padding row, ``n_prompt - 1`` all the same).
  With :attr:`Batcher.answer_window` it lets
  :func:`pockjax.models.llama.answer_loss` compute logits only on the trained
  positions (several times cheaper for a 49k vocabulary than logits everywhere).

Right padding needs no attention mask for the real tokens (causal attention
never looks ahead), so ``model(batch["tokens"])`` and
``next_token_loss(logits, batch["targets"], batch["loss_mask"])`` are enough.

:class:`Batcher` shuffles deterministically from a seed, and ``batch(step)``
depends only on ``(seed, step)``, so a resumed run sees the same batches.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from pockjax.errors import PockjaxError
import numpy as np

from pockjax.data.tasks import Example

__all__ = ["BUCKETS", "REPLIES", "Batcher", "SequenceLengthError", "choose_buckets", "collate", "control_finder",
           "encode_example", "encode_turns", "end_of_turn_id", "refuse_control_text"]

#: What :class:`Batcher` trains of a conversation: every assistant reply, or the last.
REPLIES = ("all", "last")

#: At most this many row lengths with ``Batcher(bucket_limit=...)``: the
#: train step compiles once per length.
BUCKETS = 4


class SequenceLengthError(PockjaxError, ValueError):
    """An example, or the requested sequence length, does not fit."""


def end_of_turn_id(tokenizer: Any) -> int:
    """The id that ends an assistant turn: ``<|im_end|>`` (ChatML) or ``<end_of_turn>``
    (Gemma) if the vocabulary has it, else EOS.

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> end_of_turn_id(Tokenizer.byte_level_for_tests())
      258
    """
    tid = tokenizer.token_to_id("<|im_end|>")
    if tid is None:
        tid = tokenizer.token_to_id("<end_of_turn>")
    if tid is None:
        tid = tokenizer.eos_id
    if tid is None:
        raise ValueError("the tokenizer has neither <|im_end|> nor an EOS token")
    return int(tid)


#: Document and turn markers of the common model families, structural wherever they are control tokens.
_MARKERS = ("<|endoftext|>", "<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "<|end|>", "<s>", "</s>",
            "<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>")


def _structure_ids(tokenizer: Any) -> set[int]:
    """The ids that give a text or a chat its structure: those the chat template puts around the
    turns, BOS, EOS, padding, the end of a turn and the common document markers
    (``<|endoftext|>``); not metadata tokens such as SmolLM2's ``<filename>``."""
    ids = {i for i in (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, end_of_turn_id(tokenizer),
                       *(tokenizer.token_to_id(m) for m in _MARKERS)) if i is not None}
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    for messages in (chat, chat[1:]):  # a template may refuse a system message
        try:
            ids.update(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - the template's own refusal; the other form serves
            continue
    return ids


def control_finder(tokenizer: Any):
    """``find(text) -> (control token, id) | None``: the first control token that structures a
    chat (:func:`_structure_ids`) written in ``text`` (by position), found by set lookups of
    each length at each candidate first character.

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> find = control_finder(Tokenizer.byte_level_for_tests())
      >>> find("a plain question"), find("a<|im_end|> forged turn")[0]
      (None, '<|im_end|>')
    """
    control = tokenizer.control_tokens() if hasattr(tokenizer, "control_tokens") else {}
    if control:
        structure = _structure_ids(tokenizer)
        control = {t: i for t, i in control.items() if i in structure}
    firsts = {t[0] for t in control}
    lengths = sorted({len(t) for t in control})

    def find(text: str):
        if not control or not firsts.intersection(text):
            return None
        for pos, ch in enumerate(text):
            if ch in firsts:
                for n in lengths:
                    piece = text[pos:pos + n]
                    if piece in control:
                        return piece, control[piece]
        return None

    return find


def refuse_control_text(tokenizer: Any, examples: Sequence[Example], system: str | None = None,
                        what: str = "example") -> None:
    """Refuses examples whose text holds a control token that structures a chat written out
    (``<|im_end|>`` in a user message or an answer; the template's turn markers, BOS, EOS).

    The tokenizer reads it as the control token, not as the characters, as a chat
    template's output is read: trained on, it would teach the model to end its turn
    (or open one) in mid-answer, and a reference answer holding it could never be
    matched. Raises :class:`~pockjax.errors.DataError` naming the example and the token.
    Other control tokens (SmolLM2's ``<filename>``, ``<reponame>``) are metadata that
    code or markup may hold: they pass, read as the tokenizer reads them.

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> refuse_control_text(Tokenizer.byte_level_for_tests(), [Example("What ends a turn?", "<|im_end|>")])
      Traceback (most recent call last):
      ...
      pockjax.errors.DataError: example 0 ('What ends a turn?'): its answer holds '<|im_end|>', ...
    """
    from pockjax.errors import DataError

    find = control_finder(tokenizer)
    for i, ex in enumerate(examples):
        fields = [("system message", system or ""), *((f"{r} turn", c) for r, c in ex.context),
                  ("prompt", ex.prompt), ("answer", ex.answer)]
        for field, text in fields:
            hit = find(text)
            if hit is not None:
                raise DataError(
                    f"{what} {ex.source or i} ({ex.prompt[:40]!r}{'...' if len(ex.prompt) > 40 else ''}): its {field} holds"
                    f" {hit[0]!r}, which the tokenizer reads as its control token (id {hit[1]}), not as text:"
                    f" trained on, it would teach the model that token there (an end of turn in mid-answer),"
                    f" and a reference holding it can never be matched. Rewrite it in the data (for example"
                    f" {hit[0][0] + ' ' + hit[0][1:]!r}) or leave the record out")


def encode_example(tokenizer: Any, example: Example, system: str | None = None
                   ) -> tuple[list[int], int]:
    """Token ids of prompt + answer + end-of-turn, and the number of prompt ids.

    The prompt is encoded exactly as generation will see it (chat template with
    the generation prompt); the answer is encoded on its own and appended.

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> tok = Tokenizer.byte_level_for_tests()
      >>> ids, n_prompt = encode_example(tok, Example("hi", "yo"))
      >>> tok.decode(ids[n_prompt:])
      'yo<|im_end|>'
    """
    prompt = tokenizer.apply_chat_template(example.messages(system), add_generation_prompt=True)
    answer = tokenizer.encode(example.answer, add_bos=False)
    return list(prompt) + list(answer) + [end_of_turn_id(tokenizer)], len(prompt)


def encode_turns(tokenizer: Any, example: Example, system: str | None = None
                 ) -> tuple[list[int], int, tuple[tuple[int, int], ...]]:
    """:func:`encode_example`, and where the earlier assistant replies of a conversation lie in it.

    Every assistant turn is trained, as TRL's ``assistant_only_loss`` and torchtune
    train a conversation: the answer (the ids from ``n_prompt`` on) and each earlier
    reply of ``example.context``, from the first token after its turn header
    through the end-of-turn token that closes it. The ids are those of
    :func:`encode_example`, unchanged: an earlier reply is found as the
    conversation before it, rendered with the generation prompt (its header),
    which must be a token prefix of the whole, followed by an end-of-turn token.

    Returns:
      ``(ids, n_prompt, spans)``: ``spans`` holds ``(start, end)`` per earlier
      reply, ``ids[start:end]`` its tokens and its end-of-turn token (empty for
      a single-turn example).

    Raises:
      DataError: the chat template renders an earlier reply differently in the
        whole conversation (its header is not a token prefix of it), or closes
        it without the end-of-turn token.

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> tok = Tokenizer.byte_level_for_tests()
      >>> ids, n_prompt, spans = encode_turns(tok, Example("And?", "b", context=(("user", "Hi"), ("assistant", "a"))))
      >>> [tok.decode(ids[s:e]) for s, e in spans], tok.decode(ids[n_prompt:])
      (['a<|im_end|>'], 'b<|im_end|>')
    """
    from pockjax.errors import DataError

    ids, n_prompt = encode_example(tokenizer, example, system)
    messages = example.messages(system)
    eot = end_of_turn_id(tokenizer)
    spans, done = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = list(tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True))
        start = len(head)
        end = next((i for i in range(start, n_prompt) if ids[i] == eot), None)
        if start <= done or ids[:start] != head or end is None:
            turn = sum(x["role"] == "assistant" for x in messages[:k]) + 1
            if start > done and ids[:start] == head:
                why = f"is not closed by the end-of-turn token {tokenizer.decode([eot])!r}"
            elif tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).startswith(
                    tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)):
                why = ("merges into its header's last token (the tokenizer reads the header's end and the reply's"
                       " start, whitespace most often, as one token)")
            else:
                why = ("is not where the conversation before it, rendered with the assistant header, ends (this"
                       " chat template renders earlier turns otherwise)")
            raise DataError(
                f"example {example.prompt[:40]!r}{'...' if len(example.prompt) > 40 else ''}: its assistant"
                f" turn {turn} of the context {why}, so its tokens cannot be found to train on. Train only"
                f" the last reply of each conversation (Batcher(replies='last'), finetune --train-replies"
                f" last), or rewrite the turn")
        spans.append((start, end + 1))
        done = end + 1
    return ids, n_prompt, tuple(spans)


def collate(rows: Sequence[tuple[Sequence[int], int]], seq_len: int, pad_id: int
            ) -> dict[str, np.ndarray]:
    """Pads encoded rows into a batch dict (see the module docstring).

    Args:
      rows: ``(ids, n_prompt)`` pairs from :func:`encode_example`, or
        ``(ids, n_prompt, spans)`` from :func:`encode_turns` (the spans trained too).
      seq_len: Row length; every ``ids`` must fit.
      pad_id: Padding id.

    Raises:
      SequenceLengthError: a row is longer than ``seq_len``.

    Example:
      >>> b = collate([([5, 6, 7, 8], 2)], seq_len=6, pad_id=0)
      >>> b["tokens"].tolist(), b["targets"].tolist()
      ([[5, 6, 7, 8, 0, 0]], [[6, 7, 8, 0, 0, 0]])
      >>> b["loss_mask"].tolist(), b["mask"].tolist(), b["loss_start"].tolist()
      ([[0.0, 1.0, 1.0, 0.0, 0.0, 0.0]], [[1, 1, 1, 1, 0, 0]], [1])
    """
    n = len(rows)
    tokens = np.full((n, seq_len), pad_id, np.int32)
    targets = np.full((n, seq_len), pad_id, np.int32)
    loss_mask = np.zeros((n, seq_len), np.float32)
    mask = np.zeros((n, seq_len), np.int32)
    loss_start = np.zeros((n,), np.int32)
    for i, row in enumerate(rows):
        ids, n_prompt = row[0], row[1]
        spans = row[2] if len(row) > 2 else ()
        length = len(ids)
        if length > seq_len:
            raise SequenceLengthError(f"row {i} has {length} tokens, more than seq_len={seq_len}")
        tokens[i, :length] = ids
        targets[i, :length - 1] = ids[1:]
        # targets[t] = ids[t + 1] is an answer token when t + 1 >= n_prompt.
        loss_mask[i, max(n_prompt - 1, 0):length - 1] = 1.0
        for start, end in spans:  # earlier replies: ids[start:end] predicted from start - 1 on
            loss_mask[i, start - 1:end - 1] = 1.0
        mask[i, :length] = 1
        loss_start[i] = min(max((spans[0][0] if spans else n_prompt) - 1, 0), seq_len - 1)
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask, "mask": mask,
            "loss_start": loss_start}


class Batcher:
    """Deterministic, resumable batches of chat examples with a fixed shape.

    Args:
      tokenizer: A :class:`pockjax.models.llama.Tokenizer`.
      examples: The training examples.
      batch_size: Rows per batch.
      seq_len: Row length; ``None``: the longest example rounded up to a
        multiple of 16.
      seed: Shuffling seed.
      max_seq_len: The model's context (``model.config.max_seq_len``); a
        ``seq_len`` beyond it is an error.
      system: Optional system message for every example.
      truncate: Cut over-long examples (keeping the prompt's start) instead of
        raising.
      bucket_limit: Length bucketing (instead of ``seq_len``): each batch is
        padded to the shortest of up to :data:`BUCKETS` row lengths that fits
        its longest example (:func:`choose_buckets`), the longest being at
        most ``bucket_limit``; an example longer than ``bucket_limit`` is an
        error.
      replies: ``"all"`` trains every assistant reply of a conversation
        (:func:`encode_turns`), ``"last"`` only its last (the answer; the
        earlier turns are context).

    Attributes:
      seq_len: Row length of every batch (with ``bucket_limit``: the longest bucket).
      buckets: The row lengths batches are padded to (``(seq_len,)`` without bucketing).
      answer_window: Loss positions that cover every example's answer (a
        multiple of 8), for :func:`pockjax.models.llama.answer_loss`.
      longest: Tokens in the longest example.

    Raises:
      SequenceLengthError: ``seq_len`` exceeds ``max_seq_len``, or an example
        is longer than ``seq_len`` (the message names the example and the
        length needed).

    Example:
      >>> from pockjax.models.llama import Tokenizer
      >>> from pockjax.data.tasks import make_examples
      >>> tok = Tokenizer.byte_level_for_tests()
      >>> b = Batcher(tok, make_examples("add", 10, seed=0), batch_size=4, seed=0)
      >>> b.seq_len, b.batch(0)["tokens"].shape
      (80, (4, 80))
      >>> bool((b.batch(7)["tokens"] == b.batch(7)["tokens"]).all())
      True
      >>> b = Batcher(tok, make_examples("reverse_words", 40, seed=0), batch_size=2, bucket_limit=256)
      >>> b.buckets, sorted({b.batch(i)["tokens"].shape[1] for i in range(len(b))})
      ((128, 144, 160, 176), [128, 144, 160, 176])
    """

    def __init__(self, tokenizer: Any, examples: Sequence[Example], *, batch_size: int,
                 seq_len: int | None = None, seed: int = 0, max_seq_len: int | None = None,
                 system: str | None = None, truncate: bool = False, bucket_limit: int | None = None,
                 replies: str = "all"):
        if not examples:
            raise ValueError("no training examples")
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
        refuse_control_text(tokenizer, self.examples, system)
        if replies not in REPLIES:
            raise ValueError(f"replies must be one of {', '.join(map(repr, REPLIES))}, got {replies!r}")
        self.rows = [encode_turns(tokenizer, ex, system) if replies == "all" else (*encode_example(tokenizer, ex, system), ())
                     for ex in self.examples]
        self.longest = max(len(ids) for ids, *_ in self.rows)
        self.buckets = None
        if bucket_limit is not None:
            if seq_len is not None or truncate:
                raise ValueError("bucket_limit pads each batch to its own length: give it without"
                                 " seq_len and truncate")
            if bucket_limit < 1 or (max_seq_len is not None and bucket_limit > max_seq_len):
                raise SequenceLengthError(f"--max-seq-len {bucket_limit} must be between 1 and the"
                                          f" model's context of {max_seq_len} tokens")
            too_long = [(i, len(ids)) for i, (ids, *_) in enumerate(self.rows) if len(ids) > bucket_limit]
            if too_long:
                i, n = max(too_long, key=lambda x: x[1])
                prompt = self.examples[i].prompt
                raise SequenceLengthError(
                    f"{len(too_long)} example(s) are longer than --max-seq-len {bucket_limit}; the"
                    f" longest, the training example {prompt[:40]!r}{'...' if len(prompt) > 40 else ''},"
                    f" has {n} tokens (prompt {self.rows[i][1]}): raise --max-seq-len to at least {n},"
                    f" or leave the long examples out of the data")
            self.buckets = choose_buckets([max(len(self.rows[i][0]) for i in self.indices(s))
                                           for s in range(len(self))], bucket_limit)
            seq_len = self.buckets[-1]
        if seq_len is None:
            seq_len = -(-self.longest // 16) * 16
            if max_seq_len is not None and seq_len > max_seq_len and (
                    truncate or self.longest <= max_seq_len):
                seq_len = max_seq_len
        if max_seq_len is not None and seq_len > max_seq_len:
            raise SequenceLengthError(
                f"sequence length {seq_len} exceeds the model's context of {max_seq_len}"
                f" tokens" + (f" (the longest example needs {self.longest})"
                              if self.longest > max_seq_len else ""))
        too_long = [(i, len(ids)) for i, (ids, *_) in enumerate(self.rows) if len(ids) > seq_len]
        if too_long and not truncate:
            i, n = max(too_long, key=lambda x: x[1])
            raise SequenceLengthError(
                f"{len(too_long)} example(s) exceed seq_len={seq_len}; the longest, example"
                f" {self.examples[i].source or i} ({self.examples[i].prompt[:40]!r}), needs {n} tokens"
                f" (prompt {self.rows[i][1]}): raise seq_len"
                f" to at least {n} or pass truncate=True")
        if truncate:
            cut = [i for i, (ids, n_prompt, _) in enumerate(self.rows) if n_prompt >= seq_len]
            if cut:  # a row with no answer left counts nowhere: its example would vanish from the loss
                prompt = self.examples[cut[0]].prompt
                raise SequenceLengthError(
                    f"{len(cut)} example(s) have prompts of {seq_len} tokens or more: truncated to"
                    f" seq_len={seq_len}, nothing of their answers would be left (the first:"
                    f" {prompt[:40]!r}{'...' if len(prompt) > 40 else ''}, prompt {self.rows[cut[0]][1]}"
                    f" tokens); raise seq_len or leave them out")
            # the earlier replies lie in the prompt, which fits
            self.rows = [(ids[:seq_len], min(n_prompt, seq_len), spans) for ids, n_prompt, spans in self.rows]
        self.seq_len = seq_len
        self.buckets = self.buckets or (seq_len,)
        # Loss positions per row: from the first trained token (the answer's, or an earlier
        # reply's) to the answer's end-of-turn, rounded up to 8.
        most = max(min(len(ids), seq_len) - min(spans[0][0] if spans else n, seq_len) + 1
                   for ids, n, spans in self.rows)
        self.answer_window = min(-(-most // 8) * 8, seq_len)

    def __len__(self) -> int:
        """Batches per epoch (the last partial batch wraps into the next epoch)."""
        return -(-len(self.rows) // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        cache = self.__dict__.setdefault("_orders", {})
        if epoch not in cache:
            if len(cache) > 4:
                cache.clear()
            cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return cache[epoch]

    def indices(self, step: int) -> list[int]:
        """Example indices of batch ``step``: a fresh permutation each epoch, no drops."""
        n = len(self.rows)
        start = step * self.batch_size
        out = []
        for k in range(start, start + self.batch_size):
            epoch, pos = divmod(k, n)
            out.append(int(self._order(epoch)[pos]))
        return out

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The batch for training step ``step`` (a pure function of seed and step).

        Its rows have ``seq_len`` tokens, or with buckets the shortest bucket
        that fits them.

        Example:
          >>> from pockjax.models.llama import Tokenizer
          >>> b = Batcher(Tokenizer.byte_level_for_tests(), [Example("hi", "yo")], batch_size=2)
          >>> sorted(b.batch(5))
          ['loss_mask', 'loss_start', 'mask', 'targets', 'tokens']
        """
        rows = [self.rows[i] for i in self.indices(step)]
        longest = max(len(ids) for ids, *_ in rows)
        return collate(rows, next(n for n in self.buckets if n >= longest), self.pad_id)

    def placeholder(self, length: int) -> dict[str, np.ndarray]:
        """A batch of padding only (nothing to learn from) with rows of ``length``: to compile a step for that shape.

        Example:
          >>> from pockjax.models.llama import Tokenizer
          >>> b = Batcher(Tokenizer.byte_level_for_tests(), [Example("hi", "yo")], batch_size=2)
          >>> b.placeholder(16)["tokens"].shape, float(b.placeholder(16)["loss_mask"].sum())
          ((2, 16), 0.0)
        """
        return collate([([self.pad_id], 1)] * self.batch_size, length, self.pad_id)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """Batches for steps 0, 1, 2, ... forever."""
        step = 0
        while True:
            yield self.batch(step)
            step += 1

    def stats(self) -> dict[str, float]:
        """Token counts: mean row length, mean trained tokens (``answer_tokens``: the
        answer's and earlier replies'), padding fraction.

        Example:
          >>> from pockjax.models.llama import Tokenizer
          >>> b = Batcher(Tokenizer.byte_level_for_tests(), [Example("hi", "yo")], batch_size=1)
          >>> b.stats()["answer_tokens"]
          3.0
        """
        lengths = np.array([len(ids) for ids, *_ in self.rows])
        answers = np.array([len(ids) - n + sum(e - s for s, e in spans) for ids, n, spans in self.rows])
        return {"examples": float(len(self.rows)), "mean_length": float(lengths.mean()),
                "max_length": float(lengths.max()), "answer_tokens": float(answers.mean()),
                "padding_fraction": float(1 - lengths.mean() / self.seq_len)}


def choose_buckets(batch_lengths: Sequence[int], limit: int, n: int = BUCKETS, multiple: int = 16
                   ) -> tuple[int, ...]:
    """Up to ``n`` row lengths that pad batches of these longest-row lengths the least.

    Each batch is padded to the shortest chosen length that fits it. The
    lengths are multiples of ``multiple`` (or ``limit`` itself), the longest
    fits every batch; among such sets, the one with the fewest padded tokens
    over ``batch_lengths`` (exact, by dynamic programming).

    Example:
      >>> choose_buckets([20, 30, 100, 40, 200, 33], limit=256)
      (32, 48, 112, 208)
      >>> choose_buckets([20, 30, 100, 40, 200, 33], limit=256, n=2)
      (48, 208)
      >>> choose_buckets([250], limit=250)
      (250,)
    """
    if not batch_lengths:
        raise ValueError("no batches to choose bucket lengths for")
    if max(batch_lengths) > limit:
        raise SequenceLengthError(f"a batch needs {max(batch_lengths)} tokens, more than the limit {limit}")
    need = [min(-(-m // multiple) * multiple, limit) for m in batch_lengths]
    values = sorted(set(need))
    count = [need.count(v) for v in values]
    # best[k][j]: fewest tokens for the batches up to values[j] with k + 1 buckets, the last values[j]
    inf = float("inf")
    best = [[inf] * len(values) for _ in range(n)]
    back = [[-1] * len(values) for _ in range(n)]
    for j in range(len(values)):
        best[0][j] = values[j] * sum(count[:j + 1])
    for k in range(1, n):
        for j in range(len(values)):
            covered = 0
            for p in range(j - 1, -1, -1):
                covered += count[p + 1]
                cost = best[k - 1][p] + values[j] * covered
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, p
    last = len(values) - 1
    k = min(range(n), key=lambda k: (best[k][last], k))
    chosen, j = [], last
    while j >= 0 and k >= 0:
        chosen.append(values[j])
        j, k = back[k][j], k - 1
    return tuple(sorted(chosen))
