"""Jit-compiled text generation with a KV cache: greedy, temperature and top-p.

Prompts of different lengths are left-padded to a common length (rounded up to
a multiple of ``pad_to_multiple`` so that few shapes get compiled); each row's
RoPE positions count only its real tokens, and padding slots are masked out of
attention, so a prompt generates the same tokens alone or in a batch.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pockjax.errors import InputError
from pockjax.models.llama.model import Llama

__all__ = ["check_finite_weights", "generate", "generate_text", "sample_logits"]


def sample_logits(logits: jax.Array, key: jax.Array, temperature: float | jax.Array = 1.0,
                  top_p: float | jax.Array = 1.0) -> jax.Array:
    """Samples one token per row with temperature and nucleus (top-p) filtering.

    Args:
      logits: ``(batch, vocab)``.
      key: A PRNG key.
      temperature: Divides the logits (> 0).
      top_p: Keep the smallest set of tokens whose probability reaches
        ``top_p`` (the most likely token is always kept).

    Returns:
      int32 ids, shape ``(batch,)``.

    Example:
      >>> logits = jnp.array([[0.0, 5.0, 0.0]])
      >>> int(sample_logits(logits, jax.random.key(0), 1.0, top_p=0.5)[0])
      1
    """
    logits = logits.astype(jnp.float32) / temperature
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    sorted_probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(sorted_probs, axis=-1)
    keep = (cum - sorted_probs) < top_p          # mass before this token is below top_p
    keep = keep.at[:, 0].set(True)
    threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    masked = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(key, masked, axis=-1).astype(jnp.int32)


def check_finite_weights(model: Llama, source: str = "the model") -> None:
    """Raises :class:`~pockjax.errors.NonFiniteError` if a weight is NaN or infinite.

    A model with such weights answers garbage or nothing at all; ``pockjax
    generate`` refuses it with this error instead (one pass over the weights).

    Example:
      >>> from pockjax.models.llama import LlamaConfig
      >>> m = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> check_finite_weights(m)
      >>> m.norm.scale[...] = m.norm.scale[...].at[0].set(jnp.inf)
      >>> check_finite_weights(m, "tiny")
      Traceback (most recent call last):
      ...
      pockjax.errors.NonFiniteError: tiny holds non-finite weights (norm.scale (0 NaN, 1 inf)); it cannot generate: fine-tune it again with a lower --lr, or use its last good checkpoint
    """
    from pockjax.errors import NonFiniteError
    from pockjax.models.llama.model import flatten_params, split

    for path, x in flatten_params(split(model)[1]).items():
        x = np.asarray(x).astype(np.float32, copy=False)
        if np.isfinite(x).all():
            continue
        n_nan = int(np.isnan(x).sum())
        n_inf = int(np.isinf(x).sum())
        raise NonFiniteError(f"{source} holds non-finite weights ({path} ({n_nan} NaN, {n_inf} inf));"
                             f" it cannot generate: fine-tune it again with a lower --lr, or use"
                             f" its last good checkpoint")


class _LayerByLayer:
    """Runs generation one block at a time, on ``model``'s weights as they are held.

    A decoding step is a few small compiled calls, issued from Python: the
    embedding and rotary tables, then each block in turn (its KV cache in and
    out), then the output projection and the sampler. Alike blocks share one
    compiled program, so compilation stays as short as a scanned model's, and
    no stacked copy of the blocks' weights is ever made (stacking them for one
    scanned program held 490 MB more of SmolLM2 in float32). Quantized
    weights are dequantized inside each block's program, right before each
    product (:func:`~pockjax.transforms.dequantize.quantized_jit`).
    """

    def __init__(self, model):
        from pockjax.models.llama.mixed import LlamaWeights, abstract_model
        from pockjax.models.llama.model import split

        if isinstance(model, LlamaWeights):
            params = model.params
            ref = nnx.merge(model.graphdef, abstract_model(model.config)[1])
            self.cache_dtype = jnp.float32
        else:
            params, ref = split(model)[1], model
            self.cache_dtype = model.embed.embedding.dtype
        cfg = self.config = model.config
        self.rest = {k: v for k, v in params.items() if k != "layers"}
        no_layers = cfg.slice_layers(0, 0).replace(scan_layers=False)  # the embedding, final norm and head
        self.head = nnx.split(nnx.eval_shape(lambda: Llama(no_layers, rngs=nnx.Rngs(0), dtype=ref.embed.dtype,
                                                           param_dtype=ref.embed.param_dtype)))[0]
        if cfg.scan_layers:  # one program takes the stacked weights and the layer's index
            fn = _block_fn(nnx.split(ref.layers)[0], stacked=True)
            self.blocks = [(fn, params["layers"], (jnp.int32(i),)) for i in range(cfg.n_layers)]
        else:
            self.blocks = [(_block_fn(nnx.split(ref.layers[i])[0], stacked=False), params["layers"][i], ())
                           for i in range(cfg.n_layers)]

    def __call__(self, tokens, valid, key, temperature, top_p, stop, pad_id, *, max_new_tokens: int,
                 greedy: bool) -> np.ndarray:
        cfg = self.config
        prepare, pick = _head_fns(self.head, cfg, greedy)
        b, p = tokens.shape
        shape = (b, p + max_new_tokens, cfg.n_kv_heads, cfg.head_dim_)
        caches = [(jnp.zeros(shape, self.cache_dtype), jnp.zeros(shape, self.cache_dtype)) for _ in self.blocks]
        key_valid = jnp.concatenate([valid, jnp.ones((b, max_new_tokens), bool)], axis=1)
        positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
        done = jnp.zeros((b,), bool)
        tok, index, out = tokens, jnp.int32(0), []
        for step in range(max_new_tokens):
            x, tables, local = prepare(self.rest, tok, positions, index, key_valid)
            for i, (fn, weights, extra) in enumerate(self.blocks):
                layer_tables = local if local is not None and cfg.is_sliding(i) else tables
                x, caches[i] = fn(weights, *extra, x, *layer_tables, caches[i], index)
            tok, done, key = pick(self.rest, x[:, -1:], key, done, temperature, top_p, stop, pad_id)
            out.append(tok)
            if step + 1 == max_new_tokens or bool(done.all()):  # every row has stopped: the rest is padding
                break
            positions, index, tok = positions[:, -1:] + 1, jnp.int32(p + step), tok[:, None]
        ids = np.stack([np.asarray(t) for t in out], axis=1)
        pad = np.full((b, max_new_tokens - ids.shape[1]), int(pad_id), ids.dtype)
        return np.concatenate([ids, pad], axis=1)


_BLOCK_FNS: dict = {}
_HEAD_FNS: dict = {}


def _block_fn(graphdef, *, stacked: bool):
    """One block's compiled decoding call (cached per graph definition)."""
    from pockjax.transforms.dequantize import quantized_jit

    fn = _BLOCK_FNS.get((graphdef, stacked))
    if fn is None:
        def block(params, *args):
            if stacked:  # (the layer's slice of the stacked weights, read inside the program)
                i, *args = args
                params = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, i, keepdims=False), params)
            x, cos, sin, mask, cache, index = args
            return nnx.merge(graphdef, params)(x, cos, sin, mask, cache, index)

        fn = _BLOCK_FNS[(graphdef, stacked)] = quantized_jit(block)
    return fn


