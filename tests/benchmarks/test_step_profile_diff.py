"""benchmarks/step_profile_diff.py: whole runs and their profiled steps side by side, from the
reports `whole_run` and `StepProfile` write."""

from __future__ import annotations

import json

import pytest

from benchmarks.step_profile_diff import main, read_step_profile


def _profile_text(compute_ms: float, kernels: dict[str, float]) -> str:
    """A report in StepProfile's layout: the split, an idle table, then the kernel table (us)."""
    rows = "\n".join(f"| {us * 1000:.1f} | 18 | {name} |" for name, us in kernels.items())
    return (
        "Rank 0 of 1, steps 701-703, layers falling back to dense: 0. Per step:\n\n| | ms |\n|---|---|\n"
        f"| wall_ms | {compute_ms + 5:.2f} |\n| compute_ms | {compute_ms:.2f} |\n| idle_ms | 4.00 |\n\n"
        "| idle ms | gaps | mean us | after kernel | before kernel |\n|---|---|---|---|---|\n"
        "| 0.67 | 1 | 673.7 | a | b |\n\n"
        "GPU time per call: 1.0 us in 2 launches\n\n| us per call | launches per call | kernel |\n|---|---|---|\n"
        f"{rows}\n| 2000.0 | 900 | (the remaining 130) |\n"
    )


def _run(tmp_path, name: str, steady: float, compute_ms: float, kernels: dict[str, float]):
    whole = tmp_path / f"{name}.json"
    meta = {"commit": name, "date": "2026-12-01", "device": "GPU"}
    whole.write_text(json.dumps({"meta": meta, "results": [{"steady_tokens_per_s": steady, "graphs": 5.0}]}))
    profile = tmp_path / f"{name}.txt"
    profile.write_text(_profile_text(compute_ms, kernels))
    return [name, str(whole), str(profile)]


def test_runs_side_by_side_with_the_kernels_that_differ_most(tmp_path):
    sdpa = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop"
    a = _run(tmp_path, "a", 90000.0, 160.0, {sdpa: 10.0, "csr_updown_kernel": 6.0, "gemm": 20.0})
    b = _run(tmp_path, "b", 95000.0, 150.0, {sdpa: 9.5, "csr_updown_kernel": 2.0, "gemm": 20.1})
    runs = main(
        ["--run", *a, "--run", *b, "--json", str(tmp_path / "d.json"), "--md", str(tmp_path / "d.md")]
    )
    assert [r["compute_ms"] for r in runs] == [160.0, 150.0]
    assert runs[1]["reference_kernels_ms"] == pytest.approx(9.5)  # the attention kernel alone
    text = (tmp_path / "d.md").read_text()
    assert "9.50 (0.950)" in text  # the machine's ratio, from the reference kernels
    kernel_rows = [
        line for line in text.splitlines() if line.startswith("| csr_updown") or line.startswith("| gemm")
    ]
    assert kernel_rows[0].startswith("| csr_updown_kernel | 6.00 | 2.00 |")  # the largest difference first
    written = json.loads((tmp_path / "d.json").read_text())
    assert written["steady_tokens_per_s"] == {"a": 90000.0, "b": 95000.0}


def test_a_file_that_is_not_a_step_profile_is_refused(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("no tables here\n")
    with pytest.raises(ValueError, match="not a step profile"):
        read_step_profile(path)
