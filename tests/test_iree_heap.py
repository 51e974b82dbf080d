"""IREE steps on the local CPU drivers keep their transient memory mapped between steps.

Each step allocates its transient buffers from the host heap and frees them
at the end; with glibc's defaults the freed blocks go back to the system and
the next step faults them in again (about 38,000 minor faults per step for
the step below, 172,000 for SmolLM2's ``paper`` step). pockjax sets glibc's
``M_MMAP_MAX``/``M_TRIM_THRESHOLD`` when it opens such a device
(:func:`pockjax.runtime.retain_freed_heap`); ``POCKJAX_RETAIN_HEAP=0`` keeps the defaults.
Each case runs in its own process: the setting is process-wide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("iree.compiler")
pytest.importorskip("iree.runtime")

pytestmark = pytest.mark.iree

_STEP = textwrap.dedent(
    """
    import dataclasses, json, resource
    import numpy as np, jax, jax.numpy as jnp, optax
    from flax import nnx
    import pockjax
    from pockjax import runtime
    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step

    # A LLaMA-width step (dim 576, FFN 1536, 2 layers) at batch 16 x 128: its
    # transients are well above glibc's largest mmap threshold (32 MiB).
    config = dataclasses.replace(llama.LlamaConfig.tiny(vocab=259, max_seq_len=256, scan_layers=False),
                                 dim=576, hidden_dim=1536, n_layers=2, n_heads=9, n_kv_heads=3)
    graphdef, params = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    scheme = llama_scheme("paper", config, blocks=1)
    step = pockjax.compile(lm_train_step(graphdef, tx), scheme=scheme, target="cpu")
    tokens = jax.random.randint(jax.random.key(0), (16, 128), 0, config.vocab)
    batch = (tokens, tokens, jnp.ones(tokens.shape, jnp.float32))
    opt = pockjax.init_opt_state(tx, params, scheme)
    faults, losses = [], []
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        params, opt, loss = step(params, opt, *batch)
        losses.append(float(np.asarray(loss)))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({"faults": faults, "losses": losses, "retained": runtime.heap_retained()}))
    """
)


def _run(retain: bool) -> dict:
    env = dict(os.environ)
    env.pop("POCKJAX_RETAIN_HEAP", None)
    if not retain:
        env["POCKJAX_RETAIN_HEAP"] = "0"
    out = subprocess.run([sys.executable, "-c", _STEP], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_iree_step_stops_faulting_its_transients_in_again():
    kept, default = _run(retain=True), _run(retain=False)
    assert kept["retained"] and not default["retained"]
    # The first steps fault the heap in; after that the kept heap serves every step.
    assert max(kept["faults"][3:]) < 2000, kept
    assert min(default["faults"][3:]) > 10000, default
    assert kept["losses"] == default["losses"]  # the same arithmetic either way


def test_retain_freed_heap_is_idempotent_and_can_be_turned_off():
    code = ("from pockjax import runtime; "
            "print(runtime.retain_freed_heap(), runtime.retain_freed_heap(), runtime.heap_retained())")
    env = {k: v for k, v in os.environ.items() if k != "POCKJAX_RETAIN_HEAP"}
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    off = subprocess.run([sys.executable, "-c", code], env={**env, "POCKJAX_RETAIN_HEAP": "off"},
                         capture_output=True, text=True, check=True)
    assert on.stdout.split() == ["True", "True", "True"]
    assert off.stdout.split() == ["False", "False", "False"]
