"""The background batch prefetcher: the same batches as the stream it wraps, and a state that
resumes exactly at the first batch the loop has not taken (not after the batches read ahead)."""

from __future__ import annotations

import threading

import pytest
import torch

from sparse_llm.config import DataConfig
from sparse_llm.data import RankSlice, TokenStream, load_tokenizer
from sparse_llm.data.prefetch import BatchPrefetcher

SEQ, BATCH = 63, 3


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def stream(tok, rank: int = 0, world_size: int = 1) -> RankSlice:
    return RankSlice(TokenStream(DataConfig(max_documents=6, val_fraction=0.0), tok, SEQ), rank, world_size)


def test_same_batches_and_states_as_the_stream(tok):
    plain, ahead = stream(tok), BatchPrefetcher(stream(tok), BATCH, depth=3)
    try:
        for _ in range(12):
            assert torch.equal(ahead.next_batch(BATCH), plain.next_batch(BATCH))
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.counters == plain.counters
    finally:
        ahead.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_from_a_prefetched_state_is_exact(tok, world_size):
    full = stream(tok, world_size - 1, world_size)
    expected = [full.next_batch(BATCH) for _ in range(9)]
    first = BatchPrefetcher(stream(tok, world_size - 1, world_size), BATCH, depth=4)
    got = [first.next_batch(BATCH) for _ in range(4)]  # the thread has read further
    state = first.state_dict()
    first.close()
    second = BatchPrefetcher(stream(tok, world_size - 1, world_size), BATCH)
    second.load_state_dict(state)
    got += [second.next_batch(BATCH) for _ in range(5)]
    second.close()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_load_state_dict_rewinds_a_running_prefetcher(tok):
    ahead = BatchPrefetcher(stream(tok), BATCH)
    start = ahead.state_dict()
    first = [ahead.next_batch(BATCH) for _ in range(3)]
    ahead.load_state_dict(start)
    again = [ahead.next_batch(BATCH) for _ in range(3)]
    ahead.close()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


class Failing:
    """A source whose third batch fails."""

    def __init__(self) -> None:
        self.n = 0
        self.counters: dict[str, int] = {}

    def next_batch(self, batch_size: int) -> torch.Tensor:
        self.n += 1
        if self.n == 3:
            raise OSError("disk gone")
        return torch.full((batch_size, 2), self.n)

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_errors_reach_the_loop_and_close_stops_the_thread():
    ahead = BatchPrefetcher(Failing(), 2)
    assert ahead.next_batch(2)[0, 0] == 1 and ahead.next_batch(2)[0, 0] == 2
    with pytest.raises(OSError, match="disk gone"):
        ahead.next_batch(2)
    assert not any(t.name == "batch-prefetch" and t.is_alive() for t in threading.enumerate())
    with pytest.raises(ValueError, match="batches of 2 rows"):
        ahead.next_batch(3)
    with pytest.raises(ValueError, match=">= 1"):
        BatchPrefetcher(Failing(), 0)
