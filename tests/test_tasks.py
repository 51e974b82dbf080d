"""Tasks, exact-match evaluation, Alpaca JSONL loading and batching."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.data import (
    TASKS,
    Batcher,
    DataError,
    Example,
    SequenceLengthError,
    collate,
    encode_example,
    evaluate,
    get_task,
    load_alpaca_jsonl,
    make_examples,
    save_alpaca_jsonl,
    train_eval_split,
)
from pockjax.errors import UnknownTaskError
from pockjax.models import llama
from pockjax.models.llama import LlamaConfig, Tokenizer


@pytest.fixture(scope="module")
def byte_tok():
    return Tokenizer.byte_level_for_tests()


# -- tasks ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_and_distinct(name):
    a = make_examples(name, 50, seed=7)
    assert a == make_examples(name, 50, seed=7)
    assert a != make_examples(name, 50, seed=8)
    assert len({e.prompt for e in a}) == 50
    assert all(e.task == name for e in a)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_train_and_held_out_are_disjoint(name):
    train, held_out = train_eval_split(name, 300, 100, seed=0)
    assert not {e.prompt for e in train} & {e.prompt for e in held_out}
    # the held-out set does not depend on how much training data is drawn
    assert train_eval_split(name, 10, 100, seed=0)[1] == held_out


def test_answers_are_right():
    for ex in make_examples("reverse_words", 20, seed=1):
        sentence = ex.prompt.split(": ", 1)[1]
        assert ex.answer.split() == sentence.split()[::-1]
        assert 3 <= len(sentence.split()) <= 10
    for ex in make_examples("sort_numbers", 20, seed=1):
        nums = [int(x) for x in ex.prompt.split(": ", 1)[1].split(", ")]
        assert ex.answer == ", ".join(map(str, sorted(nums)))
    for ex in make_examples("add", 20, seed=1):
        a, b = ex.prompt.split("What is ")[1].split("?")[0].split(" + ")
        assert int(ex.answer) == int(a) + int(b)
    for ex in make_examples("uppercase", 20, seed=1):
        assert ex.answer == ex.prompt.split(": ", 1)[1].upper()


def test_exact_match_judging():
    rev = make_examples("reverse_words", 1, seed=0)[0]
    task = get_task("reverse_words")
    assert task.is_correct(rev.answer, rev)
    assert task.is_correct("  " + rev.answer.capitalize() + ".\n", rev)
    assert not task.is_correct(rev.prompt.split(": ", 1)[1], rev)  # not reversed
    assert not task.is_correct(rev.answer + " extra", rev)
    up = make_examples("uppercase", 1, seed=0)[0]
    assert not get_task("uppercase").is_correct(up.answer.lower(), up)  # case matters here
    result = evaluate([rev.answer, "nope"], [rev, up])
    assert result == {"accuracy": 0.5, "correct": 1, "total": 2, "wrong": [1]}


def test_unknown_task_lists_known_ones():
    with pytest.raises(UnknownTaskError, match="reverse_words"):
        get_task("translate")
    assert get_task("reverse-words").name == "reverse_words"


def test_messages_chat_format():
    ex = Example("Q?", "A.")
    assert ex.messages() == [{"role": "user", "content": "Q?"}]
    assert ex.messages("Be brief.", with_answer=True) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "A."}]


# -- Alpaca JSONL ---------------------------------------------------------------------------


def test_load_alpaca_jsonl(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        json.dumps({"instruction": "Reverse the words.", "input": "a b c", "output": "c b a"})
        + "\n\n" + json.dumps({"instruction": "Say hi.", "output": "hi"}) + "\n"
        + json.dumps({"instruction": "Say yo.", "input": None, "output": " yo "}) + "\n"
        + json.dumps({"instruction": "Write f.", "input": "def f(x):\n", "output": "    return x\n"}) + "\n",
        encoding="utf-8")
    exs = load_alpaca_jsonl(path)
    # text as written: an answer's leading indentation was stripped away (and trained so)
    assert exs == [Example("Reverse the words.\n\na b c", "c b a", "jsonl"),
                   Example("Say hi.", "hi", "jsonl"), Example("Say yo.", " yo ", "jsonl"),
                   Example("Write f.\n\ndef f(x):\n", "    return x\n", "jsonl")]
    out = tmp_path / "out.jsonl"
    save_alpaca_jsonl(out, exs)
    assert load_alpaca_jsonl(out) == exs


@pytest.mark.parametrize("bad_line, message", [
    ('{"instruction": "x", "output": "y"', "invalid JSON"),
    ('["instruction", "output"]', "expected a JSON object"),
    ('{"instruction": "x"}', "missing 'output'"),
    ('{"output": "y"}', "missing 'instruction'"),
    ('{"instruction": "x", "output": 3}', "'output' must be a string"),
    ('{"instruction": "x", "input": ["a"], "output": "y"}', "'input' must be a string"),
    ('{"instruction": "  ", "output": "y"}', "empty 'instruction'"),
])
def test_malformed_line_names_its_line_number(tmp_path, bad_line, message):
    good = json.dumps({"instruction": "a", "output": "b"})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([good, "", good, bad_line, good]) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=f"bad.jsonl:4: {message}"):
        load_alpaca_jsonl(path)


def test_missing_and_empty_data_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_alpaca_jsonl(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="no records"):
        load_alpaca_jsonl(tmp_path / "empty.jsonl")


# -- batching ----------------------------------------------------------------------------


def test_collate_masks_prompt_and_padding(byte_tok):
    ex = Example("hi", "yo")
    ids, n_prompt = encode_example(byte_tok, ex)
    b = collate([(ids, n_prompt)], seq_len=len(ids) + 5, pad_id=byte_tok.pad_id)
    tokens, targets, loss_mask, mask = (b[k][0] for k in ("tokens", "targets", "loss_mask", "mask"))
    assert tokens[:len(ids)].tolist() == ids and (tokens[len(ids):] == byte_tok.pad_id).all()
    assert targets[:len(ids) - 1].tolist() == ids[1:]
    assert byte_tok.decode(targets[loss_mask == 1]) == "yo<|im_end|>"
    assert mask.sum() == len(ids) and loss_mask[len(ids) - 1:].sum() == 0
    assert byte_tok.decode(tokens[:n_prompt]) == byte_tok.render_chat(ex.messages())


def test_batcher_is_deterministic_and_covers_each_epoch(byte_tok):
    exs = make_examples("add", 10, seed=0)
    a = Batcher(byte_tok, exs, batch_size=4, seed=3)
    b = Batcher(byte_tok, exs, batch_size=4, seed=3)
    for step in (0, 1, 2, 7):
        for k in a.batch(step):
            np.testing.assert_array_equal(a.batch(step)[k], b.batch(step)[k])
    first_epoch = a.indices(0) + a.indices(1) + a.indices(2)[:2]
    assert sorted(first_epoch) == list(range(10))
    assert a.indices(0) != Batcher(byte_tok, exs, batch_size=4, seed=4).indices(0)
    assert len(a) == 3


def test_sequence_length_errors(byte_tok):
    exs = [Example("short", "a"), Example("a much longer prompt " * 4, "b")]
    with pytest.raises(SequenceLengthError, match="exceeds the model's context of 64"):
        Batcher(byte_tok, exs, batch_size=2, seq_len=128, max_seq_len=64)
    with pytest.raises(SequenceLengthError, match="example 1 \\('a much longer prompt.*'\\), needs"):
        Batcher(byte_tok, exs, batch_size=2, seq_len=64)
    with pytest.raises(SequenceLengthError, match="nothing of their answers would be left"):
        Batcher(byte_tok, exs, batch_size=2, seq_len=64, truncate=True)
    cut = Batcher(byte_tok, [exs[0], Example("short", "a long answer " * 8)], batch_size=2, seq_len=64, truncate=True)
    assert cut.batch(0)["tokens"].shape == (2, 64)
    with pytest.raises(SequenceLengthError, match="longest example needs"):
        Batcher(byte_tok, exs, batch_size=2, max_seq_len=64)


def test_padded_batch_loss_equals_per_example_loss(byte_tok):
    """Padding and masking are right: the batch loss is the mean over answer tokens."""
    model = llama.Llama(LlamaConfig.tiny(vocab=byte_tok.vocab_size, max_seq_len=160),
                        rngs=nnx.Rngs(0))
    exs = [Example("hi", "yo"), Example("a longer question", "ok then")]
    batcher = Batcher(byte_tok, exs, batch_size=2, seq_len=112, max_seq_len=160)
    batch = batcher.batch(0)
    fwd = nnx.jit(lambda m, t: m(t))
    loss = llama.next_token_loss(fwd(model, jnp.asarray(batch["tokens"])),
                                 jnp.asarray(batch["targets"]), jnp.asarray(batch["loss_mask"]))
    total, count = 0.0, 0
    for ex in exs:
        ids, n_prompt = encode_example(byte_tok, ex)
        logp = np.asarray(jax.nn.log_softmax(fwd(model, jnp.asarray([ids]))[0]))
        for t in range(n_prompt - 1, len(ids) - 1):
            total -= float(logp[t, ids[t + 1]])
            count += 1
    assert abs(float(loss) - total / count) < 1e-4


def test_answer_window_loss_equals_full_loss(byte_tok):
    model = llama.Llama(LlamaConfig.tiny(vocab=byte_tok.vocab_size, max_seq_len=128),
                        rngs=nnx.Rngs(1))
    exs = make_examples("sort_numbers", 6, seed=0)
    batcher = Batcher(byte_tok, exs, batch_size=6, seq_len=128, max_seq_len=128)
    batch = {k: jnp.asarray(v) for k, v in batcher.batch(0).items()}
    assert batcher.answer_window % 8 == 0
    assert batcher.answer_window >= int(batch["loss_mask"].sum(1).max())

    @nnx.jit
    def both(model, batch):
        full = llama.next_token_loss(model(batch["tokens"]), batch["targets"], batch["loss_mask"])
        return full, llama.answer_loss(model, batch, batcher.answer_window)

    full, windowed = both(model, batch)
    assert abs(float(full) - float(windowed)) < 1e-5


def test_evaluate_model_runs_generation(byte_tok):
    from pockjax.data import evaluate_model

    model = llama.Llama(LlamaConfig.tiny(vocab=byte_tok.vocab_size, max_seq_len=160),
                        rngs=nnx.Rngs(0))
    exs = make_examples("add", 3, seed=0)
    result = evaluate_model(model, byte_tok, exs, max_new_tokens=4, batch_size=4)
    assert result["total"] == 3 and len(result["predictions"]) == 3
    assert result["accuracy"] == result["correct"] / 3
