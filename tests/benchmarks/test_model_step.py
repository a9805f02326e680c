"""benchmarks/model_step.py on a tiny CPU model: the per-layer L0 it records and the trainer's dense
fallback it can apply (--fallback)."""

from __future__ import annotations

import pytest

from benchmarks.model_step import main, ran_label

TINY_ARGS = ["--tiny", "--steps", "1", "--warmup", "1"]


@pytest.mark.slow
def test_fallback_runs_the_layers_over_the_threshold_dense():
    # A freshly initialised ReLU model fires about half its units: both layers are far over
    # model.ffn_dense_above (1% of 64 units), so the trainer's rule runs both dense.
    plain = {r["impl"]: r for r in main(TINY_ARGS)}
    fallen = {r["impl"]: r for r in main([*TINY_ARGS, "--fallback"])}
    for rows in (plain, fallen):
        cuda = rows["cuda"]
        assert len(cuda["l0_per_layer"]) == 2 and min(cuda["l0_per_layer"]) > cuda["dense_above_units"]
        assert cuda["layers_over_dense_above"] == 2
    assert "dense_fallback_layers" not in plain["cuda"] and "dense_fallback_layers" not in fallen["dense"]
    assert fallen["cuda"]["dense_fallback_layers"] == 2
    assert ran_label(fallen["cuda"]) == f"{fallen['cuda']['train_ffn']}, 2 layers dense"
    assert ran_label(plain["cuda"]) == plain["cuda"]["train_ffn"]
