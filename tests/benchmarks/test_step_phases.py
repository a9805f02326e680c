"""benchmarks/step_phases.py: device events cut into forward, backward and after-the-backward phases by
the thread that launched them and the optimizer's step; each phase's span, busy, idle and NCCL time
a step, and its host lead."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks import step_phases

MAIN, AUTOGRAD = 1, 2


def _launch(ts: float, correlation: int, tid: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
            "args": {"correlation": correlation}}  # fmt: skip


def _kernel(start: float, dur: float, correlation: int, name: str = "gemm") -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "tid": 7,
            "args": {"correlation": correlation}}  # fmt: skip


def _host(name: str, ts: float, dur: float, tid: int) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _trace(launched: list[tuple[float, int, float, float, str]], hosts: list[dict]) -> dict:
    """(launch time, thread, kernel start, kernel duration, kernel name) each, and host events."""
    events = list(hosts)
    for i, (launch, tid, start, dur, name) in enumerate(launched):
        events += [_launch(launch, i, tid), _kernel(start, dur, i, name)]
    return {"traceEvents": events}


def _two_steps() -> dict:
    backward_op = "autograd::engine::evaluate_function: CompiledFunctionBackward"
    return _trace(
        [
            # step 1: forward (idle 200-300), backward (a reduce-scatter, idle 700-800), optimizer
            (0, MAIN, 100, 100, "gemm"),
            (10, MAIN, 300, 100, "gemm"),
            (20, AUTOGRAD, 400, 200, "ncclDevKernel_ReduceScatter"),
            (30, AUTOGRAD, 600, 100, "gemm"),
            (40, MAIN, 800, 50, "adamw"),
            # step 2: the forward starts as soon as it is launched (the host late), then the step's
            # bookkeeping after its optimizer, with no backward after it
            (1000, MAIN, 1000, 100, "gemm"),
            (1010, AUTOGRAD, 1200, 100, "gemm"),
            (1020, MAIN, 1400, 50, "adamw"),
            (1040, MAIN, 1500, 10, "cat"),
        ],
        [
            _host(backward_op, 15, 20, AUTOGRAD),
            _host("Optimizer.step#AdamW.step", 35, 15, MAIN),
            _host("Optimizer.step#AdamW.step", 1015, 15, MAIN),
        ],
    )


def test_phases_by_launching_thread_and_optimizer_step():
    names = [p.name for p in step_phases.phases(_two_steps())]
    assert names == ["forward", "backward", "after the backward"] * 2


def test_micro_batches_are_forwards_until_the_optimizer():
    backward_op = "autograd::engine::evaluate_function: X"
    trace = _trace(
        [
            (0, MAIN, 0, 1, "a"),
            (10, AUTOGRAD, 2, 1, "b"),
            (20, MAIN, 4, 1, "a"),
            (30, AUTOGRAD, 6, 1, "b"),
            (40, MAIN, 8, 1, "adamw"),
        ],
        [_host(backward_op, 5, 1, AUTOGRAD), _host("Optimizer.step#SGD.step", 35, 10, MAIN)],
    )
    names = [p.name for p in step_phases.phases(trace)]
    assert names == ["forward", "backward", "forward", "backward", "after the backward"]


def test_the_report_totals_each_phase_a_step(tmp_path: Path, capsys):
    summary, text = step_phases.phase_report(_two_steps(), steps=2)
    forward, backward, after = (summary[name] for name in step_phases.PHASES)
    assert forward["span_ms"] == pytest.approx(0.25) and forward["busy_ms"] == pytest.approx(0.15)
    assert forward["idle_ms"] == pytest.approx(0.10) and forward["times"] == 1
    assert forward["median_lead_ms"] == pytest.approx(0.1)  # leads 100, 290 and 0 us
    assert backward["span_ms"] == pytest.approx(0.3) and backward["busy_ms"] == pytest.approx(0.2)
    assert backward["nccl_ms"] == pytest.approx(0.1)
    assert after["span_ms"] == pytest.approx(0.155) and after["busy_ms"] == pytest.approx(0.055)
    assert "| backward | 1 | 0.3 | 0.2 | 0.1 | 0.1 | 0.38 |" in text  # leads 380, 570 and 190 us
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_two_steps(), f)
    step_phases.main([str(path), "--steps", "2"])
    assert "| backward | 1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        step_phases.main([str(tmp_path / "none.json.gz")])
    assert step_phases.phase_report({"traceEvents": []}, steps=1)[0] == {}  # a CPU run's trace
