"""IREE targets: each compiles a train step that matches ``jax.jit`` (rtol 1e-4).

Runs here: cpu (local-task), dsp (vmvx), vulkan (Mesa lavapipe), arm64 (the
aarch64 ``iree-run-module`` under qemu-aarch64). cuda compiles here and runs
only where a GPU is present (``-m gpu``). vulkan and arm64 *fail* rather than
skip when their system packages are missing; CI installs them with
``.ci/system-deps.sh``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import _iree_steps as S
from pockjax.backends import iree as piree
from pockjax.backends.iree import targets
from pockjax.errors import TargetError

pytestmark = pytest.mark.iree

RUNNABLE = ["cpu", "dsp", "vulkan", "arm64"]


# ---------------------------------------------------------------------------
# The target table
# ---------------------------------------------------------------------------


def test_target_table_names_backends_and_drivers():
    got = {n: (targets.resolve(n).backend, targets.resolve(n).driver) for n in targets.names()}
    assert got == {
        "cpu": ("llvm-cpu", "local-task"),
        "arm64": ("llvm-cpu", "local-task"),
        "vulkan": ("vulkan-spirv", "vulkan"),
        "cuda": ("cuda", "cuda"),
        "dsp": ("vmvx", "local-task"),
    }
    arm = targets.resolve("arm64")
    assert "--iree-llvmcpu-target-triple=aarch64-linux-gnu" in arm.flags
    assert "--iree-llvmcpu-target-cpu-features=+neon" in arm.flags
    assert arm.triple == "aarch64-linux-gnu"
    assert f"--iree-cuda-target={targets.DEFAULT_CUDA_ARCH}" in targets.resolve("cuda").flags


def test_target_options_override_cpu_and_gpu_arch():
    assert "--iree-llvmcpu-target-cpu=cortex-a76" in targets.resolve("arm64", cpu="cortex-a76").flags
    assert "--iree-cuda-target=sm_86" in targets.resolve("cuda", arch="sm_86").flags
    assert "--iree-vulkan-target=rdna3" in targets.resolve("vulkan", arch="rdna3").flags
    with pytest.warns(UserWarning, match="iree-org/iree#22147"):
        hopper = targets.resolve("cuda", arch="sm_90")  # IREE 3.13 cannot target sm_90 itself
    assert "--iree-cuda-target=sm_80" in hopper.flags and hopper.options["arch_requested"] == "sm_90"
    emb = targets.resolve("dsp", triple="riscv32-unknown-elf", static_library="/tmp/x.o")
    assert emb.backend == "llvm-cpu" and "--iree-llvmcpu-link-static" in emb.flags
    with pytest.raises(TargetError, match="unknown IREE target 'tpu'"):
        targets.resolve("tpu")
    with pytest.raises(TargetError, match="apply to CPU targets"):
        targets.resolve("cuda", cpu="znver4")
    with pytest.raises(TargetError, match="applies to GPU targets"):
        targets.resolve("cpu", arch="sm_80")
    with pytest.raises(TargetError, match="unknown target options"):
        targets.resolve("cpu", vector_width=4)


# ---------------------------------------------------------------------------
# MLP train step on every target
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("target", RUNNABLE)
def test_mlp_train_step_matches_jit(target):
    fs = S.mlp_step()
    exe = S.bound_executable("mlp", target)
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)


def test_mlp_compiles_for_cuda():
    c = S.compiled("mlp", "cuda")
    assert c.size_bytes > 1000
    assert c.metadata.target["backend"] == "cuda"
    assert c.metadata.target["driver"] == "cuda"


def _mlp_adam_step():
    """``(step, tx, params, x, y)``: the MLP's Adam train step and one batch."""
    import jax
    import optax

    tx = optax.adam(1e-2)

    def step(p, s, x, y):
        loss, g = jax.value_and_grad(S.mlp_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    x, y = np.ones((4, 8), np.float32), np.zeros((4, 4), np.float32)
    return step, tx, S.mlp_init(jax.random.PRNGKey(0)), x, y


def test_a_gpu_step_compiled_where_no_gpu_is_exports_its_weights_from_the_example_arguments(tmp_path):
    """Ahead-of-time for a device this machine lacks (``cuda`` without libcuda):
    the step compiles, refuses to run here in a sentence that says what to do,
    and exports module and weights from the host arrays for the device."""
    import pockjax
    from pockjax.backends.iree.lowering import _driver_has_device
    from pockjax.errors import BackendError
    from pockjax.runtime.metadata import read_metadata
    from pockjax.runtime.weights import load_weights

    if _driver_has_device("cuda"):
        pytest.skip("this test is about a machine where IREE finds no CUDA device (CI's)")
    step, tx, params, x, y = _mlp_adam_step()
    f = pockjax.compile(step, target="cuda")
    out = f.export(str(tmp_path / "cuda"), params, tx.init(params), x, y)
    meta = read_metadata(out)
    assert meta.target["name"] == "cuda" and os.path.getsize(os.path.join(out, "module.vmfb")) > 1000
    weights = load_weights(os.path.join(out, "weights.irpa"))
    np.testing.assert_array_equal(weights["l1.w"], np.asarray(params["l1"]["w"]))
    with pytest.raises(BackendError, match=r"cannot run it.*pockjax.runtime.load"):
        f(params, tx.init(params), x, y)
    compiled = f.lower(params, tx.init(params), x, y).compile()
    with pytest.raises(BackendError, match="no cuda device holding the weights"):
        compiled.export(str(tmp_path / "again"))
    assert read_metadata(compiled.export(str(tmp_path / "bare"), with_weights=False)).weights is None
    state = [weights[meta.inputs[i].name] for i in meta.state_inputs]
    with pytest.raises(BackendError, match="drop with_weights=False"):
        compiled.export(str(tmp_path / "both"), with_weights=False, state=state)
    with pytest.raises(BackendError, match="in the module's state order"):
        compiled.export(str(tmp_path / "named"), state=weights)
    again = load_weights(os.path.join(compiled.export(str(tmp_path / "listed"), state=state), "weights.irpa"))
    assert sorted(again) == sorted(weights) and all(np.array_equal(again[k], weights[k]) for k in weights)


def test_a_step_that_has_not_run_refuses_to_export_no_weights_as_if_it_had_some(tmp_path):
    """A bound IREE step exported before any call holds no weights: the export
    asks for them rather than writing a module without them."""
    import pockjax
    from pockjax.errors import BackendError

    step, tx, params, x, y = _mlp_adam_step()
    compiled = pockjax.compile(step, target="cpu").lower(params, tx.init(params), x, y).compile()
    with pytest.raises(BackendError, match="has not run yet"):
        compiled.export(str(tmp_path / "m"))


def test_an_export_with_bad_state_or_a_file_for_its_path_is_refused_and_leaves_nothing(tmp_path):
    """``state=`` of the wrong length, shape or dtype is refused before the
    directory is made (no empty export left behind), and a path that is an
    existing file is a pockjax error naming it, not ``FileExistsError``."""
    import jax

    import pockjax
    from pockjax.errors import PockjaxError

    step, tx, params, x, y = _mlp_adam_step()
    compiled = pockjax.compile(step, target="cpu").lower(params, tx.init(params), x, y).compile()
    flat = [np.asarray(a) for a in jax.tree.leaves((params, tx.init(params), x, y))]
    state = [flat[i] for i in compiled.executable.exe.metadata.state_inputs]
    wrong_shape = [state[0].reshape(1, -1)] + state[1:]
    for bad, says in [(state[:-1], f"expected {len(state)} state arrays, got {len(state) - 1}.*state order"),
                      ((params, tx.init(params)), "expected .* state arrays, got 2"),
                      (wrong_shape, "expected shape"),
                      ([state[0].astype(np.float64)] + state[1:], "expected dtype float32")]:
        with pytest.raises(ValueError, match=says):
            compiled.export(str(tmp_path / "new" / "m"), state=bad)
        assert not os.path.exists(tmp_path / "new")
    (tmp_path / "file").write_text("x")
    with pytest.raises(PockjaxError, match="'.*file' is an existing file, not a directory"):
        compiled.export(str(tmp_path / "file"), state=state)
    assert (tmp_path / "file").read_text() == "x"


def test_full_flat_call_has_jax_semantics():
    fs = S.mlp_step()
    exe = S.bound_executable("mlp", "cpu")
    args = fs.flat_state() + [np.asarray(b) for b in fs.batches[0]]
    outs = exe(*args)
    ref = [np.asarray(o) for o in fs.flat_fun(*args)]
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    # Feeding the returned state back (the XLA-style loop) uploads only the batch.
    uploads = []
    put = exe.session.put
    exe.session.put = lambda a: (uploads.append(np.shape(a)), put(a))[1]
    outs2 = exe(*outs[: fs.n_state], *args[fs.n_state:])
    assert uploads == [(4, 8), (4, 4)]
    ref2 = [np.asarray(o) for o in fs.flat_fun(*ref[: fs.n_state], *args[fs.n_state:])]
    for a, b in zip(outs2, ref2):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def test_state_stays_on_device_between_steps():
    """Only batch inputs are uploaded per step: state buffers are IREE buffer views."""
    import iree.runtime as rt

    fs = S.mlp_step()
    exe = S.bound_executable("mlp", "cpu")
    exe.set_state(fs.flat_state())
    uploads = []
    put = exe.session.put
    exe.session.put = lambda a: (uploads.append(np.shape(a)), put(a))[1]
    downloads = []
    get = exe.session.get
    exe.session.get = lambda bv, dtype=None: (downloads.append(tuple(bv.shape)), get(bv, dtype))[1]
    for _ in range(3):
        exe.step(*[np.asarray(b) for b in fs.batches[0]])
    assert uploads == [(4, 8), (4, 4)] * 3  # x, y
    assert downloads == [()] * 3  # the loss
    assert all(isinstance(v, rt.HalBufferView) for v in exe._state.values())


# ---------------------------------------------------------------------------
# Tiny LLaMA train step (full and sparse) on every target
# ---------------------------------------------------------------------------


# The sparse step on vulkan adds ~1 min (lavapipe JIT-compiles every shader on first
# use) for no new coverage of the backend: the sparse graph is a subset of the full one.
LLAMA_CASES = [(t, False) for t in RUNNABLE] + [(t, True) for t in ("cpu", "dsp", "arm64")]


@pytest.mark.parametrize(
    "target,sparse", LLAMA_CASES, ids=[f"{t}-{'sparse' if s else 'full'}" for t, s in LLAMA_CASES]
)
def test_llama_train_step_matches_jit(target, sparse):
    name = "llama-sparse" if sparse else "llama"
    fs = S.llama_step(sparse)
    exe = S.bound_executable(name, target)
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)


