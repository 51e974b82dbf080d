"""Chat-format JSONL ({"messages": [...]}): the last assistant reply is the answer, earlier turns its
context; every assistant reply is trained on."""

import json
import os

import pytest

from pockjax.data import Batcher, DataError, SequenceLengthError, load_alpaca_jsonl
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


def _trained(tok, batch, row=0):
    """The trained target tokens of a row, as runs of consecutive positions, decoded."""
    runs, last = [], None
    for t, (target, m) in enumerate(zip(batch["targets"][row], batch["loss_mask"][row])):
        if m:
            if last != t - 1:
                runs.append([])
            runs[-1].append(int(target))
            last = t
    return [tok.decode(r) for r in runs]


def test_every_assistant_reply_is_trained_and_nothing_else(tmp_path):
    # only the last reply was trained: a conversation's earlier replies taught the model nothing
    tok = llama.Tokenizer.byte_level_for_tests()
    (ex,) = load_alpaca_jsonl(_write(tmp_path / "d.jsonl", [CHAT]))
    b = Batcher(tok, [ex], batch_size=1, seed=0)
    batch = b.batch(0)
    assert _trained(tok, batch) == ["Hello.<|im_end|>", "b a<|im_end|>"]  # not the system or user turns
    assert int(batch["loss_start"][0]) == b.rows[0][2][0][0] - 1
    # the ids are those the prompt is generated from: the whole conversation as the template renders it
    assert b.rows[0][0][:b.rows[0][1]] == tok.apply_chat_template(ex.messages(), add_generation_prompt=True)
    # the answer window reaches from the first reply to the answer's end, so the windowed loss
    # reads every trained position
    import jax.numpy as jnp
    from pockjax.models.llama.model import answer_window
    _, mask = answer_window({k: jnp.asarray(v) for k, v in batch.items()}, b.answer_window)
    assert float(mask.sum()) == float(batch["loss_mask"].sum()) == len("Hello.") + len("b a") + 2
    assert b.stats()["answer_tokens"] == len("Hello.") + len("b a") + 2
    # a single-turn record: the answer alone, as before
    (single,) = load_alpaca_jsonl(_write(tmp_path / "s.jsonl", [{"instruction": "Hi", "output": "yo"}]))
    assert _trained(tok, Batcher(tok, [single], batch_size=1, seed=0).batch(0)) == ["yo<|im_end|>"]


def test_replies_last_trains_only_the_last_reply():
    tok = llama.Tokenizer.byte_level_for_tests()
    from pockjax.data import Example

    ex = Example("Reverse: a b", "b a", context=tuple((m["role"], m["content"]) for m in CHAT["messages"][:3]))
    assert _trained(tok, Batcher(tok, [ex], batch_size=1, seed=0, replies="last").batch(0)) == ["b a<|im_end|>"]
    assert _trained(tok, Batcher(tok, [ex], batch_size=1, seed=0).batch(0)) == ["Hello.<|im_end|>", "b a<|im_end|>"]
    with pytest.raises(ValueError, match="replies must be one of 'all', 'last', got 'first'"):
        Batcher(tok, [ex], batch_size=1, seed=0, replies="first")


@pytest.mark.parametrize("replies", ["all", "last"])
def test_a_conversation_that_continues_a_held_out_one_is_not_trained_on(tmp_path, replies):
    # with every reply trained, a record continuing a held-out conversation trained its held-out
    # answer verbatim (prompt, answer and end of turn): exact match then measured memory
    from pockjax.train.finetune import FinetuneConfig, _examples

    first = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    longer = {"messages": first["messages"] + [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}]}
    other = [{"instruction": f"P{i}", "output": f"R{i}"} for i in range(4)]
    for seed in range(20):  # a seed whose held-out record is `first`
        cfg = FinetuneConfig(data=str(_write(tmp_path / "d.jsonl", [first, longer, *other])), eval_examples=1,
                             seed=seed, train_replies=replies)
        train, held, _ = _examples(cfg)
        if held[0].prompt == "Q":
            break
    assert held[0].prompt == "Q"
    continued = [ex for ex in train if ex.prompt == "Q2"]
    # trained as context only (replies="last"), the continuation stays
    assert len(continued) == (0 if replies == "all" else 1) and len(train) == (4 if replies == "all" else 5)


def test_a_template_that_renders_an_earlier_reply_elsewhere_is_refused():
    # a template that drops earlier replies (as reasoning templates drop their thoughts) leaves
    # nothing to find: refused, naming the example, not trained on the wrong tokens
    from pockjax.data import Example

    class Dropping(llama.Tokenizer):
        def render_chat(self, messages, add_generation_prompt=True):
            kept = [m for m in messages[:-1] if m["role"] != "assistant"] + list(messages[-1:])
            return super().render_chat(kept, add_generation_prompt)

    base = llama.Tokenizer.byte_level_for_tests()
    tok = Dropping(base.backend, bos_id=base.bos_id, eos_id=base.eos_id, pad_id=base.pad_id,
                   chat_template=base.chat_template, add_bos=base.add_bos)
    ex = Example("And?", "b", context=(("user", "Hi"), ("assistant", "a")))
    with pytest.raises(DataError, match="example 'And\\?': its assistant turn 1 of the context is not where the"
                                        " conversation before it.*Train only the last reply of each conversation \\(Batcher\\(replies='last'\\),"
                                        " finetune --train-replies last\\)"):
        Batcher(tok, [ex], batch_size=1, seed=0)


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
    ({"messages": [{"role": "system", "content": " "}, *CHAT["messages"][1:3]]}, "messages\\[0\\] \\(system\\) is empty"),
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
    ({"instruction": "Answer the question.", "question": "What is 17+25?", "output": "42"},
     "'question' would be left out"),
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


