"""Sparse steps on 8 forced host devices: data parallel and FSDP against one device.

The multi-device checks run in one subprocess (tests/_spmd_checks.py; JAX
fixes the device count when it starts) and the tests below read its report.
The rule checks run here, on this process's devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import pockjax
from pockjax.sharding import ShardingError, partition_specs, shard, shard_like

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = [f"{model}/{scheme}" for model in ("mlp", "llama") for scheme in ("full", "sparse")] + ["llama/paper"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("spmd") / "report.json"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_spmd_checks.py"), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["data", "fsdp"])
@pytest.mark.parametrize("case", CASES)
def test_partitioned_step_equals_one_device(report, case, mode):
    r = report[f"{case}/{mode}"]
    assert r["max_abs_diff"] <= 1e-5, r  # params and optimizer state after 5 steps
    assert r["loss_diff"] <= 1e-5, r
    # what comes back is placed as what went in: an FSDP step stays sharded
    assert r["specs_kept"] and all(r["specs_kept"]), r["specs_kept"]
    assert r["opt_specs_kept"] and all(r["opt_specs_kept"]), r["opt_specs_kept"]
    if not case.endswith("full"):
        assert r["opt_type"] == "SparseOptState"  # optimizer state only for what is trained
    assert r["trained_donated"] and r["frozen_kept"], r
    if mode == "fsdp":
        assert r["opt_leaves_sharded"] > 0


@pytest.mark.parametrize("case", CASES)
def test_all_reduce_carries_only_the_trained_gradients(report, case):
    # data parallel: every all-reduce in the partitioned HLO, summed, is the
    # trained gradients plus the loss's scalars (sum, and the mask count)
    r, one = report[f"{case}/data"], report[case]
    extra = sum(r["all_reduce_bytes"]) - one["trained_grad_bytes"]
    assert 0 <= extra <= 16, (r["all_reduce_bytes"], one["trained_grad_bytes"])
    if not case.endswith("full"):
        assert one["trained_grad_bytes"] < 0.5 * one["param_bytes"]


@pytest.mark.parametrize("case", CASES)
def test_fsdp_holds_an_eighth_of_the_state_per_device(report, case):
    r, one = report[f"{case}/fsdp"], report[case]
    assert r["argument_bytes_per_device"] <= one["argument_bytes_one_device"] / 8 * 1.05, (r, one)


def test_iree_target_refuses_sharded_inputs_by_name(report):
    msg = report["iree_error"]
    assert msg is not None and "runs the step on one device" in msg and "dense0.kernel" in msg


# -- rules, on this process's devices ----------------------------------------------
def _mesh():
    return Mesh(np.array(jax.devices()[:1]), ("d",))


def test_rules_first_match_wins_and_fsdp_shards_the_largest_dimension():
    tree = {"a": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones(4)}, "b": {"kernel": jnp.ones((2, 6))}}
    specs = partition_specs(tree, _mesh(), {"a.kernel": P("d", None), "a.*": P()}, fsdp="d")
    assert specs["a"]["kernel"] == P("d", None)
    assert specs["a"]["bias"] == P()  # the second rule, not fsdp
    assert specs["b"]["kernel"] == P(None, "d")  # no rule: fsdp on its largest dimension


@pytest.mark.parametrize("rules,fsdp,needle", [
    ({"w": P("model")}, None, "names mesh axis 'model'"),
    ({"w": P(None, None, "d")}, None, "has 2 dimension(s)"),
    ({"w": "d"}, None, "is not a jax.sharding.PartitionSpec"),
    ({}, "model", "fsdp axis 'model' is not an axis"),
])
def test_bad_rules_say_what_is_wrong(rules, fsdp, needle):
    with pytest.raises(ShardingError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        partition_specs({"w": jnp.ones((4, 4))}, _mesh(), rules, fsdp=fsdp)


def test_indivisible_rule_is_refused():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("d", "e"))
    # one device: every split divides; a fake 3-way axis shows the check
    fake = type("FakeMesh", (), {"shape": {"d": 3}})()
    with pytest.raises(ShardingError, match="not divisible by 3"):
        partition_specs({"w": jnp.ones((4, 4))}, fake, {"w": P("d")})
    assert partition_specs({"w": jnp.ones((4, 4))}, mesh, {"w": P("d", "e")})["w"] == P("d", "e")


def test_shard_like_needs_placed_parameters():
    params = {"w": np.ones((2, 2), np.float32)}
    with pytest.raises(ShardingError, match="place them with pockjax.shard first"):
        shard_like({"mu": {"w": np.zeros((2, 2))}}, params)


def test_shard_like_follows_the_parameter_and_replicates_the_rest():
    import optax

    mesh = _mesh()
    params = shard({"w": jnp.ones((4, 2)), "b": jnp.ones(2)}, mesh, {"w": P("d", None)})
    state = shard_like(optax.adam(1e-3).init(params), params)
    mu = state[0].mu
    assert mu["w"].sharding.spec == P("d", None) and mu["b"].sharding.spec == P()
    assert state[0].count.sharding.spec == P()
    sparse = shard_like(pockjax.init_opt_state(optax.adam(1e-3), params, pockjax.UpdateScheme({"w": "full", "b": "frozen"})),
                        params)
    assert isinstance(sparse, pockjax.SparseOptState)
    assert [x.sharding.spec for x in sparse.leaves] == [P(), P("d", None), P("d", None)]


def test_one_step_called_on_one_device_then_sharded(report):
    # the same compiled step, first on one device, then with FSDP-sharded
    # inputs: the second call is compiled for its shardings and keeps them
    r = report["one_then_sharded"]
    assert r["max_abs_diff"] <= 1e-5
    assert all(r["one_device"]) and all(r["placed_as_given"]), r


@pytest.mark.parametrize("mesh", ["data=8", "data=2,fsdp=4"])
def test_finetune_over_a_mesh_equals_one_device(report, mesh):
    r = report["finetune"][mesh]
    assert r["loss_diff"] <= 1e-5 and r["weight_diff"] <= 1e-5, r


def test_sharded_finetune_resumes_exactly(report):
    # killed after step 3 of 4 (checkpoint at step 2, written from sharded
    # state), resumed on the same mesh: the weights of the uninterrupted run
    r = report["finetune"]["resume"]
    assert r["weight_diff"] == 0.0 and r["losses"] == r["uninterrupted_losses"], r


def test_cli_devices_splits_the_host_by_itself(tmp_path):
    # `pockjax finetune --devices 2` in a fresh process without XLA_FLAGS: the
    # CLI asks JAX for two host devices before it starts, and the run's losses
    # equal those of one device
    from flax import nnx

    from pockjax.models import llama
    from pockjax.train import FinetuneConfig, finetune

    model_dir = tmp_path / "tiny"
    tok = llama.Tokenizer.byte_level_for_tests()
    model = llama.Llama(llama.LlamaConfig.tiny(vocab=259, max_seq_len=256), rngs=nnx.Rngs(0))
    llama.save_hf_checkpoint(model, str(model_dir))
    tok.save(str(model_dir))
    args = ["--model", str(model_dir), "--task", "uppercase", "--steps", "2", "--batch-size", "4",
            "--eval-examples", "0", "--blocks", "1", "--save-every", "2", "--show", "0", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cli = os.path.join(os.path.dirname(sys.executable), "pockjax")
    proc = subprocess.run([cli, "finetune", *args, "--devices", "2", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "mesh data=2: 2 cpu devices" in proc.stdout
    losses = json.loads((tmp_path / "out" / "metrics.json").read_text())["losses"]
    one = finetune(FinetuneConfig(model=str(model_dir), task="uppercase", steps=2, batch_size=4, eval_examples=0,
                                  blocks=1, show=0, progress=False), log=lambda s: None)
    np.testing.assert_allclose(losses, one.metrics["losses"], atol=1e-5)


@pytest.mark.parametrize("mesh,needle", [
    ("data=3", "--batch-size 8 cannot be split over the 3 devices"),
    ("data=2,model=2", "knows the axes data and fsdp, not model"),
    ("data", "is not AXIS=SIZE"),
])
def test_finetune_bad_mesh_is_refused_before_any_work(mesh, needle):
    from pockjax.train import FinetuneConfig, finetune

    with pytest.raises(pockjax.PockjaxError, match=needle):
        finetune(FinetuneConfig(mesh=mesh, batch_size=8, model="/nonexistent"), log=lambda s: None)


def test_mesh_larger_than_the_devices_says_how_to_get_more():
    from pockjax.sharding import make_mesh

    with pytest.raises(ShardingError, match="xla_force_host_platform_device_count=64"):
        make_mesh("data=64")


@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_tensor_parallel_rules_equal_one_device(report, scheme):
    # attention and MLP weights split over a "model" axis by glob rules, the batch over "data"
    r = report["tensor_parallel"][scheme]
    assert r["max_abs_diff"] <= 1e-5 and r["wq_spec"] == "P(None, 'model')", r


def test_user_sharding_constraints_survive_the_passes(report):
    # full: the constraint and its transpose in the backward, as jax.jit has them;
    # sparse: the backward through it into the frozen layer is pruned, the forward one stays
    r = report["sharding_constraint"]
    assert r["full"]["constraints_in_rewritten_graph"] == 2 and r["full"]["max_abs_diff"] <= 1e-6, r
    assert r["sparse"]["constraints_in_rewritten_graph"] == 1, r
    assert r["sparse"]["frozen_unchanged"] and r["sparse"]["trained_moved"], r


def test_each_call_keeps_its_own_placements(report):
    # the outputs took the first call's shardings on every later call (FSDP state came back
    # replicated, replicated state came back sharded), and a mesh over other devices was refused
    r = report["placements"]
    assert set(r) == {"replicated", "fsdp", "replicated_again", "devices_0_3", "devices_4_7"}
    for name, v in r.items():
        assert v["kept"] and v["max_abs_diff"] <= 1e-5, (name, v)


@pytest.mark.parametrize("scheme", ["full", "sparse"])
def test_an_nnx_step_on_a_mesh_equals_nnx_jit(report, scheme):
    r = report["nnx"][scheme]
    assert r["loss_diff"] <= 1e-6 and r["max_abs_diff"] <= 1e-6 and r["on_mesh"], r


@pytest.mark.parametrize("case", ["full/data=8", "full/fsdp=8", "paper/data=8", "paper/fsdp=8"])
def test_per_device_plan_fits_its_reduced_depths(report, case):
    # the fit over depths 2-3 predicts a depth-4 compile (the check point)
    assert report["plan"][case]["check_error"] <= 0.08, report["plan"][case]


def test_per_device_plan_against_the_whole_compile(report):
    # the plan of the depth-6 tiny LLaMA (paper, 2 trained blocks, FSDP over 8)
    # from reduced depths, against a compile of the whole depth-6 step
    r = report["plan"]["paper/fsdp=8"]
    assert r["arguments"] == r["compiled_arguments"]
    assert abs(r["peak"] - r["compiled_peak"]) <= 0.08 * r["compiled_peak"], r
    # FSDP holds an eighth of what data parallel holds per device
    data = report["plan"]["paper/data=8"]
    assert r["arguments"] <= data["arguments"] / 8 * 1.05 + 4096, (r, data)


@pytest.mark.parametrize("flags,mesh", [(["--devices", "1"], "data=1"), (["--mesh", "fsdp=1"], "fsdp=1"), ([], "")])
def test_cli_resume_takes_the_mesh_given(monkeypatch, flags, mesh):
    # on --resume, a given --devices or --mesh replaces the run's own mesh
    # (it may change: the saved state is whole); none given keeps the run's
    import importlib

    from pockjax.cli import main as cli_main

    ft = importlib.import_module("pockjax.train.finetune")  # the module (pockjax.train.finetune is also a function)

    seen = {}

    def fake_finetune(config, given=None, **kw):
        seen.update(config=config, given=set(given))
        raise ft.FinetuneError("stop here")

    monkeypatch.setattr(ft, "finetune", fake_finetune)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # restored afterwards
    assert cli_main(["finetune", "--resume", "--out", "/nonexistent", *flags]) == 2
    assert seen["config"].mesh == mesh
    assert ("mesh" in seen["given"]) == bool(flags)
