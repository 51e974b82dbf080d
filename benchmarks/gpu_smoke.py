"""pockjax on a GPU: the tiny LLaMA's step against ``jax.jit``, full and sparse.

Run on a machine with an NVIDIA GPU (``python benchmarks/gpu_smoke.py``): it
prints JAX's devices, the largest difference of pockjax's all-full step from
``jax.jit`` of the same step over 5 steps, whether the sparse (paper) step
leaves every frozen tensor bitwise unchanged, and the step times of both.

IREE's ``cuda`` target in two halves, for a GPU machine without IREE's
compiler (the compiler wheel is 393 MB; the runtime alone is 15 MB):

* ``--iree-prepare DIR`` (anywhere, with ``iree-base-compiler``): compiles the
  same steps (full and paper) for ``cuda`` and exports each with its weights
  (``DIR/full``, ``DIR/paper``), with the batch and XLA's losses and final
  parameters after 3 steps on this machine's CPU (``reference.npz``);
* ``--iree-check DIR`` (on the GPU, with ``iree-base-runtime``): loads each
  module with :func:`pockjax.runtime.load`, runs the 3 steps on IREE's
  ``cuda`` driver, and compares losses (1e-4 relative) and parameters
  (1e-4 + 1e-4 x value, element by element) with the reference; exit status 1
  on a mismatch.
"""

from __future__ import annotations

import sys
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pockjax
from pockjax.errors import PockjaxError
from pockjax.io.atomic import atomic_open, file_above
from pockjax.models import llama
from pockjax.schemes import resolve_scheme
from pockjax.train.steps import lm_train_step


IREE_STEPS = 3
IREE_RTOL = 1e-4
# Adam normalises its updates (lr * m / sqrt(v)): where a gradient entry is near zero,
# float32 rounding moves that entry's update by a few percent of lr (1e-3 here) over the
# steps; 1e-4 absolute (a tenth of lr) covers that, while a wrong update (about lr) fails.
IREE_ATOL = 1e-4


def _setup(small: bool = False):
    # small: the IREE check's model, whose exports (weights and AdamW state) travel to the GPU machine
    cfg = (llama.LlamaConfig.tiny(vocab=256, dim=128, hidden_dim=384, n_layers=2, max_seq_len=256) if small else
           llama.LlamaConfig.tiny(vocab=512, dim=256, hidden_dim=768, n_layers=4, max_seq_len=256))
    graphdef, params = llama.split(llama.Llama(cfg, rngs=nnx.Rngs(0)))
    tx = optax.adamw(1e-3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab, (8, 129))
    batch = (jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32),
             jnp.ones((8, 128), jnp.float32))
    return cfg, graphdef, params, tx, batch


def _schemes(cfg):
    return {"full": pockjax.UpdateScheme.full(), "paper": resolve_scheme("paper", cfg, blocks=1)}


def iree_prepare(out: str, target: str = "cuda") -> int:
    """Compiles and exports the full and paper steps for IREE ``target``, with XLA's reference."""
    import os

    blocker = file_above(os.path.join(out, "reference.npz"))  # ``out`` itself, or a file above it
    if blocker is not None:  # before compiling anything: the first export would fail only after that
        print(f"gpu_smoke: cannot write into {out}: {blocker} is a file, not a directory; give"
              " --iree-prepare a directory (new or existing)", file=sys.stderr)
        return 2
    cfg, graphdef, params, tx, batch = _setup(small=True)
    step = lm_train_step(graphdef, tx)
    ref = {f"batch{i}": np.asarray(b) for i, b in enumerate(batch)}
    for name, scheme in _schemes(cfg).items():
        opt = pockjax.init_opt_state(tx, params, scheme)
        options = {"arch": "sm_90"} if target == "cuda" else None
        f = pockjax.compile(step, scheme=scheme, target=target, target_options=options)
        f.export(os.path.join(out, name), jax.tree.map(jnp.copy, params), opt, *batch)
        with jax.default_matmul_precision("highest"):
            xla = pockjax.compile(step, scheme=scheme)
            p, o = jax.tree.map(jnp.copy, params), opt
            for i in range(IREE_STEPS):
                p, o, loss = xla(p, o, *batch)
                ref[f"{name}/loss{i}"] = np.asarray(loss)
        for path, leaf in llama.flatten_params(p).items():
            ref[f"{name}/params/{path}"] = np.asarray(leaf)
        print(f"{name}: exported to {os.path.join(out, name)}", flush=True)
    with atomic_open(os.path.join(out, "reference.npz")) as f:  # a killed prepare leaves no half a reference
        np.savez(f, **ref)
    return 0


