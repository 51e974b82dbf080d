"""IREE targets: each compiles a train step that matches ``jax.jit`` (rtol 1e-4).

Runs here: cpu (local-task), dsp (vmvx), vulkan (Mesa lavapipe), arm64 (the
aarch64 ``iree-run-module`` under qemu-aarch64). cuda compiles here and runs
only where a GPU is present (``-m gpu``). vulkan and arm64 *fail* rather than
skip when their system packages are missing; CI installs them with
``.ci/system-deps.sh``.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("iree.compiler")
pytest.importorskip("iree.runtime")

import _iree_steps as S  # noqa: E402
from pockjax.backends import iree as piree  # noqa: E402
from pockjax.backends import targets  # noqa: E402

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
    assert "--iree-cuda-target=sm_90" in targets.resolve("cuda", arch="sm_90").flags
    assert "--iree-vulkan-target=rdna3" in targets.resolve("vulkan", arch="rdna3").flags
    emb = targets.resolve("dsp", triple="riscv32-unknown-elf", static_library="/tmp/x.o")
    assert emb.backend == "llvm-cpu" and "--iree-llvmcpu-link-static" in emb.flags
    with pytest.raises(ValueError, match="unknown IREE target 'tpu'"):
        targets.resolve("tpu")
    with pytest.raises(ValueError, match="apply to CPU targets"):
        targets.resolve("cuda", cpu="znver4")
    with pytest.raises(ValueError, match="applies to GPU targets"):
        targets.resolve("cpu", arch="sm_80")
    with pytest.raises(ValueError, match="unknown target options"):
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


def test_full_flat_call_has_jax_semantics():
    fs = S.mlp_step()
    exe = S.bound_executable("mlp", "cpu")
    args = fs.flat_state() + [np.asarray(b) for b in fs.batches[0]]
    outs = exe(*args)
    ref = [np.asarray(o) for o in fs.flat_fun(*args)]
    assert len(outs) == len(ref)
    for a, b in zip(outs, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


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


@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
@pytest.mark.parametrize("target", RUNNABLE)
def test_llama_train_step_matches_jit(target, sparse):
    name = "llama-sparse" if sparse else "llama"
    fs = S.llama_step(sparse)
    exe = S.bound_executable(name, target)
    losses, state = S.run_steps(exe, fs, 3)
    ref_losses, ref_state = fs.reference(3)
    S.assert_matches(fs, losses, state, ref_losses, ref_state)


@pytest.mark.parametrize("sparse", [False, True], ids=["full", "sparse"])
def test_llama_compiles_for_cuda(sparse):
    c = S.compiled("llama-sparse" if sparse else "llama", "cuda")
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
