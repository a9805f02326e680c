"""What the benchmark scripts share: the kernel table of one profiled call, and their report files."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def kernel_table(fn: Callable[[], Any], device: torch.device, row_limit: int = 30) -> str:
    """Run fn() once under torch.profiler: its operators and kernels by self GPU time (CPU time on
    a CPU), then the call's wall time. Warm fn up (and compile it) before."""
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
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=row_limit
    )
    return f"{table}\nWall time of the profiled call: {wall_ms:.1f} ms\n"


def write_report(
    text: str, meta: dict[str, Any], rows: list[dict], json_path: Path | None, md_path: Path | None
) -> None:
    """Print the Markdown `text`; write {"meta", "results"} as JSON and the text as Markdown where asked."""
    print(text)
    if json_path:
        json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    if md_path:
        md_path.write_text(text)
