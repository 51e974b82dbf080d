"""pockjax.runtime: export, load without JAX, continue training, clear errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import _iree_steps as S
from pockjax import runtime  # noqa: E402
from pockjax.backends import iree as piree  # noqa: E402

pytestmark = pytest.mark.iree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def exported_mlp(tmp_path_factory):
    """The MLP step for cpu, exported with its initial weights (written by the JAX side)."""
    fs = S.mlp_step()
    path = tmp_path_factory.mktemp("export") / "mlp_cpu"
    piree.export_module(S.compiled("mlp", "cpu"), path, weights=fs.flat_state(), extra={"tree": "mlp-test"})
    return str(path)


def _copy(src, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------
# Export format
# ---------------------------------------------------------------------------


def test_export_writes_module_metadata_and_weights(exported_mlp):
    assert sorted(os.listdir(exported_mlp)) == ["module.json", "module.vmfb", "weights.irpa"]
    meta = json.load(open(os.path.join(exported_mlp, "module.json")))
    assert meta["format"] == "pockjax-iree-module"
    assert meta["target"]["name"] == "cpu" and meta["target"]["driver"] == "local-task"
    assert {"jax", "iree-base-compiler", "iree-base-runtime", "pockjax"} <= set(meta["versions"])
    assert meta["extra"] == {"step": "mlp", "tree": "mlp-test"}
    fs = S.mlp_step()
    assert [i["name"] for i in meta["inputs"]] == fs.input_names
    assert meta["inputs"][-2] == {"name": "batch[0]", "shape": [4, 8], "dtype": "float32", "role": "input"}
    roles = [o["role"] for o in meta["outputs"]]
    assert roles == ["state"] * fs.n_state + ["aux"]
    assert [o["state_index"] for o in meta["outputs"][:-1]] == list(range(fs.n_state))
    assert meta["weights"] == {"file": "weights.irpa", "format": "irpa"}


def test_weights_archive_roundtrip(tmp_path):
    arrays = {"a.w": np.arange(6, dtype=np.float32).reshape(2, 3), "count": np.array(7, np.int32),
              "h": np.ones((5,), np.float16)}
    runtime.save_weights(tmp_path / "w.irpa", arrays)
    back = runtime.load_weights(tmp_path / "w.irpa")
    assert set(back) == set(arrays)
    for k in arrays:
        assert back[k].dtype == arrays[k].dtype and back[k].shape == arrays[k].shape
        np.testing.assert_array_equal(back[k], arrays[k])


def test_load_weights_of_a_directory_says_which_file(tmp_path):
    # IREE's parameter index crashes the process on a directory; the runtime checks first.
    with pytest.raises(runtime.ModuleError, match="is a directory.*weights.irpa"):
        runtime.load_weights(tmp_path)


# ---------------------------------------------------------------------------
# Running from NumPy arrays
# ---------------------------------------------------------------------------


def test_loaded_module_continues_training_like_jit(exported_mlp, tmp_path):
    """Weights written by JAX, 5 steps in the runtime == 5 jax.jit steps; then save/reload."""
    fs = S.mlp_step()
    mod = runtime.load(exported_mlp)
    losses = [float(mod.step(*[np.asarray(b) for b in fs.batches[i % 3]])[0]) for i in range(5)]
    ref_losses, ref_state = fs.reference(5)
    S.assert_matches(fs, losses, list(mod.get_state().values()), ref_losses, ref_state)
    mod.save_weights(tmp_path / "trained.irpa")
    again = runtime.load(exported_mlp)
    again.load_weights(tmp_path / "trained.irpa")
    for k, v in mod.get_state().items():
        np.testing.assert_array_equal(again.get_state()[k], v)


def test_named_batch_inputs_and_set_state_subset(exported_mlp):
    fs = S.mlp_step()
    mod = runtime.load(exported_mlp)
    x, y = (np.asarray(b) for b in fs.batches[0])
    (l1,) = mod.step(**{"batch[0]": x, "batch[1]": y})
    mod.set_state({"params['l1']['b']": np.full((16,), 0.5, np.float32)})
    np.testing.assert_array_equal(mod.get_state()["params['l1']['b']"], 0.5)
    assert np.isfinite(l1)


_NO_JAX_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoJax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "jax" or name.startswith(("jax.", "jaxlib", "flax", "optax")):
                raise ImportError(f"{name} is blocked in this test process")
            return None

    sys.meta_path.insert(0, _NoJax())
    import numpy as np
    if sys.argv[4] == "package":
        from pockjax import runtime
    else:  # the folder pockjax/runtime/, copied to a device on its own (any package name)
        sys.path.insert(0, sys.argv[4])
        import device_runtime as runtime
        assert "pockjax" not in sys.modules, "the copied runtime imported pockjax"
    try:
        import jax  # noqa: F401
        raise SystemExit("jax import was not blocked")
    except ImportError:
        pass
    mod = runtime.load(sys.argv[1])
    batches = np.load(sys.argv[2])
    losses = []
    for i in range(5):
        (loss,) = mod.step(batches[f"x{i % 3}"], batches[f"y{i % 3}"])
        losses.append(float(loss))
    np.savez(sys.argv[3], losses=np.array(losses), **mod.get_state())
    assert not any(m == "jax" or m.startswith("jax.") for m in sys.modules), "jax got imported"
    print("ok")
    """
)


