"""Which Python objects a training run keeps making: a trainer callback that counts the objects the
garbage collector tracks, by type, before step `first` and after step `last`, and writes the types
that grew the most.

Added to any run from the command line (steps are 1-based, inclusive):

    python -m sparse_llm.train ... \
      'callbacks=[{_target_:benchmarks.object_growth.ObjectGrowth,first:100,last:700,out:/tmp/objects}]'

writes `<out>/object_growth_steps_<first>_<last>.md` (and `.json`): the tracked objects at each end,
and per type the count at each end and the growth a step, and for the types that grew the most,
what holds one of them (its chain of referrers: which cache, list or object keeps them alive).
Objects that outlive every step and accumulate are what a full garbage collection walks more of as
a run goes on (training/garbage.py), and a run's host memory; each count runs a full collection
first (a second or so on a 1b run), so time runs without it.
"""

from __future__ import annotations

import collections
import gc
import json
import types
from typing import Any

from benchmarks.step_range import StepRangeCallback

TOP_TYPES = 25
HELD_TYPES = 3  # the fastest-growing types whose holders are traced
HOLDER_DEPTH = 8


def tracked_objects_by_type() -> collections.Counter[str]:
    """After a full collection: the objects the collector tracks, counted by type name."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _describe(holder: object, held: object) -> str:
    """A referrer by its type; a dict also by its owner (whose attributes it is) or the key that
    holds `held`."""
    name = type(holder).__qualname__
    if isinstance(holder, dict):
        owners = [o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
        if owners:
            return f"dict (attributes of {type(owners[0]).__qualname__})"
        keys = [k for k, v in holder.items() if v is held or k is held]
        if keys:
            return f"dict (at a {type(keys[0]).__qualname__} key)"
    return name


def holder_chain(type_name: str, depth: int = HOLDER_DEPTH) -> str:
    """What keeps an object of `type_name` alive: the last such object the collector tracks, then its
    referrers one by one (the first that is neither a frame nor already on the chain), by type."""
    target = None
    for obj in gc.get_objects():
        if type(obj).__qualname__ == type_name:
            target = obj
    if target is None:
        return ""
    chain, on_chain, current = [type_name], {id(target)}, target
    for _ in range(depth):
        referrers = [
            r
            for r in gc.get_referrers(current)
            if not isinstance(r, types.FrameType) and id(r) not in on_chain
        ]
        if not referrers:
            break
        holder = referrers[0]
        del referrers  # a list of ours would be the next object's first referrer
        chain.append(_describe(holder, current))
        on_chain.add(id(holder))
        current = holder
    return " <- ".join(chain)


class ObjectGrowth(StepRangeCallback):
    def __init__(self, first: int, last: int, out: str) -> None:
        super().__init__(first, last, out)
        self._before: collections.Counter[str] = collections.Counter()

    def start(self, trainer: Any) -> None:
        self._before = tracked_objects_by_type()

    def finish(self, trainer: Any) -> None:
        after = tracked_objects_by_type()
        if not trainer.accelerator.is_main_process:
            return
        steps = self.last - self.first + 1
        grown = sorted(after, key=lambda name: after[name] - self._before[name], reverse=True)[:TOP_TYPES]
        rows = [
            {
                "type": name,
                "before": self._before[name],
                "after": after[name],
                "per_step": (after[name] - self._before[name]) / steps,
            }
            for name in grown
        ]
        for row in rows[:HELD_TYPES]:
            row["held_by"] = holder_chain(row["type"]) if row["per_step"] > 0 else ""
        total_before, total_after = sum(self._before.values()), sum(after.values())
        lines = [
            f"# Python objects the collector tracks, before step {self.first} and after step {self.last}\n",
            f"{total_before} before, {total_after} after: {(total_after - total_before) / steps:+.1f} a step.\n",
            "| type | before | after | a step |",
            "|---|---:|---:|---:|",
            *(f"| {r['type']} | {r['before']} | {r['after']} | {r['per_step']:+.2f} |" for r in rows),
            "",
            "What holds one of each of the fastest-growing types (its referrers, nearest first):",
            "",
            *(f"- {r['held_by']}" for r in rows[:HELD_TYPES] if r.get("held_by")),
        ]
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"object_growth_steps_{self.first}_{self.last}"
        (self.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        summary = {"first": self.first, "last": self.last, "before": total_before, "after": total_after}
        (self.out / f"{name}.json").write_text(json.dumps(summary | {"types": rows}, indent=1) + "\n")
