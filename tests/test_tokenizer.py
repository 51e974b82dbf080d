"""The GGUF tokenizer against transformers' GGUF tokenizer (fixtures, and live when installed)."""

from __future__ import annotations

import json
import re
import os

import pytest

from pockjax.models import llama
from pockjax.models.llama.tokenizer import Tokenizer, render_chatml

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "llama")


@pytest.fixture(scope="module")
def reference():
    with open(os.path.join(FIXTURES, "tokenizer_reference.json"), encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tok():
    return llama.load_tokenizer(llama.pretrained_path("smollm2-135m"))


def test_special_ids(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.vocab_size == 49152
    assert not tok.add_bos


def test_ids_match_transformers_fixture(tok, reference):
    assert len(reference["strings"]) >= 15
    for text, ids in zip(reference["strings"], reference["ids"]):
        assert tok.encode(text) == ids, repr(text)
        assert tok.decode(ids) == text, repr(text)


def test_batch_encoding_matches_single(tok, reference):
    assert tok.encode_batch(reference["strings"]) == reference["ids"]


def test_chat_template_matches_transformers_fixture(tok, reference):
    for chat in reference["chats"]:
        assert tok.apply_chat_template(chat["messages"], tokenize=False) == chat["text"]
        assert tok.apply_chat_template(chat["messages"]) == chat["ids"]


def test_chat_template_without_jinja(tok, reference, monkeypatch):
    # The built-in ChatML renderer gives the same text as the model's Jinja template.
    import sys

    monkeypatch.setitem(sys.modules, "jinja2", None)
    monkeypatch.setitem(sys.modules, "jinja2.sandbox", None)
    for chat in reference["chats"]:
        assert tok.apply_chat_template(chat["messages"], tokenize=False) == chat["text"]


def test_special_tokens_stay_whole_and_decode_can_skip_them(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_digits_are_split_one_by_one(tok):
    # SmolLM2's pre-tokenizer ("smollm") splits numbers into single digits.
    pieces = [tok.decode([i]) for i in tok.encode("in 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]


def test_training_prompt_tokens_equal_generation_prompt(tok):
    from pockjax.data import encode_example, make_examples

    ex = make_examples("reverse_words", 1, seed=0)[0]
    ids, n_prompt = encode_example(tok, ex)
    assert ids[:n_prompt] == tok.apply_chat_template(ex.messages())
    assert tok.decode(ids[n_prompt:]) == ex.answer + "<|im_end|>"
    # tokenizing prompt and answer apart agrees with tokenizing the whole text
    assert tok.encode(tok.decode(ids)) == ids


def test_earlier_replies_of_a_conversation_are_found_in_smollm2_tokens(tok):
    from pockjax.data import DataError, Example, encode_turns

    ex = Example("And?", "b a", context=(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello there."),
                                          ("user", "More"), ("assistant", "x\ny")))
    ids, n_prompt, spans = encode_turns(tok, ex)
    assert ids[:n_prompt] == tok.apply_chat_template(ex.messages())  # the ids generation sees, unchanged
    assert [tok.decode(ids[s:e]) for s, e in spans] == ["Hello there.<|im_end|>", "x\ny<|im_end|>"]
    # a reply starting with whitespace: BPE reads the header's newline and its spaces as one token,
    # so the reply has no tokens of its own in the conversation; refused, saying why
    ex = Example("And?", "b a", context=(("user", "Hi"), ("assistant", "  indented")))
    with pytest.raises(DataError, match="assistant turn 1 of the context merges into its header's last token"):
        encode_turns(tok, ex)


def test_render_chatml_generation_prompt():
    text = render_chatml([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert text == "<|im_start|>user\nx<|im_end|>\n"


def test_byte_level_tokenizer_for_tests_roundtrips_anything():
    t = Tokenizer.byte_level_for_tests()
    s = "tab\tnl\n😀 ünï"
    assert t.decode(t.encode(s)) == s
    assert t.encode("<|im_end|>") == [258]


def test_unsupported_gguf_tokenizer_is_a_clear_error(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "wpm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("bert")  # SentencePiece ('llama') is supported: tests/test_gemma3.py
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer model 'bert' is not supported"):
        llama.load_tokenizer(path)


def test_hf_dir_tokenizer(tmp_path, tok):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
        "chat_template": tok.chat_template}))
    loaded = llama.load_tokenizer(tmp_path)
    assert loaded.eos_id == 2 and loaded.bos_id == 1
    msgs = [{"role": "user", "content": "Hi 123"}]
    assert loaded.apply_chat_template(msgs) == tok.apply_chat_template(msgs)


def test_ids_match_transformers_live(tok, reference):
    import transformers

    path = llama.pretrained_path("smollm2-135m")
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path))
    extra = ["x = [i**2 for i in range(10)]\n\tpass", "Ça va? Ünïcödé 🤖🚀", "3.14 + 2 = 5.14"]
    for text in reference["strings"] + extra:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), repr(text)
    for chat in reference["chats"]:
        ids = hf.apply_chat_template(chat["messages"], add_generation_prompt=True,
                                     tokenize=True, return_dict=False)
        assert tok.apply_chat_template(chat["messages"]) == list(ids)


def test_only_control_tokens_that_structure_a_chat_are_refused_in_data(tok):
    # SmolLM2's metadata tokens (<filename>, <reponame>) may stand in code or markup: they pass;
    # its turn markers and end of text may not (read as control tokens, trained mid-answer)
    from pockjax.data import DataError, Example, refuse_control_text

    assert {"<filename>", "<reponame>", "<|im_end|>"} <= set(tok.control_tokens())
    refuse_control_text(tok, [Example("Name the tag.", "<filename>notes.txt</filename> and <reponame>")])
    for marker in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"):
        with pytest.raises(DataError, match=f"its answer holds '{re.escape(marker)}'"):
            refuse_control_text(tok, [Example("Q?", f"a {marker} b")])
