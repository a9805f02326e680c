"""benchmarks/ffn_choice.py on CPU (--tiny): the calibration `fastest` decides on, then each phase
side by side, with what `fastest` picked on every row."""

from __future__ import annotations

import json

from benchmarks import ffn_choice


def test_tiny_report_has_both_tables_and_the_pick(tmp_path, capsys):
    out = tmp_path / "ffn_choice.json"
    argv = ["--tiny", "--batches", "1", "2", "--context", "64", "--decode-steps", "2", "--reps", "1"]
    ffn_choice.main([*argv, "--warmup", "0", "--json", str(out)])
    report = json.loads(out.read_text())
    calibration, rows = report["meta"]["calibration"], report["results"]
    assert [(c["phase"], c["batch"]) for c in calibration] == [("prefill", 8), ("decode", 1), ("decode", 8)]
    assert [(r["phase"], r["batch"], r["mode"]) for r in rows] == [
        ("prefill", 8, "eager"),
        ("decode", 1, "static"),  # no CUDA graphs on a CPU: the same step uncaptured
        ("decode", 2, "static"),
    ]
    for row in rows:
        assert set(row["ms"]) == {"dense", "reference"} and all(ms > 0 for ms in row["ms"].values())
        assert row["faster"] == min(row["ms"], key=row["ms"].get)
        assert row["fastest_picked"] == report["meta"]["fastest"][row["phase"]]
    text = capsys.readouterr().out
    assert "## The calibration" in text and "## Side by side" in text
