"""What the benchmark scripts share: the median time of a call, the kernel table (and GPU idle) of
one profiled call, where the memory peak of a recorded call comes from, and their report files."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup`: CUDA events on a GPU, the wall
    clock on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def kernel_table(
    fn: Callable[[], Any], device: torch.device, row_limit: int = 30, trace_path: Path | None = None
) -> str:
    """Run fn() once under torch.profiler: its operators and kernels by self GPU time (CPU time on
    a CPU), the call's wall time and, on a GPU, where the GPU sat idle (gaps between kernels).
    Warm fn up (and compile it) before. trace_path: also write the Chrome trace there (a name
    ending in .gz is compressed)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = 1000 * (time.perf_counter() - start)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=row_limit
    )
    idle = gpu_idle_table(prof.events()) if cuda else ""
    return f"{table}\nWall time of the profiled call: {wall_ms:.1f} ms\n{idle}"


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _device_spans(events: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the profiler's device events (kernels, memsets, copies)."""
    from torch.autograd import DeviceType

    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]


def gpu_idle_table(events: Any, min_gap_us: float = 2.0, rows: int = 15) -> str:
    """Where the GPU idles between the first and the last device event: the gaps (all streams
    merged) grouped by the kernels on either side, largest total first. A gap that follows a
    host read or a burst of small launches shows up here, not in the kernel table."""
    spans = sorted(_device_spans(events))
    if not spans:
        return ""
    gaps: dict[tuple[str, str], list[float]] = {}
    busy_end, last_name = spans[0][1], spans[0][2]
    total_idle = 0.0
    for start, end, name in spans[1:]:
        gap = start - busy_end
        if gap >= min_gap_us:
            total_idle += gap
            gaps.setdefault((last_name, name), []).append(gap)
        if end >= busy_end:
            busy_end, last_name = end, name
    span_ms = (busy_end - spans[0][0]) / 1000
    lines = [
        "",
        f"GPU idle between kernels: {total_idle / 1000:.2f} ms of {span_ms:.2f} ms "
        f"(gaps of at least {min_gap_us:g} us, all streams merged)",
        "",
        "| idle ms | gaps | mean us | after kernel | before kernel |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:rows]
    for (before, after), values in ranked:
        lines.append(
            f"| {sum(values) / 1000:.2f} | {len(values)} | {sum(values) / len(values):.1f} "
            f"| {_short(before)} | {_short(after)} |"
        )
    return "\n".join(lines) + "\n"


def device_kernel_table(events: Any, calls: int = 1, rows: int = 40) -> str:
    """GPU time of every kernel (and device memset or copy) over `calls` profiled calls, per call,
    largest first: the operator table of torch.profiler folds small kernels under their operators
    and cuts the list, so a few microseconds each, many times a call, go unseen there."""
    per_name: dict[str, list[float]] = {}
    for start, end, name in _device_spans(events):
        per_name.setdefault(name, []).append(end - start)
    if not per_name:
        return ""
    total = sum(sum(v) for v in per_name.values()) / calls
    lines = [
        "",
        f"GPU time per call: {total:.1f} us in {sum(len(v) for v in per_name.values()) / calls:g} launches",
        "",
        "| us per call | launches per call | kernel |",
        "|---|---|---|",
    ]
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    for name, spans in ranked[:rows]:
        lines.append(f"| {sum(spans) / calls:.1f} | {len(spans) / calls:g} | {_short(name, 90)} |")
    if len(ranked) > rows:
        rest = [t for _, spans in ranked[rows:] for t in spans]
        lines.append(
            f"| {sum(rest) / calls:.1f} | {len(rest) / calls:g} | (the remaining {len(ranked) - rows}) |"
        )
    return "\n".join(lines) + "\n"


def _frame_text(frame: dict[str, Any]) -> str:
    return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"


def _allocation_site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(the innermost frame outside torch's package: e.g. a line of Inductor's generated code,
    the innermost frame of this repository: the model or script line behind it)."""
    own = next((f for f in frames if "/site-packages/torch/" not in f["filename"]), None)
    repo = next((f for f in frames if "sparse_llm/" in f["filename"] or "scripts/" in f["filename"]), None)
    return (_frame_text(own) if own else "?", _frame_text(repo) if repo else "?")


def memory_peak_table(trace: list[dict[str, Any]], rows: int = 25) -> str:
    """From a trace of the CUDA caching allocator (`torch.cuda.memory._snapshot()["device_traces"]`
    of one device, recorded with `torch.cuda.memory._record_memory_history`): the peak of the
    memory allocated during the trace, above what was allocated when it started, and the blocks
    alive at that peak grouped by size and allocation site, largest total first."""
    total = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
        elif event["action"] == "free_requested":
            total -= event["size"]
    live: dict[int, dict[str, Any]] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[tuple[int, str, str], int] = {}
    for event in live.values():
        key = (event["size"], *_allocation_site(event.get("frames", [])))
        groups[key] = groups.get(key, 0) + 1
    mib = 2**20
    lines = [
        f"Peak during the trace: {peak / mib:.0f} MiB above the memory allocated when it started, "
        f"at event {peak_index} of {len(trace)}; blocks alive then, by size and site:",
        "",
        "| total MiB | blocks | MiB each | allocated at | from |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:rows]
    for (size, site, repo_site), count in ranked:
        lines.append(f"| {size * count / mib:.0f} | {count} | {size / mib:.1f} | {site} | {repo_site} |")
    return "\n".join(lines) + "\n"


def write_report(
    text: str, meta: dict[str, Any], rows: list[dict], json_path: Path | None, md_path: Path | None
) -> None:
    """Print the Markdown `text`; write {"meta", "results"} as JSON and the text as Markdown where asked."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if md_path:
        md_path.write_text(text)
