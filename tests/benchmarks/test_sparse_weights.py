"""benchmarks/sparse_weights.py on a tiny CPU model: the weights, and the report of their L0 by layer."""

import json

import pytest
from omegaconf import OmegaConf

from benchmarks.sparse_weights import main


@pytest.mark.slow
def test_per_layer_controller_and_layer_l0_report(tmp_path):
    out = tmp_path / "w"
    argv = [
        "--tiny",
        "--steps",
        "40",
        "--l1-warmup-end",
        "10",
        "--target-l0",
        "8",
        "--per-layer",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    (row,) = json.loads((out / "sparse_weights.json").read_text())["results"]
    assert row["per_layer_controller"] is True
    assert OmegaConf.load(out / "config.yaml").sparsity.controller.per_layer is True
    layer_l0 = row["heldout_layer_l0"]
    assert len(layer_l0) == 2 and all(v >= 0 for v in layer_l0)
    assert row["heldout_l0"] == pytest.approx(sum(layer_l0) / 2)
    assert row["layers_dense_above"] == sum(v > row["dense_above_units"] for v in layer_l0)
    assert "Held-out L0 by layer" in (out / "sparse_weights.md").read_text()
