"""Where the host's time goes in a torch.profiler Chrome trace: for the operations that make up a
training step's host work (FSDP2's hooks, the compiled layers' forward and backward, our FFN ops, the
optimizer) the calls, the median and total host time, the time a call spends waiting for the GPU
(`cudaEventSynchronize`, `cudaStreamSynchronize`, `cudaDeviceSynchronize`) and its longest stretch with
no traced child (a spin on pinned memory, Python, the GIL), and the calls where either exceeds
`--wait-ms`: the places the host gave up its lead over the GPU.

    python -m benchmarks.host_time trace_rank1.json.gz --steps 3

Times are the profiler's: it slows the host (~1.7x a launch, profiler_teardown_h100.md), so the
ratios between rows hold better than the absolute figures. `benchmarks.trace_lead` says how far
ahead the host ran; this says what it spent its time on. `benchmarks.step_profile` appends both
reports to every trace it writes.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.trace_lead import read_trace

HOST_CATEGORIES = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
SYNC_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
# The step's host work, by the name the profiler gives each piece ("*": any name that starts so).
WATCHED = (
    "FSDP::pre_forward*",
    "Torch-Compiled Region*",
    "sparse_llm::ffn_train_fwd_cuda_cap",
    "sparse_llm::ffn_train_fwd_cuda",
    "autograd::engine::evaluate_function: CompiledFunctionBackward",
    "## Call CompiledFxGraph*",
    "sparse_llm::ffn_train_bwd_cuda_cap",
    "sparse_llm::ffn_train_bwd_cuda",
    "autograd::engine::evaluate_function: RegisterPostBackwardFunctionBackward",
    "FSDP::pre_backward*",
    "Optimizer.step*",
)
WAIT_MS = 1.0


@dataclass
class Event:
    name: str
    start: float  # us
    duration: float
    children: list[Event] = field(default_factory=list)

    @property
    def end(self) -> float:
        return self.start + self.duration


def host_events(trace: dict) -> dict[int, list[Event]]:
    """Each thread's top-level host events with their nested children (by containment in time)."""
    by_thread: dict[int, list[dict]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES:
            by_thread[e.get("tid", 0)].append(e)
    roots: dict[int, list[Event]] = {}
    for tid, raw in by_thread.items():
        raw.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        stack: list[Event] = []
        top: list[Event] = []
        for e in raw:
            event = Event(e["name"], float(e["ts"]), float(e.get("dur", 0.0)))
            while stack and event.start >= stack[-1].end:
                stack.pop()
            (stack[-1].children if stack else top).append(event)
            stack.append(event)
        roots[tid] = top
    return roots


def _walk(events: list[Event]):
    for event in events:
        yield event
        yield from _walk(event.children)


def sync_us(event: Event) -> float:
    """Time the call spent in a CUDA synchronization, anywhere below it."""
    return sum(e.duration for e in _walk(event.children) if e.name in SYNC_CALLS)


def longest_untraced_us(event: Event) -> float:
    """The call's longest stretch with no traced child running (its own code: a spin, Python)."""
    longest, at = 0.0, event.start
    for child in sorted(event.children, key=lambda c: c.start):
        longest = max(longest, child.start - at)
        at = max(at, child.end)
    return max(longest, event.end - at)


@dataclass(frozen=True)
class OpRow:
    name: str
    calls: int
    median_us: float
    total_ms: float
    sync_ms: float  # in CUDA synchronizations, all calls
    longest_untraced_ms: float  # the longest stretch with no traced child, any call
    waits: list[tuple[int, float, float]]  # (call index, sync ms, untraced ms) of calls over the threshold


def matches(name: str, pattern: str) -> bool:
    """`pattern` is a name, or with a trailing "*" the start of one."""
    return name.startswith(pattern[:-1]) if pattern.endswith("*") else name == pattern


def op_rows(roots: dict[int, list[Event]], watched: tuple[str, ...], wait_ms: float) -> list[OpRow]:
    rows = []
    for pattern in watched:
        calls = sorted(
            (e for events in roots.values() for e in _walk(events) if matches(e.name, pattern)),
            key=lambda e: e.start,
        )
        if not calls:
            continue
        # Each call's (sync ms, untraced ms), walked once.
        stalls = [(sync_us(call) / 1e3, longest_untraced_us(call) / 1e3) for call in calls]
        rows.append(
            OpRow(
                pattern,
                len(calls),
                statistics.median(c.duration for c in calls),
                sum(c.duration for c in calls) / 1e3,
                sum(synced for synced, _ in stalls),
                max(untraced for _, untraced in stalls),
                [(i, *stall) for i, stall in enumerate(stalls) if max(stall) >= wait_ms],
            )
        )
    return rows


def thread_totals(roots: dict[int, list[Event]]) -> dict[int, float]:
    """Each thread's host time in top-level events (ms)."""
    return {tid: sum(e.duration for e in top) / 1e3 for tid, top in roots.items()}


def report(rows: list[OpRow], totals: dict[int, float], steps: int, wait_ms: float, source: str) -> str:
    per = f" a step (over {steps})" if steps > 1 else ""
    lines = [
        f"# Host time by operation: {source}",
        "",
        "Threads' host time in top-level events" + per + ": "
        + ", ".join(f"thread {tid} {ms / steps:.1f} ms" for tid, ms in sorted(totals.items(), key=lambda kv: -kv[1])),
        "",
        f"| operation | calls{per} | median us | total ms{per} | in CUDA syncs, ms{per} | longest untraced stretch, ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        lines.append(
            f"| {r.name} | {r.calls / steps:g} | {r.median_us:.0f} | {r.total_ms / steps:.1f} | "
            f"{r.sync_ms / steps:.1f} | {r.longest_untraced_ms:.1f} |"
        )
    waits = [(r.name, *w) for r in rows for w in r.waits]
    lines += [
        "",
        f"Calls that waited {wait_ms:g} ms or more (synchronized, or ran that long with no traced child):",
    ]
    lines += [""] + (
        ["| operation | call | in syncs, ms | longest untraced stretch, ms |", "|---|---:|---:|---:|"]
        + [f"| {name} | {i} | {s:.1f} | {u:.1f} |" for name, i, s, u in waits]
        if waits
        else ["none"]
    )
    return "\n".join(lines) + "\n"


def host_report(
    trace: dict,
    steps: int = 1,
    watched: tuple[str, ...] = WATCHED,
    wait_ms: float = WAIT_MS,
    source: str = "trace",
) -> tuple[list[OpRow], str]:
    """The rows and the Markdown report of a loaded trace."""
    roots = host_events(trace)
    rows = op_rows(roots, watched, wait_ms)
    return rows, report(rows, thread_totals(roots), steps, wait_ms, source)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path, help="a torch.profiler Chrome trace (.json or .json.gz)")
    p.add_argument("--steps", type=int, default=1, help="the steps the trace holds: figures a step")
    p.add_argument(
        "--op", action="append", default=None, help="an operation name (prefix) to report; repeatable"
    )
    p.add_argument("--wait-ms", type=float, default=WAIT_MS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}")
    return args


def main(argv: list[str] | None = None) -> list[OpRow]:
    args = parse_args(argv)
    watched = tuple(args.op) if args.op else WATCHED
    rows, text = host_report(read_trace(args.trace), args.steps, watched, args.wait_ms, args.trace.name)
    print(text)
    if args.json:
        payload = {"trace": str(args.trace), "steps": args.steps, "rows": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")
    if args.md:
        args.md.write_text(text)
    return rows


if __name__ == "__main__":
    main()
