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


def _trace(
    launched: list[tuple[float, int, float, float, str]],
    backward_at: float,
    optimizer_steps: list[tuple[float, float]],
    optimizer: str = "Optimizer.step#AdamW.step",
) -> dict:
    """(launch time, thread, kernel start, kernel duration, kernel name) each; autograd's engine at
    work on its thread at `backward_at`; the optimizer's steps (start, duration) on the main thread."""
    events = [
        _host("autograd::engine::evaluate_function: CompiledFunctionBackward", backward_at, 1, AUTOGRAD)
    ]
    events += [_host(optimizer, start, dur, MAIN) for start, dur in optimizer_steps]
    for i, (launch, tid, start, dur, name) in enumerate(launched):
        events += [_launch(launch, i, tid), _kernel(start, dur, i, name)]
    return {"traceEvents": events}


def _two_steps() -> dict:
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
        backward_at=15,
        optimizer_steps=[(35, 15), (1015, 15)],
    )


def test_phases_by_launching_thread_and_optimizer_step():
    names = [p.name for p in step_phases.phases(_two_steps())]
    assert names == ["forward", "backward", "after the backward"] * 2


def test_micro_batches_are_forwards_until_the_optimizer():
    trace = _trace(
        [
            (0, MAIN, 0, 1, "a"),
            (10, AUTOGRAD, 2, 1, "b"),
            (20, MAIN, 4, 1, "a"),
            (30, AUTOGRAD, 6, 1, "b"),
            (40, MAIN, 8, 1, "adamw"),
        ],
        backward_at=5,
        optimizer_steps=[(35, 10)],
        optimizer="Optimizer.step#SGD.step",
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


def test_work_after_the_optimizer_counts_in_the_next_forward():
    """A step's bookkeeping after its optimizer's end (not the trace's last step) opens the next
    forward; a launch at the optimizer's very end is still the optimizer's."""
    trace = _trace(
        [
            (0, MAIN, 0, 1, "a"),
            (10, AUTOGRAD, 2, 1, "b"),
            (25, MAIN, 4, 1, "adamw"),  # at the optimizer's end
            (30, MAIN, 6, 1, "stats"),  # after it: the next forward's
            (40, MAIN, 8, 1, "a"),
            (50, AUTOGRAD, 10, 1, "b"),
            (60, MAIN, 12, 1, "adamw"),
        ],
        backward_at=5,
        optimizer_steps=[(15, 10), (55, 10)],
    )
    cut = step_phases.phases(trace)
    assert [p.name for p in cut] == ["forward", "backward", "after the backward"] * 2
    assert [e.name for e in cut[3].events] == ["stats", "a"]


def test_a_phase_starting_beside_the_previous_ones_tail_waits_for_it():
    """The backward's first copy runs beside the loss's kernel: the backward's window opens when the
    forward's compute ends; an NCCL kernel still running then does not hold the forward open."""
    trace = _trace(
        [
            (0, MAIN, 100, 400, "loss"),
            (5, MAIN, 150, 400, "ncclDevKernel_AllGather"),
            (10, AUTOGRAD, 200, 50, "copy"),
            (20, AUTOGRAD, 600, 100, "gemm"),
            (30, MAIN, 800, 50, "adamw"),
        ],
        backward_at=8,
        optimizer_steps=[(25, 10)],
    )
    cut = step_phases.phases(trace)
    assert step_phases.windows(cut) == [(100, 500), (500, 800), (800, 850)]
    summary, _ = step_phases.phase_report(trace, steps=1)
    forward, backward = summary["forward"], summary["backward"]
    assert forward["span_ms"] == pytest.approx(0.4) and forward["idle_ms"] == pytest.approx(0.0)
    assert forward["nccl_ms"] == pytest.approx(0.35)
    # The gather's last 50 us and the GEMM's 100 in a 300 us window.
    assert backward["busy_ms"] == pytest.approx(0.15) and backward["nccl_ms"] == pytest.approx(0.05)
