"""benchmarks/loss_pairs.py: joined whole-run pairs read back, each pair and each A/A pair counted
once, and the verdict on the spreads."""

import json

import pytest

from benchmarks import loss_pairs, whole_run


def _run(tmp_path, name: str, impl: str, loss: float, date: str) -> str:
    """A run's whole_run JSON with the fields the join reads."""
    summary = {
        "impl": impl,
        "preset": "1b",
        "gpus": 1,
        "seed": 0,
        "steps": 800,
        "early_end_step": 100,
        "wall_s": 300.0,
        "wall_s_after_first_step": 250.0,
        "early_tokens_per_s": 100.0,
        "steady_tokens_per_s": 100.0,
        "peak_mem_gib": 40.0,
        "recompiles": 0,
        "flips": 0,
        "final_val_loss": loss,
        "heldout_l0": 30.0,
    }
    path = tmp_path / f"{name}.json"
    meta = {"commit": name, "date": date, "device": "NVIDIA H200"}
    path.write_text(json.dumps({"meta": meta, "results": [summary]}))
    return str(path)


def _joined(tmp_path, name: str, *runs: str, aa: str | None = None) -> str:
    out = tmp_path / f"{name}_joined.json"
    whole_run.main(["--join", *runs, *(["--aa", aa] if aa else []), "--json", str(out)])
    return str(out)


def test_each_pair_and_each_aa_pair_counts_once(tmp_path):
    dense = _run(tmp_path, "dense", "dense", 3.0, "d1")
    dense2 = _run(tmp_path, "dense2", "dense", 3.006, "d2")
    auto = _run(tmp_path, "auto", "auto", 3.03, "a1")
    auto2 = _run(tmp_path, "auto2", "auto", 2.97, "a2")
    # Two files with the first pair, and a second pair whose A/A is the first's seen the other way.
    first = _joined(tmp_path, "first", dense, auto, aa=dense2)
    both = _joined(tmp_path, "both", dense, auto, dense2, auto2)
    second = _joined(tmp_path, "second", dense2, auto2, aa=dense)
    result = loss_pairs.main([first, both, second])
    # Two pairs; the second keeps the A/A figure the last file gives it; (d1, d2) counts once.
    assert [p["ratio"] for p in result["pairs"]] == pytest.approx([1.01, 2.97 / 3.006])
    assert result["pairs"][1]["aa_ratio"] == pytest.approx(3.0 / 3.006)
    assert result["aa_ratios"] == pytest.approx([1.002])
    ab = result["ab"]
    assert ab["n"] == 2 and ab["mean"] == pytest.approx((1.01 + 2.97 / 3.006) / 2)
    assert result["aa"]["stdev"] is None and "too few A/A pairs" in result["verdict"]


def test_the_verdict_weighs_the_mean_and_the_spreads():
    def spreads(ab: list[float], aa: list[float]) -> str:
        return loss_pairs.verdict(loss_pairs.spread(ab), loss_pairs.spread(aa))

    assert "no shift detected" in spreads([0.99, 1.01, 1.0, 1.005], [1.0, 1.001])
    assert "a shift" in spreads([1.02, 1.021, 1.019], [1.0, 1.001])
    assert "wider than the runs' own" in spreads([0.99, 1.01], [1.0, 1.001])
    assert "within the runs' own" in spreads([0.999, 1.001], [0.99, 1.01])
    assert "one pair" in spreads([1.01], [1.0, 1.001])


def test_a_missing_file_is_named_before_any_reading(tmp_path):
    with pytest.raises(SystemExit, match=r"no such file: .*nope\.json"):
        loss_pairs.main([str(tmp_path / "nope.json")])
