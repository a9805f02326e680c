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


class SignalAt(Callback):
    """Sends `signal` (a name: SIGTERM, SIGUSR1, SIGINT) `times` times to its own process when
    step `step` ends, on the process of rank `rank`: a scheduler's preemption, delivered for real
    at a known step."""

    def __init__(self, step: int, signal: str = "SIGTERM", times: int = 1, rank: int = 0) -> None:
        self.step, self.signal, self.times, self.rank = step, signal, times, rank

    def on_step_end(self, trainer, step, metrics):
        import os
        import signal

        if step == self.step and trainer.rank == self.rank:
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signal, self.signal))
