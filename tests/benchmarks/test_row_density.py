"""benchmarks/row_density.py: the per-layer counts, and the script end to end on CPU."""

from __future__ import annotations

import json

import torch

from benchmarks import row_density as rd


def test_early_capacity_is_the_forwards():
    # kernels/train_bindings.cpp: heavy_gemm_rows(ceil(M / 64)), a multiple of 64 rows.
    assert rd.early_capacity(16384) == 256
    assert rd.early_capacity(1) == 64
    assert rd.early_capacity(64 * 65) == 128


def test_layer_rows_count_heavy_rows_and_what_passes_the_capacity():
    counts = torch.zeros(2, 4096, dtype=torch.int64)
    counts[0, :100] = 65  # 100 heavy rows at threshold 64: 36 past an early capacity of 64 (4096 tokens)
    counts[0, 100:200] = 64  # not heavy: the threshold itself is light
    counts[1, 0] = 3
    first, second = rd.layer_rows(counts, threshold=64)
    assert first["heavy_rows"] == 100 and first["early"] == 64 and first["past_early"] == 36
    assert first["max_units"] == 65 and first["active_tokens"] == 200 / 4096
    assert second["heavy_rows"] == 0 and second["past_early"] == 0 and second["l0"] == 3 / 4096


def test_script_end_to_end_on_a_tiny_model(tmp_path):
    out = tmp_path / "rows.json"
    rd.main(["--tiny", "--heavy-threshold", "16", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["meta"]["tokens"] == 128 and len(report["results"]) == 2
    for row in report["results"]:
        assert 0 <= row["past_early"] <= row["heavy_rows"] <= 128