def iree_check(out: str, target: str = "cuda") -> int:
    """Runs the exported modules (``cuda``: on this machine's GPU) against the reference."""
    import os

    from pockjax import runtime

    ok = True
    ref_path = os.path.join(out, "reference.npz")
    if not os.path.isfile(ref_path):
        print(f"gpu_smoke: no {ref_path}: run --iree-prepare {out} first (where iree-base-compiler is)"
              " and copy that directory here", file=sys.stderr)
        return 2
    try:
        with np.load(ref_path) as z:
            ref = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        print(f"gpu_smoke: {ref_path} is not a readable reference ({e}); run --iree-prepare {out} again",
              file=sys.stderr)
        return 2
    needed = [f"batch{i}" for i in range(3)] + [f"{n}/loss{i}" for n in ("full", "paper") for i in range(IREE_STEPS)]
    missing = [k for k in needed if k not in ref]
    if missing:
        print(f"gpu_smoke: {ref_path} lacks {missing}; run --iree-prepare {out} again", file=sys.stderr)
        return 2
    batch = [ref[f"batch{i}"] for i in range(3)]
    for name in ("full", "paper"):
        try:
            module = runtime.load(os.path.join(out, name), target=target)
        except (PockjaxError, runtime.ModuleError) as e:  # missing or corrupt export, or another target's
            print(f"gpu_smoke: {e}; run --iree-prepare {out} --iree-target {target} again", file=sys.stderr)
            return 2
        losses, times = [], []
        for _ in range(IREE_STEPS):
            t = time.perf_counter()
            (loss,) = module.step(*batch)
            times.append(time.perf_counter() - t)
            losses.append(float(loss))
        want = [float(ref[f"{name}/loss{i}"]) for i in range(IREE_STEPS)]
        # np.max, not max(): a NaN (in the module's results or the reference) must fail, not be skipped
        loss_err = float(np.max(np.abs(np.subtract(losses, want)) / np.maximum(np.abs(want), 1e-12)))
        state = module.get_state()
        worst, checked = 0.0, 0
        for key, value in ref.items():
            if not key.startswith(f"{name}/params/"):
                continue
            path = key[len(f"{name}/params/"):]
            if path not in state:
                print(f"{name}: the module's state has no {path!r}", flush=True)
                ok = False
                continue
            if np.shape(state[path]) != np.shape(value):  # no broadcasting one against the other
                print(f"{name}: {path!r} has shape {np.shape(state[path])} in the module, {np.shape(value)}"
                      " in the reference", flush=True)
                ok = False
                continue
            # as np.testing.assert_allclose: |got - want| <= atol + rtol * |want|, element by element
            excess = np.abs(state[path] - value) / (IREE_ATOL + IREE_RTOL * np.abs(value))
            worst = float(np.max([worst, np.max(excess)]))  # NaN stays NaN, and fails below
            checked += 1
        good = loss_err <= IREE_RTOL and worst <= 1.0 and checked > 0
        ok = ok and good
        print(f"IREE {target} {name}: losses {[round(x, 5) for x in losses]} vs XLA cpu {[round(x, 5) for x in want]}"
              f" (largest relative difference {loss_err:.1e}); {checked} parameters, largest difference"
              f" {worst:.2f} of the tolerance ({IREE_ATOL:g} + {IREE_RTOL:g} x value); steps {', '.join(f'{t * 1e3:.1f}' for t in times)} ms"
              f" {'OK' if good else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iree-prepare", metavar="DIR", help="compile and export the steps for IREE cuda into DIR")
    ap.add_argument("--iree-check", metavar="DIR", help="run DIR's exported cuda modules on this GPU")
    ap.add_argument("--iree-target", default="cuda", help="the IREE target of --iree-prepare/--iree-check")
    args = ap.parse_args(argv)
    if args.iree_prepare:
        return iree_prepare(args.iree_prepare, args.iree_target)
    if args.iree_check:
        return iree_check(args.iree_check, args.iree_target)
    print("jax", jax.__version__, jax.devices(), flush=True)
    cfg, graphdef, params, tx, batch = _setup()
    step = lm_train_step(graphdef, tx)

    def train(fn, opt_state, n=5):
        p, o = jax.tree.map(jnp.copy, params), opt_state
        times = []
        for _ in range(n):
            t = time.perf_counter()
            p, o, loss = fn(p, o, *batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t)
        return p, o, float(loss), times

    with jax.default_matmul_precision("highest"):
        want = train(jax.jit(step), tx.init(params))
        got = train(pockjax.compile(step, scheme=pockjax.UpdateScheme.full()), tx.init(params))
        diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])))
        print(f"full vs jax.jit: max |diff| {diff:.2e} over 5 steps; loss {got[2]:.5f} vs {want[2]:.5f};"
              f" step {np.median(got[3][1:]) * 1e3:.2f} ms vs {np.median(want[3][1:]) * 1e3:.2f} ms", flush=True)
        scheme = _schemes(cfg)["paper"]
        sparse = train(pockjax.compile(step, scheme=scheme), pockjax.init_opt_state(tx, params, scheme))
        rules = scheme.resolve_tree(params)
        frozen_same = all(np.array_equal(np.asarray(a), np.asarray(b))
                          for a, b, r in zip(jax.tree.leaves(sparse[0]), jax.tree.leaves(params), rules)
                          if isinstance(r, pockjax.Frozen))
        trained_moved = any(not np.array_equal(np.asarray(a), np.asarray(b))
                            for a, b, r in zip(jax.tree.leaves(sparse[0]), jax.tree.leaves(params), rules)
                            if not isinstance(r, pockjax.Frozen))
        print(f"paper: frozen bitwise unchanged {frozen_same}, trained moved {trained_moved};"
              f" step {np.median(sparse[3][1:]) * 1e3:.2f} ms", flush=True)
    return 0 if diff <= 1e-4 and frozen_same and trained_moved else 1


if __name__ == "__main__":
    raise SystemExit(main())
