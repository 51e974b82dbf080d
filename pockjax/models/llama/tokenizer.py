"""Tokenizers for LLaMA-family models, built with the ``tokenizers`` library.

:func:`load_tokenizer` builds the byte-level BPE tokenizer that a GGUF file
describes in its metadata (``tokenizer.ggml.tokens``, ``merges``,
``token_type``, special token ids and the pre-tokenizer name), or its
SentencePiece-BPE tokenizer (``tokenizer.ggml.model == "llama"``: LLaMA-2,
Gemma 3; :mod:`.spm`), or loads a Hugging Face ``tokenizer.json``.
:class:`Tokenizer` adds the model's chat template (ChatML or Gemma's turns).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Sequence

from pockjax.errors import FileMissingError, TokenizerFileError, UnsupportedModelError
from pockjax.io.atomic import write_json, write_text
from pockjax.io.gguf import GGUFFile, open_gguf
from pockjax.io.tokenizer_json import read_tokenizer_config, read_tokenizer_json
from pockjax.models.llama.config import is_finite_number

__all__ = ["GEMMA_CHAT_TEMPLATE", "SPM_VOCAB_FILE", "Tokenizer", "load_tokenizer", "tokenizer_from_gguf",
           "tokenizer_from_hf_dir", "render_chatml", "render_gemma"]

#: Written beside ``tokenizer.json`` by :meth:`Tokenizer.save` for a SentencePiece-BPE tokenizer:
#: its exact pieces, scores and types (``tokenizer.json`` holds BPE merges, not scores), read back
#: by :func:`tokenizer_from_hf_dir` and needed to write the tokenizer into a GGUF file.
SPM_VOCAB_FILE = "sentencepiece_vocab.json"

# llama.cpp token types (gguf.TokenType).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 split, used by byte-level BPE unless a pre-tokenizer says otherwise.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp pre-tokenizer names (tokenizer.ggml.pre) -> how to split.
# "digits": each digit is its own piece, then the GPT-2 split (StarCoder, SmolLM).
_PRE_TOKENIZERS = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "olmo": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3",
    "dbrx": "llama3", "falcon3": "llama3",
}

_CHATML_DEFAULT_SYSTEM = re.compile(
    r"<\|im_start\|>system\n(.*?)<\|im_end\|>", re.DOTALL)


def render_chatml(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                  default_system: str | None = None) -> str:
    """Renders messages in the ChatML format (``<|im_start|>role\\ncontent<|im_end|>\\n``).

    Args:
      messages: ``[{"role": ..., "content": ...}, ...]``.
      add_generation_prompt: End with ``<|im_start|>assistant\\n``.
      default_system: System message inserted when the first message is not a
        system message (``None``: none).

    Example:
      >>> render_chatml([{"role": "user", "content": "Hi"}], default_system="Be brief.")
      '<|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
    """
    out = []
    if messages and messages[0]["role"] != "system" and default_system is not None:
        out.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for m in messages:
        out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


#: Gemma's chat template (Gemma 3's, as its tokenizer_config.json has it), for GGUF files that
#: carry none; :func:`render_gemma` renders it without Jinja.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\")"
    " + message['content'] | trim + '<end_of_turn>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def render_gemma(messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
                 bos: str = "<bos>") -> str:
    """Renders messages in Gemma's turn format (:data:`GEMMA_CHAT_TEMPLATE`).

    The assistant's turns are the ``model`` role's; a system message is put
    in front of the first user message (Gemma has no system role); contents
    are stripped of surrounding whitespace.

    Example:
      >>> render_gemma([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      ...               {"role": "assistant", "content": "Hello."}], add_generation_prompt=False)
      '<bos><start_of_turn>user\\nBe brief.\\n\\nHi<end_of_turn>\\n<start_of_turn>model\\nHello.<end_of_turn>\\n'
    """
    prefix = ""
    if messages and messages[0]["role"] == "system":
        prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    out = [bos]
    for n, m in enumerate(messages):
        role = "model" if m["role"] == "assistant" else m["role"]
        out.append(f"<start_of_turn>{role}\n{prefix if n == 0 else ''}{m['content'].strip()}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus special ids and the chat template.

    Args:
      backend: The ``tokenizers.Tokenizer`` doing the work.
      bos_id, eos_id, pad_id: Special token ids (``None`` if absent).
      chat_template: The model's Jinja chat template, if any.
      add_bos: Prepend ``bos_id`` in :meth:`encode` by default.

    Attributes:
      backend, bos_id, eos_id, pad_id, chat_template, add_bos.

    Example:
      >>> tok = Tokenizer.byte_level_for_tests()
      >>> tok.decode(tok.encode("héllo wörld"))
      'héllo wörld'
    """

    def __init__(self, backend: Any, *, bos_id: int | None = None, eos_id: int | None = None,
                 pad_id: int | None = None, chat_template: str | None = None,
                 add_bos: bool = False):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.chat_template = chat_template
        self.add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        """Number of token ids, including added tokens.

        Example:
          >>> Tokenizer.byte_level_for_tests().vocab_size
          259
        """
        return self.backend.get_vocab_size(with_added_tokens=True)

    def control_tokens(self) -> dict[str, int]:
        """``{text: id}`` of the control tokens (``<|im_end|>``, ``<start_of_turn>``): written in a
        text, :meth:`encode` reads them as the control token, not as the characters.

        Example:
          >>> Tokenizer.byte_level_for_tests().control_tokens()["<|im_end|>"]
          258
        """
        cached = getattr(self, "_control", None)
        if cached is None:
            b = self.backend
            cached = (b.control_tokens() if hasattr(b, "control_tokens")
                      else {t.content: i for i, t in b.get_added_tokens_decoder().items() if t.special and t.content})
            self._control = cached
        return cached

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. ``"<|im_end|>"``), or ``None``.

        Example:
          >>> Tokenizer.byte_level_for_tests().token_to_id("<|im_end|>")
          258
        """
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are parsed.

        Args:
          text: The string to encode.
          add_bos: Prepend the BOS id (default: the model's ``add_bos``).

        Example:
          >>> tok = Tokenizer.byte_level_for_tests()
          >>> tok.encode("ab")
          [97, 98]
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def encode_batch(self, texts: Iterable[str], add_bos: bool | None = None) -> list[list[int]]:
        """:meth:`encode` over several strings (in parallel in the backend).

        Example:
          >>> Tokenizer.byte_level_for_tests().encode_batch(["a", "bc"])
          [[97], [98, 99]]
        """
        encs = self.backend.encode_batch(list(texts), add_special_tokens=False)
        use_bos = (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None
        return [([self.bos_id] if use_bos else []) + e.ids for e in encs]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids.

        Example:
          >>> tok = Tokenizer.byte_level_for_tests()
          >>> tok.decode([104, 105])
          'hi'
        """
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``, as text.

        Uses ``jinja2`` to render the model's own template when it is installed;
        otherwise, for ChatML templates (``<|im_start|>``), a built-in renderer
        that keeps the template's default system message.

        Example:
          >>> tok = Tokenizer.byte_level_for_tests()
          >>> tok.render_chat([{"role": "user", "content": "Hi"}])
          '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
        """
        template = self.chat_template
        if template is not None and "<start_of_turn>" in template:  # Gemma
            bos = self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""
            return render_gemma(messages, add_generation_prompt, bos)
        if template is None or "<|im_start|>" in template:
            default_system = None
            if template is not None:
                m = _CHATML_DEFAULT_SYSTEM.search(template.replace("\\n", "\n"))
                if m and "messages[0]['role'] != 'system'" in template:
                    default_system = m.group(1)
            chatml = render_chatml(messages, add_generation_prompt, default_system)
            if template is None:
                return chatml
        try:
            import jinja2.sandbox
        except ImportError:
            if template is not None and "<|im_start|>" in template:
                return chatml
            raise ImportError("rendering this model's chat template needs jinja2"
                              " (pip install jinja2)") from None
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise ValueError(msg)

        env.globals["raise_exception"] = raise_exception
        special = {"bos_token": "", "eos_token": ""}
        if self.bos_id is not None:
            special["bos_token"] = self.backend.id_to_token(self.bos_id)
        if self.eos_id is not None:
            special["eos_token"] = self.backend.id_to_token(self.eos_id)
        try:
            compiled = env.from_string(template)
        except jinja2.TemplateError as e:
            raise TokenizerFileError(f"the model's chat template is not valid Jinja: {e}") from None
        try:
            return compiled.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt, **special)
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise TokenizerFileError(f"the model's chat template fails: {e}") from None

    def apply_chat_template(self, messages: Sequence[dict[str, str]],
                            add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """Token ids (or text, with ``tokenize=False``) of a chat.

        Args:
          messages: ``[{"role": "user", "content": "..."}, ...]``.
          add_generation_prompt: End with the assistant header so the model
            answers next.
          tokenize: Return ids (default) or the rendered text.

        Example:
          >>> tok = Tokenizer.byte_level_for_tests()
          >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)[:15]
          '<|im_start|>use'
        """
        text = self.render_chat(messages, add_generation_prompt)
        return self.encode(text, add_bos=False) if tokenize else text

    def save(self, path: str | os.PathLike) -> None:
        """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into directory ``path``.

        :func:`load_tokenizer` reads them back (chat template and special
        tokens included), e.g. next to :func:`save_hf_checkpoint` weights.

        Example:
          >>> import tempfile
          >>> d = tempfile.mkdtemp()
          >>> Tokenizer.byte_level_for_tests().save(d)
          >>> load_tokenizer(d).eos_id
          258
        """
        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)

        def name(tid):
            return None if tid is None else self.backend.id_to_token(tid)

        config = {"bos_token": name(self.bos_id), "eos_token": name(self.eos_id),
                  "pad_token": name(self.pad_id), "add_bos_token": self.add_bos,
                  "chat_template": self.chat_template}
        from pockjax.models.llama.spm import SentencePieceBPE

        write_text(os.path.join(path, "tokenizer.json"), self.backend.to_str())
        write_json(os.path.join(path, "tokenizer_config.json"), config, indent=1)
        spm_file = os.path.join(path, SPM_VOCAB_FILE)
        if isinstance(self.backend, SentencePieceBPE):
            b = self.backend
            write_json(spm_file, {"tokens": b.tokens, "scores": b.scores, "types": b.types, "unk_id": b.unk_id,
                                  "add_space_prefix": b.add_space_prefix}, indent=None)
        elif os.path.exists(spm_file):  # an earlier tokenizer's: it would be read instead of this one
            os.remove(spm_file)

    @classmethod
    def byte_level_for_tests(cls) -> "Tokenizer":
        """A 256-token byte-level tokenizer with ChatML specials, for tests and docs.

        Example:
          >>> Tokenizer.byte_level_for_tests().vocab_size
          259
        """
        from tokenizers import pre_tokenizers

        byte_map = _bytes_to_unicode()
        tokens = [byte_map[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>",
                                                       "<|im_end|>"]
        types = [_NORMAL] * 256 + [_CONTROL] * 3
        backend = _byte_level_bpe(tokens, [], types, pre_tokenizers.ByteLevel(
            add_prefix_space=False, use_regex=True))
        return cls(backend, bos_id=None, eos_id=258, pad_id=256,
                   chat_template=None)


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable unicode character map.
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int] | None,
                    pre_tokenizer: Any, source: str = "tokenizer"):
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerFileError(f"{source}: malformed BPE merge {m!r} (expected"
                                     f" 'left right')")
        pairs.append((a, b))
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                         byte_fallback=False, ignore_merges=False))
    except Exception as e:  # the Rust library raises a bare Exception
        raise TokenizerFileError(f"{source}: the tokenizers library rejects the vocabulary:"
                                 f" {str(e).strip() or type(e).__name__}") from None
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    types = token_types or [_NORMAL] * len(tokens)
    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
    return backend


def _pre_tokenizer(name: str | None, source: str = "tokenizer"):
    from tokenizers import Regex, pre_tokenizers

    kind = _PRE_TOKENIZERS.get(name or "default") if isinstance(name, (str, type(None))) else None
    if kind is None:
        raise UnsupportedModelError(
            f"{source}: unsupported GGUF pre-tokenizer {name!r}; supported:"
            f" {sorted(_PRE_TOKENIZERS)}")
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = _LLAMA3_SPLIT
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _is_str_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, str) for t in x)


def _check_vocabulary(source: str, tokens: Any, types: Any, tokens_key: str, types_key: str) -> None:
    if not _is_str_list(tokens) or not tokens:
        raise TokenizerFileError(f"{source}: {tokens_key} must be a non-empty list of strings")
    if len(set(tokens)) != len(tokens):
        raise TokenizerFileError(f"{source}: {tokens_key} lists a token twice")
    if types is not None and not (isinstance(types, list) and len(types) == len(tokens)
                                  and all(type(t) is int for t in types)):
        raise TokenizerFileError(f"{source}: {types_key} must be a list of {len(tokens)} integers, one per token")


def _spm_backend(source: str, tokens: list, scores: Any, types: Any, unk: Any, add_space_prefix: Any,
                 prefix: str) -> Any:
    """A checked :class:`~pockjax.models.llama.spm.SentencePieceBPE` (tokens and types already checked)."""
    from pockjax.models.llama.spm import SentencePieceBPE

    if not (isinstance(scores, list) and len(scores) == len(tokens) and all(map(is_finite_number, scores))):
        # finite: a NaN breaks the merge order, and the tokenizer could not be saved (JSON has no NaN)
        raise TokenizerFileError(f"{source}: {prefix}scores must be a list of {len(tokens)} numbers, one per"
                                 f" token, none NaN or infinite")
    unk_key = "unknown_token_id" if prefix else "unk_id"
    if unk is not None and not (type(unk) is int and 0 <= unk < len(tokens)):
        raise TokenizerFileError(f"{source}: {prefix}{unk_key} {unk!r} is not a token id")
    if not isinstance(add_space_prefix, bool):
        raise TokenizerFileError(f"{source}: {prefix}add_space_prefix must be true or false, got {add_space_prefix!r}")
    return SentencePieceBPE(tokens, scores, types, unk_id=unk, add_space_prefix=add_space_prefix)


def _spm_from_vocab_file(path: str, hf_backend: Any) -> Any:
    """The SentencePiece-BPE backend of :data:`SPM_VOCAB_FILE`, checked against ``tokenizer.json``'s vocabulary."""
    from pockjax.io.jsonfile import read_json_object

    spec = read_json_object(path, error=TokenizerFileError, what="SentencePiece vocabulary")
    unknown = set(spec) - {"tokens", "scores", "types", "unk_id", "add_space_prefix"}
    if unknown or not {"tokens", "scores"} <= set(spec):
        raise TokenizerFileError(f"{path}: expected the keys tokens, scores and optionally types, unk_id,"
                                 f" add_space_prefix; got {sorted(spec)}")
    _check_vocabulary(path, spec["tokens"], spec.get("types"), "tokens", "types")
    backend = _spm_backend(path, spec["tokens"], spec["scores"], spec.get("types"), spec.get("unk_id"),
                           spec.get("add_space_prefix", False), "")
    if hf_backend.get_vocab(with_added_tokens=True) != backend.vocab:
        raise TokenizerFileError(f"{path}: its pieces are not those of tokenizer.json beside it (one of the two"
                                 f" was replaced); save the tokenizer again, or delete {SPM_VOCAB_FILE} to use"
                                 f" tokenizer.json alone")
    return backend


