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
`trace_rank<r>_steps_<first>_<last>.json.gz` when training ends: the trace's export and analysis
take seconds (on a 1b `auto` step's ~2,500 kernels a step), which, written at the range's end as
until 8b460dc, went into the run's own clock: the whole run's log window holding steps 385-387
took 10.3 s against ~3.1 for its neighbours (dense: 5.9 against ~4.1), ~6 s of `auto`'s wall clock
more than dense's. Profiling itself still slows the steps it covers; time runs without it. Kineto leaves CUPTI's callbacks installed after a profile unless TEARDOWN_CUPTI=1,
which slowed every later step of a host-bound run by 12% (`benchmarks.profiler_teardown`), so the
callback sets it where the environment does not. Profile steps between logging steps (e.g. 385-387
in an 800-step whole run, which logs every 20 steps: before its steady phase, the last 400 steps, so
that the profile's slow window is not in its figures): a logging step reads its scalars on the host,
which drains the launch queue for the next step's start.
The profile's start does not synchronize: until 2026-12-02 it did (for a wall clock that started
with an idle GPU), and the first profiled step's forward then ran as fast as the host launched it,
most of the idle time such a profile reported on a one-GPU 1b run (gaps of 0.6-0.9 ms at each
layer's start in that forward, the next kernel launched 10-30 us before it ran; in the later steps
the host led by 20-50 ms). The step's wall clock is timed on the device instead: CUDA events recorded
when the profile starts and ends, i.e. from the GPU's start of step `first` to its end of step
`last` (the host's clock where there is no GPU). Without that synchronize the first profiled
forward still ran at the host's pace (H200, 6b1c41a: a median lead of 0.47 ms over the profile's
first 40 ms, 28-47 ms after 80 ms): the profiler's own start drains the queue, so read a step's idle
from the host-lead table's later windows, or profile one step more and discount the first.
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
        self._start_event: torch.cuda.Event | None = None
        self._wall_ms: float | None = None  # the range's wall clock once it ended
        self._dense_layers = 0  # layers on the dense fallback at the range's end

    def start(self, trainer: Any) -> None:
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        os.environ.setdefault("TEARDOWN_CUPTI", "1")  # read by Kineto when the profile stops
        self._profiler = profile(activities=activities)
        self._profiler.start()
        self._started_at = time.perf_counter()
        if torch.cuda.is_available():  # where the GPU starts step `first`: after its queued work
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def finish(self, trainer: Any) -> None:
        """Stop the profile; its report waits for the end of training (on_train_end), so that its
        seconds of trace export and analysis stay out of the run's own clock."""
        if self._profiler is None:  # resumed past `first`: nothing was recorded
            return
        if self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self._wall_ms = self._start_event.elapsed_time(end)
        else:
            self._wall_ms = 1000 * (time.perf_counter() - self._started_at)
        self._dense_layers = sum(trainer.model.ffn_dense_fallback())
        self._profiler.stop()

    def on_train_end(self, trainer: Any) -> None:
        if self._profiler is not None and self._wall_ms is not None:
            self.report(trainer)

    def report(self, trainer: Any) -> None:
        """Write the stopped profile's files (the split, its text report, the trace)."""
        events = self._profiler.events()
        steps = self.last - self.first + 1
        name = f"rank{trainer.rank}_steps_{self.first}_{self.last}"
        self.out.mkdir(parents=True, exist_ok=True)
        split = {
            "rank": trainer.rank,
            "world_size": trainer.world_size,
            "steps": [self.first, self.last],
            "wall_ms": self._wall_ms / steps,
            "dense_layers": self._dense_layers,
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
            f"layers falling back to dense: {split['dense_layers']}. Per step (wall clock on the device, "
            "then the GPU's time from its first to its last event, split):\n\n| | ms |\n|---|---|\n"
            f"{rows}\n{lead_text}{common.gpu_idle_table(events)}{common.device_kernel_table(events, calls=steps)}"
        )
        (self.out / f"step_profile_{name}.txt").write_text(text)
        self._profiler = None
