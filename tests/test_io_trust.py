"""Each bad input found by attack gets a clear PockjaxError; every write is atomic and durable.

One test per attack that once ended in a traceback, a wrong message or wrong
data; then the atomic writer under simulated crashes (an exception mid-write
and a process killed mid-write), the cleanup of stale temporaries, and the
command line's one-line errors.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pockjax import cli
from pockjax.data import load_alpaca_jsonl
from pockjax.errors import (
    CheckpointError,
    DataError,
    FileMissingError,
    GGUFError,
    PockjaxError,
    SafetensorsError,
    TokenizerFileError,
    UnknownModelError,
    UnsupportedModelError,
)
from pockjax.io import atomic
from pockjax.io.safetensors import read_safetensors, write_safetensors
from pockjax.models import llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _safetensors(path, header: object, data: bytes = b"") -> str:
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)
    return str(path)


# -- safetensors headers -----------------------------------------------------------------


def test_negative_data_offsets_do_not_read_the_header(tmp_path):
    # begin = -len(header) once pointed the memory map at the header's own bytes
    header = {"w": {"dtype": "U8", "shape": [4], "data_offsets": [-4, 0]}}
    path = _safetensors(tmp_path / "neg.safetensors", header)
    with pytest.raises(SafetensorsError, match=r"neg\.safetensors: tensor 'w'.*0 <= begin"):
        read_safetensors(path)


def test_header_that_is_a_list(tmp_path):
    path = _safetensors(tmp_path / "list.safetensors", [1, 2])
    with pytest.raises(SafetensorsError, match="must be a JSON object, not list"):
        read_safetensors(path)


def test_a_tensor_named_twice_in_the_header_is_refused(tmp_path):
    # json kept the second entry silently: the file read as one tensor with the other's bytes
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}'
    blob = ('{"w": %s, "w": %s}' % (entry % (0, 4), entry % (4, 8))).encode()
    path = tmp_path / "twice.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 8)
    with pytest.raises(SafetensorsError, match=r"twice\.safetensors: the header: invalid JSON \(key 'w' given twice"):
        read_safetensors(str(path))


def test_header_entry_without_data_offsets(tmp_path):
    path = _safetensors(tmp_path / "nooff.safetensors",
                        {"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4)
    with pytest.raises(SafetensorsError, match="tensor 'w': its entry lacks data_offsets"):
        read_safetensors(path)


@pytest.mark.parametrize("entry, message", [
    ("oops", "must be an object"),
    ({"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}, "dtype 'F31'"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [1.0], "data_offsets": [0, 4]}, "non-negative integers"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "two integers"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [0, True]}, "two integers"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8 bytes"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}, "truncated"),
    # no bytes, yet no array can have this shape: a bare numpy error once, naming nothing
    ({"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}, "more values than any array"),
])
def test_malformed_tensor_entries(tmp_path, entry, message):
    path = _safetensors(tmp_path / "bad.safetensors", {"w": entry}, b"\0" * 4)
    with pytest.raises(SafetensorsError, match=message):
        read_safetensors(path)


def test_gguf_tensor_dimensions_no_array_can_have_are_refused(tmp_path):
    from pockjax.io.gguf import open_gguf, write_gguf

    path = str(tmp_path / "huge.gguf")
    write_gguf(path, {"general.architecture": "llama"}, [("w", "F32", (0, 2**62), np.zeros(0, np.float32))])
    with pytest.raises(GGUFError, match=r"huge\.gguf: tensor 'w' has dimensions .*more values than any array"):
        open_gguf(path)


def test_scalars_keep_their_shape_and_metadata_must_be_strings(tmp_path):
    from pockjax.io.safetensors import LazyTensor

    path = tmp_path / "s.safetensors"
    write_safetensors(path, {"t": np.array(2.0, np.float32), "lazy": LazyTensor((), np.float32, lambda: np.float32(3)),
                             "be": LazyTensor((2,), ">i4", lambda: np.array([1, 2], ">i4"))})
    back = read_safetensors(path)
    assert back["t"].shape == back["lazy"].shape == () and float(back["lazy"]) == 3.0
    assert back["be"].dtype == np.int32 and back["be"].tolist() == [1, 2]
    with pytest.raises(ValueError, match="strings to strings"):
        write_safetensors(path, {"t": np.ones(1)}, metadata={"format": None})
    assert float(read_safetensors(path)["t"]) == 2.0  # refused before anything was written


def test_views_and_big_endian_arrays_are_written_as_stored(tmp_path):
    # Each array takes its stored form (C order, little-endian) as it is written, one at a time.
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "v.safetensors"
    write_safetensors(path, {"t": x.T, "step": x[:, ::2], "be": np.arange(5, dtype=">f8"), "z": np.zeros((0, 3))})
    back = read_safetensors(path)
    np.testing.assert_array_equal(back["t"], x.T)
    np.testing.assert_array_equal(back["step"], x[:, ::2])
    assert back["be"].dtype == np.float64 and back["be"].tolist() == [0, 1, 2, 3, 4]
    assert back["z"].shape == (0, 3)


def test_overlapping_and_gapped_tensors(tmp_path):
    both = {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}
    with pytest.raises(SafetensorsError, match="overlaps"):
        read_safetensors(_safetensors(tmp_path / "o.safetensors", both, b"\0" * 4))
    gap = {"a": {"dtype": "U8", "shape": [2], "data_offsets": [2, 4]}}
    with pytest.raises(SafetensorsError, match="gap"):
        read_safetensors(_safetensors(tmp_path / "g.safetensors", gap, b"\0" * 4))


def test_checkpoint_with_only_pickle_files_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "intermediate_size": 8}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(FileMissingError, match="never unpickles"):
        llama.load_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("config, error, message", [
    ([1, 2], CheckpointError, "expected a JSON object"),
    ({"model_type": "llama"}, CheckpointError, "missing vocab_size"),
    ({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 0, "intermediate_size": 8}, CheckpointError, "n_heads must be"),
    ({"model_type": "mistral"}, UnsupportedModelError, "'mistral' is not supported"),
])
def test_bad_config_json(tmp_path, config, error, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors(tmp_path / "model.safetensors", {"x": np.zeros(1, np.float32)})
    with pytest.raises(error, match=message):
        llama.load_hf_checkpoint(tmp_path)


def test_layer_beyond_the_config_is_named(tmp_path):
    from flax import nnx

    llama.save_hf_checkpoint(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(tmp_path / "model.safetensors").items()}
    tensors["model.layers.9.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(tmp_path / "model.safetensors", tensors)
    with pytest.raises(UnsupportedModelError, match="model.layers.9.mlp.up_proj.weight"):
        llama.load_hf_checkpoint(tmp_path, scan_layers=True)


# -- GGUF ----------------------------------------------------------------------------------


def _gguf(path, build):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_gguf_without_required_metadata(tmp_path):
    path = _gguf(tmp_path / "nometa.gguf",
                 lambda w: w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32)))
    with pytest.raises(GGUFError, match="nometa.gguf: metadata key 'llama.attention.head_count'"
                                        " is missing"):
        llama.load_gguf(path)


def test_gguf_tokenizer_metadata_of_the_wrong_type(tmp_path):
    def build(w):
        w.add_tokenizer_model("gpt2")
        w.add_uint32("tokenizer.ggml.tokens", 3)

    with pytest.raises(TokenizerFileError, match="tokenizer.ggml.tokens must be"):
        llama.load_tokenizer(_gguf(tmp_path / "tok.gguf", build))


def test_gguf_version_and_directory(tmp_path):
    bad = tmp_path / "v9.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(GGUFError, match="version 9 is not supported"):
        llama.load_gguf(bad)
    (tmp_path / "d.gguf").mkdir()
    with pytest.raises(GGUFError, match="is a directory"):
        llama.load_gguf(tmp_path / "d.gguf")


# -- tokenizer.json, data files, missing paths ------------------------------------------------


def test_corrupt_tokenizer_json_names_the_file(tmp_path):
    from flax import nnx

    tok = llama.Tokenizer.byte_level_for_tests()
    llama.save_hf_checkpoint(llama.Llama(llama.LlamaConfig.tiny(vocab=tok.vocab_size),
                                         rngs=nnx.Rngs(0)), tmp_path)
    tok.save(tmp_path)
    text = (tmp_path / "tokenizer.json").read_text()
    (tmp_path / "tokenizer.json").write_text(text[: len(text) // 2])
    with pytest.raises(TokenizerFileError, match=r"tokenizer\.json:\d+: invalid JSON"):
        llama.load_pretrained(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(TokenizerFileError, match="tokenizer.json: the tokenizers library rejects"):
        llama.load_tokenizer(tmp_path)
    tok.save(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerFileError, match="'<|nope|>' is not in the vocabulary"):
        llama.load_tokenizer(tmp_path)


def test_binary_data_file_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"instruction": "a", "output": "b"}\n\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR')
    with pytest.raises(DataError, match=r"data\.jsonl:2: .*binary"):
        load_alpaca_jsonl(path)
    path.write_bytes(b'{"instruction": "a", "output": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:1: not UTF-8"):
        load_alpaca_jsonl(path)
    path.write_text('{"instruction": "a", "output": NaN}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:1: invalid JSON \(NaN"):
        load_alpaca_jsonl(path)
    path.write_text('{"instruction": "a", "output": "\\ud800"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:1: 'output' holds an unpaired"):
        load_alpaca_jsonl(path)
    with pytest.raises(DataError, match="it is a directory"):
        load_alpaca_jsonl(tmp_path)
    # UTF-16 (what Windows PowerShell 5 writes): once called binary data
    path.write_bytes('{"instruction": "a", "output": "b"}\n'.encode("utf-16"))
    with pytest.raises(DataError, match=r"data\.jsonl:1: the file is UTF-16 text .* save it as UTF-8"):
        load_alpaca_jsonl(path)


def test_missing_model_directory_says_it_does_not_exist(tmp_path):
    missing = str(tmp_path / "tuned")
    with pytest.raises(FileMissingError, match=f"model path {missing} does not exist"):
        llama.load_pretrained(missing)
    with pytest.raises(FileMissingError, match="does not exist"):
        llama.load_pretrained("./no-such-run/")
    with pytest.raises(FileMissingError, match="does not exist"):
        llama.load_tokenizer(missing)
    with pytest.raises(UnknownModelError, match="unknown pretrained model 'gpt-5'"):
        llama.load_pretrained("gpt-5")


# -- the command line -----------------------------------------------------------------------


def _parser_raising(exc: BaseException):
    def build():
        parser = argparse.ArgumentParser(prog="pockjax")
        sub = parser.add_subparsers(dest="command")
        p = sub.add_parser("boom")

        def run(args):
            raise exc

        p.set_defaults(func=run)
        return parser

    return build


def test_cli_turns_pockjax_errors_into_one_line(monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", _parser_raising(
        FileMissingError("model path ./x does not exist\n(check --out)")))
    assert cli.main(["boom"]) == 2
    err = capsys.readouterr().err
    assert err == "pockjax: error: model path ./x does not exist; (check --out)\n"
    monkeypatch.setattr(cli, "build_parser", _parser_raising(UnknownModelError("unknown 'x'")))
    assert cli.main(["boom"]) == 2
    assert capsys.readouterr().err == "pockjax: error: unknown 'x'\n"


def test_cli_lets_bugs_propagate(monkeypatch):
    monkeypatch.setattr(cli, "build_parser", _parser_raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main(["boom"])


def test_cli_generate_with_a_missing_model_directory(tmp_path, capsys):
    missing = str(tmp_path / "run")
    assert cli.main(["generate", "--model", missing, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "unknown pretrained model" not in err
    assert len(err.splitlines()) == 1


# -- atomic writes ---------------------------------------------------------------------------


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "metrics.json"
    atomic.write_json(path, {"ok": 1})
    with pytest.raises(TypeError):
        atomic.write_json(path, {"bad": object()})
    with pytest.raises(RuntimeError):
        with atomic.atomic_open(path, "w") as f:
            f.write('{"half": ')
            raise RuntimeError("crash mid-write")
    assert json.loads(path.read_text()) == {"ok": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]


def test_write_json_refuses_nan_and_infinity_naming_the_file_and_where(tmp_path):
    """NaN and Infinity are not JSON (a strict reader, as ``finetune --resume``'s,
    refuses the file): write_json refuses them in one line naming the file and
    where the value is, and the old file stays as it was."""
    from pockjax.errors import InputError
    from pockjax.io.jsonfile import read_json

    path = tmp_path / "results.json"
    atomic.write_json(path, {"ok": 1, "missing": None})
    for bad, where, value in [({"speed": {"row": {"step_s": float("nan")}}}, '["speed"]["row"]["step_s"]', "nan"),
                              ({"losses": [1.0, np.float64("-inf")]}, '["losses"][1]', "-inf"),
                              (float("inf"), "the top level", "inf")]:
        with pytest.raises(InputError) as e:
            atomic.write_json(path, bad)
        msg = str(e.value)
        assert isinstance(e.value, ValueError) and "\n" not in msg
        assert msg.startswith(f"cannot write {path}: it would hold {value} at {where}, ")
        assert "NaN/Infinity are not JSON" in msg and "write null (None)" in msg
    assert read_json(path) == {"ok": 1, "missing": None}
    assert os.listdir(tmp_path) == ["results.json"]
    with pytest.raises(ValueError, match="Circular reference"):  # json's other faults are its own
        loop = []
        loop.append(loop)
        atomic.write_json(path, loop)


def _killed_writer(tmp_path, body: str) -> None:
    """Runs ``body`` in a child that SIGKILLs itself mid-write, like an OOM kill."""
    script = textwrap.dedent("""
        import os, signal, sys
        from pockjax.io import atomic
        target = sys.argv[1]
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
    """) + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


def test_killed_file_write_leaves_old_file_and_a_stale_temporary(tmp_path):
    target = tmp_path / "module.json"
    atomic.write_text(target, "old")
    _killed_writer(tmp_path, """
        with atomic.atomic_open(os.path.join(target, "module.json"), "w") as f:
            f.write("new, half written")
            f.flush()
            die()
    """)
    assert target.read_text() == "old"
    leftovers = [n for n in os.listdir(tmp_path) if atomic.is_temporary(n)]
    assert len(leftovers) == 1 and leftovers[0].startswith("module.json.pockjax-tmp-")
    removed = atomic.remove_stale_temporaries(tmp_path)  # the next run's start
    assert [os.path.basename(p) for p in removed] == leftovers
    assert os.listdir(tmp_path) == ["module.json"]


def test_killed_directory_write_leaves_old_checkpoint(tmp_path):
    out = tmp_path / "run"
    with atomic.atomic_directory(out) as tmp:
        atomic.write_text(os.path.join(tmp, "model.safetensors"), "old weights")
    _killed_writer(tmp_path, """
        with atomic.atomic_directory(os.path.join(target, "run")) as tmp:
            open(os.path.join(tmp, "model.safetensors"), "w").write("new")
            die()
    """)
    assert (out / "model.safetensors").read_text() == "old weights"
    assert len(os.listdir(tmp_path)) == 2
    atomic.remove_stale_temporaries(tmp_path)
    assert os.listdir(tmp_path) == ["run"]


def test_live_process_temporaries_are_kept(tmp_path):
    mine = atomic.temporary_name(tmp_path / "report.json")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = str(tmp_path / f"plot.png.pockjax-tmp-{other.pid}-0123abcd")
        dead = str(tmp_path / "bench.json.pockjax-tmp-999999999-0123abcd")
        user = str(tmp_path / "notes.tmp-999999999")  # not ours: never touched
        for p in (mine, theirs, dead, user):
            open(p, "w").close()
        assert atomic.remove_stale_temporaries(tmp_path) == [dead]
        assert all(os.path.exists(p) for p in (mine, theirs, user))
    finally:
        other.kill()
        other.wait()
    assert not os.path.exists(dead)


def test_interrupted_fallback_swap_is_undone(tmp_path):
    # killed between "OUT -> OUT.pockjax-old-..." and "tmp -> OUT"
    old = tmp_path / "run.pockjax-old-999999999-0123abcd"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (tmp_path / "run.pockjax-tmp-999999999-89abcdef").mkdir()
    atomic.remove_stale_temporaries(tmp_path)
    assert os.listdir(tmp_path) == ["run"]
    assert (tmp_path / "run" / "config.json").read_text() == "{}"


def test_finetune_leaves_directories_named_like_old_leftovers_alone(tmp_path):
    # versions before 2026-11-25 wrote OUT.tmp-PID and OUT.old: the recovery of those names once
    # deleted a user's run.tmp-N and moved a user's backup run.old into run
    from pockjax.train.finetune import _recover

    out = tmp_path / "run"
    for name in ("run.tmp-999999999", "run.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("mine")
    (tmp_path / "run.pockjax-tmp-999999999-0a1b2c3d").mkdir()  # a dead run's temporary: removed
    _recover(str(out))
    assert sorted(os.listdir(tmp_path)) == ["run.old", "run.tmp-999999999"]
    assert (tmp_path / "run.old" / "notes.txt").read_text() == "mine"


def test_every_error_names_its_file_and_is_a_pockjax_error(tmp_path):
    cases = [
        (read_safetensors, _safetensors(tmp_path / "a.safetensors", {"w": 1})),
        (llama.load_gguf, str(tmp_path / "missing.gguf")),
        (load_alpaca_jsonl, str(tmp_path / "missing.jsonl")),
    ]
    for fn, path in cases:
        with pytest.raises(PockjaxError) as info:
            fn(path)
        assert os.path.basename(path) in str(info.value)


def test_output_path_for_tools_that_write_files(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")
    with pytest.raises(FileNotFoundError, match="produced no file"):
        with atomic.atomic_output_path(path):
            pass  # the tool failed silently
    with pytest.raises(RuntimeError):
        with atomic.atomic_output_path(path) as tmp:
            open(tmp, "wb").write(b"half")
            raise RuntimeError("tool crashed")
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["plot.png"]


def test_atomic_writer_is_jax_free():
    # the JAX-free runtime may use it
    code = ("import sys, pockjax.io.atomic, pockjax.io.safetensors, pockjax.io.gguf;"
            " assert 'jax' not in sys.modules, 'jax imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_format_loaders_do_not_import_each_other():
    import ast

    loaders = ("gguf", "hf", "tokenizer")
    for name in loaders:
        path = os.path.join(REPO, "pockjax", "models", "llama", f"{name}.py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        others = {f"pockjax.models.llama.{o}" for o in loaders if o != name}
        assert not imported & others, f"{name}.py imports {imported & others}"


def test_bfloat16_checkpoint_loads_and_integer_weights_do_not(tmp_path):
    import ml_dtypes
    from flax import nnx

    model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    llama.save_hf_checkpoint(model, tmp_path)
    st = tmp_path / "model.safetensors"
    tensors = {k: np.array(v) for k, v in read_safetensors(st).items()}
    write_safetensors(st, {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()})
    _, flat = llama.read_hf_checkpoint(tmp_path)
    assert flat["norm.scale"].dtype.name == "bfloat16"
    write_safetensors(st, {**tensors, "model.norm.weight": np.ones(64, np.int32)})
    with pytest.raises(CheckpointError, match="model.norm.weight' has dtype int32"):
        llama.read_hf_checkpoint(tmp_path)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_directory_replace_with_and_without_atomic_exchange(tmp_path, monkeypatch, exchange):
    if not exchange:
        monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
    out = tmp_path / "run"
    for content in ("one", "two"):
        with atomic.atomic_directory(out) as tmp:
            atomic.write_text(os.path.join(tmp, "step.txt"), content)
        assert (out / "step.txt").read_text() == content
        assert os.listdir(tmp_path) == ["run"]


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", r"module\.json'?: not UTF-8 text \(byte 0xff at offset 0\)"),
    (b"[1, 2]", r"module\.json'?: expected a JSON object, got list"),
    (b"{\"format\": ", r"module\.json'?: invalid JSON"),
    (b"{\"format\": \"pockjax-iree-module\", \"format\": \"x\"}", r"module\.json'?: invalid JSON \(key 'format' given twice"),
    (b"{\"format\": NaN}", r"module\.json'?: invalid JSON \(NaN is not valid JSON"),
    (b"{\"format\": \"pockjax-iree-module\", \"inputs\": 3}", r"module\.json'?: TypeError"),
    (b"{\"format\": \"other\"}", r"module\.json'?: not a pockjax module metadata file"),
])
def test_runtime_metadata_reader_names_the_file(tmp_path, content, message):
    from pockjax.runtime import ModuleError, read_metadata

    (tmp_path / "module.json").write_bytes(content)
    with pytest.raises(ModuleError, match=message) as e:
        read_metadata(tmp_path)
    assert str(tmp_path / "module.json") in str(e.value)
    assert e.value.__cause__ is None