def test_llama_compiles_for_cuda():
    c = S.compiled("llama", "cuda")
    assert c.size_bytes > 1000
    assert "cuda-reduction-distribution" in c.workarounds


@pytest.mark.gpu
@pytest.mark.parametrize("step_name", ["mlp", "llama"])
def test_cuda_runs_and_matches(step_name):
    if not S.have_cuda_gpu():
        pytest.skip("needs an NVIDIA GPU")
    fs = S.mlp_step() if step_name == "mlp" else S.llama_step(False)
    exe = piree.IreeExecutable(S.compiled(step_name, "cuda"))
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)


# ---------------------------------------------------------------------------
# Workarounds for IREE failures: each fails without it and passes with it
# ---------------------------------------------------------------------------


def _cross_entropy_grad(logits, targets):
    import jax
    import jax.numpy as jnp

    def ce(a):
        logp = jax.nn.log_softmax(a, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return (jax.grad(ce)(logits),)


def _ce_avals(batch):
    import jax
    import jax.numpy as jnp

    return [jax.ShapeDtypeStruct((batch, 8, 64), jnp.float32), jax.ShapeDtypeStruct((batch, 8), jnp.int32)]


def test_cuda_cross_entropy_backward_needs_reduction_distribution_workaround():
    avals = _ce_avals(2)
    with pytest.raises(piree.IreeCompileError, match="failed to get neutral element for reduction") as e:
        piree.compile_flat(_cross_entropy_grad, avals, "cuda", workarounds=None, bind=False)
    assert "cuda-reduction-distribution" in str(e.value)  # the error points at the fix
    c = piree.compile_flat(_cross_entropy_grad, avals, "cuda", workarounds=["cuda-reduction-distribution"], bind=False)
    assert c.size_bytes > 1000
    assert "cuda-reduction-distribution" in piree.default_workarounds(targets.resolve("cuda"))


@pytest.mark.parametrize("target", ["cpu", "dsp"])
def test_batch1_cross_entropy_backward_needs_scatter_rewrite(target):
    avals = _ce_avals(1)
    with pytest.raises(piree.IreeCompileError, match="expected indices to be equal to batch rank"):
        piree.compile_flat(_cross_entropy_grad, avals, target, workarounds=None, bind=False)
    exe = piree.compile_flat(_cross_entropy_grad, avals, target, workarounds=["scatter-add-to-select"])
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 8, 64)).astype(np.float32)
    tgt = rng.integers(0, 64, size=(1, 8)).astype(np.int32)
    (got,) = exe(logits, tgt)
    np.testing.assert_allclose(got, np.asarray(_cross_entropy_grad(logits, tgt)[0]), rtol=1e-5, atol=1e-7)


