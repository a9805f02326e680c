"""Data pipeline: streamed documents, on-the-fly tokenization, packing, sharding, exact resume.

Usage (the trainer's view)::

    tok = load_tokenizer(cfg.data.tokenizer)
    stream = TokenStream(cfg.data, tok, seq_len, split="train", rank=rank, world_size=world_size)
    batch = stream.next_batch(batch_size)  # int64 [batch_size, seq_len + 1]
    state = stream.state_dict()  # JSON-serialisable; stream.load_state_dict(state) resumes exactly
"""

from sparse_llm.data.errors import DataError
from sparse_llm.data.stream import RankSlice, TokenStream, heldout_text_ids, validation_batches
from sparse_llm.data.tokenizer import load_tokenizer

__all__ = [
    "DataError",
    "RankSlice",
    "TokenStream",
    "heldout_text_ids",
    "load_tokenizer",
    "validation_batches",
]
