"""Which Python objects a training run keeps making: a trainer callback that counts the objects the
garbage collector tracks, by type, before step `first` and after step `last`, and writes the types
that grew the most.

Added to any run from the command line (steps are 1-based, inclusive):

    python -m sparse_llm.train ... \
      'callbacks=[{_target_:benchmarks.object_growth.ObjectGrowth,first:100,last:700,out:/tmp/objects}]'

writes `<out>/object_growth_steps_<first>_<last>.md` (and `.json`): the tracked objects at each end,
and per type the count at each end and the growth a step, and for the types that grew the most,
what holds one of them (its chain of referrers: which cache, list or object keeps them alive; a
tuple by the types it holds) and one of them as its repr shows it.
Objects that outlive every step and accumulate are what a full garbage collection walks more of as
a run goes on (training/garbage.py), and a run's host memory; each count runs a full collection
first (a second or so on a 1b run), so time runs without it.
"""

from __future__ import annotations

import collections
import gc
import json
import reprlib
import types
from typing import Any

from benchmarks.step_range import StepRangeCallback

TOP_TYPES = 25
HELD_TYPES = 3  # the fastest-growing types whose holders are traced
HOLDER_DEPTH = 8
TUPLE_ITEMS = 4  # a tuple holder is described by the types of its first items
SAMPLE_CHARS = 240  # of one object's repr


def tracked_objects_by_type() -> collections.Counter[str]:
    """After a full collection: the objects the collector tracks, counted by type name."""
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


def _describe(holder: object, held: object) -> str:
    """A referrer by its type; a dict also by its owner (whose attributes it is) or the key that
    holds `held`."""
    name = type(holder).__qualname__
    if isinstance(holder, tuple):  # a cache key's shape shows in what it holds
        kinds = ", ".join(type(item).__qualname__ for item in holder[:TUPLE_ITEMS])
        return f"tuple of {len(holder)} ({kinds}{', ...' if len(holder) > TUPLE_ITEMS else ''})"
    if isinstance(holder, dict):
        owners = [o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
        if owners:
            return f"dict (attributes of {type(owners[0]).__qualname__})"
        keys = [k for k, v in holder.items() if v is held or k is held]
        if keys:
            return f"dict (at a {type(keys[0]).__qualname__} key)"
    return name


def _newest(type_name: str) -> object | None:
    """The last object of `type_name` the collector tracks (among the newest made)."""
    target = None
    for obj in gc.get_objects():
        if type(obj).__qualname__ == type_name:
            target = obj
    return target


def sample(target: object) -> str:
    """An object as its repr shows it (its shape, its fields), bounded as it is built."""
    shown = reprlib.Repr()  # (its limits set one by one: Python 3.11 takes none in the constructor)
    shown.maxstring = shown.maxother = SAMPLE_CHARS
    try:
        return shown.repr(target)[:SAMPLE_CHARS]
    except Exception as err:  # a broken __repr__ must not end the run's callback
        return f"<repr failed: {err!r}>"


def holder_chain(target: object, depth: int = HOLDER_DEPTH) -> str:
    """What keeps `target` alive: its referrers one by one (the first that is neither a frame nor
    already on the chain), by type."""
    chain, on_chain, current = [type(target).__qualname__], {id(target)}, target
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
            target = _newest(row["type"]) if row["per_step"] > 0 else None
            row["held_by"] = holder_chain(target) if target is not None else ""
            row["sample"] = sample(target) if target is not None else ""
            del target  # not a referrer of the next type's objects
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
            "",
            "One of each (its repr):",
            "",
            *(f"- {r['type']}: `{r['sample']}`" for r in rows[:HELD_TYPES] if r.get("sample")),
        ]
        self.out.mkdir(parents=True, exist_ok=True)
        name = f"object_growth_steps_{self.first}_{self.last}"
        (self.out / f"{name}.md").write_text("\n".join(lines) + "\n")
        summary = {"first": self.first, "last": self.last, "before": total_before, "after": total_after}
        (self.out / f"{name}.json").write_text(json.dumps(summary | {"types": rows}, indent=1) + "\n")
