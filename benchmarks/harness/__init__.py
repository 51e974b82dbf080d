"""``pockjax bench``: pockjax against PyTorch (+ PEFT) and plain JAX, side by side.

Speed, peak memory and fine-tuning quality of the same model, data, batch and
sequence length on the same machine in one run; every row in its own process.
See :mod:`benchmarks.harness.rows` for the rows and :mod:`benchmarks.harness.runner` for
how they are run and summarised. Importing this package imports neither JAX nor
PyTorch.

Example (not run here: minutes of training)::

    from benchmarks.harness import BenchConfig, run
    results = run(BenchConfig(), reps=2, out="bench-results")
    print(open("bench-results/results.md").read())
"""

from benchmarks.harness.common import BenchConfig
from benchmarks.harness.rows import DEFAULT_ROWS, QUALITY_ROWS, ROWS, default_rows

__all__ = ["BenchConfig", "ROWS", "DEFAULT_ROWS", "QUALITY_ROWS", "default_rows", "run"]


def run(*args, **kwargs):
    """:func:`benchmarks.harness.runner.run` (imported on first use)."""
    from benchmarks.harness.runner import run as _run

    return _run(*args, **kwargs)
