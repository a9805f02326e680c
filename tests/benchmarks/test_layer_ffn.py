"""benchmarks/layer_ffn.py on a tiny random model on CPU: each layer's FFN input as the model computes
it, and the per-layer table with its totals."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.common import ffn_inputs
from benchmarks.layer_ffn import kernel_markdown, main, totals
from benchmarks.row_density import RANDOM_TINY
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model


def test_ffn_inputs_are_what_each_layer_feeds_its_ffn():
    torch.manual_seed(0)
    model = build_model(ModelConfig(**RANDOM_TINY)).eval()
    ids = torch.randint(0, RANDOM_TINY["vocab_size"], (2, 12))
    inputs = ffn_inputs(model, ids)
    stats = model(ids, with_stats=True).ffn_stats.nnz_per_token  # [layers, tokens]
    assert len(inputs) == RANDOM_TINY["num_hidden_layers"]
    for x, mlp, nnz in zip(inputs, (layer.mlp for layer in model.model.layers), stats, strict=True):
        assert x.shape == (24, RANDOM_TINY["hidden_size"])
        assert torch.equal((x @ mlp.gate_proj.weight.T > 0).sum(-1), nnz)


def test_totals_apply_the_trainers_rule_and_the_best_per_layer():
    rows = [
        {"l0": 10.0, "ms_dense": 4.0, "ms_dense_recomputed": 5.0, "ms_ours": 2.0},
        {"l0": 80.0, "ms_dense": 4.0, "ms_dense_recomputed": 5.0, "ms_ours": 3.5},
        {"l0": 120.0, "ms_dense": 4.0, "ms_dense_recomputed": 5.0, "ms_ours": 6.0},
    ]
    sums = totals(rows, hidden=1000, max_density=0.056)  # layers 1 and 2 run dense, recomputed
    assert sums == {"ms_dense": 12.0, "ms_ours": 11.5, "ms_trainer_rule": 12.0, "ms_best_per_layer": 10.5}
    gpu_rows = [{k.replace("ms_", "gpu_ms_"): v for k, v in r.items()} for r in rows]
    assert totals(gpu_rows, 1000, 0.056, prefix="gpu_ms")["gpu_ms_trainer_rule"] == 12.0


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path):
    args = ["--tiny", "--warmup", "1", "--reps", "1", "--sets", "2", "--synthetic", "8", "30"]
    rows = main([*args, "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")])
    assert [r["layer"] for r in rows] == list(range(RANDOM_TINY["num_hidden_layers"]))
    assert all(
        r["ms_dense"] > 0 and r["ms_dense_recomputed"] > 0 and r["ms_ours"] > 0 and r["l0"] > 0 for r in rows
    )
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["meta"]["impl"] == "reference" and written["meta"]["totals"]["ms_dense"] > 0
    assert "gpu_ms_ours" not in rows[0]  # GPU busy time is measured on a GPU only
    # The headline at the top level (busy_speedup on a GPU only), and the synthetic rows at the
    # asked non-zeros (the workload's calibration lands near them).
    totals_ = written["meta"]["totals"]
    assert written["speedup"] == pytest.approx(totals_["ms_dense"] / totals_["ms_ours"])
    assert "busy_speedup" not in written
    synthetic = written["synthetic"]
    assert [r["nnz"] for r in synthetic] == [8, 30] and synthetic[0]["l0"] < synthetic[1]["l0"]
    assert all(r["ms_dense"] > 0 and r["ms_ours"] > 0 for r in synthetic)
    assert "| 30 |" in (tmp_path / "r.md").read_text()


def test_kernel_table_sums_each_kernel_over_the_layers_and_their_l0_bands():
    rows = [
        {"l0": 8.0, "gpu_ms_ours": 2.0, "kernel_us_ours": {"gate_gemm": 500.0, "rows_kernel": 300.0}},
        {"l0": 30.0, "gpu_ms_ours": 3.0, "kernel_us_ours": {"gate_gemm": 500.0, "heavy_gemm": 1000.0}},
        {"l0": 80.0, "gpu_ms_ours": 5.0, "kernel_us_ours": {"gate_gemm": 500.0, "heavy_gemm": 3000.0}},
    ]
    table = kernel_markdown(rows, top=2)
    assert "GPU busy 10.00 ms" in table
    assert "| heavy_gemm | 4.00 | 40.0% | 0.00 | 1.00 | 3.00 |" in table
    assert "| gate_gemm | 1.50 | 15.0% | 0.50 | 0.50 | 0.50 |" in table
    assert "| rows_kernel | 0.30 | 3.0% | 0.30 | 0.00 | 0.00 |" in table  # one left over: named
    assert "L0 0-20 (1 layers), ms | L0 20-50 (1 layers), ms | L0 50+ (1 layers), ms" in table
    assert kernel_markdown([{"l0": 8.0, "gpu_ms_ours": 2.0}]) == ""  # no per-kernel times: no table


def test_kernels_need_a_gpu():
    with pytest.raises(SystemExit, match="on a GPU"):
        main(["--tiny", "--kernels"])
