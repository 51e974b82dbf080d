"""pockjax.train: finetune() on a tiny random LLaMA, resume, atomic output, bad input, CLI."""

import json
import math
import os

import numpy as np
import pytest
from flax import nnx

import pockjax
from pockjax.cli import main as cli_main
from pockjax.data import DataError, SequenceLengthError
from pockjax.models import llama
from pockjax.models.llama import GGUFError
from pockjax.train import FinetuneConfig, FinetuneError, finetune, llama_scheme
from pockjax.train.finetune import OUTPUT_FILES, PLOT_FILE

TINY = llama.LlamaConfig.tiny(vocab=259, max_seq_len=256)


def tiny_model(seed=0):
    return llama.Llama(TINY, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def tok():
    return llama.Tokenizer.byte_level_for_tests()


def cfg(**kw):
    base = dict(task="uppercase", steps=4, batch_size=2, train_examples=16, eval_examples=2,
                eval_max_new_tokens=4, save_every=2, show=1, progress=False, blocks=1)
    base.update(kw)
    return FinetuneConfig(**base)


def flat(model):
    return {k: np.asarray(v) for k, v in llama.flatten_params(llama.split(model)[1]).items()}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tok):
    """An uninterrupted 4-step run (written to disk)."""
    out = str(tmp_path_factory.mktemp("ft") / "full")
    result = finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    return out, result


def test_run_writes_a_loadable_directory(full_run):
    out, result = full_run
    assert sorted(os.listdir(out)) == sorted(OUTPUT_FILES + (PLOT_FILE,))  # Matplotlib is a test dependency
    m = json.load(open(os.path.join(out, "metrics.json")))
    assert m["steps"] == 4 and len(m["losses"]) == 4 and m["step"] == 4
    assert m["accuracy_before"] is not None and m["accuracy_after"] is not None
    assert m["trainable_params"] < m["total_params"]
    model, tok = llama.load_pretrained(out)
    w = flat(model)
    for k, v in flat(result.model).items():
        np.testing.assert_array_equal(w[k], v)
    assert pockjax.UpdateScheme.from_dict(json.load(open(os.path.join(out, "scheme.json")))) \
        == result.scheme