@pytest.mark.parametrize("how", ["package", "copied-folder"])
def test_runtime_runs_in_a_process_where_jax_cannot_be_imported(exported_mlp, tmp_path, how):
    """``from pockjax import runtime`` (and the bare runtime folder) work where ``import jax`` fails.

    The ``package`` variant also needs ``pockjax/__init__.py`` not to import JAX eagerly; the
    ``copied-folder`` variant needs the runtime's modules to import each other relatively.
    """
    fs = S.mlp_step()
    which = "package"
    if how == "copied-folder":
        which = str(tmp_path / "device")
        shutil.copytree(os.path.join(REPO, "pockjax", "runtime"), os.path.join(which, "device_runtime"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    np.savez(tmp_path / "batches.npz", **{f"x{i}": np.asarray(b[0]) for i, b in enumerate(fs.batches)},
             **{f"y{i}": np.asarray(b[1]) for i, b in enumerate(fs.batches)})
    script = tmp_path / "run_no_jax.py"
    script.write_text(_NO_JAX_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, str(script), exported_mlp, str(tmp_path / "batches.npz"), str(tmp_path / "out.npz"), which],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    ref_losses, ref_state = fs.reference(5)
    S.assert_matches(fs, list(out["losses"]), [out[n] for n in fs.input_names[: fs.n_state]], ref_losses, ref_state)


_EXIT_WITH_LIVE_BUFFERS = textwrap.dedent(
    """
    import numpy as np, jax.numpy as jnp, optax
    from flax import nnx
    import pockjax
    from pockjax.models import llama
    from pockjax.train.steps import lm_train_step

    graphdef, params = llama.split(llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    step = pockjax.compile(lm_train_step(graphdef, tx), target="cpu")
    tokens = jnp.ones((2, 16), jnp.int32)
    opt_state = tx.init(params)
    for _ in range(2):
        params, opt_state, loss = step(params, opt_state, tokens, tokens, jnp.ones((2, 16)))
    print(float(np.asarray(loss)))
    # the script ends with params and opt_state still on the IREE device
    """
)


def test_process_exits_cleanly_with_state_still_on_the_iree_device(tmp_path):
    # Left to interpreter shutdown, IREE objects were destroyed in module-teardown
    # order and the process crashed on exit (SIGSEGV) after every such script.
    proc = subprocess.run([sys.executable, "-c", _EXIT_WITH_LIVE_BUFFERS], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert np.isfinite(float(proc.stdout.split()[-1]))


# ---------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------


def test_wrong_shape_and_dtype_are_named(exported_mlp):
    mod = runtime.load(exported_mlp)
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(runtime.InputError, match=r"'batch\[1\]': expected shape \(4, 4\), got \(4, 5\)"):
        mod.step(x, np.zeros((4, 5), np.float32))
    with pytest.raises(runtime.InputError, match=r"'batch\[0\]': expected dtype float32, got float64"):
        mod.step(x.astype(np.float64), np.zeros((4, 4), np.float32))
    with pytest.raises(runtime.InputError, match="expected 2 batch inputs"):
        mod.step(x)
    with pytest.raises(runtime.InputError, match="unknown state names"):
        mod.set_state({"params.nope": x})


def test_missing_files(exported_mlp, tmp_path):
    with pytest.raises(runtime.ModuleError, match="does not exist"):
        runtime.load(tmp_path / "nowhere")
    d = _copy(exported_mlp, tmp_path, "no_vmfb")
    os.remove(d / "module.vmfb")
    with pytest.raises(runtime.ModuleError, match="module file .* is missing"):
        runtime.load(d)
    d = _copy(exported_mlp, tmp_path, "no_weights")
    os.remove(d / "weights.irpa")
    with pytest.raises(runtime.ModuleError, match="weights file .* is missing"):
        runtime.load(d)
    d = _copy(exported_mlp, tmp_path, "no_meta")
    os.remove(d / "module.json")
    with pytest.raises(runtime.ModuleError, match="no module metadata"):
        runtime.load(d)
    mod = runtime.load(exported_mlp, load_initial_weights=False)
    with pytest.raises(runtime.ModuleError, match="state not initialised"):
        mod.step(np.zeros((4, 8), np.float32), np.zeros((4, 4), np.float32))


def test_replaced_module_fails_checksum(exported_mlp, tmp_path):
    d = _copy(exported_mlp, tmp_path)
    with open(d / "module.vmfb", "wb") as f:
        f.write(S.compiled("mlp", "dsp").vmfb)
    with pytest.raises(runtime.ModuleError, match="checksum"):
        runtime.load(d)


@pytest.mark.parametrize("edit", ["outputs-swapped", "input-shape"])
def test_metadata_that_does_not_describe_the_module_is_refused(exported_mlp, tmp_path, edit):
    # module.json's checksum covers the .vmfb only: outputs swapped in it filed each returned buffer
    # as another state leaf, without a word; the module's own declaration is the reference now
    d = _copy(exported_mlp, tmp_path)
    meta = json.loads((d / "module.json").read_text())
    if edit == "outputs-swapped":
        shapes = [tuple(o["shape"]) for o in meta["outputs"]]
        k = next(k for k in range(1, len(shapes)) if shapes[k] != shapes[0])
        meta["outputs"][0], meta["outputs"][k] = meta["outputs"][k], meta["outputs"][0]
    else:
        meta["inputs"][-1]["shape"][0] += 1
    (d / "module.json").write_text(json.dumps(meta))
    with pytest.raises(runtime.ModuleError, match="the module's function has .* there: the metadata does not"
                                                  " describe this module"):
        runtime.load(d)


def test_module_for_another_target_is_refused(tmp_path):
    fs = S.mlp_step()
    dsp = piree.export_module(S.compiled("mlp", "dsp"), tmp_path / "dsp")
    with pytest.raises(runtime.TargetMismatchError, match="compiled for target 'dsp', not 'cpu'"):
        runtime.load(dsp, target="cpu")
    vk = piree.export_module(S.compiled("mlp", "vulkan"), tmp_path / "vk")
    with pytest.raises(runtime.TargetMismatchError, match="runs on driver 'vulkan', not 'local-task'"):
        runtime.load(vk, driver="local-task")
    arm = piree.export_module(S.compiled("mlp", "arm64"), tmp_path / "arm", weights=fs.flat_state())
    with pytest.raises(runtime.TargetMismatchError, match="compiled for 'aarch64-linux-gnu'"):
        runtime.load(arm)


def test_arm64_export_runs_through_iree_run_module_under_qemu(tmp_path):
    fs = S.mlp_step()
    arm = piree.export_module(S.compiled("mlp", "arm64"), tmp_path / "arm", weights=fs.flat_state())
    mod = runtime.load(arm, tool=S.require_arm64_runner())
    losses = [float(mod.step(*[np.asarray(b) for b in fs.batches[i]])[0]) for i in range(3)]
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, list(mod.get_state().values()), ref_losses, ref_state)


# ---------------------------------------------------------------------------
# State in module globals read by name from a parameter archive
# ---------------------------------------------------------------------------


def _mlp_eval_step():
    """Loss only: every param is read-only state (the 'generate'-style second module)."""
    import jax

    fs = S.mlp_step()
    n_params = len(jax.tree.leaves(fs.params))

    def eval_loss(*flat):
        params = jax.tree.unflatten(jax.tree.structure(fs.params), flat[:n_params])
        return (S.mlp_loss(params, *flat[n_params:]),)

    avals = fs.flat_avals[:n_params] + fs.flat_avals[fs.n_state:]
    names = fs.input_names[:n_params] + fs.input_names[fs.n_state:]
    return eval_loss, avals, [i < n_params for i in range(len(avals))], names


def test_parameter_backed_state_matches_jit_and_shares_one_archive(tmp_path):
    fs = S.mlp_step()
    train = piree.compile_flat(fs.flat_fun, fs.flat_avals, "cpu", state_mask=fs.state_mask,
                               input_names=fs.input_names, state_storage="parameters")
    d = piree.export_module(train, tmp_path / "train", weights=fs.flat_state())
    mod = runtime.load(d)
    losses = [float(mod.step(*[np.asarray(b) for b in fs.batches[i % 3]])[0]) for i in range(5)]
    ref_losses, ref_state = fs.reference(5)
    S.assert_matches(fs, losses, list(mod.get_state().values()), ref_losses, ref_state)

    # A second module (loss only, all weights read-only) reads the same archive by name.
    mod.save_weights(tmp_path / "shared.irpa")
    fun, avals, mask, names = _mlp_eval_step()
    ev = piree.compile_flat(fun, avals, "cpu", state_mask=mask, input_names=names, state_outputs={},
                            state_storage="parameters")
    e = runtime.load(piree.export_module(ev, tmp_path / "eval", weights_file=str(tmp_path / "shared.irpa")))
    x, y = (np.asarray(b) for b in fs.batches[0])
    trained = S.jax_tree_params(fs, ref_state)
    np.testing.assert_allclose(e.step(x, y)[0], S.mlp_loss(trained, x, y), rtol=1e-5)
    with pytest.raises(runtime.InputError, match="read-only"):
        e.set_state({names[0]: np.zeros(avals[0].shape, np.float32)})
