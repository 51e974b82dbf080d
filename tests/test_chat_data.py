"""Chat-format JSONL ({"messages": [...]}): the last assistant reply is the answer, earlier turns its context."""

import json

import pytest

from pockjax.data import Batcher, DataError, load_alpaca_jsonl
from pockjax.models import llama

CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "Reverse: a b"}, {"role": "assistant", "content": "b a"}]}


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_alpaca_metadata_keys_are_ignored(tmp_path):
    # exports carry an id, a category or the formatted text: no text of the prompt is lost
    p = _write(tmp_path / "d.jsonl", [{"instruction": "Add.", "input": "2 3", "output": "5", "id": 7,
                                       "category": "math", "text": "### Instruction: Add. ..."}])
    (ex,) = load_alpaca_jsonl(p)
    assert ex.answer == "5" and "2 3" in ex.prompt


def test_chat_and_alpaca_records_mix(tmp_path):
    p = _write(tmp_path / "d.jsonl", [CHAT, {"instruction": "Add.", "input": "2 3", "output": "5"}])
    chat, alpaca = load_alpaca_jsonl(p)
    assert (chat.prompt, chat.answer) == ("Reverse: a b", "b a")
    assert chat.messages(with_answer=True) == CHAT["messages"]
    assert alpaca.context == () and alpaca.answer == "5"


def test_only_the_last_reply_is_trained(tmp_path):
    tok = llama.Tokenizer.byte_level_for_tests()
    (ex,) = load_alpaca_jsonl(_write(tmp_path / "d.jsonl", [CHAT]))
    b = Batcher(tok, [ex], batch_size=1, seed=0).batch(0)
    answer_ids = [int(t) for t, m in zip(b["targets"][0], b["loss_mask"][0]) if m]
    assert tok.decode(answer_ids, skip_special_tokens=True).strip() == "b a"
    assert "Hello." in tok.decode([int(t) for t in b["tokens"][0]])  # the earlier reply is context


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "at least a user and an assistant"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "?"}]}, "ends with user, user"),
    ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]}, "role 'bot'"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]}, "string 'content'"),
    ({"messages": CHAT["messages"][1:3], "id": 7}, "only 'messages'"),
    ({"messages": [CHAT["messages"][1], CHAT["messages"][0], CHAT["messages"][1], CHAT["messages"][2]]},
     "system message may only come first"),
    ({"messages": [CHAT["messages"][1], {"role": "assistant", "content": "  "}]},
     "last assistant message \\(the answer trained on\\) is empty"),
    ({"instruction": "Add.", "input": "2 3", "output": ""}, "empty 'output'"),
    # once dropped without a word: a misspelt input, or history and system fields left out of the prompt
    ({"instruction": "ab", "output": "AB", "inptu": "extra text"}, "'inptu' would be left out of the prompt"),
    ({"instruction": "ab", "output": "AB", "history": [], "system": "x"}, "'history', 'system' would be left out"),
    # the last of two equal keys once won silently (trained on "ZZ")
    ('{"instruction": "ab", "output": "AB", "output": "ZZ"}', r"key 'output' given twice in one object"),
])
def test_bad_chat_records_name_the_line(tmp_path, record, message):
    p = _write(tmp_path / "d.jsonl", [CHAT, record])
    with pytest.raises(DataError, match=f"d.jsonl:2: .*{message}"):
        load_alpaca_jsonl(p)