def test_batch1_llama_train_step_runs_with_default_workarounds():
    fs = S.llama_step(False, S.TinyLlama(batch=1))
    with pytest.raises(piree.IreeCompileError, match="expected indices to be equal to batch rank"):
        piree.compile_flat(fs.flat_fun, fs.flat_avals, "cpu", state_mask=fs.state_mask, workarounds=None, bind=False)
    exe = piree.compile_flat(fs.flat_fun, fs.flat_avals, "cpu", state_mask=fs.state_mask)
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)


@pytest.mark.parametrize(
    "case",
    ["take_last_axis", "take_middle_axis", "batch1", "vector", "clip_mode", "embedding_is_kept"],
)
def test_scatter_add_to_select_is_exact(case):
    import jax
    import jax.numpy as jnp
    from pockjax.backends.iree import rewrites

    rng = np.random.default_rng(1)
    x3 = rng.normal(size=(3, 5, 7)).astype(np.float32)
    if case == "take_last_axis":
        idx = rng.integers(0, 7, size=(3, 5, 1)).astype(np.int32)
        f = lambda x: jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, idx, -1) ** 2))(x)  # noqa: E731
        args = [x3]
    elif case == "take_middle_axis":
        idx = rng.integers(0, 5, size=(3, 1, 7)).astype(np.int32)
        f = lambda x: jax.grad(lambda x: jnp.sum(jnp.sin(jnp.take_along_axis(x, idx, 1))))(x)  # noqa: E731
        args = [x3]
    elif case == "batch1":
        idx = rng.integers(0, 7, size=(1, 5, 1)).astype(np.int32)
        f = lambda x: jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, idx, -1) ** 3))(x)  # noqa: E731
        args = [x3[:1]]
    elif case == "vector":
        f = lambda x, i: jnp.zeros(7, jnp.float32).at[i].add(x[0, 0, 0])  # noqa: E731
        args = [x3, np.int32(4)]
    elif case == "clip_mode":
        f = lambda x, i: jnp.asarray(x).at[:, :, i].add(1.0, mode="clip")  # noqa: E731
        args = [x3, np.int32(11)]
    else:  # embedding gradient: many tokens hit one row, the one-hot form would be huge
        tok = np.array([[1, 1, 2]], np.int32)
        f = lambda e: jax.grad(lambda e: jnp.sum(e[tok] ** 2))(e)  # noqa: E731
        args = [x3[0]]
    avals = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for a in args]
    g = rewrites.scatter_add_to_select(f, avals)
    np.testing.assert_allclose(np.asarray(g(*args)), np.asarray(f(*args)), rtol=1e-6, atol=1e-7)
    left = str(jax.make_jaxpr(g)(*args)).count("scatter-add")
    assert left == (1 if case == "embedding_is_kept" else 0)


