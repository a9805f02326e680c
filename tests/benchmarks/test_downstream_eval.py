"""benchmarks/downstream_eval.py on a toy CPU model: both models evaluate, ours agrees with hf."""

import json

import pytest

pytest.importorskip("lm_eval")

from benchmarks.downstream_eval import main


@pytest.mark.slow
def test_tiny_run_times_both_models_and_ours_agrees_with_hf(tmp_path):
    argv = [
        "--tiny",
        "--out",
        str(tmp_path),
        "--ffn",
        "reference",
        "--limit",
        "6",
        "--reps",
        "1",
        "--warmup",
        "0",
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "downstream_eval.json").read_text())
    hf, ours = report["results"]
    assert (hf["model"].split()[0], ours["model"].split()[0], ours["ffn"]) == ("hf", "ours", "reference")
    assert ours["max_abs_ll_diff"] < 1e-3 and ours["same_doc_scores"] == 1.0
    for task, result in hf["tasks"].items():
        assert result["samples"] == ours["tasks"][task]["samples"] == 6
        for metric, value in result["metrics"].items():
            assert ours["tasks"][task]["metrics"][metric] == pytest.approx(value, rel=1e-5)
    assert ours["wall_s"] > 0 and ours["model_s"] > 0
    assert ours["wall_vs_hf"] == pytest.approx(hf["wall_s"] / ours["wall_s"])
    assert 0 < report["meta"]["l0"] <= report["meta"]["hidden"]
    assert "max abs dlogL vs hf" in (tmp_path / "downstream_eval.md").read_text()
