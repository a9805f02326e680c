"""Reads training batches ahead in a background thread, so reading and tokenizing the next
batches overlaps the GPU's work on the current one (one process reads and tokenizes every
document, see RankSlice).

The wrapper keeps the exact-resume contract of the stream it wraps: `state_dict()` and
`counters` describe the stream after the last batch *handed out*, not after the batches read
ahead, so a checkpoint resumes at the first batch the training loop has not seen.
"""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any, Protocol

import torch


class BatchSource(Protocol):
    def next_batch(self, batch_size: int) -> torch.Tensor: ...

    @property
    def counters(self) -> dict[str, int]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class BatchPrefetcher:
    """`source`'s batches of `batch_size` rows, up to `depth` of them read ahead by a daemon
    thread (started on the first batch, stopped by `close()` or `load_state_dict()`). With
    `pin_memory` the batches come in page-locked memory, so `.to("cuda", non_blocking=True)`
    is asynchronous. An error in the thread is raised by the `next_batch` call that meets it."""

    _POLL_S = 0.1  # how often a blocked thread checks whether it should stop

    def __init__(
        self, source: BatchSource, batch_size: int, depth: int = 2, pin_memory: bool = False
    ) -> None:
        if batch_size < 1 or depth < 1:
            raise ValueError(f"batch_size and depth must be >= 1, got {batch_size} and {depth}")
        self.source = source
        self.batch_size = batch_size
        self.depth = depth
        self.pin_memory = pin_memory
        self._state = source.state_dict()
        self._counters = dict(source.counters)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def next_batch(self, batch_size: int) -> torch.Tensor:
        if batch_size != self.batch_size:
            raise ValueError(
                f"this prefetcher reads batches of {self.batch_size} rows, asked for {batch_size}"
            )
        if self._thread is None:
            self._start()
        batch, state, counters, error = self._queue.get()
        if error is not None:
            self.close()
            raise error
        self._state, self._counters = state, counters
        return batch

    @property
    def counters(self) -> dict[str, int]:
        return dict(self._counters)

    def state_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()  # the batches read ahead belong to the old position
        self.source.load_state_dict(state)
        self._state = self.source.state_dict()
        self._counters = dict(self.source.counters)

    def close(self) -> None:
        """Stop the thread and drop what it read ahead (the source then stands past those
        batches: only `load_state_dict` or a new prefetcher on a reloaded source continues)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread, self._queue = None, None
        self._stop.clear()

    def _start(self) -> None:
        self._queue = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=self._read_ahead, args=(self._queue,), name="batch-prefetch", daemon=True
        )
        self._thread.start()

    def _put(self, out: queue.Queue, item: tuple) -> bool:
        while not self._stop.is_set():
            try:
                out.put(item, timeout=self._POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read_ahead(self, out: queue.Queue) -> None:
        try:
            while not self._stop.is_set():
                batch = self.source.next_batch(self.batch_size)
                if self.pin_memory:
                    batch = batch.pin_memory()
                item = (batch, self.source.state_dict(), dict(self.source.counters), None)
                if not self._put(out, item):
                    return
        except Exception as error:  # handed to the consumer, raised in the training loop
            self._put(out, (None, None, None, error))