def test_paper_scheme_trains_only_its_tensors(full_run, tok):
    _, result = full_run
    before, after = flat(tiny_model()), flat(result.model)
    changed = sorted(k for k in before if not np.array_equal(before[k], after[k]))
    assert changed == sorted(f"layers.1.{t}.kernel" for t in
                             ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w3"))


def test_resume_equals_uninterrupted(full_run, tok, tmp_path):
    out_full, full = full_run
    out = str(tmp_path / "run")

    def crash(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, log=lambda s: None,
                 on_step=crash)
    state = json.load(open(os.path.join(out, "state", "trainer.json")))
    assert state["step"] == 2  # the checkpoint written halfway
    resumed = finetune(cfg(out=out, resume=True), log=lambda s: None)
    a, b = flat(full.model), flat(resumed.model)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bitwise
    m_full = json.load(open(os.path.join(out_full, "metrics.json")))
    m_res = json.load(open(os.path.join(out, "metrics.json")))
    assert m_res["losses"] == m_full["losses"]
    assert not [p for p in os.listdir(tmp_path) if p != "run"]  # no temporary directories


def test_failed_write_leaves_previous_output(full_run, tok, tmp_path, monkeypatch):
    out = str(tmp_path / "run")
    real = llama.save_hf_checkpoint
    calls = []

    def flaky(model, path):
        calls.append(path)
        if len(calls) == 2:  # the final write, after the step-2 checkpoint succeeded
            real(model, path)
            raise OSError("disk full (injected)")
        real(model, path)

    monkeypatch.setattr(llama, "save_hf_checkpoint", flaky)
    with pytest.raises(OSError, match="injected"):
        finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    assert sorted(os.listdir(tmp_path)) == ["run"]
    assert sorted(os.listdir(out)) == sorted(OUTPUT_FILES + (PLOT_FILE,))  # Matplotlib is a test dependency
    assert json.load(open(os.path.join(out, "state", "trainer.json")))["step"] == 2
    llama.load_pretrained(out)  # complete and loadable


def test_existing_output_is_not_overwritten(full_run, tok):
    out, _ = full_run
    before = os.path.getmtime(os.path.join(out, "model.safetensors"))
    with pytest.raises(FinetuneError, match="--resume"):
        finetune(cfg(out=out), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    assert os.path.getmtime(os.path.join(out, "model.safetensors")) == before


def test_bad_data_line_names_its_line(tok, tmp_path):
    data = tmp_path / "d.jsonl"
    good = json.dumps({"instruction": "Echo.", "input": "a", "output": "a"})
    data.write_text("\n".join([good] * 5 + ['{"instruction": "x", "output": '] + [good]) + "\n")
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"d\.jsonl:6"):
        finetune(cfg(data=str(data), out=str(out)), model=tiny_model(), tokenizer=tok,
                 log=lambda s: None)
    assert not out.exists()


def test_seq_len_beyond_context(tok, tmp_path):
    with pytest.raises(SequenceLengthError, match="context of 256"):
        finetune(cfg(seq_len=512, out=str(tmp_path / "o")), model=tiny_model(), tokenizer=tok,
                 log=lambda s: None)
    assert not (tmp_path / "o").exists()
    # too short for the examples: the message names the command's option, not Batcher's truncate=True
    with pytest.raises(SequenceLengthError, match=r"raise --seq-len to at least \d+, or leave --seq-len out"):
        finetune(cfg(seq_len=24, out=str(tmp_path / "o")), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    assert not (tmp_path / "o").exists()


def test_scheme_file_not_matching_model(tok, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(pockjax.UpdateScheme({"layers.7.attn.wq.kernel": "full"}).to_dict()))
    with pytest.raises(pockjax.UnmatchedPatternError, match="layers.7.attn.wq.kernel"):
        finetune(cfg(scheme=str(path), out=str(tmp_path / "o")), model=tiny_model(),
                 tokenizer=tok, log=lambda s: None)
    assert not (tmp_path / "o").exists()


def test_missing_and_corrupt_model_files(tmp_path, full_run):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        finetune(cfg(model=str(tmp_path / "nope.gguf")))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        finetune(cfg(model=str(bad)))
    import shutil

    trunc = tmp_path / "trunc"
    shutil.copytree(full_run[0], trunc)
    st = trunc / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(llama.CheckpointError, match="truncated"):
        finetune(cfg(model=str(trunc), out=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_named_schemes():
    params = llama.split(tiny_model())[1]
    counts = {name: llama_scheme(name, TINY, blocks=1).describe(params).trainable
              for name in ("full", "paper", "norm-only", "channels")}
    assert counts["full"] == TINY.num_params()
    assert counts["norm-only"] == (2 * TINY.n_layers + 1) * TINY.dim
    assert counts["channels"] * 2 == counts["paper"]
    with pytest.raises(pockjax.SchemeError, match="unknown scheme"):
        llama_scheme("nope", TINY)


def test_cli(full_run, tmp_path, capsys):
    out, _ = full_run
    assert cli_main(["generate", "--model", out, "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    assert cli_main(["finetune", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "GGUF file not found" in capsys.readouterr().err
    # a real CLI run on the tiny model saved by the fixture: two more steps on top of it
    new = str(tmp_path / "cli")
    rc = cli_main(["finetune", "--model", out, "--task", "uppercase", "--steps", "2",
                   "--batch-size", "2", "--eval-examples", "1", "--blocks", "1",
                   "--scheme", "channels", "--optimizer", "sgd", "--out", new, "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "summary" in text and "exact match" in text
    assert json.load(open(os.path.join(new, "metrics.json")))["steps"] == 2


def test_schedule_clip_and_curves(tmp_path, tok):
    out = str(tmp_path / "sched")
    result = finetune(cfg(out=out, schedule="cosine", warmup=1, grad_clip=0.5), model=tiny_model(), tokenizer=tok,
                      log=lambda s: None)
    rows = [line.split(",") for line in open(os.path.join(out, "metrics.csv")).read().split()]
    assert rows[0] == ["step", "loss", "lr", "val_loss"] and len(rows) == 5
    assert [float(r[1]) for r in rows[1:]] == result.metrics["losses"]
    lrs = [float(r[2]) for r in rows[1:]]  # warm-up from 0 to the peak, then the cosine down
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(3e-4) and lrs[1] > lrs[2] > lrs[3] > 0
    assert open(os.path.join(out, PLOT_FILE), "rb").read(4) == b"\x89PNG"


@pytest.mark.parametrize("kw, message", [
    (dict(schedule="step"), "--schedule must be constant, cosine or linear"),
    (dict(warmup=4), "--warmup 4 leaves no step at the full learning rate"),
    (dict(grad_clip=-1.0), "--grad-clip must be a finite number > 0"),
    (dict(eval_every=5), "--eval-every 5 is beyond --steps 4: no held-out loss would ever be computed"),
])
def test_bad_schedule_options_are_refused(tmp_path, tok, kw, message):
    with pytest.raises(FinetuneError, match=message):
        finetune(cfg(out=str(tmp_path / "x"), **kw), model=tiny_model(), tokenizer=tok, log=lambda s: None)


def test_lora_resume_equals_uninterrupted(tok, tmp_path):
    """A LoRA run saves the merged model for users and base + factors for --resume, which continues exactly."""
    lora = dict(scheme="lora", lr=1e-2)
    full = finetune(cfg(out=str(tmp_path / "full"), **lora), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    out = str(tmp_path / "run")

    def crash(step, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(cfg(out=out, **lora), model=tiny_model(), tokenizer=tok, log=lambda s: None, on_step=crash)
    assert "adapters.safetensors" in os.listdir(os.path.join(out, "state"))
    resumed = finetune(cfg(out=out, resume=True, **lora), log=lambda s: None)
    assert resumed.metrics["losses"] == full.metrics["losses"]
    a, b = flat(full.model), flat(resumed.model)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # bitwise, the merged weights too
    os.remove(os.path.join(out, "state", "adapters.safetensors"))
    with pytest.raises(FinetuneError, match="its LoRA adapters are unreadable"):
        finetune(cfg(out=out, resume=True, steps=6, **lora), log=lambda s: None)


def test_held_out_loss_every_n_steps(tmp_path, tok):
    out = str(tmp_path / "val")
    lines = []
    result = finetune(cfg(out=out, eval_every=2), model=tiny_model(), tokenizer=tok, log=lines.append)
    steps = [s for s, _ in result.metrics["val_losses"]]
    assert steps == [2, 4] and all(math.isfinite(v) and v > 0 for _, v in result.metrics["val_losses"])
    assert any(line.startswith("step 2: loss") and "held-out loss" in line for line in lines)
    rows = [line.split(",") for line in open(os.path.join(out, "metrics.csv")).read().split()]
    assert rows[0][-1] == "val_loss" and rows[2][-1] == str(result.metrics["val_losses"][0][1]) and rows[1][-1] == ""
    with pytest.raises(FinetuneError, match="--eval-examples is 0"):
        finetune(cfg(eval_every=2, eval_examples=0), model=tiny_model(), tokenizer=tok, log=lambda s: None)


def test_out_that_is_a_file_is_refused_before_any_work(tok, tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(FinetuneError, match="--out .*f is an existing file, but a run writes a directory"):
        finetune(cfg(out=str(tmp_path / "f")), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    with pytest.raises(FinetuneError, match="lies under .*f, which is a file, not a directory"):
        finetune(cfg(out=str(tmp_path / "f" / "run")), model=tiny_model(), tokenizer=tok, log=lambda s: None)
    assert (tmp_path / "f").read_text() == "x"


def test_resume_of_a_scheduled_run(tok, tmp_path, capsys):
    """A cosine run resumes with its own --steps only; restating its --warmup or resuming a finished run works."""
    out = str(tmp_path / "cos")
    finetune(cfg(out=out, steps=101, warmup=100, schedule="cosine", save_every=1000, eval_examples=0, show=0),
             model=tiny_model(), tokenizer=tok, log=lambda s: None)
    # its own --warmup restated without --steps: checked against the run's 101 steps, not the CLI's default 100
    assert cli_main(["finetune", "--out", out, "--resume", "--warmup", "100", "--no-progress"]) == 0
    # a finished run resumed (no step left) stays resumable: metrics.json holds no NaN seconds per step
    assert cli_main(["finetune", "--out", out, "--resume", "--no-progress"]) == 0, capsys.readouterr().err
    assert json.load(open(os.path.join(out, "metrics.json")))["seconds_per_step"] is None
    with pytest.raises(FinetuneError, match="with --steps 120: its cosine schedule takes the learning rate to 0"
                                            " at the run's own --steps 101"):
        finetune(cfg(out=out, resume=True, steps=120, eval_examples=0), log=lambda s: None)


def test_resume_refuses_a_model_passed_in(tmp_path, tok):
    """A resumed run reloads the model it saved: a model passed in would be silently ignored, so it is refused."""
    out = str(tmp_path / "run")
    with pytest.raises(FinetuneError, match="a model passed in would be ignored: pass model=None"):
        finetune(cfg(out=out, resume=True), model=tiny_model(), tokenizer=tok, log=lambda s: None)
