"""benchmarks/dense_units.py on a tiny random model on CPU: the dense units' statistics per layer and
share, the totals, the arguments."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.dense_units import dense_unit_stats, main, min_fires, totals


def test_min_fires_rounds_up_and_zero_means_none():
    assert min_fires(16384, 1 / 32) == 512
    assert min_fires(100, 1 / 32) == 4
    assert min_fires(16384, 0.0) == 0


def test_dense_units_count_the_light_rows_entries_only():
    """Unit 0 fires on every row, unit 1 on two light rows and on the heavy row, unit 2 on the heavy
    row alone; at 2 fires units 0 and 1 are dense (the heavy row's entries do not count)."""
    active = torch.zeros(4, 8, dtype=torch.bool)
    active[:, 0] = True
    active[:2, 1] = True
    active[3] = True  # the heavy row: every unit
    stats = dense_unit_stats(active, heavy_threshold=4, fires=2)
    light_entries = 3 + 2  # unit 0 on rows 0-2, unit 1 on rows 0-1
    assert stats == {"dense_units": 2, "dense_entry_share": pytest.approx(5 / light_entries)}
    assert dense_unit_stats(active, heavy_threshold=4, fires=4) == {
        "dense_units": 0,
        "dense_entry_share": 0.0,
    }
    assert dense_unit_stats(active, heavy_threshold=4, fires=0)["dense_units"] == 0


def test_totals_sum_each_share_and_the_fastest_per_layer():
    rows = [
        {"layer": 0, "share": 0.0, "gpu_ms": 2.0},
        {"layer": 0, "share": 0.5, "gpu_ms": 1.0},
        {"layer": 1, "share": 0.0, "gpu_ms": 1.5},
        {"layer": 1, "share": 0.5, "gpu_ms": 3.0},
    ]
    assert totals(rows, [0.0, 0.5]) == {"gpu_ms_0": 3.5, "gpu_ms_0.5": 4.0, "gpu_ms_best": 2.5}


def test_tiny_end_to_end(tmp_path):
    """Every layer at every share, the dense units fewer as the share grows; no timing on the CPU."""
    args = ["--tiny", "--heavy-threshold", "512", "--shares", "0", "0.05", "0.5"]
    rows = main([*args, "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")])
    layers = sorted({r["layer"] for r in rows})
    assert len(rows) == 3 * len(layers)
    for layer in layers:
        counts = [r["dense_units"] for r in rows if r["layer"] == layer]
        assert counts[0] == 0 and counts[1] >= counts[2]
    assert all("gpu_ms" not in r for r in rows)
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["meta"]["shares"] == [0.0, 0.05, 0.5] and "gpu_ms_by_share" not in written
    assert "| s = 0.05 |" in (tmp_path / "r.md").read_text()


def test_bad_share_is_refused_before_any_work():
    with pytest.raises(SystemExit):
        main(["--tiny", "--shares", "1.5"])
