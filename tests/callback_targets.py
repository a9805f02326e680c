"""Callback classes that configs name by import path (`_target_: callback_targets.Recorder`)."""

from __future__ import annotations

from sparse_llm.training.callbacks import Callback


class Recorder(Callback):
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def on_step_end(self, trainer, step, metrics):
        self.log.append((self.name, "step", step))
        metrics[self.name] = step

    def on_checkpoint(self, trainer, step, path):
        self.log.append((self.name, "ckpt", path))


class NotACallback:
    def __init__(self, every: int = 1) -> None:
        self.every = every
