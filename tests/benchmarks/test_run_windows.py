"""benchmarks/run_windows.py: the steady phase's windows of whole-run summaries and comparisons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.run_windows import main

META = {"commit": "abc1234", "device": "cpu"}


def summary(impl: str, rates: list[float], gc_s: float | None = None) -> dict:
    series = [{"step": 20 * (i + 1), "tokens_per_s": r, "gc_s": gc_s} for i, r in enumerate(rates)]
    return {"impl": impl, "gpus": 2, "series": series}


def test_a_summary_and_a_comparison(tmp_path: Path):
    run = tmp_path / "run.json"
    # the first window falls outside the last 80 steps; one window 20% below the median of 100
    run.write_text(json.dumps({"meta": META, "results": [summary("dense", [10, 100, 100, 80, 101])]}))
    pair = {"dense": summary("dense", [100] * 4, gc_s=0.25), "sparse": summary("auto", [120] * 4, gc_s=0.5)}
    comparison = tmp_path / "pair.json"
    comparison.write_text(
        json.dumps({"meta": {"pairs": [{"dense": META, "sparse": META}]}, "results": [{"pairs": [pair]}]})
    )
    md = tmp_path / "windows.md"
    rows = main([str(run), str(comparison), "--steady-steps", "80", "--md", str(md)])
    assert [(r["impl"], r["windows"], r["dips"]) for r in rows] == [
        ("dense", 4, 1),
        ("dense", 4, 0),
        ("auto", 4, 0),
    ]
    assert rows[0]["median_tokens_per_s"] == 100 and rows[0]["slowest_over_median"] == pytest.approx(0.8)
    assert rows[0]["gc_s"] is None and rows[1]["gc_s"] == 1.0 and rows[2]["gc_s"] == 2.0
    assert "| run.json | dense | 2 | `abc1234` | 4 | 100 | 0.800 | 1 |  |" in md.read_text()


def test_a_missing_file_is_named(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere.json")])
    assert "no such file" in capsys.readouterr().err
