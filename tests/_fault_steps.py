"""A LLaMA-width train step, run in a fresh process, that reports its page faults per step.

Shared by the tests of the heap settings (IREE's ``retain_freed_heap``, XLA's
``keep_step_memory``): those settings are process-wide, so each case runs
:func:`fault_script`'s text with ``python -c`` and reads the JSON it prints.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import textwrap

_BODY = """
import dataclasses, json, resource
import numpy as np, jax, jax.numpy as jnp, optax
from flax import nnx
import pockjax
from pockjax.models import llama
from pockjax.train.schemes import llama_scheme
from pockjax.train.steps import lm_train_step

# A LLaMA-width step (dim 576, FFN 1536, 2 layers) at batch 16 x 128: its
# working memory is well above glibc's largest mmap threshold (32 MiB).
config = dataclasses.replace(llama.LlamaConfig.tiny(vocab=259, max_seq_len=256, scan_layers=False),
                             dim=576, hidden_dim=1536, n_layers=2, n_heads=9, n_kv_heads=3)
graphdef, params = llama.split(llama.Llama(config, rngs=nnx.Rngs(0)))
tx = optax.adamw(1e-3)
scheme = {scheme}
step = pockjax.compile(lm_train_step(graphdef, tx), scheme=scheme{compile_args})
tokens = jax.random.randint(jax.random.key(0), (16, 128), 0, config.vocab)
batch = (tokens, tokens, jnp.ones(tokens.shape, jnp.float32))
opt = pockjax.init_opt_state(tx, params, scheme)
faults, losses = [], []
for _ in range({steps}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    params, opt, loss = step(params, opt, *batch)
    losses.append(float(np.asarray(loss)))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"faults": faults, "losses": losses, **({report})}}))
"""


def fault_script(*, scheme: str, report: str, prologue: str = "", compile_args: str = "", steps: int = 5) -> str:
    """Python source: ``prologue``, then ``steps`` steps of the model above, then one JSON line.

    ``scheme`` is an expression for the update scheme (``config`` in scope),
    ``compile_args`` extra ``pockjax.compile`` arguments (``", target='cpu'"``),
    ``report`` a dict expression merged into the printed ``faults``/``losses``.
    """
    return textwrap.dedent(prologue) + _BODY.format(scheme=scheme, compile_args=compile_args, report=report, steps=steps)


def run_script(code: str, *, retain_heap: bool) -> dict:
    """Runs ``code`` in a fresh interpreter (CPU JAX) and returns its last line as JSON.

    ``retain_heap=False`` sets ``POCKJAX_RETAIN_HEAP=0`` (glibc's and JAX's defaults).
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("POCKJAX_RETAIN_HEAP", None)
    if not retain_heap:
        env["POCKJAX_RETAIN_HEAP"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_heap_kept(kept: dict, default: dict, *, warm_up: int, kept_below: int, default_above: int) -> None:
    """The kept heap serves the steps after ``warm_up``; the default faults them in again.

    A busy machine (CI runs two test workers) can make the kernel or glibc hand back
    a block now and then (one step of 72,000 faults was seen once in CI among steps of
    1,000), so this judges the typical step (the median) and the total, not the worst.
    """
    kept_after, default_after = kept["faults"][warm_up:], default["faults"][warm_up:]
    assert statistics.median(kept_after) < kept_below, kept
    assert statistics.median(default_after) > default_above, default
    assert sum(kept_after) < sum(default_after) / 3, (kept, default)
