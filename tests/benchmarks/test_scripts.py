"""Every benchmark script is a module of the benchmarks package, run from the repository root as
`python -m benchmarks.<name>`: it imports, its --help works, and nothing in benchmarks/ edits
sys.path to run as a file. Imported in this process (one subprocess checks the `-m` entry)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"
# Modules of the package that are not scripts: the package, the shared helpers, a trainer callback.
NOT_SCRIPTS = {"__init__", "common", "memory_peak", "object_growth", "step_profile", "step_range"}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_every_module_is_a_script_or_a_known_helper():
    assert set(SCRIPTS) == {p.stem for p in BENCHMARKS.glob("*.py")} - NOT_SCRIPTS


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_imports_and_takes_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as done:
        module.parse_args(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_a_script_runs_as_a_module_from_the_repository_root():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.ffn_bound", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0 and "python -m benchmarks.ffn_bound" in done.stdout, done.stderr


def test_no_benchmark_edits_sys_path():
    assert not [p.name for p in BENCHMARKS.glob("*.py") if "sys.path" in p.read_text()]
