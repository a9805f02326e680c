"""ScheduledCollection: Python's garbage collected at the trainer's steps only, then given back."""

from __future__ import annotations

import gc
import weakref

import pytest

from sparse_llm.training.garbage import ScheduledCollection


class Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def cyclic_garbage() -> weakref.ref:
    return weakref.ref(Node())


def test_collects_every_n_steps_only():
    assert gc.isenabled()
    with ScheduledCollection(every=3) as collection:
        assert not gc.isenabled()
        garbage = cyclic_garbage()
        for step in (1, 2):
            collection.after_step(step)
        for _ in range(10_000):  # allocations that would start an automatic collection
            Node()
        assert garbage() is not None and collection.take_seconds() == 0
        collection.after_step(3)
        assert garbage() is None
        assert collection.take_seconds() > 0 and collection.take_seconds() == 0
    assert gc.isenabled()


def test_every_zero_keeps_pythons_schedule():
    with ScheduledCollection(every=0) as collection:
        assert gc.isenabled()
        garbage = cyclic_garbage()
        collection.after_step(50)
        assert collection.take_seconds() == 0
        gc.collect()
        assert garbage() is None
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled_after():
    gc.disable()
    try:
        with ScheduledCollection(every=2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_negative_every_is_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        ScheduledCollection(every=-1)
