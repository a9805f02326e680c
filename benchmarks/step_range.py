"""The base of the measuring callbacks (memory_peak, step_profile): something started before
step `first` and finished after step `last` (1-based, inclusive) of a real run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparse_llm.training.callbacks import Callback


class StepRangeCallback(Callback):
    def __init__(self, first: int, last: int, out: str) -> None:
        if not 1 <= first <= last:
            raise ValueError(f"need 1 <= first <= last, got {first}, {last}")
        self.first, self.last, self.out = first, last, Path(out)

    def start(self, trainer: Any) -> None:
        """Before step `first`."""

    def finish(self, trainer: Any) -> None:
        """After step `last`."""

    def on_train_start(self, trainer: Any) -> None:
        if self.first == trainer.step + 1:
            self.start(trainer)

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if step == self.first - 1:
            self.start(trainer)
        if step == self.last:
            self.finish(trainer)