def test_dsp_embedded_static_library(tmp_path):
    """dsp with an embedded triple: a static object + header for a firmware image (not run here)."""
    fs = S.mlp_step()
    out = tmp_path / "step.o"
    t = targets.resolve("dsp", triple="riscv32-unknown-elf", features="+m,+f", static_library=str(out))
    c = piree.compile_flat(fs.flat_fun, fs.flat_avals, t, state_mask=fs.state_mask)
    assert isinstance(c, piree.CompiledModule)  # cannot run here: compiled only
    assert out.stat().st_size > 1000 and (tmp_path / "step.h").exists()


def test_llvmcpu_stack_limit_with_aggressive_fusion_needs_workaround():
    """O3 (aggressive fusion) puts the embedding gradient's tokens x dim tile on the stack."""
    fs = S.llama_step(False, S.TinyLlama(seq=64, batch=4))
    o3 = {"extra_flags": ["--iree-opt-level=O3"]}
    with pytest.raises(piree.IreeCompileError, match="exceeded stack allocation limit") as e:
        piree.compile_flat(fs.flat_fun, fs.flat_avals, "cpu", o3, state_mask=fs.state_mask, workarounds=None,
                           bind=False)
    assert "llvmcpu-no-aggressive-fusion" in str(e.value)
    exe = piree.compile_flat(fs.flat_fun, fs.flat_avals, "cpu", o3, state_mask=fs.state_mask,
                             workarounds=["llvmcpu-no-aggressive-fusion"])
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)
    assert "llvmcpu-no-aggressive-fusion" in piree.default_workarounds(targets.resolve("arm64"))


