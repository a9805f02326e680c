"""Data pipeline: streamed documents, on-the-fly tokenization, packing, sharding, exact resume.

Usage (the trainer's view)::

    tok = load_tokenizer(cfg.data.tokenizer)
    stream = TokenStream(cfg.data, tok, seq_len, split="train", rank=rank, world_size=world_size)
    batch = stream.next_batch(batch_size)  # int64 [batch_size, seq_len + 1]
    state = stream.state_dict()  # JSON-serialisable; stream.load_state_dict(state) resumes exactly
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparse_llm.data.errors import DataError
    from sparse_llm.data.stream import RankSlice, TokenStream, heldout_text_ids, validation_batches
    from sparse_llm.data.tokenizer import load_tokenizer

# The names above, imported on first use: the stream imports torch and `datasets` (seconds), which
# the up-front file checks (sparse_llm.data.file_check) and DataError do not need.
_HOMES = {
    "DataError": "errors",
    "RankSlice": "stream",
    "TokenStream": "stream",
    "heldout_text_ids": "stream",
    "validation_batches": "stream",
    "load_tokenizer": "tokenizer",
}
__all__ = [
    "DataError",
    "RankSlice",
    "TokenStream",
    "heldout_text_ids",
    "load_tokenizer",
    "validation_batches",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
