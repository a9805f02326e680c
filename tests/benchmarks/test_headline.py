"""benchmarks/headline.py: its options, the headline ratios from raw rows, the report files; and the
whole run on tiny weights on a CPU (the plumbing through the other benchmarks' functions)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from in_process import run_module

from benchmarks import headline
from benchmarks.headline import (
    FULL,
    QUICK,
    build_report,
    gpu_tag,
    main,
    markdown,
    merge_reports,
    parse_args,
    summary,
    write_outputs,
)

META = {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234", "date": "2026-11-25", "torch": "2.11"}


def rows() -> list[dict]:
    """Raw rows as the parts write them (the fields the report reads)."""
    train = [
        {
            "part": "train",
            "impl": impl,
            "ms_step": ms,
            "tokens_per_s": 16376 / ms * 1000,
            "peak_mem_gib": peak,
        }
        | {"l0_mean": 29.5, "loss_last": 3.21}
        for impl, ms, peak in (("dense", 200.0, 35.0), ("cuda", 125.0, 21.0))
    ]
    inference = []
    for batch, dense_decode, sparse_decode in ((1, 100.0, 160.0), (8, 800.0, 1000.0), (64, 6000.0, 6300.0)):
        for impl, decode in (("dense", dense_decode), ("cuda", sparse_decode)):
            row = {"part": "inference", "batch": batch, "impl": impl, "decode_graph_tokens_per_s": decode}
            row["decode_tokens_per_s"] = decode / 4  # eager: not what the speed-up is taken from
            row |= {"prefill_tokens_per_s": 2e5, "peak_mem_gib": 20.0, "tokens_match_dense": 1.0}
            if batch == 64:
                row["prefill_compiled_tokens_per_s"] = 3e5 if impl == "dense" else 5.1e5
            inference.append(row)
    ffn = [
        {"part": part, "M": 16384, "nnz_target": nnz, "nnz_measured": nnz - 0.5, "ms_dense_compiled": 4.8}
        | {"ms_ours": ours if part == "ffn_train" else {64: ours}, "speedup_vs_compiled": 4.8 / ours}
        for nnz, ours in ((15, 2.0), (30, 2.4))
        for part in ("ffn_train", "ffn_inference")
    ]
    return train + inference + ffn


def extra(**overrides) -> dict:
    base = {"model": "/tmp/w", "weights_made_here": True, "budget_name": "quick", "target_l0": 30.0}
    return (
        base | {"seconds": {"weights": 265.0, "train": 120.0}, "notes": ["A note."], "l0": 29.4} | overrides
    )


def test_parse_args_defaults_and_budgets():
    args = parse_args([])
    assert args.model is None and args.budget is FULL and args.target_l0 == 30.0
    assert args.parts == ["train", "inference", "ffn"]
    args = parse_args(["--model", "/w", "--quick", "--parts", "train", "--tag", "h200"])
    assert str(args.model) == "/w" and args.budget is QUICK and args.parts == ["train"] and args.tag == "h200"
    assert QUICK.train_warmup >= 3 and QUICK.prompt_len + QUICK.decode_tokens <= 2048
    with pytest.raises(SystemExit):
        parse_args(["--parts", "nonsense"])
    with pytest.raises(SystemExit):  # --per-layer makes weights: with --model there are none to make
        parse_args(["--model", "/w", "--per-layer"])


def test_summary_computes_the_headline_ratios():
    figures = summary(rows(), FULL)
    assert figures["train_step_speedup"] == pytest.approx(1.6)
    assert figures["train_peak_mem_ratio"] == pytest.approx(0.6)
    assert figures["prefill_speedup"] == pytest.approx(1.7) and figures["prefill_compiled"]
    assert figures["decode_speedup"] == pytest.approx({"1": 1.6, "8": 1.25, "64": 1.05})
    assert figures["ffn_train_speedup"] == pytest.approx(2.0)
    assert figures["ffn_train_speedup_by_nnz"] == pytest.approx({"15": 2.4, "30": 2.0})
    assert figures["ffn_inference_speedup_by_nnz"] == pytest.approx({"15": 2.4, "30": 2.0})


def test_decode_speedup_takes_the_compiled_steps_where_both_have_them():
    compiled = {("dense", 1): 150.0, ("cuda", 1): 270.0}
    with_compiled = [
        r | {"decode_graph_compiled_tokens_per_s": compiled[r["impl"], r["batch"]]}
        if (r.get("impl"), r.get("batch")) in compiled
        else r
        for r in rows()
    ]
    figures = summary(with_compiled, FULL)
    assert figures["decode_speedup"] == pytest.approx({"1": 1.8, "8": 1.25, "64": 1.05})
    assert figures["decode_speedup_uncompiled"] == pytest.approx({"1": 1.6, "8": 1.25, "64": 1.05})


def test_summary_of_missing_parts_and_cpu_peaks_is_none():
    cpu = [r | {"peak_mem_gib": float("nan")} if r["part"] == "train" else r for r in rows()]
    figures = summary([r for r in cpu if r["part"] == "train"], FULL)
    assert figures["train_step_speedup"] == pytest.approx(1.6)
    assert figures["train_peak_mem_ratio"] is None and figures["prefill_speedup"] is None
    assert figures["decode_speedup"] == {"1": None, "8": None, "64": None}
    assert figures["ffn_train_speedup"] is None


def test_markdown_shows_each_figure_against_its_target():
    report = build_report(META, rows(), FULL, extra())
    md = markdown(report)
    assert "| l0 (held-out text) | 29.40 | 30 +- 3 | yes |" in md
    assert "| train_step_speedup | 1.600 | >= 1.45 | yes |" in md
    assert "| train_peak_mem_ratio | 0.600 | <= 0.6 | yes |" in md
    assert "| decode_speedup/8 | 1.250 | >= 1.35 | **no** |" in md
    assert "| ffn_train_speedup | 2.000 | >= 2.2 | **no** |" in md
    assert "| 64 | cuda | 510,000 | 200,000 | 1,575 | 6,300 | - | 20.00 | 100.0% |" in md
    assert "| inference | 16384 | 30 / 29.5 | 4.800 | 2.400 | 2.00x |" in md
    assert "commit `abc1234`" in md and "A note." in md and "weights 265 s" in md
    # A run cut short: the parts not reached leave no table behind.
    short = markdown(build_report(META, rows()[:2], FULL, extra(l0=None)))
    assert "Training step" in short and "Inference" not in short and "l0 (held-out" not in short


def test_merge_joins_parts_measured_in_separate_calls(tmp_path):
    by_part = {
        part: [r for r in rows() if r["part"].startswith(part)] for part in ("train", "inference", "ffn")
    }
    train = build_report(META, by_part["train"] + by_part["ffn"], FULL, extra())
    later = META | {"commit": "def5678", "date": "2026-11-26"}
    inference = build_report(
        later, by_part["inference"], FULL, extra(seconds={"l0": 2.0, "inference": 180.0})
    )
    merged = merge_reports([train, inference])
    whole = build_report(META, rows(), FULL, extra())
    for key in ("train_step_speedup", "prefill_speedup", "decode_speedup", "ffn_train_speedup", "l0"):
        assert merged[key] == whole[key]
    assert merged["commit"] == "abc1234 + def5678" and merged["date"] == "2026-11-26"
    assert [c["parts"] for c in merged["calls"]] == [["ffn_inference", "ffn_train", "train"], ["inference"]]
    assert merged["seconds"] == {"weights": 265.0, "train": 120.0, "inference": 180.0}
    assert "--merge" in merged["notes"][-1]
    # The CLI writes the joined report; reports of different weights or a part twice are refused.
    paths = []
    for name, report in (("a", train), ("b", inference)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    joined = main(["--merge", *map(str, paths), "--out-dir", str(tmp_path)])
    assert joined["rows"] == json.loads(json.dumps(merged["rows"]))
    assert (tmp_path / "headline_h100.md").exists()
    with pytest.raises(ValueError, match="different weights"):
        merge_reports([train, inference | {"l0": 31.0}])
    with pytest.raises(ValueError, match="model"):
        merge_reports([train, inference | {"model": "/other"}])
    with pytest.raises(ValueError, match="more than one"):
        merge_reports([train, train])


def test_write_outputs_names_the_files_by_gpu(tmp_path):
    report = build_report(META, rows(), FULL, extra())
    json_path, md_path = write_outputs(report, tmp_path / "results", gpu_tag(META["device"]))
    assert (json_path.name, md_path.name) == ("headline_h100.json", "headline_h100.md")
    written = json.loads(json_path.read_text())
    for key in ("train_step_speedup", "train_peak_mem_ratio", "prefill_speedup", "decode_speedup"):
        assert key in written
    for key in ("ffn_train_speedup", "l0", "device", "commit", "date", "rows", "budget"):
        assert key in written
    assert written["decode_speedup"]["64"] == pytest.approx(1.05) and len(written["rows"]) == len(rows())
    assert md_path.read_text() == markdown(report)


def test_gpu_tag():
    assert gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_tag("NVIDIA H200") == "h200"
    assert gpu_tag("x86_64") == "cpu"


@pytest.mark.slow
def test_headline_tiny_runs_end_to_end(tmp_path, monkeypatch):
    """Tiny weights made by sparse_weights.py, then every part but the FFN one (CUDA only) on a CPU."""
    # sparse_weights.py's command line runs in this process (no GPU memory to hand back here).
    monkeypatch.setattr(headline, "subprocess", SimpleNamespace(run=run_module))
    report = main(["--tiny", "--weights-dir", str(tmp_path / "weights"), "--out-dir", str(tmp_path)])
    assert report["l0"] > 0 and report["weights_made_here"] and set(report["seconds"]) >= {"weights", "train"}
    assert (
        report["train_step_speedup"] > 0 and report["prefill_speedup"] > 0 and not report["prefill_compiled"]
    )
    assert set(report["decode_speedup"]) == {"1", "8", "64"} and all(report["decode_speedup"].values())
    assert report["ffn_train_speedup"] is None and any("FFN part" in n for n in report["notes"])
    written = json.loads((tmp_path / "headline_cpu.json").read_text())
    assert (
        written["commit"]
        and written["device"]
        and written["train_step_speedup"] == report["train_step_speedup"]
    )
    train = [r for r in written["rows"] if r["part"] == "train"]
    for r in train:
        over = sum(v > r["dense_above_units"] for v in r["l0_per_layer"])
        assert len(r["l0_per_layer"]) == 2 and r["layers_over_dense_above"] == over
    sparse = [r for r in written["rows"] if r["part"] == "inference" and r["impl"] != "dense"]
    assert sparse and all(r["tokens_match_dense"] > 0.5 for r in sparse)
