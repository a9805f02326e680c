"""Python's cyclic garbage collector on the trainer's schedule: every rank collects at the same steps.

CPython collects when enough container objects have been allocated since its last collection, so
each process collects at moments of its own, and a full (generation 2) collection walks every
tracked object a training process holds. On several GPUs a paused rank holds up every other rank
at the next FSDP2 collective, and each rank pauses at its own moment, so every rank pays for every
rank's pause: the 1b whole runs on 2 and 4 GPUs lost 10-25% of a 20-step window about every 50 s,
dense and sparse alike, where one GPU's did not (benchmarks/results/gc_windows_h100.md). A full
collection every 50 steps instead took 0.04 s at step 60 and 0.3 s by step 800: it walks every
live object, and those grew through the run (one cause found since, a ContextVar left in the
thread's context at every call of a compiled region, is fixed in model/compiling.py; whether it
was all of the growth is not measured).

So while `ScheduledCollection` is installed (the trainer's `fit`), automatic collection is off and
every `every` steps each rank collects the young generations (0 and 1: what the last steps made;
0.05-0.09 s on the 1b run, all ranks at once): garbage from a step is freed within `every` steps,
and objects that outlive a collection (the model, compiled graphs) move to the oldest
generation, which is not walked again until the run ends and Python's automatic collection is back.
"""

from __future__ import annotations

import gc
import time

YOUNG_GENERATIONS = 1  # gc.collect(1): generations 0 and 1


class ScheduledCollection:
    """Collects the young generations every `every` steps; `every` 0 leaves Python's automatic
    collection as it is (and `after_step` does nothing)."""

    def __init__(self, every: int) -> None:
        if every < 0:
            raise ValueError(f"collection every {every} steps: must be >= 0")
        self.every = every
        self.seconds = 0.0  # spent collecting since the last `take_seconds`
        self._was_enabled = True

    def __enter__(self) -> ScheduledCollection:
        self._was_enabled = gc.isenabled()
        if self.every > 0:
            gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.every > 0 and self._was_enabled:
            gc.enable()

    def after_step(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            start = time.perf_counter()
            gc.collect(YOUNG_GENERATIONS)
            self.seconds += time.perf_counter() - start

    def take_seconds(self) -> float:
        """Seconds spent collecting since the last call (the trainer logs them per window)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