def test_errors_about_a_record_name_its_line(tmp_path):
    # once "example 9": its place in the shuffled training list, not in the file
    tok = llama.Tokenizer.byte_level_for_tests()
    rows = [{"instruction": f"Q{i}", "output": f"A{i}"} for i in range(3)]
    bad = _write(tmp_path / "d.jsonl", rows + [{"instruction": "Q", "output": "ends <|im_end|> here"}])
    with pytest.raises(DataError, match=r"example .*d\.jsonl:4 \('Q'\): its answer holds '<\|im_end\|>'"):
        Batcher(tok, load_alpaca_jsonl(bad)[::-1], batch_size=1, seed=0)
    long = _write(tmp_path / "e.jsonl", rows + [{"instruction": "Q", "output": "x" * 200}])
    with pytest.raises(SequenceLengthError, match=r"the longest, example .*e\.jsonl:4 \('Q'\), needs"):
        Batcher(tok, load_alpaca_jsonl(long)[::-1], batch_size=1, seed=0, seq_len=64)


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
    # the same question and answer under a system message, after other turns, or among the earlier
    # turns of a conversation: once trained while its twin was held out
    def chat(*turns, system=None):
        msgs = [{"role": "system", "content": system}] if system else []
        return {"messages": msgs + [{"role": r, "content": c} for r, c in zip(("user", "assistant") * 3, turns)]}

    twins = [chat("Capital of France?", "Paris"), chat("Capital of France?", "Paris", system="Be brief."),
             chat("Hi", "Hello", "Capital of France?", "Paris"), chat("Capital of France?", "Paris", "And Spain?", "Madrid")]
    others = [chat(f"Q{i}", f"A{i}") for i in range(4)]
    checked = 0
    for seed in range(8):
        cfg = FinetuneConfig(data=str(_write(tmp_path / "f.jsonl", twins + others)), eval_examples=1, seed=seed)
        train, held, _ = _examples(cfg)
        if held[0].prompt == "Capital of France?":
            checked += 1
            assert all("Paris" not in (e.answer, *(c for _, c in e.context)) for e in train), (seed, train)
            assert len(train) == 4  # the four others
    assert checked >= 2


def test_a_run_on_a_relative_data_path_resumes_from_another_directory(tmp_path, monkeypatch):
    # run.json held "d.jsonl" as given: resumed elsewhere it named another (or no) file
    from pockjax.train import finetune
    from test_finetune import cfg, tiny_model

    tok = llama.Tokenizer.byte_level_for_tests()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _write(tmp_path / "a" / "d.jsonl", [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(8)])
    monkeypatch.chdir(tmp_path / "a")
    out = str(tmp_path / "run")
    finetune(cfg(data="d.jsonl", out=out, steps=2, save_every=2, eval_examples=2), model=tiny_model(), tokenizer=tok,
             log=lambda s: None)
    assert json.load(open(os.path.join(out, "run.json")))["config"]["data"] == str(tmp_path / "a" / "d.jsonl")
    monkeypatch.chdir(tmp_path / "b")
    res = finetune(cfg(out=out, resume=True, steps=3), log=lambda s: None)
    assert len(res.metrics["losses"]) == 3


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


def test_finetune_trains_every_reply_of_chat_records(tmp_path):
    # end to end: conversations of two replies train (their held-out loss too) and the run records
    # what it trained; the first reply's loss positions reach the compiled step's answer window
    import math

    from pockjax.train import finetune
    from test_finetune import cfg, tiny_model

    tok = llama.Tokenizer.byte_level_for_tests()
    records = [{"messages": [{"role": "user", "content": f"Say {i}."}, {"role": "assistant", "content": f"{i}"},
                             {"role": "user", "content": "Again."}, {"role": "assistant", "content": f"{i} {i}"}]}
               for i in range(8)]
    out = tmp_path / "run"
    res = finetune(cfg(data=str(_write(tmp_path / "d.jsonl", records)), steps=2, save_every=0, eval_every=2,
                       out=str(out), show=0), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    assert len(res.metrics["losses"]) == 2 and all(map(math.isfinite, res.metrics["losses"]))
    assert [s for s, _ in res.metrics["val_losses"]] == [2] and math.isfinite(res.metrics["val_losses"][0][1])
    assert json.loads((out / "run.json").read_text())["config"]["train_replies"] == "all"
