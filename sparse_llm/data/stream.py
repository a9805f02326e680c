"""Packed token streams: documents -> tokens + EOS -> fixed-length rows, resumable exactly.

A rank's stream is the concatenation, in source order, of `tokens(doc) + [EOS]` for each of its
usable documents of one split, looping over epochs. A batch is the next `batch_size * (seq_len
+ 1)` tokens of that stream. The resume point is the first document not yet fully emitted: the
source's reading position just before it (a `datasets` state dict), plus how many of its tokens
were already emitted. Resuming re-reads from that position, so no document is re-tokenized except
the one that was cut.

Data parallelism: the trainer gives every rank the same global stream (world_size=1) wrapped in
a `RankSlice`, which takes the rank's rows of each global micro-batch, so the global batch does
not depend on the number of processes. A `TokenStream` with rank/world_size > 1 instead reads
only its share of the documents (cheaper, but the batches then depend on the world size).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast

from sparse_llm.config import DataConfig
from sparse_llm.data.documents import EMPTY, MALFORMED, SPLITS, classify, split_of
from sparse_llm.data.errors import READ_ERRORS, DataError
from sparse_llm.data.sources import open_source

STATE_VERSION = 1
_CHUNK_DOCS = 16  # documents per tokenizer call, at most: one Rust call spreads them over threads
_CHUNK_CHARS = 1 << 20  # ... or fewer, so that one call stays short
_GIVE_UP_ROWS = 10_000  # rows read in an epoch without any usable document: wrong text_field?
_FINGERPRINT_SKIP = ("name",)  # DataConfig fields that do not change the token stream


@dataclass
class _Document:
    ids: np.ndarray  # token ids followed by EOS
    cursor: dict[str, Any]  # reading position just before this document


def _new_cursor() -> dict[str, Any]:
    return {
        "epoch": 0,
        "dataset": None,  # datasets' state dict after the last row read; None: start of the epoch
        "documents": 0,  # usable documents of this split read, all epochs
        "empty_skipped": 0,
        "malformed_skipped": 0,
        "epoch_rows": 0,  # rows read in this epoch
        "epoch_usable": 0,  # usable documents of either split in this epoch
        "epoch_documents": 0,  # usable documents of this split in this epoch
    }


class TokenStream:
    """One rank's packed token stream of one split; see the module docstring."""

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: PreTrainedTokenizerFast,
        seq_len: int,
        split: str = "train",
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if split == "val" and cfg.val_fraction <= 0:
            raise ValueError("no validation split: data.val_fraction is 0")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be > 0, got {seq_len}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no EOS token, which separates packed documents")
        self.seq_len = seq_len
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self._cfg = cfg
        self._dataset, self._text_field = open_source(cfg, rank, world_size)
        self._encoder = tokenizer.backend_tokenizer  # the Rust tokenizer: batched, no Python overhead
        self._eos = tokenizer.eos_token_id
        self._fingerprint = {k: v for k, v in asdict(cfg).items() if k not in _FINGERPRINT_SKIP}
        self._fingerprint["eos_token_id"] = self._eos
        self._fingerprint["vocab_size"] = len(tokenizer)
        self._cursor = _new_cursor()
        self._rows: Any = None  # iterator over the source's rows; None: (re)start at the cursor
        self._docs: deque[_Document] = deque()
        # Documents per tokenizer call: 1 at first, doubling up to _CHUNK_DOCS, so that a stream's
        # first batches (the held-out ones, a short run's) tokenize only about the documents they take.
        self._chunk_docs = 1
        self._offset = 0  # tokens of self._docs[0] already emitted
        self._tokens = 0
        self._malformed_fields: list[str] | None = None  # the first malformed row's fields, for errors

    # -- reading and tokenizing documents -------------------------------------------------------

    def _next_row(self) -> dict[str, Any] | None:
        """The next raw row, or None at the end of an epoch (after which the next epoch starts)."""
        if self._rows is None:
            # None clears a previously loaded state, so the epoch starts from its beginning.
            self._dataset.load_state_dict(self._cursor["dataset"])
            self._rows = iter(self._dataset)
        try:
            row = next(self._rows)
        except StopIteration:
            self._end_epoch()
            return None
        except READ_ERRORS as err:  # a fault past the start of a file that file_check read
            raise DataError(
                f"cannot read data.source={self._cfg.source!r} after {self._cursor['epoch_rows']} rows of epoch "
                f"{self._cursor['epoch']}: {err}"
            ) from err
        self._cursor["dataset"] = self._dataset.state_dict()
        self._cursor["epoch_rows"] += 1
        return row

    def _end_epoch(self) -> None:
        c = self._cursor
        if c["epoch_documents"] == 0:
            raise DataError(self._no_documents_message())
        c.update(epoch=c["epoch"] + 1, dataset=None, epoch_rows=0, epoch_usable=0, epoch_documents=0)
        self._rows = None

    def _no_documents_message(self) -> str:
        c = self._cursor
        where = f"data.source={self._cfg.source!r}, text field {self._text_field!r}"
        if self.world_size > 1:
            where += f", rank {self.rank} of {self.world_size}"
        fields = ""
        if self._malformed_fields is not None:
            fields = (
                f" (no string under {self._text_field!r}; the first one's fields: "
                f"{', '.join(self._malformed_fields) or 'none'})"
            )
        return (
            f"no usable {self.split} documents ({where}): {c['epoch_rows']} rows read in epoch "
            f"{c['epoch']}, {c['epoch_usable']} usable in either split (data.val_fraction="
            f"{self._cfg.val_fraction}); empty or malformed rows so far: {c['empty_skipped']} empty, "
            f"{c['malformed_skipped']} malformed{fields}"
        )

    def _read_chunk(self) -> None:
        """Read and tokenize the next few documents of this split, each with its resume cursor."""
        pending: list[tuple[dict[str, Any], str]] = []
        chars = 0
        while len(pending) < self._chunk_docs and chars < _CHUNK_CHARS:
            before = dict(self._cursor)  # "dataset" is replaced on each read, never mutated
            row = self._next_row()
            if row is None:
                if pending:
                    break  # tokenize what we have rather than reading the next epoch ahead
                continue
            c = self._cursor
            kind, text = classify(row, self._text_field)
            if kind == EMPTY:
                c["empty_skipped"] += 1
            elif kind == MALFORMED:
                c["malformed_skipped"] += 1
                if self._malformed_fields is None:
                    self._malformed_fields = sorted(row)
            else:
                c["epoch_usable"] += 1
                if split_of(text, self._cfg.val_fraction) == self.split:
                    c["documents"] += 1
                    c["epoch_documents"] += 1
                    pending.append((before, text))
                    chars += len(text)
            if c["epoch_usable"] == 0 and c["epoch_rows"] >= _GIVE_UP_ROWS:
                raise DataError(self._no_documents_message() + "; is data.text_field right?")
        self._chunk_docs = min(2 * self._chunk_docs, _CHUNK_DOCS)
        encodings = self._encoder.encode_batch_fast([text for _, text in pending], add_special_tokens=False)
        for (cursor, _), encoding in zip(pending, encodings, strict=True):
            ids = np.empty(len(encoding.ids) + 1, dtype=np.int64)
            ids[:-1] = encoding.ids
            ids[-1] = self._eos
            self._docs.append(_Document(ids, cursor))

    # -- the public interface -------------------------------------------------------------------

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """The next `batch_size` rows of `seq_len + 1` tokens: int64 [batch_size, seq_len + 1]."""
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        out = np.empty(batch_size * (self.seq_len + 1), dtype=np.int64)
        self._advance(out.size, out)
        return torch.from_numpy(out).view(batch_size, self.seq_len + 1)

    def skip(self, num_rows: int) -> None:
        """Consume the next `num_rows` rows without building them (another rank's share).

        The documents are still read and tokenized (a row's boundaries depend on every token
        before it); only the copy into a batch is saved.
        """
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        self._advance(num_rows * (self.seq_len + 1), None)

    def _advance(self, need: int, out: np.ndarray | None) -> None:
        """Consume the next `need` tokens of the stream, copying them into `out` if given."""
        filled = 0
        while filled < need:
            if not self._docs:
                self._read_chunk()
                continue
            doc = self._docs[0]
            take = min(need - filled, len(doc.ids) - self._offset)
            if out is not None:
                out[filled : filled + take] = doc.ids[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(doc.ids):
                self._docs.popleft()
                self._offset = 0
        self._tokens += need

    def _position(self) -> tuple[dict[str, Any], int]:
        """The resume point: the cursor of the first document not fully emitted, and its offset."""
        if self._docs:
            return self._docs[0].cursor, self._offset
        return self._cursor, 0

    @property
    def counters(self) -> dict[str, int]:
        """Progress as of the tokens emitted so far (identical after a resume).

        documents: documents whose tokens have started to be emitted; empty_skipped and
        malformed_skipped: rows skipped before the current document; tokens: tokens emitted;
        epoch: the epoch of the current document (0-based).
        """
        cursor, offset = self._position()
        return {
            "documents": cursor["documents"] + (1 if offset > 0 else 0),
            "empty_skipped": cursor["empty_skipped"],
            "malformed_skipped": cursor["malformed_skipped"],
            "tokens": self._tokens,
            "epoch": cursor["epoch"],
        }

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable resume point (plain ints, strs, lists, dicts and None)."""
        cursor, offset = self._position()
        return {
            "version": STATE_VERSION,
            "split": self.split,
            "rank": self.rank,
            "world_size": self.world_size,
            "fingerprint": copy.deepcopy(self._fingerprint),
            "cursor": copy.deepcopy(cursor),
            "offset": offset,
            "tokens": self._tokens,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where `state` was taken (same cfg, tokenizer, split, rank and world size)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state version {state.get('version')!r} is not {STATE_VERSION}")
        expected = {"split": self.split, "rank": self.rank, "world_size": self.world_size}
        for key, value in expected.items():
            if state[key] != value:
                raise ValueError(f"data state was saved with {key}={state[key]!r}, this stream has {value!r}")
        changed = sorted(
            k
            for k in self._fingerprint.keys() | state["fingerprint"].keys()
            if self._fingerprint.get(k) != state["fingerprint"].get(k)
        )
        if changed:
            raise ValueError(f"data state was saved with different settings: {', '.join(changed)}")
        self._cursor = copy.deepcopy(state["cursor"])
        self._rows = None
        self._docs.clear()
        self._offset = 0
        self._tokens = state["tokens"]
        if state["offset"]:
            self._read_chunk()
            if state["offset"] >= len(self._docs[0].ids):
                raise ValueError("data state does not match the data: the document is shorter than saved")
            self._offset = state["offset"]


class RankSlice:
    """One data-parallel rank's rows of a token stream that every rank reads in full.

    The stream is cut into global micro-batches of `batch_size * world_size` rows; rank r takes
    rows `[r * batch_size, (r + 1) * batch_size)` of each and skips the others' without building
    them. An optimizer step of `accum` micro-batches per rank therefore consumes the same
    `global_batch_size` rows, in the same order, for any number of processes, and after every
    step all ranks stand at the same stream position: the state is that of the global stream,
    independent of rank and world size (a run can resume on a different number of processes).
    With world_size 1 this is the stream itself. The cost: every rank reads and tokenizes all
    documents (world_size times the tokenization work in total, but per rank no more than a
    single-process run at the same global throughput).
    """

    def __init__(self, stream: TokenStream, rank: int = 0, world_size: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        if stream.world_size != 1:
            raise ValueError("RankSlice needs the global stream (a TokenStream with world_size=1)")
        self.stream = stream
        self.rank = rank
        self.world_size = world_size

    def next_batch(self, batch_size: int) -> torch.Tensor:
        """This rank's `batch_size` rows of the next global micro-batch of `batch_size * world_size` rows."""
        self.stream.skip(self.rank * batch_size)
        batch = self.stream.next_batch(batch_size)
        self.stream.skip((self.world_size - 1 - self.rank) * batch_size)
        return batch

    @property
    def counters(self) -> dict[str, int]:
        """The global stream's counters (tokens: over all ranks)."""
        return self.stream.counters

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


def validation_batches(
    cfg: DataConfig,
    tokenizer: PreTrainedTokenizerFast,
    seq_len: int,
    batch_size: int,
    num_batches: int,
    rank: int = 0,
    world_size: int = 1,
) -> list[torch.Tensor]:
    """The first `num_batches` batches of this rank's held-out stream: fixed and deterministic.

    Empty when data.val_fraction is 0. A held-out set smaller than the request repeats (epochs).
    """
    if cfg.val_fraction <= 0 or num_batches <= 0:
        return []
    stream = TokenStream(cfg, tokenizer, seq_len, split="val", rank=rank, world_size=world_size)
    return [stream.next_batch(batch_size) for _ in range(num_batches)]


def heldout_text_ids(tokenizer: PreTrainedTokenizerFast, batch_size: int, length: int) -> torch.Tensor:
    """[batch_size, length] token ids of held-out text of the embedded corpus (the first 2000
    documents, 5% held out): real text for benchmarks, the same on every call."""
    data = DataConfig(max_documents=2000, val_fraction=0.05)
    return validation_batches(data, tokenizer, length, batch_size, 1)[0][:, :length]
