"""pockjax finetune / generate: no silent wrong result, a clear error for every bad input,
nothing lost on a crash (the guards of DESIGN.md "Trust", each made to fire)."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import pockjax
from pockjax.cli import main as cli_main
from pockjax.data import Batcher
from pockjax.errors import FileFormatError, NonFiniteError, SchemeError
from pockjax.models import llama
from pockjax.train import FinetuneError, finetune
from pockjax.train.finetune import WEIGHT_GROWTH_LIMIT
from test_finetune import cfg, flat, tiny_model

QUIET = {"log": lambda s: None}


@pytest.fixture(scope="module")
def tok():
    return llama.Tokenizer.byte_level_for_tests()


@pytest.fixture(scope="module")
def run4(tmp_path_factory, tok):
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    out = str(tmp_path_factory.mktemp("trust") / "run4")
    finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, **QUIET)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    """The tiny random model saved as a model directory the CLI loads with --model."""
    d = str(tmp_path_factory.mktemp("trust") / "tiny")
    llama.save_hf_checkpoint(tiny_model(), d)
    tok.save(d)
    return d


def assert_all_finite(out):
    model, _ = llama.load_pretrained(out)
    for k, v in flat(model).items():
        assert np.isfinite(v).all(), k
    with np.load(os.path.join(out, "state", "opt_state.npz")) as z:
        for k in z.files:
            assert np.isfinite(z[k]).all(), k


def cli_error(capsys, argv):
    """Runs the CLI; returns (exit code, stderr). argparse errors exit with 2."""
    try:
        rc = cli_main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


# -- numbers refused before any work --------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got 'inf'"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got 'nan'"),
    (["--lr", "-1"], "argument --lr: must be a finite number > 0, got '-1'"),
    (["--steps", "0"], "argument --steps: must be a whole number >= 1, got '0'"),
    (["--save-every", "-1"], "argument --save-every: must be a whole number >= 1, got '-1'"),
    (["--save-every", "0"], "argument --save-every: must be a whole number >= 1, got '0'"),
    (["--batch-size", "0"], "argument --batch-size: must be a whole number >= 1, got '0'"),
    (["--blocks", "-2"], "argument --blocks: must be a whole number >= 1, got '-2'"),
    (["--seq-len", "0"], "argument --seq-len: must be a whole number >= 1, got '0'"),
    (["--eval-examples", "-1"], "argument --eval-examples: must be a whole number >= 0, got '-1'"),
    (["--seed", "-3"], "argument --seed: must be a whole number >= 0, got '-3'"),
    (["--fail-below", "2"], "argument --fail-below: must be a finite number >= 0 and <= 1"),
])
def test_finetune_cli_refuses_bad_numbers(argv, message, capsys, tmp_path):
    out = tmp_path / "o"
    rc, err = cli_error(capsys, ["finetune", "--out", str(out), *argv])
    assert rc == 2 and message in err
    assert err.strip().splitlines()[-1].startswith("pockjax finetune: error: argument")
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "0"], "argument --top-p: must be a finite number > 0 and <= 1, got '0'"),
    (["--temperature", "inf"], "argument --temperature: must be a finite number >= 0, got 'inf'"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be a whole number >= 1"),
])
def test_generate_cli_refuses_bad_numbers(argv, message, capsys):
    rc, err = cli_error(capsys, ["generate", "--prompt", "Hi", *argv])
    assert rc == 2 and message in err


@pytest.mark.parametrize("field, value, message", [
    ("lr", float("inf"), "--lr must be a finite number > 0, got inf"),
    ("lr", 0.0, "--lr must be a finite number > 0, got 0.0"),
    ("steps", 0, "--steps must be a whole number >= 1, got 0"),
    ("save_every", -1, "--save-every must be a whole number >= 0, got -1"),
    ("batch_size", 0, "--batch-size must be a whole number >= 1, got 0"),
    ("blocks", 0, "--blocks must be a whole number >= 1, got 0"),
    # once accepted: an empty --data trained the built-in task; an optimizer name in another case
    # failed on a KeyError after the model had loaded
    ("data", "", "--data must name a JSONL file, got ''; leave it out to train the built-in --task"),
    ("optimizer", "adagrad", "--optimizer must be one of adamw, adam, sgd, lion, got 'adagrad'"),
])
def test_api_refuses_bad_numbers(field, value, message, tok, tmp_path):
    with pytest.raises(FinetuneError, match=f"^{message}$"):
        finetune(cfg(out=str(tmp_path / "o"), **{field: value}), model=tiny_model(),
                 tokenizer=tok, **QUIET)
    assert not (tmp_path / "o").exists()


def test_api_takes_numpy_numbers_and_any_case_optimizer_name(tok, tmp_path):
    # a numpy integer or float passed the checks, then failed writing run.json after training
    out = tmp_path / "o"
    finetune(cfg(out=str(out), steps=np.int64(2), lr=np.float32(1e-3), optimizer="AdamW"), model=tiny_model(),
             tokenizer=tok, **QUIET)
    run = json.load(open(out / "run.json"))["config"]
    assert run["steps"] == 2 and run["lr"] == pytest.approx(1e-3) and run["optimizer"] == "adamw"


# -- finite or refused -------------------------------------------------------------------------


def test_exploding_lr_stops_at_step_one_and_writes_nothing(tok, tmp_path):
    out = tmp_path / "o"
    with pytest.raises(NonFiniteError) as e:
        finetune(cfg(lr=1e9, out=str(out), save_every=1), model=tiny_model(), tokenizer=tok,
                 **QUIET)
    msg = str(e.value)
    assert msg.startswith("training stopped at step 1: the norm of the trained weights reached")
    assert f"over {WEIGHT_GROWTH_LIMIT:g} times its value at the start" in msg
    assert ", in layers.1." in msg
    assert "nothing was saved; start a new run with a lower --lr (this one: 1e+09)" in msg
    assert not out.exists()


def test_exploding_lr_from_the_cli(tiny_dir, tmp_path, capsys):
    out = tmp_path / "o"
    rc, err = cli_error(capsys, ["finetune", "--model", tiny_dir, "--task", "uppercase",
                                 "--steps", "3", "--batch-size", "2", "--eval-examples", "1",
                                 "--blocks", "1", "--lr", "1e9", "--save-every", "1",
                                 "--out", str(out), "--no-progress"])
    assert rc == 2
    assert err.strip().splitlines() == [err.strip()]
    assert err.startswith("pockjax finetune: error: training stopped at step 1: the norm of the"
                          " trained weights reached")
    assert not out.exists()


def _nan_at(monkeypatch, step):
    real = Batcher.batch

    def batch(self, i):
        b = real(self, i)
        if i == step:
            b["loss_mask"] = b["loss_mask"].astype(np.float32)
            b["loss_mask"][0, int(np.argmax(b["loss_mask"][0] > 0))] = np.nan
        return b

    monkeypatch.setattr(Batcher, "batch", batch)


def test_nan_in_batch_stops_and_keeps_last_good_checkpoint(tok, tmp_path, monkeypatch):
    _nan_at(monkeypatch, 2)  # the third step
    out = str(tmp_path / "o")
    with pytest.raises(NonFiniteError) as e:
        finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, **QUIET)
    msg = str(e.value)
    assert msg.startswith("training stopped at step 3: the loss is nan and params layers.1.")
    assert f"this step was not saved and {out} keeps the checkpoint of step 2" in msg
    state = json.load(open(os.path.join(out, "state", "trainer.json")))
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    assert state["step"] == 2 and metrics["step"] == 2 and len(metrics["losses"]) == 2
    assert_all_finite(out)


def test_nan_on_channel_scheme_is_caught(tok, tmp_path, monkeypatch):
    # channel-ruled tensors are not in the step's health scalar: the loss is
    _nan_at(monkeypatch, 0)
    with pytest.raises(NonFiniteError, match="^training stopped at step 1: the loss is nan"):
        finetune(cfg(scheme="channels", out=str(tmp_path / "o")), model=tiny_model(),
                 tokenizer=tok, **QUIET)
    assert not (tmp_path / "o").exists()


def test_non_finite_model_is_refused(run4, tok, tmp_path, capsys):
    model, _ = llama.load_pretrained(run4)
    kernel = model.layers[0].attn.wq.kernel
    kernel[...] = kernel[...].at[0, 0].set(np.nan)
    bad = str(tmp_path / "bad")
    llama.save_hf_checkpoint(model, bad)
    tok.save(bad)
    rc, err = cli_error(capsys, ["generate", "--model", bad, "--prompt", "Hi"])
    assert rc == 2
    assert err.strip() == (f"pockjax generate: error: {bad} holds non-finite weights"
                           " (layers.0.attn.wq.kernel (1 NaN, 0 inf)); it cannot generate:"
                           " fine-tune it again with a lower --lr, or use its last good checkpoint")
    with pytest.raises(NonFiniteError, match="holds non-finite weights"):
        finetune(cfg(model=bad, out=str(tmp_path / "o")), **QUIET)
    assert not (tmp_path / "o").exists()


# -- all frozen ---------------------------------------------------------------------------------


def test_all_frozen_scheme_is_refused(tiny_dir, tmp_path, capsys):
    scheme = tmp_path / "frozen.json"
    scheme.write_text(json.dumps(pockjax.UpdateScheme({}, default="frozen").to_dict()))
    out = tmp_path / "o"
    with pytest.raises(SchemeError, match="freezes every parameter of the model"):
        finetune(cfg(model=tiny_dir, scheme=str(scheme), out=str(out)), **QUIET)
    rc, err = cli_error(capsys, ["finetune", "--model", tiny_dir, "--task", "uppercase",
                                 "--scheme", str(scheme), "--out", str(out), "--no-progress"])
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "freezes every parameter of the model: fine-tuning would train nothing" in err
    assert not out.exists()


# -- resume means resume ------------------------------------------------------------------------


def _mtimes(out):
    return {f: os.path.getmtime(os.path.join(out, f)) for f in ("model.safetensors", "run.json")}


def test_resume_with_lower_steps_is_refused(run4, capsys):
    before = _mtimes(run4)
    with pytest.raises(FinetuneError, match=r"--steps 2 is below the step the run in .* has"
                                            r" reached \(4\)"):
        finetune(cfg(out=run4, resume=True, steps=2), **QUIET)
    rc, err = cli_error(capsys, ["finetune", "--out", run4, "--resume", "--steps", "3"])
    assert rc == 2 and "--steps 3 is below the step" in err
    assert _mtimes(run4) == before


def test_resume_with_other_options_is_refused(run4, capsys):
    before = _mtimes(run4)
    with pytest.raises(FinetuneError, match=r"--lr: the run has 0\.0003 \(default\), given 5\.0"):
        finetune(cfg(out=run4, resume=True, lr=5.0), **QUIET)
    # the CLI compares what was given, even a value equal to the option's default (--batch-size 8)
    rc, err = cli_error(capsys, ["finetune", "--out", run4, "--resume", "--lr", "5",
                                 "--batch-size", "8", "--no-progress"])
    assert rc == 2
    assert ("--lr: the run has 0.0003 (default), given 5.0; --batch-size: the run has 2, given 8"
            in err)
    assert _mtimes(run4) == before
    # the same values as the run's are fine: nothing left to train, the run ends where it was
    res = finetune(cfg(out=run4, resume=True, lr=3e-4, save_every=1), **QUIET)
    assert res.metrics["steps_this_run"] == 0 and res.metrics["steps"] == 4


def test_a_run_saved_with_more_blocks_than_the_model_resumes_with_them_capped(run4):
    # Before 2026-11-27 --blocks above the depth was quietly capped; now it is an error, but a
    # run saved then still resumes, with the blocks it trained (the model's 2)
    from pockjax.train.finetune import _resume_config

    run = json.load(open(os.path.join(run4, "run.json")))
    run["config"]["blocks"] = 5
    assert _resume_config(cfg(out=run4, resume=True), run4, run, given=set()).blocks == 2
    assert _resume_config(cfg(out=run4, resume=True, blocks=2), run4, run, given={"blocks"}).blocks == 2
    with pytest.raises(FinetuneError, match="--blocks: the run has 5, given 1"):
        _resume_config(cfg(out=run4, resume=True, blocks=1), run4, run, given={"blocks"})


def test_a_run_saved_before_every_reply_was_trained_resumes_training_the_last(run4):
    # run.json without train_replies: the run trained only each conversation's last reply, and
    # continues so (not silently on another objective); a run.json with it keeps its own
    from pockjax.train.finetune import _resume_config

    run = json.load(open(os.path.join(run4, "run.json")))
    assert run["config"]["train_replies"] == "all"
    assert _resume_config(cfg(out=run4, resume=True), run4, run, given=set()).train_replies == "all"
    del run["config"]["train_replies"]
    assert _resume_config(cfg(out=run4, resume=True), run4, run, given=set()).train_replies == "last"
    with pytest.raises(FinetuneError, match="--train-replies: the run has 'last', given 'all'"):
        _resume_config(cfg(out=run4, resume=True), run4, run, given={"train_replies"})


def test_run_json_records_the_configuration(run4):
    run = json.load(open(os.path.join(run4, "run.json")))
    assert run["config"]["batch_size"] == 2 and run["config"]["blocks"] == 1
    assert run["effective"]["lr"] == 3e-4 and run["effective"]["seq_len"] > 0


def test_resume_with_more_steps_continues_exactly(tok, tmp_path):
    a = str(tmp_path / "a")
    finetune(cfg(out=a, steps=2), model=tiny_model(), tokenizer=tok, **QUIET)
    resumed = finetune(cfg(out=a, resume=True, steps=4), **QUIET)
    full = finetune(cfg(out=str(tmp_path / "b"), steps=4), model=tiny_model(), tokenizer=tok,
                    **QUIET)
    x, y = flat(full.model), flat(resumed.model)
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)
    m = json.load(open(os.path.join(a, "metrics.json")))
    assert m["step"] == 4 and len(m["losses"]) == 4
    assert json.load(open(os.path.join(a, "state", "trainer.json")))["step"] == 4


# -- kill -9 at random points, resume, same weights -----------------------------------------------


def _cli(*args):
    return [sys.executable, "-m", "pockjax.cli", "finetune", *args]


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tiny_dir, tmp_path, capsys):
    steps = 8
    common = ["--task", "uppercase", "--steps", str(steps), "--batch-size", "2",
              "--eval-examples", "1", "--blocks", "1", "--save-every", "1", "--show", "0",
              "--no-progress"]
    ref = str(tmp_path / "ref")
    assert cli_main(["finetune", "--model", tiny_dir, *common, "--out", ref]) == 0
    capsys.readouterr()

    out = str(tmp_path / "run")
    name = os.path.basename(out)
    assert os.path.dirname(tiny_dir) != str(tmp_path)
    rnd = random.Random()
    seed = rnd.randrange(1 << 30)
    rnd.seed(seed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(pockjax.__file__)), os.environ.get("PYTHONPATH", "")]))

    def start(resume):
        argv = _cli("--out", out, "--resume", "--no-progress") if resume else \
            _cli("--model", tiny_dir, *common, "--out", out)
        return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def step_on_disk():
        try:
            return json.load(open(os.path.join(out, "state", "trainer.json")))["step"]
        except (OSError, ValueError):
            return None

    def temporaries():  # whatever a checkpoint write puts beside OUT
        return [p for p in os.listdir(tmp_path) if p not in (name, "ref")]

    kills = []
    # 1: during the write of a checkpoint (a temporary sibling of OUT exists), once OUT holds one
    proc = start(resume=False)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        if step_on_disk() and step_on_disk() >= 2 and temporaries():
            proc.send_signal(signal.SIGKILL)
            kills.append(("during a checkpoint write", step_on_disk()))
            break
        time.sleep(0.002)
    proc.wait()
    # 2, 3: at random moments of resumed runs, once they have trained past a random step
    for _ in range(2):
        reached = step_on_disk()
        if reached is None or reached >= steps - 1:
            break
        target = rnd.randint(reached + 1, steps - 1)
        proc = start(resume=True)
        while proc.poll() is None and (step_on_disk() or 0) < target:
            time.sleep(0.002)
        time.sleep(rnd.uniform(0.0, 0.05))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills.append(("at random", step_on_disk()))
        proc.wait()
    # finish
    proc = start(resume=True)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (seed, kills, err.decode()[-2000:])
    assert kills, "no kill landed before the run finished"
    print(f"killed {kills} (seed {seed})")

    a, _ = llama.load_pretrained(ref)
    b, _ = llama.load_pretrained(out)
    fa, fb = flat(a), flat(b)
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=f"{k} (seed {seed}, kills {kills})")
    m_ref = json.load(open(os.path.join(ref, "metrics.json")))
    m = json.load(open(os.path.join(out, "metrics.json")))
    assert m["losses"] == m_ref["losses"] and m["step"] == steps
    with np.load(os.path.join(ref, "state", "opt_state.npz")) as z1, \
            np.load(os.path.join(out, "state", "opt_state.npz")) as z2:
        for k in z1.files:
            np.testing.assert_array_equal(z1[k], z2[k])


# -- the health scalar, in the compiled step ------------------------------------------------------


@pytest.mark.parametrize("target", [None, "cpu"])  # XLA, IREE
def test_health_scalar_in_the_compiled_step(target):
    import jax
    import jax.numpy as jnp
    import optax

    from pockjax.train import llama_scheme
    from test_finetune import TINY
    from pockjax.train.steps import answer_train_step

    graphdef, params = llama.split(tiny_model())
    tx = optax.adamw(1e-3, weight_decay=0.0)
    scheme = llama_scheme("paper", TINY, blocks=1)
    batch = {"tokens": jnp.array([[5, 6, 7, 8]] * 2), "targets": jnp.array([[6, 7, 8, 0]] * 2),
             "loss_mask": jnp.array([[0., 1., 1., 0.]] * 2), "loss_start": jnp.array([1, 1])}
    plain = pockjax.compile(answer_train_step(graphdef, tx, 2), scheme=scheme, target=target)
    step = pockjax.compile(answer_train_step(graphdef, tx, 2, health=scheme), scheme=scheme,
                           target=target)
    def fresh():  # the steps take their inputs' buffers
        return jax.tree.map(jnp.array, params), pockjax.init_opt_state(tx, params, scheme)

    p1, _, _ = plain(*fresh(), batch)
    p2, o2, _, health = step(*fresh(), batch)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):  # the flag changes nothing
        np.testing.assert_array_equal(a, b)
    trained = [v for k, v in llama.flatten_params(p2).items() if k.startswith("layers.1.")
               and k.split(".")[3] in ("wq", "wk", "wv", "wo", "w1", "w3")]
    assert len(trained) == 6
    np.testing.assert_allclose(float(health), sum(float(np.sum(np.square(v))) for v in trained),
                               rtol=1e-5)
    bad = dict(batch, loss_mask=batch["loss_mask"].at[0, 1].set(jnp.nan))
    _, _, loss, health = step(p2, o2, bad)
    assert np.isnan(float(loss)) and not np.isfinite(float(health))


def _as_written(out, rel):
    """Records ``rel``'s digest as the run's own: a file the run wrote so (the content checks that
    follow the digests, which runs written before them rely on)."""
    from pockjax.runtime.module import file_sha256

    tj = os.path.join(out, "state", "trainer.json")
    trainer = json.load(open(tj))
    trainer["sha256"][rel] = file_sha256(os.path.join(out, rel))
    json.dump(trainer, open(tj, "w"))


def test_resume_with_corrupt_metrics_names_the_file(run4, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        f.write("{not json")
    _as_written(out, "metrics.json")
    with pytest.raises(FileFormatError, match=r"metrics\.json:1: invalid JSON"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)


@pytest.mark.parametrize("edit, message", [
    # json took the last of two "config" keys and NaN, silently
    (lambda t: t.replace('{', '{"config": {"steps": 99}, ', 1), "key 'config' given twice"),
    (lambda t: t.replace('"steps": 4', '"steps": NaN', 1), "NaN is not valid JSON"),
    (lambda t: '{"config": [1]}', "KeyError: 'config'"),
])
def test_resume_with_a_bad_run_json_is_refused(run4, tmp_path, edit, message):
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    path = os.path.join(out, "run.json")
    text = open(path).read()
    assert edit(text) != text
    open(path, "w").write(edit(text))
    with pytest.raises(FinetuneError, match=f"cannot resume from .*run: its run.json is unreadable .*{message}"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)


@pytest.mark.parametrize("patch, message", [
    ({"losses": ["a", "b", "c", "d"]}, "'losses' is not a list of finite numbers"),
    ({"losses": None}, "'losses' is not a list of finite numbers"),
    ({"val_losses": [[2]]}, "'val_losses' is not a list of \\[step, finite loss or null\\] pairs"),
    ({"val_losses": "x"}, "'val_losses' is not a list"),
    ({"trained_weight_norm_start": -1.0}, "'trained_weight_norm_start' is not a finite number >= 0"),
    ({"trained_weight_norm_start": "3"}, "'trained_weight_norm_start' is not a finite number >= 0"),
])
def test_resume_with_corrupt_metrics_values_is_refused(run4, tmp_path, patch, message):
    """Valid JSON with wrong values: refused before any step (not carried into the curves, nor a crash later)."""
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    metrics.update(patch)
    json.dump(metrics, open(os.path.join(out, "metrics.json"), "w"))
    _as_written(out, "metrics.json")
    with pytest.raises(FinetuneError, match=f"cannot resume from .*run: its metrics.json is corrupt \\({message}"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)


def test_resume_checks_metrics_numbers_with_the_shared_number_check():
    """``metrics.json``'s numbers are checked by the one "finite number, not a bool"
    definition (:func:`pockjax.models.llama.config.is_finite_number`, beside
    ``is_positive_number``), not a copy of it in ``finetune``."""
    import importlib

    from pockjax.models.llama.config import is_finite_number, is_positive_number

    ft = importlib.import_module("pockjax.train.finetune")  # the module (pockjax.train.finetune is the function)
    assert ft.is_finite_number is is_finite_number and not hasattr(ft, "_is_number")
    for x in (3, -2.5, 0, 0.0, 10**400, np.float64(1.5), True, False, float("nan"), float("inf"), -float("inf"),
              "1", None, [1]):
        ok = isinstance(x, (int, float)) and not isinstance(x, bool) and -float("inf") < x < float("inf")
        assert is_finite_number(x) is ok, x
        assert is_positive_number(x) is (ok and x > 0), x
    ft._check_metrics("run", {"losses": [1.0, 2, 3, 4], "val_losses": [[2, None], [4, 0.5]],
                              "trained_weight_norm_start": 0, "accuracy_before": 1})
    for bad, says in [({"losses": [1.0, True]}, "'losses'"), ({"losses": [float("nan")]}, "'losses'"),
                      ({"val_losses": [[2, float("inf")]]}, "'val_losses'"),
                      ({"val_losses": [[2, False]]}, "'val_losses'"),
                      ({"losses": [1.0], "val_losses": [[2, 1.0]]}, "'val_losses' names a step the run has not"),
                      ({"losses": [1.0] * 4, "val_losses": [[2, 1.0], [2, 1.0]]}, "'val_losses' names .* a step twice"),
                      ({"losses": [1.0] * 4, "val_losses": [[0, 1.0]]}, "'val_losses' names a step"),
                      ({"trained_weight_norm_start": True}, "'trained_weight_norm_start'"),
                      ({"accuracy_before": True}, "'accuracy_before'")]:
        with pytest.raises(FinetuneError, match=f"run: its metrics.json is corrupt \\({says}"):
            ft._check_metrics("run", bad)


def test_resume_accepts_a_held_out_loss_recorded_as_null(run4, tmp_path):
    """A held-out loss that was not finite is recorded as null (JSON has no NaN):
    a run that wrote one resumes, and its curve shows no value at that step."""
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    metrics = json.load(open(os.path.join(out, "metrics.json")))
    metrics["val_losses"] = [[2, None]]
    json.dump(metrics, open(os.path.join(out, "metrics.json"), "w"))
    _as_written(out, "metrics.json")
    finetune(cfg(out=out, resume=True, steps=6), **QUIET)
    resumed = json.load(open(os.path.join(out, "metrics.json")))
    assert resumed["val_losses"][0] == [2, None] and len(resumed["losses"]) == 6
    assert open(os.path.join(out, "metrics.csv")).read().splitlines()[2].endswith(",")  # step 2: no held-out value


def _damage(path, how):
    data = bytearray(open(path, "rb").read())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:  # 64 bytes inside the data overwritten
        i = len(data) // 3
        data[i:i + 64] = bytes((7 * k + 1) % 256 for k in range(64))
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("name, how", [("state/opt_state.npz", "truncate"), ("state/opt_state.npz", "overwrite"),
                                       ("model.safetensors", "overwrite")])
def test_resume_refuses_a_damaged_array_file(run4, tmp_path, name, how):
    # A truncated opt_state.npz crashed with zipfile.BadZipFile; bytes overwritten inside
    # model.safetensors were trained on (embedding rows of 1e36). The run records the
    # sha256 of the files --resume reads, and checks them.
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    trainer = json.load(open(os.path.join(out, "state", "trainer.json")))
    assert {"model.safetensors", "state/opt_state.npz", "run.json", "config.json"} <= set(trainer["sha256"])
    assert not {"metrics.csv", "loss.png", "state/trainer.json"} & set(trainer["sha256"])
    _damage(os.path.join(out, name), how)
    if how == "truncate":  # its digest removed from the list: refused too
        tj = os.path.join(out, "state", "trainer.json")
        json.dump({**trainer, "sha256": {k: v for k, v in trainer["sha256"].items() if k != name}}, open(tj, "w"))
        with pytest.raises(FinetuneError, match=f"sha256 lists no digest for {name}"):
            finetune(cfg(out=out, resume=True, steps=6), **QUIET)
        json.dump(trainer, open(tj, "w"))
    with pytest.raises(FinetuneError, match=f"cannot resume from .*{name}.* is not the file this run wrote"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)


def _set_json(path, edit):
    d = json.load(open(path))
    edit(d)
    json.dump(d, open(path, "w"))


@pytest.mark.parametrize("edit", ["run-lr", "config-eps", "tokenizer", "metrics-held", "tb-deleted"])
def test_resume_refuses_an_edited_run_file(run4, tmp_path, edit):
    # Only the arrays were checked: an edited run.json resumed at lr 0.5 (the options --resume
    # holds the run to are read from it), an edited config.json or tokenizer.json trained
    # another model, an added held-out loss at a step not reached showed in the curves, and
    # deleted TensorBoard events of the run's first part were lost without a word
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    if edit == "run-lr":
        _set_json(os.path.join(out, "run.json"), lambda d: d["config"].update(lr=0.5))
    elif edit == "config-eps":
        _set_json(os.path.join(out, "config.json"), lambda d: d.update(rms_norm_eps=1e-2))
    elif edit == "tokenizer":
        with open(os.path.join(out, "tokenizer.json"), "a") as f:
            f.write(" ")
    elif edit == "metrics-held":
        _set_json(os.path.join(out, "metrics.json"), lambda d: d.update(val_losses=[[5, 1.0]]))
    else:
        shutil.rmtree(os.path.join(out, "tb"))
    what = {"run-lr": "run.json", "config-eps": "config.json", "tokenizer": "tokenizer.json",
            "metrics-held": "metrics.json", "tb-deleted": "tb/events"}[edit]
    with pytest.raises(FinetuneError, match=f"{what}.* (is not the file this run wrote|is missing)"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)
    if edit == "metrics-held":  # without the digests (an older run), the metrics' own check refuses it
        tj = os.path.join(out, "state", "trainer.json")
        _set_json(tj, lambda d: d.update(sha256={k: v for k, v in d["sha256"].items() if "/" in k
                                                 or k == "model.safetensors"}))
        with pytest.raises(FinetuneError, match="'val_losses' names a step the run has not reached"):
            finetune(cfg(out=out, resume=True, steps=6), **QUIET)


def test_resume_of_a_run_with_array_digests_only_continues(run4, tmp_path):
    # a run written before the JSON files had digests: resumed as before, its arrays checked
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    _set_json(os.path.join(out, "state", "trainer.json"), lambda d: d.update(
        sha256={k: v for k, v in d["sha256"].items() if k in ("model.safetensors", "state/opt_state.npz")}))
    finetune(cfg(out=out, resume=True, steps=5), **QUIET)
    trainer = json.load(open(os.path.join(out, "state", "trainer.json")))
    assert trainer["step"] == 5 and "run.json" in trainer["sha256"]


@pytest.mark.parametrize("field, value", [("blocks", "3"), ("lr", "abc"), ("optimizer", "adagrad")])
def test_resume_of_an_older_run_refuses_an_edited_run_json(run4, tmp_path, field, value):
    # a run whose run.json has no digest (written before 2026-11-28): an option no run could have had
    # once failed on a raw TypeError / ValueError
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    _set_json(os.path.join(out, "state", "trainer.json"), lambda d: d.update(
        sha256={k: v for k, v in d["sha256"].items() if k in ("model.safetensors", "state/opt_state.npz")}))
    _set_json(os.path.join(out, "run.json"), lambda d: d["config"].update({field: value}))
    with pytest.raises(FinetuneError, match=f"its run.json holds an option the run could not have had .*--{field}"):
        finetune(cfg(out=out, resume=True), **QUIET)


def test_resume_refuses_examples_that_now_encode_to_other_rows(run4, tmp_path):
    # (as another tokenizer or chat template would make them): the run would not continue as it started
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    _set_json(os.path.join(out, "state", "trainer.json"), lambda d: d.update(
        sha256={k: v for k, v in d["sha256"].items() if k in ("model.safetensors", "state/opt_state.npz")}))
    run = json.load(open(os.path.join(out, "run.json")))
    seq_len = run["effective"]["seq_len"]
    _set_json(os.path.join(out, "run.json"), lambda d: d["effective"].update(seq_len=seq_len + 8))
    with pytest.raises(FinetuneError, match=f"examples now encode to other rows \\(seq_len {seq_len + 8} -> {seq_len}\\)"):
        finetune(cfg(out=out, resume=True, steps=5), **QUIET)


def test_resume_refuses_an_empty_digest_list(run4, tmp_path):
    # "sha256": {} once turned every check off without a word (a missing entry at least warns)
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    _set_json(os.path.join(out, "state", "trainer.json"), lambda d: d.update(sha256={}))
    with pytest.raises(FinetuneError, match="sha256 is empty, though a run records the digest of every file"):
        finetune(cfg(out=out, resume=True, steps=5), **QUIET)


def test_resume_without_digests_still_refuses_a_broken_or_mistyped_state(run4, tmp_path):
    # a run written before the digests: the zip and the dtypes are checked on their own
    out = str(tmp_path / "run")
    shutil.copytree(run4, out)
    tj = os.path.join(out, "state", "trainer.json")
    trainer = json.load(open(tj))
    del trainer["sha256"]
    json.dump(trainer, open(tj, "w"))
    npz = os.path.join(out, "state", "opt_state.npz")
    good = open(npz, "rb").read()
    _damage(npz, "truncate")
    with pytest.raises(FinetuneError, match="training state is unreadable \\(BadZipFile"), \
            pytest.warns(UserWarning, match="records no sha256 digests .* cannot be checked for damage"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)
    open(npz, "wb").write(good)
    z = dict(np.load(npz))
    z["leaf_0000"] = np.float32(2.7)  # the step count, an int32
    np.savez(npz, **z)
    with pytest.raises(FinetuneError, match="optimizer state leaf 0 in state/opt_state.npz is float32"), \
            pytest.warns(UserWarning, match="records no sha256 digests"):
        finetune(cfg(out=out, resume=True, steps=6), **QUIET)
