"""Runs one benchmark row in this interpreter: ``python -m benchmarks.harness.worker JOB OUT``.

``JOB`` is the JSON job :mod:`benchmarks.harness.runner` writes; ``OUT`` receives the
row's result (or ``{"error": traceback}``), written atomically. A job with a
``workload`` other than ``llama`` runs a row of :mod:`benchmarks.harness.classifier_rows`. Nothing but the
row's own framework is imported before the row runs, so a PyTorch row's memory
holds no JAX and the other way round.
"""

from __future__ import annotations

import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m benchmarks.harness.worker JOB.json OUT.json", file=sys.stderr)
        return 2
    from pockjax.io.jsonfile import read_json_object

    job = read_json_object(argv[0], what="benchmark job")
    if job.get("workload", "llama") != "llama":  # pockjax bench --workload mobilenetv2 / minilm
        from benchmarks.harness.classifier_rows import run_classifier_row as run_row
    else:
        from benchmarks.harness.rows import run_row

    try:
        result, rc = run_row(job), 0
    except Exception:  # noqa: BLE001 - reported to the runner, which shows it
        result, rc = {"row": job.get("row"), "phase": job.get("phase"),
                      "error": traceback.format_exc()}, 1
    from pockjax.io.atomic import write_json

    write_json(argv[1], result, indent=None, ensure_ascii=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
