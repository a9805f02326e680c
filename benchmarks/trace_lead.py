"""How far the host runs ahead of the GPU, from a torch.profiler Chrome trace: for every device event
(kernel, memset, copy) the time from its launch on the host (the CUDA runtime call with the same
correlation id) to its start on the GPU.

A lead of milliseconds means the launch queue holds work and the GPU never waits for the host; a
lead near zero means the GPU had run out of queued work and started the event as soon as it was
launched: the host bounded that stretch. The report gives the median lead, the device events that
started within `--starved-us` of their launch (and their GPU time), and the same over equal slices
of the trace's time, where a host read (a sync) shows up as the slices after it running with no lead.

    python -m benchmarks.trace_lead trace_rank0_steps_421_423.json.gz

`benchmarks.step_profile` appends this report to every trace it writes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
STARVED_US = 50.0


@dataclass(frozen=True)
class Launched:
    """One device event: when the host launched it, when and how long it ran (us), its name and the
    host thread that launched it."""

    launch_us: float
    start_us: float
    duration_us: float
    name: str = ""
    launch_thread: int = 0

    @property
    def lead_us(self) -> float:
        return self.start_us - self.launch_us


def launched_events(trace: dict) -> list[Launched]:
    """The trace's device events paired with their launches by correlation id, in start order;
    events without a launch in the trace (started before the profiler) are left out."""
    launches: dict[int, dict] = {}
    device: list[tuple[int, dict]] = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        correlation = event.get("args", {}).get("correlation")
        if correlation is None:
            continue
        if event.get("cat") in LAUNCH_CATEGORIES:
            launches[correlation] = event
        elif event.get("cat") in DEVICE_CATEGORIES:
            device.append((correlation, event))
    paired = [
        Launched(
            float(launches[c]["ts"]),
            float(e["ts"]),
            float(e.get("dur", 0.0)),
            str(e.get("name", "")),
            int(launches[c].get("tid", 0)),
        )
        for c, e in device
        if c in launches
    ]
    return sorted(paired, key=lambda x: x.start_us)


@dataclass(frozen=True)
class LeadSummary:
    events: int
    median_lead_ms: float
    starved_events: int  # started within `starved_us` of their launch
    starved_gpu_ms: float  # their GPU time
    starved_us: float


def summarize(events: list[Launched], starved_us: float = STARVED_US) -> LeadSummary:
    starved = [e for e in events if e.lead_us < starved_us]
    return LeadSummary(
        events=len(events),
        median_lead_ms=statistics.median(e.lead_us for e in events) / 1000 if events else 0.0,
        starved_events=len(starved),
        starved_gpu_ms=sum(e.duration_us for e in starved) / 1000,
        starved_us=starved_us,
    )


def lead_report(trace: dict, slices: int = 12, starved_us: float = STARVED_US) -> tuple[LeadSummary, str]:
    """The summary, and a Markdown report with the same over `slices` equal slices of the trace."""
    events = launched_events(trace)
    total = summarize(events, starved_us)
    lines = [
        "",
        f"Host lead (launch to start of each device event): median {total.median_lead_ms:.2f} ms over "
        f"{total.events} events; {total.starved_events} started within {starved_us:g} us of their launch "
        f"(the GPU waiting for the host), {total.starved_gpu_ms:.2f} ms of GPU time.",
    ]
    if events:
        first = events[0].start_us
        width = max((events[-1].start_us - first) / slices, 1.0)
        parts: list[list[Launched]] = [[] for _ in range(slices)]
        for e in events:
            parts[min(int((e.start_us - first) / width), slices - 1)].append(e)
        lines += [
            "",
            "| from ms | events | median lead ms | started within the threshold |",
            "|---|---|---|---|",
        ]
        for i, part in enumerate(parts):
            s = summarize(part, starved_us)
            lines.append(
                f"| {i * width / 1000:.1f} | {s.events} | {s.median_lead_ms:.2f} | {s.starved_events} |"
            )
    return total, "\n".join(lines) + "\n"


def read_trace(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path, help="a Chrome trace (.json or .json.gz) of torch.profiler")
    parser.add_argument("--slices", type=int, default=12)
    parser.add_argument("--starved-us", type=float, default=STARVED_US)
    parser.add_argument("--json", type=Path, help="write the summary here")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    summary, text = lead_report(read_trace(args.trace), args.slices, args.starved_us)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(asdict(summary), indent=1))


if __name__ == "__main__":
    main()