# ---------------------------------------------------------------------------
# cpu data tiling (mmt4d microkernels) and the workaround it needs
# ---------------------------------------------------------------------------


def test_cpu_data_tiling_option_and_auto_threshold():
    import jax
    import jax.numpy as jnp

    assert targets.resolve("cpu").options["data_tiling"] == "auto"
    on = targets.resolve("cpu", data_tiling=True).flags
    assert all(f in on for f in targets.DATA_TILING_FLAGS)
    off = targets.resolve("cpu", data_tiling=False).flags
    assert not any(f in off for f in targets.DATA_TILING_FLAGS)
    assert not any(f in targets.resolve("arm64").flags for f in targets.DATA_TILING_FLAGS)
    with pytest.raises(TargetError, match="apply to llvm-cpu targets"):
        targets.resolve("vulkan", data_tiling=True)

    def mm(a, b):
        return (a @ b,)

    # "auto" turns data tiling on for a step whose largest matmul reaches the threshold.
    n = int(np.ceil(targets.DATA_TILING_MIN_MACS ** (1 / 3)))
    big = [jax.ShapeDtypeStruct((n, n), jnp.float32)] * 2
    small = [jax.ShapeDtypeStruct((16, 16), jnp.float32)] * 2
    assert piree.largest_matmul_macs(mm, big) == n**3 >= targets.DATA_TILING_MIN_MACS
    c_big = piree.compile_flat(mm, big, "cpu", bind=False)
    c_small = piree.compile_flat(mm, small, "cpu", bind=False)
    assert "--iree-opt-data-tiling=true" in c_big.metadata.target["flags"]
    assert "llvmcpu-no-multi-use-fusion" in c_big.workarounds
    assert "--iree-dispatch-creation-fuse-multi-use=false" in c_big.metadata.target["flags"]
    assert "dot-operands-behind-barrier" not in c_big.workarounds  # an alternative, applied only when named
    assert "--iree-opt-data-tiling=true" not in c_small.metadata.target["flags"]
    assert "llvmcpu-no-multi-use-fusion" not in c_small.workarounds
    # The caller's extra flags stay last, so they can override what "auto" adds.
    t = targets.resolve("cpu", extra_flags=["--iree-llvmcpu-enable-ukernels=none"])
    from pockjax.backends.iree.lowering import _resolve_auto_data_tiling

    flags = _resolve_auto_data_tiling(t, mm, big).flags
    assert flags[-1] == "--iree-llvmcpu-enable-ukernels=none" and "--iree-opt-data-tiling=true" in flags
    a = np.random.default_rng(0).normal(size=(n, n)).astype(np.float32)
    exe = piree.IreeExecutable(c_big)
    (got,) = exe(a, a.T.copy())
    np.testing.assert_allclose(got, a @ a.T, rtol=1e-4, atol=1e-3)


