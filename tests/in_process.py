"""Run the project's `python -m <module> ...` commands in the test process, through their
`main(argv)`: for tests of scripts that start another of our programs, where the process boundary
is not what is tested (a fresh interpreter costs seconds of imports on a small CPU)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence
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
