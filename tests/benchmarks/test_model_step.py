"""benchmarks/model_step.py on a tiny CPU model: it times the trainer's own step, with the trainer's
dense fallback (or without it, --no-fallback)."""

from __future__ import annotations

import pytest

from benchmarks.model_step import main, ran_label

TINY_ARGS = ["--tiny", "--steps", "1", "--warmup", "1"]


@pytest.mark.slow
def test_the_trainers_step_with_and_without_its_fallback():
    # A freshly initialised ReLU model fires about half its units: both layers are far over
    # model.ffn_dense_above (3% of the units), so the trainer's rule keeps both dense.
    with_rule = {r["impl"]: r for r in main(TINY_ARGS)}
    every_layer_sparse = {r["impl"]: r for r in main([*TINY_ARGS, "--no-fallback"])}
    cuda = with_rule["cuda"]
    assert len(cuda["l0_per_layer"]) == 2 and min(cuda["l0_per_layer"]) > cuda["dense_above_units"]
    assert cuda["layers_over_dense_above"] == 2
    assert every_layer_sparse["cuda"]["layers_over_dense_above"] == 0  # model.ffn_dense_above = 1
    for rows in (with_rule, every_layer_sparse):  # the same function on the same batches
        assert rows["dense"]["loss_last"] == pytest.approx(rows["cuda"]["loss_last"], rel=1e-4)
    assert with_rule["cuda"]["dense_fallback_layers"] == 2
    assert every_layer_sparse["cuda"]["dense_fallback_layers"] == 0
    assert ran_label(with_rule["cuda"]) == f"{with_rule['cuda']['train_ffn']}, 2 layers dense"
    assert ran_label(every_layer_sparse["cuda"]) == every_layer_sparse["cuda"]["train_ffn"]


@pytest.mark.slow
def test_accumulated_steps_count_every_micro_batch_and_time_the_optimizer():
    one, four = (
        {r["impl"]: r for r in main([*TINY_ARGS, "--impls", "dense", "--accumulate", str(n)])}["dense"]
        for n in (1, 4)
    )
    assert (one["accumulate"], four["accumulate"]) == (1, 4)
    # Four micro-batches a step: four times the tokens of one, over the step's median time.
    assert four["tokens_per_s"] * four["ms_step"] == pytest.approx(4 * one["tokens_per_s"] * one["ms_step"])
    assert 0 < four["optimizer_ms"] < four["ms_step"] and 0 < four["optimizer_share"] < 1
    assert four["optimizer_share"] < one["optimizer_share"]  # AdamW once per four forwards and backwards
