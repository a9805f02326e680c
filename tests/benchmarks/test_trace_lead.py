"""benchmarks/trace_lead.py: launches paired with their device events by correlation id, the lead,
the events the GPU started as soon as they were launched, and the report over slices of time."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import trace_lead


def _event(cat: str, ts: float, correlation: int, dur: float = 1.0) -> dict:
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _trace() -> dict:
    # Three kernels queued 5 ms ahead, then a host read: two kernels start as soon as launched.
    events = []
    for i, (launch, start) in enumerate([(0, 5000), (10, 5100), (20, 5200), (9000, 9010), (9100, 9120)]):
        events += [_event("cuda_runtime", launch, i), _event("kernel", start, i, dur=100.0)]
    events.append(_event("kernel", 4000, 99))  # launched before the profiler started: no pair
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5})
    return {"traceEvents": events}


def test_launches_pair_with_their_device_events():
    events = trace_lead.launched_events(_trace())
    assert [e.lead_us for e in events] == [5000, 5090, 5180, 10, 20]
    summary = trace_lead.summarize(events, starved_us=50)
    assert summary.events == 5 and summary.median_lead_ms == pytest.approx(5.0)
    assert summary.starved_events == 2 and summary.starved_gpu_ms == pytest.approx(0.2)


def test_the_report_shows_where_the_host_fell_behind(tmp_path: Path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    summary, text = trace_lead.lead_report(trace_lead.read_trace(path), slices=2)
    assert summary.starved_events == 2
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| from")]
    assert rows == ["| 0.0 | 3 | 5.09 | 0 |", "| 2.1 | 2 | 0.01 | 2 |"]


def test_the_command_refuses_a_missing_trace(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        trace_lead.main([str(tmp_path / "none.json.gz")])
    assert "no trace at" in capsys.readouterr().err
