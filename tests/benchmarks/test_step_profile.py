"""benchmarks/step_profile.py: the profiling callback on a tiny CPU run writes its files for the
range asked, and refuses an empty range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import tiny_run_config

from benchmarks.step_profile import StepProfile
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.trainer import Trainer


class FilesAtStep(Callback):
    """Which files `out` holds at the end of each step (after the callbacks listed before it)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.seen: dict[int, list[str]] = {}

    def on_step_end(self, trainer, step: int, metrics: dict[str, float]) -> None:
        self.seen[step] = sorted(p.name for p in self.out.glob("*")) if self.out.is_dir() else []


def test_step_profile_writes_the_range_it_profiled(tmp_path: Path):
    out = tmp_path / "profile"
    cfg = tiny_run_config(tmp_path / "run", max_steps=4)
    files = FilesAtStep(out)
    Trainer(cfg, tmp_path / "run", [StepProfile(first=2, last=3, out=str(out)), files]).fit()
    # The report is written when training ends, not inside the run's timed steps.
    assert files.seen[3] == [] and files.seen[4] == []
    split = json.loads((out / "step_profile_rank0_steps_2_3.json").read_text())
    assert split["steps"] == [2, 3] and split["rank"] == 0 and split["world_size"] == 1
    assert split["wall_ms"] > 0 and split["dense_layers"] == 0
    text = (out / "step_profile_rank0_steps_2_3.txt").read_text()
    assert text.startswith("Rank 0 of 1, steps 2-3") and "| wall_ms |" in text
    # Where the host's time went: the optimizer's step, once a step, among the operations.
    assert "Host time by operation" in text and "| Optimizer.step* | 1 |" in text
    assert (out / "trace_rank0_steps_2_3.json.gz").stat().st_size > 0


def test_step_profile_from_the_first_step(tmp_path: Path):
    out = tmp_path / "profile"
    cfg = tiny_run_config(tmp_path / "run", max_steps=2)
    Trainer(cfg, tmp_path / "run", [StepProfile(first=1, last=1, out=str(out), trace=False)]).fit()
    assert (out / "step_profile_rank0_steps_1_1.json").is_file()
    assert not (out / "trace_rank0_steps_1_1.json.gz").exists()


def test_step_profile_refuses_an_empty_range():
    with pytest.raises(ValueError, match="first <= last"):
        StepProfile(first=3, last=2, out="unused")
