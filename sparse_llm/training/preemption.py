"""Preemption: a signal stops the run after the step in flight, with a checkpoint to resume from.

SIGTERM is what Slurm and Kubernetes send before they kill a job (after a grace period: Slurm's
KillWait, 30 s by default; Kubernetes' terminationGracePeriodSeconds, 30 s by default), SIGUSR1
what Slurm sends ahead of time with `--signal=USR1@<seconds>`, SIGINT what Ctrl-C sends. While
`StopSignals` is installed (the trainer's `fit`), the first of them only records the request; the
trainer finishes the step in flight, writes a checkpoint, logs one line and raises
`TrainingPreempted`, which the command turns into exit code `EXIT_PREEMPTED` (75, sysexits'
EX_TEMPFAIL: "try again later"); `train.resume=auto` continues exactly where it stopped. A second
signal ends the process at once, by that signal (no checkpoint; the shell reports 128 + its
number: 143 for SIGTERM, 130 for SIGINT).

With several processes every rank may be signalled at a different moment, or only some of them:
each step's one all-reduce of its scalars carries every rank's request (`Trainer.train_step`), so
all ranks stop after the same step and write one checkpoint together.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_PREEMPTED = 75


class TrainingPreempted(Exception):
    """The run stopped on a signal after writing a checkpoint (`checkpoint`, at `step`)."""

    def __init__(self, message: str, step: int, checkpoint: Path) -> None:
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class StopSignals:
    """Records the first of STOP_SIGNALS as a request to stop; a second one ends the process.

    A context manager: the previous handlers come back on exit. Outside the main thread (where
    Python cannot install signal handlers) it installs nothing and never requests a stop.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return self.received.name if self.received is not None else "no signal"

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
            return
        # The second signal: end now, by the signal itself (what the sender expects to see).
        # os.write, not logging: this runs between any two bytecodes, the logging lock possibly held.
        os.write(2, f"\n{sig.name} again: stopping at once, without a checkpoint\n".encode())
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
