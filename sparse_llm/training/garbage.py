"""Python's cyclic garbage collector on the trainer's schedule: every rank collects at the same steps.

CPython collects when enough container objects have been allocated since the last collection, so a
process collects at moments of its own; a full (generation 2) collection walks every tracked object,
and after torch.compile a training process holds a great many (graphs, guards, code). One GPU hides
part of such a pause behind the kernels already queued. With several, a paused rank holds up every
other rank at the next FSDP2 collective, and each rank pauses at its own moment: every rank pays
for every rank's pause. The whole runs on 2 and 4 GPUs lost 10-25% of a 20-step window about every
50 s, dense and sparse alike, where one GPU's ran smooth (run_1b_4xh100.md).

While `ScheduledCollection` is installed (the trainer's `fit`), automatic collection is off. After
the run's first step (the first compile) one full collection runs and the survivors are frozen
(`gc.freeze`: never walked again), then every `every` steps a full collection walks only what was
made since: the same steps on every rank, a short pause each. On exit automatic collection is back.
"""

from __future__ import annotations

import gc
import time


class ScheduledCollection:
    """Collects garbage after steps `first_step` and every `every` steps; `every` 0 leaves Python's
    automatic collection as it is (and `after_step` does nothing)."""

    def __init__(self, every: int, first_step: int) -> None:
        if every < 0:
            raise ValueError(f"collection every {every} steps: must be >= 0")
        self.every = every
        self.first_step = first_step
        self.seconds = 0.0  # spent collecting since the last `take_seconds`
        self._was_enabled = True

    def __enter__(self) -> ScheduledCollection:
        self._was_enabled = gc.isenabled()
        if self.every > 0:
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.every > 0:
            gc.unfreeze()  # what was frozen is walked again by later collections (no leak)
            if self._was_enabled:
                gc.enable()

    def after_step(self, step: int) -> None:
        if self.every == 0:
            return
        if step == self.first_step:
            start = time.perf_counter()
            gc.collect()
            gc.freeze()  # what the first compile built lives as long as the run
            self.seconds += time.perf_counter() - start
        elif step % self.every == 0:
            start = time.perf_counter()
            gc.collect()
            self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        """Seconds spent collecting since the last call (the trainer logs them per window)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
