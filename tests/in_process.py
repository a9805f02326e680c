"""Run the project's `python -m <module> ...` commands in the test process, through their
`main(argv)`: for tests of scripts that start another of our programs, where the process boundary
is not what is tested (a fresh interpreter costs seconds of imports on a small CPU)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

# The modules whose command lines may run in-process, and the function that takes their argv.
ENTRY_POINTS = {
    "sparse_llm.train": "single_run",  # main() without Hydra's flags: the overrides alone
    "benchmarks.sparse_weights": "main",
}


def run_module(command: Sequence[str], check: bool = False, **_: Any) -> subprocess.CompletedProcess:
    """subprocess.run's signature for `[sys.executable, "-m", module, *argv]`: the module's entry
    point called on argv, its return value the exit status (CalledProcessError with `check`)."""
    command = list(command)
    if command[:2] != [sys.executable, "-m"] or command[2] not in ENTRY_POINTS:
        raise AssertionError(f"not one of our in-process commands: {command[:3]}")
    entry = getattr(importlib.import_module(command[2]), ENTRY_POINTS[command[2]])
    code = entry(command[3:]) or 0
    if check and code != 0:
        raise subprocess.CalledProcessError(code, command)
    return subprocess.CompletedProcess(command, code)


@contextlib.contextmanager
def logging_kept() -> Iterator[None]:
    """Every logger's level, handlers and flags as they were before the block: Hydra's launcher
    configures logging for each job (logging.config.dictConfig: the root's handlers replaced, levels
    set), which in this process would stay for the tests after; handlers added meanwhile are closed."""
    manager = logging.Logger.manager

    def loggers() -> list[logging.Logger]:
        return [
            logging.getLogger(),
            *(v for v in manager.loggerDict.values() if isinstance(v, logging.Logger)),
        ]

    saved = {lg: (lg.level, lg.handlers[:], lg.propagate, lg.disabled) for lg in loggers()}
    kept = {h for _, handlers, _, _ in saved.values() for h in handlers}
    try:
        yield
    finally:
        for lg in loggers():
            for handler in lg.handlers:
                if handler not in kept:
                    handler.close()
            if lg in saved:
                level, handlers, lg.propagate, lg.disabled = saved[lg]
                lg.setLevel(level)  # (setLevel, not the attribute: it clears the loggers' level caches)
                lg.handlers = handlers[:]
            else:
                lg.handlers = [h for h in lg.handlers if h in kept]
