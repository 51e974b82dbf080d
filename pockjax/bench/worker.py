"""Runs one benchmark row in this interpreter: ``python -m pockjax.bench.worker JOB OUT``.

``JOB`` is the JSON job :mod:`pockjax.bench.runner` writes; ``OUT`` receives the
row's result (or ``{"error": traceback}``), written atomically. Nothing but the
row's own framework is imported before the row runs, so a PyTorch row's memory
holds no JAX and the other way round.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m pockjax.bench.worker JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        job = json.load(f)
    from pockjax.bench.rows import run_row

    try:
        result, rc = run_row(job), 0
    except Exception:  # noqa: BLE001 - reported to the runner, which shows it
        result, rc = {"row": job.get("row"), "phase": job.get("phase"),
                      "error": traceback.format_exc()}, 1
    tmp = argv[1] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return rc


if __name__ == "__main__":
    sys.exit(main())
