"""benchmarks/column_hybrid.py: the hot-unit choice, and the hybrid (the op over the units outside S
plus the dense FFN over S) equal to the dense FFN in its output, L1 and every gradient, on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.column_hybrid import (
    gradients,
    hot_dense,
    hybrid_call,
    hybrid_gradients,
    hybrid_leaves,
    main,
    split_stats,
)
from benchmarks.ffn import dense_train, train_ours
from benchmarks.row_density import RANDOM_TINY
from sparse_llm.ops.ffn.hot_units import choose_hot_units


def test_split_stats_count_what_the_hot_units_take():
    active = torch.zeros(10, 5, dtype=torch.bool)
    active[:, 1] = True  # 10 of 10 tokens
    active[:3, 3] = True  # 3 of 10
    active[0, 4] = True  # 1 of 10
    stats = split_stats(active, torch.tensor([1, 3]), threshold=0)
    assert stats == {"hot_units": 2, "hot_entry_share": pytest.approx(13 / 14), "heavy_rows_left": 1}


@pytest.mark.parametrize("share", [0.0, 0.2, 1.0])  # S: every unit that fires, some, none
def test_hybrid_equals_the_dense_ffn(share):
    torch.manual_seed(0)
    m, d, h = 96, 32, 48
    x = torch.randn(m, d, dtype=torch.float64)
    weights = tuple(torch.randn(*shape, dtype=torch.float64) * 0.3 for shape in ((h, d), (h, d), (d, h)))
    weights[0][:, 0] -= 0.4  # a spread of densities: some units rarely fire
    active = x @ weights[0].T > 0
    hot = choose_hot_units(active.sum(0), m, share, multiple=1) if share > 0 else torch.arange(h)
    want = gradients(dense_train, tuple(t.clone().requires_grad_(True) for t in (x, *weights)))
    hybrid = hybrid_call(train_ours("reference", threshold=4), hot_dense)
    got = hybrid_gradients(hybrid, hybrid_leaves(x, weights, hot), hot)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value.float(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path):
    args = ["--tiny", "--warmup", "1", "--reps", "1", "--sets", "1", "--shares", "0.05", "0.5"]
    rows = main([*args, "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")])
    assert [r["layer"] for r in rows] == list(range(RANDOM_TINY["num_hidden_layers"]))
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["timing"] == "ms" and written["speedup_hybrid"] > 0 and written["speedup_block_hot"] > 0
    for r in rows:
        assert [s["share"] for s in r["shares"]] == [0.05, 0.5]
        assert r["shares"][0]["hot_units"] >= r["shares"][1]["hot_units"]
        assert max(r["err_hybrid"].values()) < 1e-4  # float32 on CPU: both parts exact
        assert r["shares"][0]["ms_hot"] > 0 and r["err_dense"]["y"] < 1e-4
        assert r["ms_hybrid_recomputed"] > 0
        # The built block op, without and with the hot units of each share.
        assert r["ms_dense_block"] > 0 and r["ms_block"] > 0 and set(r["block_shares"]) == {0.05, 0.5}
        assert r["ms_block_hot"] == min(r["block_shares"].values())
        assert r["saved_mb"]["hybrid_recomputed"] < r["saved_mb"]["hybrid"]  # the dense part's inputs only
    assert "hybrid at each layer's best share" in (tmp_path / "r.md").read_text()