def _head_fns(graphdef, cfg, greedy: bool):
    """``(prepare, pick)``: the embedding and tables of a step, and its next tokens from the last hidden state."""
    from pockjax.models.llama.model import decode_tables
    from pockjax.transforms.dequantize import quantized_jit

    key = (graphdef, cfg, greedy)
    if key in _HEAD_FNS:
        return _HEAD_FNS[key]
    sliding = cfg.is_sliding(*range(cfg.n_layers))

    def prepare(rest, tokens, positions, index, key_valid):
        tables, local = decode_tables(cfg, positions, index, key_valid, sliding)
        return nnx.merge(graphdef, rest).embed_tokens(tokens), tables, local

    def pick(rest, x, key, done, temperature, top_p, stop, pad_id):
        logits = nnx.merge(graphdef, rest).logits_from_hidden(x)[:, -1]
        key, sub = jax.random.split(key)
        new = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if greedy
               else sample_logits(logits, sub, temperature, top_p))
        new = jnp.where(done, pad_id, new)  # a row that has stopped only pads
        return new, done | jnp.isin(new, stop), key

    fns = _HEAD_FNS[key] = (quantized_jit(prepare), quantized_jit(pick))
    return fns


def generate(model: Llama, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 32,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             stop_ids: Sequence[int] = (), pad_id: int = 0, pad_to_multiple: int = 16,
             batch_size: int | None = None) -> list[list[int]]:
    """Generates continuations of token-id prompts.

    Args:
      model: The :class:`Llama`.
      prompts: One list of token ids per prompt (lengths may differ; none empty).
      max_new_tokens: Number of tokens to generate per prompt.
      temperature: 0 for greedy decoding, else the sampling temperature.
      top_p: Nucleus sampling threshold (with ``temperature > 0``).
      seed: PRNG seed for sampling.
      stop_ids: Ids that end a row (e.g. the EOS / ``<|im_end|>`` id); the stop
        id itself is not returned.
      pad_id: Id used to left-pad prompts (never attended to).
      pad_to_multiple: Prompt length is rounded up to a multiple of this, so
        that prompts of similar length share one compiled program.
      batch_size: Rows per compiled call (default: all prompts at once).

    Returns:
      One list of generated ids per prompt.

    Raises:
      ValueError: an empty prompt, or prompt plus ``max_new_tokens`` longer
        than the model's ``max_seq_len``.

    Example:
      >>> from pockjax.models.llama import Llama, LlamaConfig
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> out = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=4)
      >>> [len(o) for o in out]
      [4, 4]
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    # (a NaN temperature decoded token 0 throughout, a negative one or a top_p outside (0, 1] greedily)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise InputError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.integer, np.floating)) or not 0 < top_p <= 1:
        raise InputError(f"top_p must be in (0, 1], got {top_p!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):  # (-1 returned no answers at all)
        raise InputError(f"batch_size must be a whole number >= 1 or None, got {batch_size!r}")
    if isinstance(pad_to_multiple, bool) or not isinstance(pad_to_multiple, (int, np.integer)) or pad_to_multiple < 1:
        raise InputError(f"pad_to_multiple must be a whole number >= 1, got {pad_to_multiple!r}")
    vocab = model.config.vocab
    checked = []
    for i, p in enumerate(prompts):
        a = None if isinstance(p, (str, bytes, int, np.integer)) else np.asarray(p)
        if a is None or a.ndim != 1:
            raise InputError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if a.size and (not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= vocab):
            # (an id past the vocabulary decoded zeros, -1 the last token, 3.9 token 3)
            raise InputError(f"prompt {i} holds ids that are no token of the model's {vocab}: give whole numbers"
                             f" in [0, {vocab})")
        checked.append([int(t) for t in a])
    prompts = checked
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise InputError("every prompt needs at least one token")
    batch_size = batch_size or len(prompts)
    longest = max(len(p) for p in prompts)
    pad_len = -(-longest // pad_to_multiple) * pad_to_multiple
    limit = model.config.max_seq_len
    if longest + max_new_tokens > limit:
        raise InputError(f"prompt of {longest} tokens + {max_new_tokens} new tokens exceeds"
                         f" the model's context of {limit} tokens")
    pad_len = min(pad_len, limit - max_new_tokens)
    run = _LayerByLayer(model)
    # Pad the stop list to a fixed size so that it does not change the compiled shape.
    stop_list = list(stop_ids)
    stop = jnp.asarray(stop_list + [-1] * (-len(stop_list) % 4 or (4 if not stop_list else 0)),
                       jnp.int32)
    key = jax.random.key(seed)
    results: list[list[int]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start:start + batch_size]
        rows = len(chunk)
        if rows < batch_size and start > 0:  # keep one compiled shape per call
            chunk = chunk + [chunk[-1]] * (batch_size - rows)
        tokens = np.full((len(chunk), pad_len), pad_id, np.int32)
        valid = np.zeros((len(chunk), pad_len), bool)
        for i, p in enumerate(chunk):
            tokens[i, pad_len - len(p):] = p
            valid[i, pad_len - len(p):] = True
        key, sub = jax.random.split(key)
        out = run(jnp.asarray(tokens), jnp.asarray(valid), sub, jnp.float32(max(temperature, 1e-6)),
                  jnp.float32(top_p), stop, jnp.int32(pad_id), max_new_tokens=max_new_tokens,
                  greedy=temperature <= 0.0)[:rows]
        stop_set = set(int(s) for s in stop_ids)
        for row in out.tolist():
            cut = next((j for j, t in enumerate(row) if t in stop_set), len(row))
            results.append(row[:cut])
    return results


def generate_text(model: Llama, tokenizer: Any, prompts: Sequence[str | Sequence[dict]],
                  *, chat: bool = True, max_new_tokens: int = 64, temperature: float = 0.0,
                  top_p: float = 1.0, seed: int = 0, batch_size: int | None = None) -> list[str]:
    """Generates text answers to text prompts or chats.

    Args:
      model: The :class:`Llama`.
      tokenizer: A :class:`pockjax.models.llama.Tokenizer`.
      prompts: Strings, or chats (lists of ``{"role", "content"}`` dicts).
      chat: Wrap string prompts as a single user message and apply the chat
        template (default); with False, strings are encoded as they are.
      max_new_tokens, temperature, top_p, seed, batch_size: as for
        :func:`generate`. Generation stops at the tokenizer's EOS id and at
        ``<|im_end|>`` / ``<|endoftext|>`` when the vocabulary has them.

    Returns:
      The decoded answers (special tokens removed, surrounding whitespace kept).

    Example (not run: needs a pretrained model)::

      model, tok = load_pretrained("smollm2-135m")
      generate_text(model, tok, ["What is the capital of France?"], max_new_tokens=12)
    """
    if isinstance(prompts, str):  # (each character was answered as a prompt of its own)
        raise InputError("prompts is one string: give a list of prompts, e.g. [prompt]")
    from pockjax.data.batching import control_finder

    find = control_finder(tokenizer)
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not chat:
            ids.append(tokenizer.encode(p))
        else:
            messages = [{"role": "user", "content": p}] if isinstance(p, str) else list(p)
            for m in messages:  # (a message could write chat turns of its own: "<|im_end|>...")
                hit = find(m.get("content", "")) if isinstance(m, dict) and isinstance(m.get("content"), str) else None
                if hit is not None:
                    raise InputError(f"prompt {i}: its {m.get('role', '')} message holds {hit[0]!r}, which the"
                                     f" tokenizer reads as its control token (id {hit[1]}): it would end the turn"
                                     f" and write turns of its own; rewrite it, or pass chat=False with the whole"
                                     f" text rendered")
            ids.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    stops = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>"):
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            stops.add(tid)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    out = generate(model, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, seed=seed, stop_ids=sorted(stops), pad_id=pad,
                   batch_size=batch_size)
    return [tokenizer.decode(o, skip_special_tokens=True) for o in out]
