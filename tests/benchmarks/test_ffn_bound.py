"""benchmarks/ffn_bound.py: the threshold search of the lower bound, and the script end to end (its
main in this process; tests/benchmarks/test_scripts.py runs it as `python -m benchmarks.ffn_bound`)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import ffn_bound as fb
from benchmarks.common import make_workload


def test_bound_picks_the_cheapest_threshold_and_only_the_units_heavy_rows_use():
    d = 4
    # Two heavy-ish rows using units 0-2 only; four light rows of one unit each; unit 3 fires in a
    # light row only, unit 4 never.
    row_counts = torch.tensor([3, 3, 1, 1, 1, 1])
    unit_max_row = torch.tensor([3, 3, 3, 1, 0])
    rates = fb.Rates(gemm_flops=1e3, gather_bytes=1e3, reuse=1.0)
    bound = fb.best_bound(row_counts, unit_max_row, d, rates, train=False)
    # Threshold t: gate 2*6*4*5 flops; heavy rows (count > t) cost 2 GEMM rows over the units
    # whose largest row count is > t; light non-zeros cost 2 rows of 2*d bytes.
    gate = 2 * 6 * d * 5

    def cost(t: int) -> float:
        heavy = int((row_counts > t).sum())
        fired = int((unit_max_row > t).sum())
        light = int(row_counts[row_counts <= t].sum())
        return (gate + heavy * 2 * 2 * d * fired + light * 2 * 2 * d) / 1e3 * 1e3

    expected_t = min(range(4), key=cost)
    assert bound.threshold == expected_t
    assert abs(bound.ms - cost(expected_t)) < 1e-9
    # The forward + backward bound is never below the forward's.
    assert fb.best_bound(row_counts, unit_max_row, d, rates, train=True).ms >= bound.ms


def test_activation_rate_prices_only_the_backward_activation_rows():
    d = 4
    row_counts = torch.tensor([1, 1, 1])  # at threshold 1: three light non-zeros
    unit_max_row = torch.tensor([1, 1])
    # GEMMs so slow that every row stays light.
    same = fb.Rates(gemm_flops=1.0, gather_bytes=1e3, reuse=1.0)
    slow_activations = fb.Rates(gemm_flops=1.0, gather_bytes=1e3, reuse=1.0, activation_gather_bytes=5e2)
    for train in (False, True):
        a = fb.best_bound(row_counts, unit_max_row, d, same, train)
        b = fb.best_bound(row_counts, unit_max_row, d, slow_activations, train)
        assert a.threshold == b.threshold == 1
        # Per light non-zero, forward+backward gathers 2 rows of x and grad_y (2 * 2d bytes):
        # at half the rate they cost that much again (in ms); the forward gathers none.
        extra = 3 * 2 * 2 * d / 1e3 * 1e3 if train else 0.0
        assert b.ms - a.ms == pytest.approx(extra, abs=1e-6)


def test_activity_profile_matches_the_workload_counts():
    row_counts, unit_max_row = fb.activity_profile(300, 32, 96, 6.0, seed=1, chunk=128)
    w = make_workload(300, 32, 96, 6.0, seed=1, dtype=torch.float32)
    active = (w.x @ w.wg.T) > 0
    assert torch.equal(row_counts, active.sum(1))
    expected = torch.where(active, active.sum(1, keepdim=True), 0).amax(0)
    assert torch.equal(unit_max_row, expected)


def test_ffn_bound_tiny_runs_end_to_end_with_measured_results(tmp_path):
    measured = tmp_path / "measured.json"
    case = {
        "M": 512,
        "nnz_target": 16,
        "ms_dense_compiled": 1.0,
        "ms_ours": {"64": 0.8},
        "ms_ours_cached_wdT": 0.7,
    }
    measured.write_text(json.dumps({"results": [case]}))
    out, md = tmp_path / "bound.json", tmp_path / "bound.md"
    fb.main(["--tiny", "--measured", str(measured), "--json", str(out), "--md", str(md)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["nnz"], r["pass"]) for r in rows] == [
        (4, "forward"),
        (4, "forward+backward"),
        (16, "forward"),
        (16, "forward+backward"),
    ]
    fwd16 = rows[2]
    assert fwd16["ms_ours"] == 0.7 and abs(fwd16["max_speedup"] - 1.0 / fwd16["ms"]) < 1e-12
    assert "ms_ours" not in rows[3]  # no training results given
    assert "| forward | 512 | 16 |" in md.read_text()


def test_ffn_bound_rejects_a_missing_results_file(tmp_path):
    # A SystemExit with a message: Python prints it on stderr and exits with status 1.
    with pytest.raises(SystemExit) as done:
        fb.main(["--tiny", "--measured", str(tmp_path / "none.json")])
    assert isinstance(done.value.code, str) and "no such results file" in done.value.code
