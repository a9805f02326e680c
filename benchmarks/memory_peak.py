"""What sets a training run's peak memory: a trainer callback that records the CUDA caching
allocator over a range of steps and writes the blocks alive at the range's peak.

Added to any run from the command line (one entry per range; steps are 1-based, inclusive):

    python -m sparse_llm.train ... \
      'callbacks=[{_target_:benchmarks.memory_peak.MemoryPeak,first:2,last:3,out:/tmp/mem}]'

writes `<out>/memory_peak_steps_<first>_<last>.txt` (benchmarks.common.memory_peak_table: the peak
above what was allocated when the range started, with that starting level and the run's
high-water mark so far). Recording slows the steps it covers; time runs without it.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks import common
from benchmarks.step_range import StepRangeCallback


class MemoryPeak(StepRangeCallback):
    def __init__(self, first: int, last: int, out: str) -> None:
        super().__init__(first, last, out)
        self._start_bytes = 0

    def start(self, trainer: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self._start_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def finish(self, trainer: Any) -> None:
        if not torch.cuda.is_available():
            return
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        self.out.mkdir(parents=True, exist_ok=True)
        gib = 2**30
        header = (
            f"Steps {self.first}-{self.last}: allocated when the range started {self._start_bytes / gib:.2f} GiB; "
            f"the run's high-water mark so far {torch.cuda.max_memory_allocated() / gib:.2f} GiB; "
            f"layers falling back to dense now {sum(trainer.model.ffn_dense_fallback())}.\n\n"
        )
        path = self.out / f"memory_peak_steps_{self.first}_{self.last}.txt"
        path.write_text(header + common.memory_peak_table(trace, rows=30))
