"""A training step's GPU timeline cut into its phases, from a torch.profiler Chrome trace: the
forward (device events the main thread launched), the backward (those autograd's engine threads
launched: the layers' backward and FSDP2's reduce-scatters) and what follows the last backward
(main-thread launches up to the end of the optimizer's step: clipping, the step, zeroing). For
each phase, totals a step: its span on the GPU (from its first device event, or the previous
phase's last compute event where that ends later, to the next phase's start), the time some
device event ran in it (all streams merged), the idle rest, the NCCL kernels' time, and the median
host lead of its events (launch to start).

A phase with idle time and a lead near zero waited for the host; one with little idle was bound
by the GPU. So where `benchmarks.trace_lead` says that the host fell behind and
`benchmarks.host_time` what it spent its time on, this says in which part of the step.

    python -m benchmarks.step_phases trace_rank1_steps_700_702.json.gz --steps 3

`benchmarks.step_profile` appends this report to every trace it writes.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.trace_lead import Launched, launched_events, read_trace

PHASES = ("forward", "backward", "after the backward")
# Host events that mark autograd's engine at work: their threads launch the backward.
BACKWARD_EVENT = "autograd::engine::evaluate_function"
OPTIMIZER_EVENT = "Optimizer.step"


@dataclass(frozen=True)
class Phase:
    name: str  # one of PHASES
    events: list[Launched]  # in launch order


def backward_threads(trace: dict) -> set[int]:
    """The host threads autograd's engine ran on (the backward's launches come from them)."""
    return {
        int(e.get("tid", 0))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and str(e.get("name", "")).startswith(BACKWARD_EVENT)
    }


def optimizer_ends(trace: dict) -> list[float]:
    """When each optimizer step ended on the host (us), in order."""
    return sorted(
        float(e["ts"]) + float(e.get("dur", 0.0))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X"
        and e.get("cat") in ("cpu_op", "user_annotation")
        and str(e.get("name", "")).startswith(OPTIMIZER_EVENT)
    )


def phases(trace: dict) -> list[Phase]:
    """The trace's device events in phases, in launch order: each run of main-thread launches up to
    a backward is a forward; each run of backward launches a backward; main-thread launches after a
    backward up to the end of an optimizer step that ends before the next backward are 'after the
    backward', as are those after the trace's last backward (with several micro-batches a step, the
    main-thread launches between two backwards are the next micro-batch's forward; what a step does
    on the GPU after its optimizer, such as gathering its logged statistics, counts in the next
    forward)."""
    threads = backward_threads(trace)
    ends = optimizer_ends(trace)
    events = sorted(launched_events(trace), key=lambda e: e.launch_us)
    # The next backward launch after each event (one pass from the end).
    next_backward = [float("inf")] * len(events)
    for i in range(len(events) - 2, -1, -1):
        following = events[i + 1]
        next_backward[i] = following.launch_us if following.launch_thread in threads else next_backward[i + 1]
    out: list[Phase] = []
    for event, backward_after in zip(events, next_backward, strict=True):
        if event.launch_thread in threads:
            name = "backward"
        elif out and out[-1].name in ("backward", "after the backward"):
            # After a backward: the optimizer's part if an optimizer step ends at or after this
            # launch and before the next backward launch; with no backward after it, a launch ends
            # the traced steps (the last step's bookkeeping).
            in_step = any(event.launch_us <= end < backward_after for end in ends)
            name = "after the backward" if in_step or backward_after == float("inf") else "forward"
        else:
            name = "forward"
        if not out or out[-1].name != name:
            out.append(Phase(name, []))
        out[-1].events.append(event)
    return out


def _is_nccl(event: Launched) -> bool:
    return "nccl" in event.name.lower()


def windows(cut: list[Phase]) -> list[tuple[float, float]]:
    """Each phase's window on the GPU (us): from its first device event, or from the end of the
    previous phase's last compute event where that runs later (a phase's first event may start
    beside the previous one's tail: the backward's first copies beside the loss's kernels), to the
    next window's start. NCCL kernels do not hold a window open: they run beside compute and may
    wait long for their peers."""
    starts: list[float] = []
    for i, phase in enumerate(cut):
        start = min(e.start_us for e in phase.events)
        if i:
            previous = [e.start_us + e.duration_us for e in cut[i - 1].events if not _is_nccl(e)]
            start = max(start, max(previous, default=start), starts[-1])
        starts.append(start)
    last_end = max(e.start_us + e.duration_us for phase in cut for e in phase.events)
    return [(start, max(end, start)) for start, end in zip(starts, [*starts[1:], last_end], strict=True)]


@dataclass(frozen=True)
class PhaseTimes:
    span_ms: float
    busy_ms: float
    nccl_ms: float
    leads_us: list[float]

    @property
    def idle_ms(self) -> float:
        return self.span_ms - self.busy_ms


def phase_times(by_start: list[Launched], start: float, end: float, leads: list[float]) -> PhaseTimes:
    """The GPU window [start, end) (us): its length, the union of every device event in it (clipped
    to it; `by_start`: all the trace's device events in start order), the NCCL kernels' share of
    that union's events."""
    busy = nccl = 0.0
    covered_to = start
    for event in by_start:
        lo, hi = max(event.start_us, start), min(event.start_us + event.duration_us, end)
        if hi <= lo:
            continue
        if _is_nccl(event):
            nccl += hi - lo
        if hi > covered_to:
            busy += hi - max(lo, covered_to)
            covered_to = hi
    return PhaseTimes((end - start) / 1000, busy / 1000, nccl / 1000, leads)


def phase_report(
    trace: dict, steps: int, source: str = "the trace"
) -> tuple[dict[str, dict[str, float]], str]:
    """Totals a step by phase (span, busy, idle, NCCL ms; median lead ms), and the Markdown table."""
    cut = phases(trace)
    if not cut:  # a CPU run's trace: no device events
        return {}, f"\nThe step's phases on the GPU: no device events in {source}.\n"
    by_start = sorted((e for phase in cut for e in phase.events), key=lambda e: e.start_us)
    totals: dict[str, list[PhaseTimes]] = {name: [] for name in PHASES}
    for phase, (start, end) in zip(cut, windows(cut), strict=True):
        leads = [e.lead_us for e in phase.events]
        totals[phase.name].append(phase_times(by_start, start, end, leads))
    summary: dict[str, dict[str, float]] = {}
    lines = [
        "",
        f"# The step's phases on the GPU: {source}",
        "",
        f"Totals a step (over {steps}); a phase runs from its first device event (or the previous "
        "phase's last compute event's end, if later) to the next phase's start; busy: some device event "
        "running, all streams merged, NCCL kernels waiting for their peers included; lead: launch to start.",
        "",
        "| phase | times | span ms | busy ms | idle ms | NCCL ms | median lead ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, parts in totals.items():
        if not parts:
            continue
        leads = [lead for p in parts for lead in p.leads_us]
        row = {
            "times": len(parts) / steps,
            "span_ms": sum(p.span_ms for p in parts) / steps,
            "busy_ms": sum(p.busy_ms for p in parts) / steps,
            "idle_ms": sum(p.idle_ms for p in parts) / steps,
            "nccl_ms": sum(p.nccl_ms for p in parts) / steps,
            "median_lead_ms": statistics.median(leads) / 1000 if leads else 0.0,
        }
        summary[name] = row
        lines.append(
            f"| {name} | {row['times']:g} | {row['span_ms']:.1f} | {row['busy_ms']:.1f} | {row['idle_ms']:.1f} "
            f"| {row['nccl_ms']:.1f} | {row['median_lead_ms']:.2f} |"
        )
    return summary, "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) of torch.profiler")
    parser.add_argument("--steps", type=int, default=1, help="the training steps the trace covers")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(phase_report(read_trace(args.trace), args.steps, source=args.trace.name)[1])


if __name__ == "__main__":
    main()
