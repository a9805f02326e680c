"""benchmarks/host_time.py: host events nested by time, each watched operation's calls, median and
total, the time below it in CUDA syncs, its longest stretch with no traced child, and the calls that
waited; the report a step."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import host_time

OP = "sparse_llm::ffn_train_bwd_cuda_cap"


def _x(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 2) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _trace() -> dict:
    events = [
        # A call that spins 3 ms on its own, then waits 1.5 ms in a sync two levels down.
        _x(OP, 0, 5000),
        _x("aten::slice", 3000, 100),
        _x("aten::copy_", 3200, 1700),
        _x("cudaEventSynchronize", 3300, 1500, cat="cuda_runtime"),
        # A quick call, and a call of another operation on another thread.
        _x(OP, 10000, 300),
        _x("aten::mm", 10050, 100),
        _x("Torch-Compiled Region: 0/1", 0, 800, tid=1),
        {
            "ph": "X",
            "cat": "kernel",
            "name": "gemm",
            "ts": 100,
            "dur": 50,
            "tid": 7,
        },  # a device event: not host
    ]
    return {"traceEvents": events}


def test_calls_their_syncs_and_their_own_stretches():
    roots = host_time.host_events(_trace())
    assert sorted(roots) == [1, 2]
    rows = {
        r.name: r for r in host_time.op_rows(roots, (OP, "Torch-Compiled Region*", "absent"), wait_ms=1.0)
    }
    assert set(rows) == {OP, "Torch-Compiled Region*"}
    op = rows[OP]
    assert (op.calls, op.median_us, op.total_ms) == (2, 2650.0, pytest.approx(5.3))
    assert op.sync_ms == pytest.approx(1.5) and op.longest_untraced_ms == pytest.approx(3.0)
    assert op.waits == [(0, pytest.approx(1.5), pytest.approx(3.0))]  # the quick call did not wait
    assert host_time.thread_totals(roots) == {1: pytest.approx(0.8), 2: pytest.approx(5.3)}


def test_names_match_whole_or_by_their_start():
    assert host_time.matches("sparse_llm::ffn_train_fwd_cuda", "sparse_llm::ffn_train_fwd_cuda")
    assert not host_time.matches("sparse_llm::ffn_train_fwd_cuda_cap", "sparse_llm::ffn_train_fwd_cuda")
    assert host_time.matches("Torch-Compiled Region: 0/1", "Torch-Compiled Region*")


def test_the_report_a_step_from_a_gzipped_trace(tmp_path: Path, capsys):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    out_json, out_md = tmp_path / "h.json", tmp_path / "h.md"
    rows = host_time.main(
        [str(path), "--steps", "2", "--op", OP, "--json", str(out_json), "--md", str(out_md)]
    )
    assert [r.name for r in rows] == [OP]
    text = out_md.read_text()
    assert f"| {OP} | 1 | 2650 | 2.6 | 0.8 | 3.0 |" in text  # a step: 2 calls and 5.3 ms over 2 steps
    assert f"| {OP} | 0 | 1.5 | 3.0 |" in text
    assert json.loads(out_json.read_text())["rows"][0]["calls"] == 2
    assert "Host time by operation" in capsys.readouterr().out


def test_a_missing_trace_is_refused(tmp_path: Path):
    with pytest.raises(SystemExit):
        host_time.parse_args([str(tmp_path / "none.json")])
