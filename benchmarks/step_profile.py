"""Where a training step's time goes, on every rank: a trainer callback that profiles a range of
steps with torch.profiler and writes, per rank, the step's time split (compute, communication not
hidden by compute, GPU idle), the idle gaps by their neighbouring kernels, the kernels by GPU time,
the host's lead over the GPU (`benchmarks.trace_lead`, from the trace), where the host's time went
(`benchmarks.host_time`), the step's forward, backward and optimizer phases on the GPU
(`benchmarks.step_phases`) and the Chrome trace.

Added to any run from the command line (steps are 1-based, inclusive), e.g. a whole run's steady
phase on 2 GPUs:

    python -m benchmarks.whole_run --impl auto --gpus 2 --out-dir out \\
      --override 'callbacks=[{_target_:benchmarks.step_profile.StepProfile,first:701,last:703,out:/tmp/prof}]'

writes `<out>/step_profile_rank<r>_steps_<first>_<last>.txt` and `.json` (the split) and
`trace_rank<r>_steps_<first>_<last>.json.gz`. Profiling slows the steps it covers; time runs
without it. Kineto leaves CUPTI's callbacks installed after a profile unless TEARDOWN_CUPTI=1,
which slowed every later step of a host-bound run by 12% (`benchmarks.profiler_teardown`), so the
callback sets it where the environment does not. Profile steps between logging steps (e.g. 701-703 in a whole run, which logs every 20 steps): a logging
step reads its scalars on the host, which drains the launch queue for the next step's start.
The profile's own start does the same (it synchronizes, so that its wall clock starts with an idle
GPU): the first profiled step's forward runs as fast as the host launches it, and on a one-GPU 1b run
that is most of the idle time reported (gaps of 0.6-0.9 ms at each layer's start in that forward, the
next kernel launched 10-30 us before it ran; in the later steps the host leads by 20-50 ms). Read the
host lead's table by window: idle in its first windows only is this start, not the run's.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import common, host_time, step_phases, trace_lead
from benchmarks.step_range import StepRangeCallback


class StepProfile(StepRangeCallback):
    def __init__(self, first: int, last: int, out: str, trace: bool = True) -> None:
        super().__init__(first, last, out)
        self.trace = trace
        self._profiler: profile | None = None
        self._started_at = 0.0

    def start(self, trainer: Any) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        os.environ.setdefault("TEARDOWN_CUPTI", "1")  # read by Kineto when the profile stops
        self._profiler = profile(activities=activities)
        self._profiler.start()
        self._started_at = time.perf_counter()

    def finish(self, trainer: Any) -> None:
        if self._profiler is None:  # resumed past `first`: nothing was recorded
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = 1000 * (time.perf_counter() - self._started_at)
        self._profiler.stop()
        events = self._profiler.events()
        steps = self.last - self.first + 1
        name = f"rank{trainer.rank}_steps_{self.first}_{self.last}"
        self.out.mkdir(parents=True, exist_ok=True)
        split = {
            "rank": trainer.rank,
            "world_size": trainer.world_size,
            "steps": [self.first, self.last],
            "wall_ms": wall_ms / steps,
            "dense_layers": sum(trainer.model.ffn_dense_fallback()),
            **common.step_time_split(events, steps),
        }
        lead_text = ""
        if self.trace:
            trace = self.out / f"trace_{name}.json.gz"
            self._profiler.export_chrome_trace(str(trace))
            trace_events = trace_lead.read_trace(trace)
            lead, lead_text = trace_lead.lead_report(trace_events)
            lead_text += "\n" + host_time.host_report(trace_events, steps, source=trace.name)[1]
            phase_split, phase_text = step_phases.phase_report(trace_events, steps, source=trace.name)
            lead_text += phase_text
            split["phases"] = phase_split
            split["host_lead_median_ms"] = lead.median_lead_ms
            split["starved_gpu_ms"] = lead.starved_gpu_ms / steps
        (self.out / f"step_profile_{name}.json").write_text(json.dumps(split, indent=1))
        rows = "\n".join(f"| {key} | {value:.2f} |" for key, value in split.items() if key.endswith("_ms"))
        text = (
            f"Rank {trainer.rank} of {trainer.world_size}, steps {self.first}-{self.last}, "
            f"layers falling back to dense: {split['dense_layers']}. Per step (host wall clock, then "
            "the GPU's time from its first to its last event, split):\n\n| | ms |\n|---|---|\n"
            f"{rows}\n{lead_text}{common.gpu_idle_table(events)}{common.device_kernel_table(events, calls=steps)}"
        )
        (self.out / f"step_profile_{name}.txt").write_text(text)
        self._profiler = None
