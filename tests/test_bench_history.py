"""``pockjax bench --history``: the speed goals over many runs, round by round."""

import glob
import json
import os

import pytest

from benchmarks.harness.common import BenchConfig
from benchmarks.harness.history import goal_history, history, history_table, load_runs
from benchmarks.harness.runner import summarize

RESULTS = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "results")


def _run(date, times, with_rep=True):
    """A results.json, summarised as the runner does, with one process per round for
    each row: ``times[row] = [t_round0, ...]``."""
    raw = []
    for rep in range(len(next(iter(times.values())))):
        for row, ts in times.items():
            r = {"row": row, "phase": "speed", "step_times": [ts[rep], ts[rep] * 1.1, ts[rep] * 0.9],
                 "losses": [], "setup_s": 0.0, "train_peak_rss": 1}
            if with_rep:
                r["rep"] = rep
            raw.append(r)
    res = summarize(raw, BenchConfig(model="tiny"))
    res["date"], res["machine"] = date, {"cpu": "test cpu", "cores": 2}
    return res


def test_rounds_and_summary_over_runs(tmp_path):
    a = _run("2026-01-02 00:00 UTC", {"torch-full": [3.0, 3.0], "torch-lora": [2.0, 2.0],
                                      "pockjax-full": [2.0, 2.5], "pockjax-paper": [1.0, 1.1]})
    # an older run written before results carried the round: processes in round order
    b = _run("2026-01-01 00:00 UTC", {"torch-full": [3.0, 3.3], "torch-lora": [2.0, 1.7],
                                      "pockjax-full": [2.0, 2.0], "pockjax-paper": [1.0, 0.9]},
             with_rep=False)
    for name, r in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(r))
    g = goal_history(a)
    assert g[("pockjax-paper", "torch-lora")]["rounds"] == pytest.approx([2.0, 2.0 / 1.1])
    assert g[("pockjax-paper", "torch-lora")]["rounds_met"] == 1
    assert g[("pockjax-full", "torch-full")]["rounds"] == pytest.approx([1.5, 1.2])
    assert goal_history(b)[("pockjax-paper", "torch-full")]["rounds"] == pytest.approx([3.0, 3.3 / 0.9])

    h = history([str(tmp_path / "a"), str(tmp_path / "b" / "results.json")])
    assert [r["date"][:10] for r in h["runs"]] == ["2026-01-01", "2026-01-02"]  # oldest first
    s = h["summary"][("pockjax-paper", "torch-lora")]
    assert (s["runs"], s["rounds"]) == (2, 4)
    assert s["rounds_met"] == 2  # 2.0 (b, round 1) and 2.0 (a, round 1)
    assert s["runs_met"] == 0 and s["min"] <= s["median"] <= s["max"] < 2.0
    table = history_table(h)
    assert table.count("| a |") == 1 and table.count("| b |") == 1
    assert "paper vs LoRA (goal 2x)" in table and "of 2 runs" in table
    # a run that met every goal counts; a run of other rows is left out
    c = _run("2026-01-03 00:00 UTC", {"torch-full": [3.5], "torch-lora": [2.2], "pockjax-full": [2.0],
                                      "pockjax-paper": [1.0], "pockjax-lora": [1.4]})
    d = _run("2026-01-04 00:00 UTC", {"torch-full": [3.0], "pockjax-norm-only": [1.0]})
    for name, r in (("c", c), ("d", d)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(r))
    h = history([str(tmp_path / n) for n in "abcd"])
    # only c measured the LoRA goal (pockjax-lora vs torch-lora) too
    assert len(h["runs"]) == 3 and (h["complete"], h["all_met"]) == (1, 1)
    assert "1 of the 1 runs that measured all 4" in history_table(h)


def test_history_of_each_committed_run():
    """Every speed run under benchmarks/results: each goal it measured has a ratio for
    every round (the older runs carry no round number: their processes are in round
    order), and the latest documented run's rounds are the ones the docs quote."""
    paths = sorted(glob.glob(os.path.join(RESULTS, "speed_*", "results.json")))
    assert len(paths) >= 10
    runs = load_runs(paths)
    checked = 0
    for _, res in runs:
        for (row, base), g in goal_history(res).items():
            n = {r: sum(x["phase"] == "speed" and x["row"] == r and bool(x.get("step_times"))
                        for x in res["raw"]) for r in (row, base)}
            assert len(g["rounds"]) == n[row] == n[base] >= 2
            checked += 1
    assert checked >= 3 * 10
    g = goal_history(json.load(open(os.path.join(RESULTS, "speed_20261123g", "results.json"))))
    assert [round(x, 2) for x in g[("pockjax-paper", "torch-lora")]["rounds"]] == [1.84, 1.67, 1.53, 2.07, 1.78]


def test_cli_history_and_bad_input(tmp_path, capsys):
    from pockjax.cli import main

    png = tmp_path / "history.png"
    assert main(["bench", "--history", os.path.join(RESULTS, "speed_20261123f"),
                 os.path.join(RESULTS, "speed_20261123g"), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| speed_20261123g |" in out and "met in" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert main(["bench", "--plot", str(png)]) == 2
    assert "--plot goes with --history" in capsys.readouterr().err
    assert main(["bench", "--history", str(tmp_path / "nope")]) == 2
    assert "no results.json" in capsys.readouterr().err
    (tmp_path / "results.json").write_text("{not json")
    assert main(["bench", "--history", str(tmp_path)]) == 2
    assert "not a results.json" in capsys.readouterr().err
