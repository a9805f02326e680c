"""benchmarks/object_growth.py: on a tiny CPU run, the callback names the type a run keeps making."""

from __future__ import annotations

import json
from pathlib import Path

from tiny import tiny_run_config

from benchmarks.object_growth import ObjectGrowth
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.trainer import Trainer


class Kept:
    """What the leaking callback keeps, 50 a step (the run's fastest-growing type)."""

    def __repr__(self) -> str:
        return "Kept(by the callback)"


class KeepOneAStep(Callback):
    def __init__(self) -> None:
        self.kept: list[Kept] = []

    def on_step_end(self, trainer, step, metrics) -> None:
        self.kept += [Kept() for _ in range(50)]


def test_the_type_a_run_keeps_making_is_counted_and_traced_to_its_holder(tmp_path: Path):
    out = tmp_path / "objects"
    cfg = tiny_run_config(tmp_path / "run", max_steps=5)
    Trainer(cfg, tmp_path / "run", [KeepOneAStep(), ObjectGrowth(first=2, last=4, out=str(out))]).fit()
    summary = json.loads((out / "object_growth_steps_2_4.json").read_text())
    kept = next(row for row in summary["types"] if row["type"] == "Kept")
    assert (kept["before"], kept["after"], kept["per_step"]) == (50, 200, 50.0)
    assert summary["after"] > 0
    assert "| Kept | 50 | 200 | +50.00 |" in (out / "object_growth_steps_2_4.md").read_text()
    # What keeps them: the callback's list (held by the callback itself, or by its attribute dict
    # where Python keeps one).
    chain = kept["held_by"].split(" <- ")
    assert chain[:2] == ["Kept", "list"] and chain[2] in ("KeepOneAStep", "dict (attributes of KeepOneAStep)")
    assert "- Kept <- list <- " in (out / "object_growth_steps_2_4.md").read_text()
    assert kept["sample"] == "Kept(by the callback)"


def test_a_tuple_holder_is_described_by_what_it_holds():
    from benchmarks.object_growth import _describe

    key = (Kept(), 1.5, "a", None, 7)
    assert _describe(key, key[0]) == "tuple of 5 (Kept, float, str, NoneType, ...)"
