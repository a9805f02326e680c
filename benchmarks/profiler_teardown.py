"""Whether a torch.profiler session leaves the host slower after it stops: the host time of launching
small CUDA ops before a short profile and after it, in a fresh process per setting of
`TEARDOWN_CUPTI` (Kineto's switch for finalizing CUPTI when a profile ends; pytorch issue 144455:
without it, CUPTI's callbacks stay installed and every later launch pays for them).

Why it matters here: a whole run that profiled steps 383-385 on 4 GPUs ran the rest of its steps 12%
slower with the kernels (whose step is bound by the host's launches) and not at all slower dense
(`run_1b_4xh100_windows.md`). `benchmarks.step_profile` therefore turns the teardown on.

    python -m benchmarks.profiler_teardown --json out.json --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common

# How TEARDOWN_CUPTI is set: not at all, in the process's environment at its start, or by the
# process itself after CUDA is up and before the profile starts (what StepProfile does).
SETTINGS = ("not set", "at process start", "in process, before the profile")


def launch_us(ops: int) -> float:
    """Host microseconds per launch of a small elementwise op (the GPU never the bound)."""
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * elapsed / ops


def measure_in_this_process(ops: int, repeats: int, set_teardown: bool) -> dict[str, float]:
    """Median launch time before a profile of a few ops and after it (the profile's own ops not timed)."""
    launch_us(ops)  # warm-up: CUDA context, caching allocator
    before = sorted(launch_us(ops) for _ in range(repeats))[repeats // 2]
    if set_teardown:
        os.environ["TEARDOWN_CUPTI"] = "1"
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]):
        launch_us(100)
    torch.cuda.synchronize()
    after = sorted(launch_us(ops) for _ in range(repeats))[repeats // 2]
    return {"before_us": before, "after_us": after, "after_over_before": after / before}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--ops", type=int, default=20000, help="launches a timing")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:  # one setting, in its own process: print the figures as JSON
        figures = measure_in_this_process(args.ops, args.repeats, set_teardown=args.child == SETTINGS[2])
        print(json.dumps(figures))
        return
    common.require_cuda("the profiler's effect on CUDA launches")
    rows = []
    for name in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "TEARDOWN_CUPTI"}
        if name == SETTINGS[1]:
            env["TEARDOWN_CUPTI"] = "1"
        command = [sys.executable, "-m", "benchmarks.profiler_teardown", "--child", name]
        command += ["--ops", str(args.ops), "--repeats", str(args.repeats)]
        out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
        rows.append({"setting": name, **json.loads(out.strip().splitlines()[-1])})
    lines = [
        "# Host time of a CUDA launch before and after a torch.profiler session",
        "",
        f"{args.ops} launches of a small in-place add a timing, median of {args.repeats}, a fresh process each.",
        "",
        "| TEARDOWN_CUPTI=1 set | us a launch, before | after | after / before |",
        "|---|---:|---:|---:|",
        *(
            f"| {r['setting']} | {r['before_us']:.2f} | {r['after_us']:.2f} | {r['after_over_before']:.2f}x |"
            for r in rows
        ),
    ]
    text = "\n".join(lines) + "\n"
    common.write_report(text, common.run_meta("cuda"), rows, args.json, args.md)


if __name__ == "__main__":
    main()