def tokenizer_from_gguf(reader: GGUFFile) -> Tokenizer:
    """Builds the :class:`Tokenizer` described by an open GGUF file's metadata.

    Supports byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``),
    as used by SmolLM, LLaMA-3 and StarCoder-style models, and
    SentencePiece-BPE ones (``"llama"``: LLaMA-2, Gemma 3), encoded as
    llama.cpp does (:class:`~pockjax.models.llama.spm.SentencePieceBPE`). A
    file without a chat template whose vocabulary has ``<start_of_turn>``
    gets :data:`GEMMA_CHAT_TEMPLATE`.

    Raises:
      UnsupportedModelError: for other tokenizer models, or an unknown
        pre-tokenizer (a ``ValueError``).
      TokenizerFileError: tokenizer metadata of the wrong type or size.

    Example (not run: reads a model file)::

      tok = tokenizer_from_gguf(open_gguf(pretrained_path("smollm2-135m")))
      tok.encode("Hello world")   # [19556, 905]
    """
    source = reader.path
    model = reader.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"{source}: GGUF tokenizer model {model!r} is not supported (pockjax builds"
            f" byte-level BPE 'gpt2' and SentencePiece 'llama' tokenizers)")
    tokens = reader.get("tokenizer.ggml.tokens")
    merges = reader.get("tokenizer.ggml.merges", [])
    types = reader.get("tokenizer.ggml.token_type")
    _check_vocabulary(source, tokens, types, "tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
    if not _is_str_list(merges):
        raise TokenizerFileError(f"{source}: tokenizer.ggml.merges must be a list of strings")
    ids = {}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        tid = reader.get(f"tokenizer.ggml.{key}")
        if tid is not None and not (type(tid) is int and 0 <= tid < len(tokens)):
            raise TokenizerFileError(f"{source}: tokenizer.ggml.{key} {tid!r} is not a token id"
                                     f" (the vocabulary has {len(tokens)} tokens)")
        ids[key] = tid
    template = reader.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerFileError(f"{source}: tokenizer.chat_template must be a string")
    if model == "llama":
        backend = _spm_backend(source, tokens, reader.get("tokenizer.ggml.scores"), types,
                               reader.get("tokenizer.ggml.unknown_token_id"),
                               reader.get("tokenizer.ggml.add_space_prefix", True), "tokenizer.ggml.")
        if template is None and "<start_of_turn>" in backend.vocab:
            template = GEMMA_CHAT_TEMPLATE
    else:
        backend = _byte_level_bpe(tokens, merges, types,
                                  _pre_tokenizer(reader.get("tokenizer.ggml.pre"), source), source)
    return Tokenizer(
        backend,
        bos_id=ids["bos_token_id"],
        eos_id=ids["eos_token_id"],
        pad_id=ids["padding_token_id"],
        chat_template=template,
        add_bos=bool(reader.get("tokenizer.ggml.add_bos_token", False)),
    )


def tokenizer_from_hf_dir(path: str | os.PathLike) -> Tokenizer:
    """Loads ``tokenizer.json`` (+ ``tokenizer_config.json``) from a Hugging Face directory.

    Raises:
      FileMissingError: no ``tokenizer.json`` in ``path`` (a ``FileNotFoundError``).
      TokenizerFileError: a corrupt ``tokenizer.json`` or ``tokenizer_config.json``.

    Example:
      >>> import tempfile, os
      >>> d = tempfile.mkdtemp()
      >>> Tokenizer.byte_level_for_tests().backend.save(os.path.join(d, "tokenizer.json"))
      >>> tokenizer_from_hf_dir(d).encode("ok")
      [111, 107]
    """
    path = os.fspath(path)
    tj = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tj):
        raise FileMissingError(f"no tokenizer.json in {path}")
    backend = read_tokenizer_json(tj)
    spm_file = os.path.join(path, SPM_VOCAB_FILE)
    if os.path.isfile(spm_file):  # the exact SentencePiece tokenizer tokenizer.json stands in for
        backend = _spm_from_vocab_file(spm_file, backend)
    cj = os.path.join(path, "tokenizer_config.json")
    cfg = read_tokenizer_config(cj) if os.path.isfile(cj) else {}

    def special(name):
        tok = cfg.get(name)
        if not tok:
            return None
        tid = backend.token_to_id(tok)
        if tid is None:
            raise TokenizerFileError(f"{cj}: {name} {tok!r} is not in the vocabulary of {tj}")
        return tid

    # A post-processor in tokenizer.json may add BOS itself; encode() calls the backend
    # without special tokens, so follow tokenizer_config's add_bos_token.
    return Tokenizer(backend, bos_id=special("bos_token"), eos_id=special("eos_token"),
                     pad_id=special("pad_token"), chat_template=cfg.get("chat_template"),
                     add_bos=bool(cfg.get("add_bos_token", False)))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Loads a tokenizer from a ``.gguf`` file or a Hugging Face model directory.

    Raises:
      FileMissingError: ``path`` does not exist.
      GGUFError, TokenizerFileError, UnsupportedModelError: a corrupt or
        unsupported tokenizer.

    Example (not run: reads a model file)::

      tok = load_tokenizer(pretrained_path("smollm2-135m"))
      tok.decode(tok.encode("Hello world"))   # 'Hello world'
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return tokenizer_from_hf_dir(path)
    if not os.path.exists(path):
        raise FileMissingError(f"tokenizer source {path} does not exist (expected a .gguf file"
                               f" or a model directory)")
    return tokenizer_from_gguf(open_gguf(path))
