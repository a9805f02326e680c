"""benchmarks/device_count_gemm.py on the CPU (torch's reference grouped GEMM): every GEMM kind at
every count, the grouped GEMM's first `count` rows (or its reduction over them) equal to cuBLAS's
path, a count of zero included, and the report written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import device_count_gemm


def test_every_kind_and_count_agrees_with_the_host_sized_gemm(tmp_path: Path):
    out, md = tmp_path / "gemm.json", tmp_path / "gemm.md"
    rows = device_count_gemm.main(
        ["--tiny", "--warmup", "0", "--reps", "1", "--json", str(out), "--md", str(md)]
    )
    assert [(r["kind"], r["count"]) for r in rows] == [
        (kind, n) for kind in device_count_gemm.KINDS for n in device_count_gemm.TINY["counts"]
    ]
    for r in rows:
        assert "error" not in r and r["max_rel_diff"] <= 1e-2, r
        assert r["padded"] == -(-r["count"] // 64) * 64 and r["ms_grouped"] > 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["m"] == device_count_gemm.TINY["m"]
    assert f"Commit {meta['commit']}, {meta['date']}" in md.read_text()


def test_a_gpu_run_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(device_count_gemm.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        device_count_gemm.main([])
