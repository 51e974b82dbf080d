"""pockjax with an all-full scheme against ``jax.jit`` of the same step, on the test corpus.

The corpus (``tests/corpus_programs.py``) holds user-style programs: Linen and
NNX CNNs with BatchNorm and Dropout, TrainState classifiers, scanned stacks
with and without remat, ``lax.cond``, ``custom_vjp``, Optax MultiSteps,
``inject_hyperparams`` and schedules. Each is trained with ``jax.jit`` (or
``nnx.jit``) and with ``pockjax.compile(step, scheme=UpdateScheme.full())``;
rounds alternate between the two so that machine noise hits both alike, and
the table gives the median step time of each and the median over rounds of
their ratio within a round (goal: pockjax within 1.03x of jit). A control
column times a second ``jax.jit`` wrapper of the same step the same
way: its ratio to the first (ideally 1.000) shows how far machine noise alone
moves a ratio on this machine, so a deviation of pockjax's ratio can be told
from noise.

Usage: ``python benchmarks/corpus_parity.py [--scale 8] [--rounds 21] [--steps 30]
[--min-round-seconds 0.4]``.
``--scale`` multiplies the corpus's batch size (and image side for the CNNs),
so that the step does real work rather than measuring dispatch alone.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))


def _block(tree):
    jax.block_until_ready([x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)])


def _timed(advance, carry, steps: int) -> float:
    """Seconds per call of ``carry, outs = advance(carry)`` after one warm-up call."""
    carry, outs = advance(carry)
    _block(outs)
    t = time.perf_counter()
    for _ in range(steps):
        carry, outs = advance(carry)
    _block(outs)
    return (time.perf_counter() - t) / steps


def _runner(program, compiled):
    """A function running ``steps`` steps from fresh state; returns seconds per step."""
    from flax import nnx

    def run(steps: int) -> float:
        state, batch = program.init(), program.batches[0]
        if program.kind == "nnx":
            model, optimizer = state
            return _timed(lambda _: (None, (compiled(model, optimizer, *batch), nnx.state(model))), None, steps)
        n = program.n_state

        def advance(state):
            out = compiled(*state, *batch)
            return out[:n], out

        return _timed(advance, state, steps)

    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=8, help="batch (and image side) multiplier")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round (at least)")
    parser.add_argument("--min-round-seconds", type=float, default=0.4,
                        help="more steps per round for fast programs, so that each timed round lasts"
                             " this long (a 0.1 ms step timed 20 times is mostly timer and scheduler noise)")
    parser.add_argument("--only", default=None, help="comma-separated program names")
    args = parser.parse_args(argv)

    import corpus_programs as cp
    from flax import nnx

    import pockjax

    cp.BATCH *= args.scale
    cp.IMG *= 2 if args.scale > 1 else 1
    names = args.only.split(",") if args.only else list(cp.FACTORIES)
    rows = []
    for name in names:
        program = cp.FACTORIES[name]()
        step = program.make_step(lambda g: g)
        jit = nnx.jit(step) if program.kind == "nnx" else jax.jit(step, donate_argnums=tuple(range(program.n_state)))
        pock = pockjax.compile(step, scheme=pockjax.UpdateScheme.full())
        run_jit, run_pock = _runner(program, jit), _runner(program, pock)
        again = nnx.jit(step) if program.kind == "nnx" else jax.jit(step, donate_argnums=tuple(range(program.n_state)))
        run_control = _runner(program, again)
        steps = max(args.steps, math.ceil(args.min_round_seconds / run_jit(args.steps)))
        times = {"jit": [], "pockjax": [], "control": []}
        runners = [("jit", run_jit), ("pockjax", run_pock), ("control", run_control)]
        for r in range(args.rounds):
            for key, run in runners[r % 3:] + runners[: r % 3]:  # rotate the order every round
                times[key].append(run(steps))
        j, p = (statistics.median(times[k]) for k in ("jit", "pockjax"))
        # the ratio is the median over rounds of pockjax / jit within one round:
        # both ran back to back under the same machine conditions
        paired = sorted(pt / jt for pt, jt in zip(times["pockjax"], times["jit"]))
        control = statistics.median(ct / jt for ct, jt in zip(times["control"], times["jit"]))
        ratio = statistics.median(paired)
        rows.append((name, j, p, ratio, control))
        print(f"{name:26s} jit {j * 1e3:8.3f} ms  pockjax {p * 1e3:8.3f} ms  ratio {ratio:5.3f}"
              f" (rounds {paired[0]:.3f}-{paired[-1]:.3f})  control jit/jit {control:5.3f}"
              f"  [{steps} steps/round]", flush=True)
    worst = max(r[3] for r in rows)
    print(f"\nworst ratio {worst:.3f} (goal <= 1.03); median ratio {statistics.median(r[3] for r in rows):.3f}")
    print(f"control (a second jax.jit against the first): ratios {min(r[4] for r in rows):.3f}"
          f"-{max(r[4] for r in rows):.3f}, median {statistics.median(r[4] for r in rows):.3f}")
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, scale {args.scale}, rounds {args.rounds} x {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
