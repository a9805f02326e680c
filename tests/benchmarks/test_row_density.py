"""benchmarks/row_density.py: the per-layer counts, the token tiles' unions and the work bounds on
hand-made patterns, the saved FFN inputs, and the script end to end on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import common
from benchmarks import row_density as rd
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model


def _mask(h: int, active: list[list[int]]) -> torch.Tensor:
    """[tokens, h] bool: token i's active units are active[i]."""
    mask = torch.zeros(len(active), h, dtype=torch.bool)
    for token, units in enumerate(active):
        mask[token, units] = True
    return mask


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


def test_tile_unions_count_distinct_units_and_the_short_last_tile():
    mask = _mask(4, [[0], [0, 1], [], [3], [2]])
    unions, rows = rd.tile_unions(mask, 2)
    assert unions.tolist() == [2, 1, 1] and rows.tolist() == [2, 2, 1]


def test_lowest_unit_order_is_stable_and_puts_empty_tokens_last():
    mask = _mask(4, [[1, 3], [0], [], [3], [1], [0, 2]])
    assert rd.lowest_unit_order(mask).tolist() == [1, 5, 0, 4, 3, 2]


def test_speedup_bound_spans_the_gate_alone_to_dense():
    assert rd.speedup_bound(0, 16, 8) == 9.0  # nothing past the gate's forward
    assert rd.speedup_bound(16 * 8, 16, 8) == 1.0  # every pair: dense work


def test_tile_rows_on_a_round_robin_pattern():
    # Token i fires unit i % 8 alone: consecutive tiles see all 8 units, tiles of the sorted tokens
    # (16 a unit) see 4 (T=64) or 8 (T=128).
    mask = _mask(8, [[i % 8] for i in range(128)])
    row = rd.tile_rows(mask, threshold=1)
    assert row["union_mean_64"] == row["union_p90_64"] == 8 and row["reuse_64"] == 8
    assert row["union_mean_128"] == 8 and row["reuse_128"] == 16
    assert row["union_mean_64_sorted"] == 4 and row["reuse_64_sorted"] == 16
    assert row["union_mean_128_sorted"] == 8 and row["reuse_128_sorted"] == 16
    # 128 entries of 128 x 8: 9 / (1 + 8 / 8); tiles over their unions: the dense work, or half
    assert row["bound_gather"] == row["bound_as_built"] == 4.5
    assert row["bound_tile_64"] == row["bound_tile_128"] == row["bound_tile_128_sorted"] == 1.0
    assert row["bound_tile_64_sorted"] == pytest.approx(9 / 5)
    # Threshold 0: every token is heavy and runs over all 8 units.
    assert rd.tile_rows(mask, threshold=0)["bound_as_built"] == 1.0


def test_heavy_rows_over_their_union_count_only_the_units_heavy_rows_use():
    # 16 units; tokens 0-3 fire units 0-5 (heavy at threshold 4), tokens 4-7 fire unit 10 alone.
    mask = _mask(16, [list(range(6))] * 4 + [[10]] * 4)
    row = rd.tile_rows(mask, threshold=4)
    assert row["units_active"] == 7 and row["units_active_heavy"] == 6
    assert row["bound_as_built"] == rd.speedup_bound(4 + 4 * 16, 8, 16)
    assert row["bound_heavy_union"] == rd.speedup_bound(4 + 4 * 6, 8, 16)
    # Here every heavy row uses every unit of the union: the union bound is the gather bound.
    assert row["bound_heavy_union"] == row["bound_gather"]
    # No heavy rows: the union is empty and the bound is the as-built one.
    light = rd.tile_rows(mask, threshold=8)
    assert light["units_active_heavy"] == 0 and light["bound_heavy_union"] == light["bound_as_built"]


def test_saved_inputs_reload_identical_and_report_the_same(tmp_path):
    saved, out = tmp_path / "inputs", tmp_path / "rows.json"
    first = rd.main(["--tiny", "--save-inputs", str(saved), "--json", str(out)])
    torch.manual_seed(0)  # the tiny model and tokens of --tiny
    model = build_model(ModelConfig(**rd.RANDOM_TINY)).eval()
    ids, _ = common.token_batch(None, model.config.vocab_size, 2, 64)
    loaded, meta = rd.load_inputs(saved, model.config, torch.device("cpu"))
    for got, want in zip(loaded, common.ffn_inputs(model, ids), strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert meta["tokens"] == 128 and meta["layer_l0"] == [r["l0"] for r in first]
    assert rd.main(["--tiny", "--inputs", str(saved)]) == first  # no forward, the same figures
    with pytest.raises(SystemExit, match="another model config"):
        rd.load_inputs(saved, ModelConfig(**{**rd.RANDOM_TINY, "hidden_size": 32}), torch.device("cpu"))
