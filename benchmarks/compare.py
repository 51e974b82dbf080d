"""The side-by-side benchmark: pockjax vs PyTorch (+ PEFT) and plain JAX.

    python benchmarks/compare.py --quality-steps 60 --out benchmarks/results/compare

is ``pockjax bench`` (see ``pockjax bench --help`` and :mod:`benchmarks.harness`).
"""

import sys

from pockjax.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
