"""Gradient accumulation: answer_train_step(accum=K) inside pockjax.compile, and finetune --grad-accum."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax
from pockjax.cli import main as cli_main
from pockjax.data import Batcher
from pockjax.data.tasks import make_examples
from pockjax.models import llama
from pockjax.train import FinetuneConfig, FinetuneError, finetune, llama_scheme
from pockjax.train.steps import answer_train_step

TINY = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)
K, B = 4, 2


@pytest.fixture(scope="module")
def setup():
    tok = llama.Tokenizer.byte_level_for_tests()
    graphdef, params = llama.split(llama.Llama(TINY, rngs=nnx.Rngs(0)))
    batcher = Batcher(tok, make_examples("uppercase", 24, seed=0), batch_size=K * B, seed=0)
    return graphdef, params, batcher


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _split(batch):
    return {k: jnp.asarray(v).reshape((K, B) + v.shape[1:]) for k, v in batch.items()}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.slow  # 9-16 s on a 2-core CPU (two compiles)
def test_accumulated_step_equals_one_large_batch_step(setup):
    """K micro-batches of B rows inside pockjax.compile == jax.jit of one step on the K*B rows (3 steps)."""
    graphdef, params, batcher = setup
    tx = optax.sgd(0.5, momentum=0.9)
    scheme = llama_scheme("paper", TINY, blocks=1)
    acc = pockjax.compile(answer_train_step(graphdef, tx, batcher.answer_window, accum=K), scheme=scheme)
    trained = [p for p in llama.flatten_params(params) if p.startswith("layers.1.") and "norm" not in p
               and "w2" not in p]
    assert len(trained) == 6

    @jax.jit
    def big(p, opt_state, batch):  # the reference: one step on all K*B rows, frozen gradients zeroed
        loss, grads = jax.value_and_grad(
            lambda p: llama.answer_loss(llama.merge(graphdef, p), batch, batcher.answer_window))(p)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g if ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            in trained else jnp.zeros_like(g), grads)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    p_acc, s_acc = _copy(params), pockjax.init_opt_state(tx, params, scheme)
    p_big, s_big = _copy(params), tx.init(params)
    for i in range(3):
        p_acc, s_acc, l_acc = acc(p_acc, s_acc, _split(batcher.batch(i)))
        p_big, s_big, l_big = big(p_big, s_big, {k: jnp.asarray(v) for k, v in batcher.batch(i).items()})
        assert abs(float(l_acc) - float(l_big)) <= 1e-6 * abs(float(l_big))
    f0, fa, fb = (llama.flatten_params(p) for p in (params, p_acc, p_big))
    worst = max(_rel(fa[p] - f0[p], fb[p] - f0[p]) for p in trained)  # relative to the change
    print(f"largest relative difference of the update after 3 steps: {worst:.2e}")
    assert worst < 1e-5
    for p in f0:
        if p not in trained:
            np.testing.assert_array_equal(fa[p], f0[p], err_msg=p)  # frozen: untouched


@pytest.mark.slow  # 10-19 s on a 2-core CPU (two compiles)
def test_passes_run_inside_the_scan_and_prune_frozen_gradients(setup):
    """The default passes rewrite the accumulated step: backward FLOPs as for one B-row step, K times."""
    graphdef, params, batcher = setup
    tx = optax.adam(1e-3)
    scheme = llama_scheme("paper", TINY, blocks=1)
    opt = pockjax.init_opt_state(tx, params, scheme)
    micro = batcher.batch(0)
    one = {k: jnp.asarray(v[:B]) for k, v in micro.items()}
    acc = pockjax.compile(answer_train_step(graphdef, tx, batcher.answer_window, accum=K), scheme=scheme)
    single = pockjax.compile(answer_train_step(graphdef, tx, batcher.answer_window), scheme=scheme)
    lowered = acc.lower(_copy(params), opt, _split(micro))
    sparse, full = (pockjax.count_flops(g, matmul_only=True) for g in (lowered.graph, lowered.traced))
    single_sparse = pockjax.count_flops(single.lower(_copy(params), opt, one).graph, matmul_only=True)
    assert sparse == pytest.approx(K * single_sparse, rel=0.01)  # the scan runs the pruned step K times
    assert sparse < 0.6 * full  # the frozen block's backward is gone
    # optimizer state only for the 6 trained tensors, and the compiled step equals jax.jit's
    assert len(jax.tree.leaves(opt)) == 1 + 2 * 6
    out = acc(_copy(params), opt, _split(micro))
    ref = jax.jit(answer_train_step(graphdef, tx, batcher.answer_window, accum=K))(
        _copy(params), tx.init(params), _split(micro))
    fa, fr = llama.flatten_params(out[0]), llama.flatten_params(ref[0])
    for p in fa:
        if p.startswith("layers.1.") and "norm" not in p and "w2" not in p:
            np.testing.assert_allclose(fa[p], fr[p], rtol=0, atol=1e-6, err_msg=p)
    assert float(out[2]) == pytest.approx(float(ref[2]), rel=1e-6)


def test_bad_accumulation_is_refused(setup, tmp_path, capsys):
    graphdef, params, batcher = setup
    with pytest.raises(ValueError, match="accum must be a whole number >= 1"):
        answer_train_step(graphdef, optax.sgd(0.1), 8, accum=0)
    step = jax.jit(answer_train_step(graphdef, optax.sgd(0.1), batcher.answer_window, accum=3))
    with pytest.raises(ValueError, match="leading axis of 3 micro-batches"):
        step(params, optax.sgd(0.1).init(params), _split(batcher.batch(0)))
    for kw, message in ((dict(grad_accum=0), "--grad-accum must be a whole number >= 1"),
                        (dict(grad_accum=2, batch_size=3, mesh="data=2"), "--batch-size 3 cannot be split")):
        with pytest.raises(FinetuneError, match=message):
            finetune(FinetuneConfig(**kw), model=llama.Llama(TINY, rngs=nnx.Rngs(0)),
                     tokenizer=llama.Tokenizer.byte_level_for_tests())
    with pytest.raises(SystemExit):
        cli_main(["finetune", "--grad-accum", "0"])
    assert "--grad-accum" in capsys.readouterr().err


def _cfg(**kw):
    base = dict(task="uppercase", steps=4, batch_size=2, train_examples=16, eval_examples=0, save_every=2,
                show=0, progress=False, blocks=1, lr=1e-2)
    base.update(kw)
    return FinetuneConfig(**base)


def _flat(model):
    return {k: np.asarray(v) for k, v in llama.flatten_params(llama.split(model)[1]).items()}


@pytest.mark.slow  # about 20 s each on a 2-core CPU: three runs
@pytest.mark.parametrize("scheme", ["paper", "lora"])
def test_finetune_grad_accum_resumes_bitwise(tmp_path, scheme):
    """--grad-accum 2 --batch-size 1 trains like --batch-size 2, and a resumed run continues bitwise."""
    tok = llama.Tokenizer.byte_level_for_tests()
    model = lambda: llama.Llama(TINY, rngs=nnx.Rngs(0))  # noqa: E731
    full = finetune(_cfg(out=str(tmp_path / "full"), grad_accum=2, batch_size=1, scheme=scheme), model=model(),
                    tokenizer=tok, log=lambda s: None)
    out = str(tmp_path / "run")

    def crash(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(_cfg(out=out, grad_accum=2, batch_size=1, scheme=scheme), model=model(), tokenizer=tok,
                 log=lambda s: None, on_step=crash)
    resumed = finetune(_cfg(out=out, resume=True, grad_accum=2, batch_size=1, scheme=scheme), log=lambda s: None)
    assert resumed.metrics["losses"] == full.metrics["losses"]
    a, b = _flat(full.model), _flat(resumed.model)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    run = json.load(open(os.path.join(out, "run.json")))
    assert run["config"]["grad_accum"] == 2 and full.metrics["grad_accum"] == 2
    with pytest.raises(FinetuneError, match="--grad-accum: the run has 2, given 1"):
        finetune(_cfg(out=out, resume=True, grad_accum=1, batch_size=1, scheme=scheme, steps=6),
                 given={"grad_accum", "steps"}, log=lambda s: None)
    if scheme == "paper":  # the same rows as one batch of 2: the same losses up to rounding
        big = finetune(_cfg(batch_size=2, scheme=scheme), model=model(), tokenizer=tok, log=lambda s: None)
        np.testing.assert_allclose(full.metrics["losses"], big.metrics["losses"], rtol=1e-5)


_MESH_SCRIPT = """
import json, sys
from flax import nnx
from pockjax.models import llama
from pockjax.train import FinetuneConfig, finetune
tiny = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)
tok = llama.Tokenizer.byte_level_for_tests()
losses = {}
for mesh in ("", "data=2", "fsdp=2"):
    r = finetune(FinetuneConfig(task="uppercase", steps=3, batch_size=2, grad_accum=2, train_examples=16,
                                eval_examples=0, show=0, progress=False, blocks=1, lr=1e-2, mesh=mesh,
                                max_seq_len=128),
                 model=llama.Llama(tiny, rngs=nnx.Rngs(0)), tokenizer=tok, log=lambda s: None)
    losses[mesh] = r.metrics["losses"]
json.dump(losses, open(sys.argv[1], "w"))
"""


@pytest.mark.slow  # about 25 s on a 2-core CPU: a subprocess with 2 host devices, three runs
def test_grad_accum_over_a_mesh_equals_one_device(tmp_path):
    """--grad-accum with --mesh data=2 / fsdp=2 (each micro-batch split over the devices) trains as on one device."""
    import subprocess
    import sys

    out = tmp_path / "losses.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    losses = json.loads(out.read_text())
    for mesh in ("data=2", "fsdp=2"):
        np.testing.assert_allclose(losses[mesh], losses[""], rtol=1e-5, err_msg=mesh)
