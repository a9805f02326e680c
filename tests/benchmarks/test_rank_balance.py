"""benchmarks/rank_balance.py: each rank's compute stream cut into layers at its attention kernels,
the ranks' layers side by side, and the wait a per-layer barrier would cost."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import rank_balance

FWD = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma"
BWD = "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma"
FFN = "sparse_llm::(anonymous namespace)::csr_updown_kernel"


def _trace(ffn_us: list[float], stream: int = 7) -> dict:
    """Two forward layers and two backward ones on `stream`, each an attention kernel (10 us), a
    GEMM (20 us) and the layer's FFN kernel (ffn_us[i]); NCCL kernels on another stream."""
    events, ts = [], 0.0

    def add(name: str, dur: float, on: int = stream) -> None:
        nonlocal ts
        events.append(
            {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": on}}
        )
        ts += dur + 1

    add("before the first mark", 5)
    for i, mark in enumerate([FWD, FWD, BWD, BWD]):
        add(mark, 10)
        add("nvjet_gemm", 20)
        add(FFN, ffn_us[i])
        add("ncclDevKernel_AllGather", 50, on=stream + 1)
    add(FWD, 10)  # the next step's first layer closes the last segment
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5})
    return {"traceEvents": events}


def test_layers_are_cut_at_the_attention_kernels_of_the_compute_stream():
    events = rank_balance.compute_stream_events(_trace([1, 2, 3, 4]))
    assert all(e["args"]["stream"] == 7 for e in events)
    segments = rank_balance.layer_segments(events)
    assert [s.passes for s in segments] == ["FF", "FB", "BB", "BF"]
    assert [s.busy_us for s in segments] == [31, 32, 33, 34]
    assert [s.ffn_us for s in segments] == [1, 2, 3, 4]


def test_the_barrier_wait_sums_each_layers_slowest_rank_over_the_mean():
    fast = rank_balance.layer_segments(rank_balance.compute_stream_events(_trace([10, 10, 10, 10])))
    slow = rank_balance.layer_segments(rank_balance.compute_stream_events(_trace([30, 10, 10, 50])))
    result = rank_balance.balance([fast, slow], steps=2)
    # Per layer (max - mean): 10, 0, 0, 20 us; over 2 steps.
    assert result["layer_barrier_wait_ms_per_step"] == pytest.approx(0.030 / 2)
    assert result["ffn_layer_barrier_wait_ms_per_step"] == pytest.approx(0.030 / 2)
    # The whole step: the slow rank's 60 us more, 30 over the mean.
    assert result["slowest_rank_over_mean_ms_per_step"] == pytest.approx(0.030 / 2)
    assert result["layers"][0]["ffn_ms"] == [0.010, 0.030]


def test_ranks_must_cover_the_same_passes():
    one = rank_balance.layer_segments(rank_balance.compute_stream_events(_trace([1, 1, 1, 1])))
    with pytest.raises(ValueError, match="at least 2 ranks"):
        rank_balance.balance([one], steps=1)
    shifted = one[1:]
    with pytest.raises(ValueError, match="not the same on every rank"):
        rank_balance.balance([one, shifted], steps=1)


def test_the_command_writes_its_report_and_refuses_a_missing_trace(tmp_path: Path, capsys):
    paths = []
    for rank, ffn in enumerate([[10, 10, 10, 10], [30, 10, 10, 50]]):
        path = tmp_path / f"trace_rank{rank}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump(_trace(ffn), f)
        paths.append(str(path))
    rank_balance.main(
        [*paths, "--steps", "2", "--json", str(tmp_path / "b.json"), "--md", str(tmp_path / "b.md")]
    )
    assert json.loads((tmp_path / "b.json").read_text())["segments"] == 4
    assert "| 3 | BF | 0.04 / 0.08 | 0.01 / 0.05 |" in (tmp_path / "b.md").read_text()
    with pytest.raises(SystemExit, match="no trace at"):
        rank_balance.main([str(tmp_path / "none.json.gz"), paths[0]])