def test_cpu_data_tiling_full_step_needs_no_multi_use_fusion_workaround(monkeypatch):
    """Data tiling fuses a transposed gradient's packing into its producer: llvm-cpu refuses it.

    The default passes' ``fold_dot_transpose`` computes weight gradients without
    that transpose, so the step here runs ``sparse_grad`` + ``dce`` only: the
    workaround is what makes such a pipeline (a user's own ``passes=``) compile.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step

    cfg = llama.LlamaConfig.tiny(n_layers=1)  # one block is enough to hit it
    graphdef, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    scheme = llama_scheme("full", cfg)
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab)
    batch = (tokens, tokens, jnp.ones((2, 16), jnp.float32))

    def compiled(target):
        passes = pockjax.chain(pockjax.sparse_grad(scheme, sparse_opt_state=True), pockjax.dce())
        # An AVX2 CPU, whatever the host: the failure is about AVX2's vector sizes (an
        # AVX-512 host compiles the same step without the workaround).
        step = pockjax.compile(lm_train_step(graphdef, tx), scheme=scheme, target=target, passes=passes,
                               target_options=None if target is None else {"data_tiling": True, "cpu": "haswell"})
        p = jax.tree.map(jnp.copy, params)
        return [step, p, pockjax.init_opt_state(tx, p, scheme)]

    with monkeypatch.context() as m:
        m.delitem(piree.WORKAROUNDS, "llvmcpu-no-multi-use-fusion")
        step, p, s = compiled("cpu")
        with pytest.raises(piree.IreeCompileError, match="large vector sizes"):
            step.lower(p, s, *batch).compile()
    runs = [compiled("cpu"), compiled(None)]
    compiled_module = runs[0][0].lower(runs[0][1], runs[0][2], *batch).compile().executable.exe.compiled
    assert "llvmcpu-no-multi-use-fusion" in compiled_module.workarounds
    for _ in range(3):
        losses = []
        for r in runs:
            r[1], r[2], loss = r[0](r[1], r[2], *batch)
            losses.append(float(np.asarray(loss)))
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(runs[0][1]), jax.tree.leaves(runs[1][1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_dot_operands_behind_barrier_is_exact():
    import jax
    import jax.numpy as jnp
    from pockjax.backends.iree import rewrites

    def f(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) @ w.T))(w)

    rng = np.random.default_rng(2)
    args = [rng.normal(size=(4, 6)).astype(np.float32), rng.normal(size=(6, 6)).astype(np.float32)]
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    g = rewrites.dot_operands_behind_barrier(f, avals)
    np.testing.assert_array_equal(np.asarray(g(*args)), np.asarray(f(*args)))
    text = str(jax.make_jaxpr(g)(*args))
    assert text.count("dot_general") == str(jax.make_jaxpr(f)(*args)).count("dot_general") > 0
    assert "optimization_barrier" in text


def test_dot_barrier_fences_computed_operands_only():
    """Inputs (and transposes of inputs) are packed straight from the input: no barrier, so IREE
    can hoist the packing of a frozen weight held in an immutable global."""
    import jax
    import jax.numpy as jnp
    from pockjax.backends.iree import rewrites

    avals = [jax.ShapeDtypeStruct((8, 300), jnp.float32), jax.ShapeDtypeStruct((16, 300), jnp.float32)]

    def barriers(f):
        return str(jax.make_jaxpr(rewrites.dot_operands_behind_barrier(f, avals))(*avals)).count(
            "optimization_barrier")

    assert barriers(lambda x, w: x @ w.T) == 0
    assert barriers(lambda x, w: jnp.tanh(x) @ w.T) == 1
    # 2nd dot: both operands computed (one barrier), and its 16-long contraction fences its result
    assert barriers(lambda x, w: jnp.tanh(x) @ w.T @ (2 * w)) == 3
    assert barriers(lambda x, w: x.T @ jnp.tanh(x)) == 2  # a 8-long contraction: its result fenced too


def test_cpu_data_tiling_short_weight_gradient_needs_no_multi_use_fusion(monkeypatch):
    """A weight gradient over 64 tokens with the AdamW moments fused into its dispatch: with data
    tiling llvm-cpu needs 145 KiB of stack ('exceeded stack allocation limit'). With multi-use
    fusion off (the default workaround) it compiles, and so it does with the alternative that fences
    the short matmul's result; the values match XLA's."""
    import jax
    import jax.numpy as jnp
    from pockjax.backends.iree import rewrites

    def step(w, m, x, g):
        m = 0.9 * m + 0.1 * (x.T @ g)
        return w - 1e-3 * m / (jnp.sqrt(m * m) + 1e-8), m

    shapes = [(576, 1536), (576, 1536), (64, 576), (64, 1536)]
    avals = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    with pytest.raises(piree.IreeCompileError, match="exceeded stack allocation limit"):
        piree.compile_flat(step, avals, "cpu", {"data_tiling": True}, bind=False,
                           workarounds=["llvmcpu-no-aggressive-fusion"])
    with monkeypatch.context() as m:
        m.setattr(rewrites, "SHORT_CONTRACTION", 0)
        with pytest.raises(piree.IreeCompileError, match="exceeded stack allocation limit"):
            piree.compile_flat(step, avals, "cpu", {"data_tiling": True}, bind=False,
                               workarounds=["llvmcpu-no-aggressive-fusion", "dot-operands-behind-barrier"])
    rng = np.random.default_rng(3)
    args = [rng.normal(size=s).astype(np.float32) for s in shapes]
    want = jax.jit(step)(*args)
    for names in ("default", ["llvmcpu-no-aggressive-fusion", "dot-operands-behind-barrier"]):
        exe = piree.compile_flat(step, avals, "cpu", {"data_tiling": True}, workarounds=names)
        for got, ref in zip(exe(*args), want):
            np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
