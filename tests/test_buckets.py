"""Length bucketing: Batcher(bucket_limit=...), choose_buckets, and finetune --max-seq-len."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pockjax.compiler import Lowered
from pockjax.cli import main as cli_main
from pockjax.data import Batcher, SequenceLengthError
from pockjax.data.batching import BUCKETS, choose_buckets, collate
from pockjax.data.tasks import Example, make_examples
from pockjax.models import llama
from pockjax.train import FinetuneConfig, FinetuneError, finetune

TINY = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)


@pytest.fixture(scope="module")
def tok():
    return llama.Tokenizer.byte_level_for_tests()


def test_choose_buckets_pads_least():
    lengths = [17, 30, 31, 47, 64, 65, 90, 200, 201]
    chosen = choose_buckets(lengths, limit=256)
    assert len(chosen) <= BUCKETS and all(n % 16 == 0 for n in chosen) and chosen[-1] >= max(lengths)

    def padded(buckets):
        return sum(next(b for b in buckets if b >= m) for m in lengths)

    # exhaustive check over every set of up to 4 multiples of 16 that fits all
    import itertools

    candidates = range(16, 257, 16)
    best = min(padded(c) for k in range(1, 5) for c in itertools.combinations(candidates, k) if c[-1] >= 201)
    assert padded(chosen) == best
    assert choose_buckets([5, 300], limit=300) == (16, 300)  # the limit itself when no multiple of 16 fits
    with pytest.raises(SequenceLengthError):
        choose_buckets([301], limit=300)


def test_batches_take_their_bucket_and_long_examples_are_named(tok):
    examples = make_examples("reverse_words", 40, seed=0)
    b = Batcher(tok, examples, batch_size=2, seed=0, bucket_limit=256)
    assert len(b.buckets) == BUCKETS
    for step in range(3 * len(b)):
        batch = b.batch(step)
        longest = max(len(b.rows[i][0]) for i in b.indices(step))
        t = batch["tokens"].shape[1]
        assert t in b.buckets and t >= longest and all(n < longest for n in b.buckets if n < t)
    long = examples[:3] + [Example("x " * 100, "y")] + examples[3:]
    with pytest.raises(SequenceLengthError, match=r"^1 example\(s\) are longer than --max-seq-len 200; the longest, "
                                                  r"the training example 'x x x.*has 2\d\d tokens.*"
                                                  r"raise --max-seq-len to at least 2\d\d"):
        Batcher(tok, long, batch_size=2, bucket_limit=200)
    with pytest.raises(SequenceLengthError, match="model's context of 256"):
        Batcher(tok, examples, batch_size=2, bucket_limit=512, max_seq_len=256)
    with pytest.raises(ValueError, match="without seq_len"):
        Batcher(tok, examples, batch_size=2, bucket_limit=256, seq_len=256)


def test_padding_does_not_change_the_loss(tok):
    """The same rows padded to two bucket lengths: the same loss."""
    graphdef, params = llama.split(llama.Llama(TINY, rngs=nnx.Rngs(0)))
    b = Batcher(tok, make_examples("uppercase", 8, seed=0), batch_size=4, seed=0)
    rows = [b.rows[i] for i in b.indices(0)]
    longest = max(len(ids) for ids, *_ in rows)

    @jax.jit
    def loss(p, batch):
        return llama.answer_loss(llama.merge(graphdef, p), batch, b.answer_window)

    short = {k: jnp.asarray(v) for k, v in collate(rows, longest, b.pad_id).items()}
    long = {k: jnp.asarray(v) for k, v in collate(rows, longest + 48, b.pad_id).items()}
    l1, l2 = float(loss(params, short)), float(loss(params, long))
    print(f"loss at {longest} and {longest + 48} tokens: {l1!r}, {l2!r}")
    assert l1 == pytest.approx(l2, rel=1e-6, abs=0)


@pytest.mark.slow  # about 13 s on a 2-core CPU: 2 compiles
def test_finetune_compiles_once_per_bucket(tok, monkeypatch):
    compiles = []
    real = Lowered.compile

    def counted(self):
        if self._compiled is None:
            compiles.append(tuple(self.graph.in_avals[-1].shape))
        return real(self)

    monkeypatch.setattr(Lowered, "compile", counted)
    lines = []
    # the first step's rows need the longest bucket: the others compile on placeholder batches
    result = finetune(FinetuneConfig(task="uppercase", steps=8, batch_size=2, train_examples=16, eval_examples=0,
                                     show=0, progress=False, blocks=1, max_seq_len=128),
                      model=llama.Llama(TINY, rngs=nnx.Rngs(0)), tokenizer=tok, log=lines.append)
    buckets = result.metrics["buckets"]
    assert 1 < len(buckets) <= BUCKETS and result.metrics["seq_len"] == buckets[-1]
    print(f"buckets {buckets}: {len(compiles)} compiles in 8 steps")
    assert len(compiles) == len(buckets)  # each row length compiled once, before the first step
    assert any("(buckets)" in line for line in lines)
    assert all(np.isfinite(result.metrics["losses"]))


def test_bad_bucket_options_are_refused(tok, capsys):
    model = llama.Llama(TINY, rngs=nnx.Rngs(0))
    with pytest.raises(FinetuneError, match="--seq-len 128 pads every row to one length, --max-seq-len 128"):
        finetune(FinetuneConfig(seq_len=128, max_seq_len=128), model=model, tokenizer=tok)
    with pytest.raises(FinetuneError, match="--max-seq-len must be a whole number >= 1"):
        finetune(FinetuneConfig(max_seq_len=0), model=model, tokenizer=tok)
    with pytest.raises(SequenceLengthError, match="longer than --max-seq-len 32"):
        finetune(FinetuneConfig(task="uppercase", train_examples=8, eval_examples=0, max_seq_len=32, progress=False),
                 model=model, tokenizer=tok, log=lambda s: None)
    assert cli_main(["finetune", "--seq-len", "64", "--max-seq-len", "64"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert cli_main(["finetune", "--model", "mobilenetv2", "--max-seq-len", "64"]) == 2
    assert "--grad-accum and --max-seq-len are for the LLaMA models" in capsys.readouterr().err


def test_truncation_that_leaves_no_answer_is_refused(tok):
    # a row whose prompt fills seq_len kept 0 answer tokens: its example vanished from the loss
    from pockjax.data import Example, SequenceLengthError

    long = Example("word " * 40, "yes")
    with pytest.raises(SequenceLengthError, match="1 example\\(s\\) have prompts of 32 tokens or more"):
        Batcher(tok, [long, Example("hi", "yo")], batch_size=2, seq_len=32, truncate=True)
    b = Batcher(tok, [Example("word " * 4, "a long answer " * 8)], batch_size=1, seq_len=48, truncate=True)
    assert b.batch(0)["loss_mask"].sum() > 0  # an answer cut short still trains what is left
