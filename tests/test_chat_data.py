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
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "?"}]},
     "messages\\[1\\] is a user message where an assistant message is due"),
    # accepted once: turns that do not alternate (a chat template renders them as it can, or fails),
    # an empty turn of the context, a chat that starts with the assistant
    ({"messages": [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "?"},
                   {"role": "assistant", "content": "!"}]}, "messages\\[0\\] is an assistant message where a user"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "assistant", "content": "c"}]}, "messages\\[2\\] is an assistant message"),
    ({"messages": [{"role": "user", "content": " "}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
     "messages\\[0\\] \\(user\\) is empty"),
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


@pytest.mark.parametrize("where", ["answer", "prompt", "context", "system"])
def test_a_control_token_written_in_the_text_is_refused(where):
    # '<|im_end|>' in a user message or an answer was encoded as the control token and trained
    # on (the model learned to end its turn mid-answer); an answer holding it could never match
    from pockjax.data import Example

    tok = llama.Tokenizer.byte_level_for_tests()
    text = "It ends a turn: <|im_end|> closes it."
    ex = {"answer": Example("What is it?", text), "prompt": Example(text, "ok"),
          "context": Example("And?", "ok", context=(("user", "Hi"), ("assistant", text))),
          "system": Example("What is it?", "ok")}[where]
    system = text if where == "system" else None
    field = {"answer": "answer", "prompt": "prompt", "context": "assistant turn", "system": "system message"}[where]
    with pytest.raises(DataError, match=f"example 0 .*its {field} holds '<\\|im_end\\|>', which the tokenizer reads"
                                        " as its control token \\(id 258\\)"):
        Batcher(tok, [Example("Hi", "yo"), ex][1:], batch_size=1, seed=0, system=system)
    Batcher(tok, [Example("What is <im_end>?", "a tag, <|im_end without its bar")], batch_size=1, seed=0)


def test_a_held_out_record_is_never_trained_on(tmp_path):
    # a record given twice was held out and trained on: held-out accuracy measured memory
    from pockjax.train.finetune import FinetuneConfig, _examples

    records = [{"instruction": f"Q{i}", "output": f"A{i}"} for i in range(6)] * 2
    cfg = FinetuneConfig(data=str(_write(tmp_path / "d.jsonl", records)), eval_examples=3)
    train, held, _ = _examples(cfg)
    assert len(held) == 3 and not {e.prompt for e in held} & {e.prompt for e in train}
    assert len(train) == 6  # the 3 other prompts, twice each
    cfg = FinetuneConfig(data=str(_write(tmp_path / "e.jsonl", [records[0]] * 4)), eval_examples=1)
    with pytest.raises(DataError, match="every record's prompt is among the 1 held out"):
        _examples(cfg)


def test_chat_examples_round_trip_through_save(tmp_path):
    # save_alpaca_jsonl dropped a chat example's earlier turns; an input of spaces alone is no input
    from pockjax.data import save_alpaca_jsonl

    exs = load_alpaca_jsonl(_write(tmp_path / "d.jsonl", [CHAT, {"instruction": "Say hi.", "input": " ",
                                                                   "output": "  hi\n"}]))
    assert exs[1].prompt == "Say hi." and exs[1].answer == "  hi\n"
    save_alpaca_jsonl(tmp_path / "out.jsonl", exs)
    assert load_alpaca_jsonl(tmp_path / "out.jsonl") == exs
    with pytest.raises(DataError, match="instruction= applies to single-turn examples"):
        save_alpaca_jsonl(tmp_path / "x.jsonl", exs, instruction="Answer.")
