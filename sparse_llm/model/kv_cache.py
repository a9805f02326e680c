"""The KV cache of incremental decoding (its write, RoPE applied to k on the way in, is the op
sparse_llm.ops.kv_cache_write)."""

from __future__ import annotations

import torch

from sparse_llm.config import ModelConfig
from sparse_llm.ops.decode_attention import column_range_mask, decode_attention, reads_bounds, sdpa_one_query
from sparse_llm.ops.kv_cache_write import write_kv, write_kv_columns


class KVCache:
    """Keys (after RoPE) and values of every layer, preallocated for `max_len` positions.

    Column s of the cache holds the token at input column s (padding included); which columns a
    row may attend to is the caller's padding mask. `length` columns are filled. The layout is
    [layers, B, max_len, kv_heads, head_dim], the projections' token-major layout. The write is
    the op `ops.kv_cache_write.write_kv` (one fused kernel on a Hopper GPU).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, batch_size, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    @classmethod
    def from_tensors(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over given [layers, B, max_len, kv_heads, head_dim] tensors (used, not copied),
        nothing filled: how the decode slots of sparse_llm.inference.decode lay their caches over
        one shared allocation."""
        if k.dim() != 5 or k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            raise ValueError(
                f"k and v must be alike [layers, B, max_len, kv_heads, head_dim], got {tuple(k.shape)} "
                f"({k.dtype}, {k.device}) and {tuple(v.shape)} ({v.dtype}, {v.device})"
            )
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.max_len, cache.length = k, v, k.shape[2], 0
        return cache

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's RoPE(k) and v (k, v: [B, T, kv_heads, head_dim] before RoPE; cos, sin
        as the model's rotary embedding gives them) after the filled columns; return all filled
        columns as [B, kv_heads, length + T, head_dim] views (SDPA's layout)."""
        start, end = self.length, self.length + k.shape[1]  # write_kv checks end <= max_len
        if torch.compiler.is_compiling():
            # Traced, a slice assignment into the cache (a graph input) is functionalized into a
            # copy of the whole cache per write (measured: 20% of a compiled 1B prefill); the
            # custom op's declared mutation is re-inplaced by Inductor instead.
            torch.ops.sparse_llm.kv_cache_write(self.k, self.v, layer, start, k, v, cos, sin)
        else:  # eager: the same write without the custom op's dispatch (decode runs eager)
            write_kv(self.k, self.v, layer, start, k, v, cos, sin)
        return self.k[layer, :, :end].transpose(1, 2), self.v[layer, :, :end].transpose(1, 2)


class ColumnWriteCache:
    """A KVCache as a static-shape decode step sees it (KVCache.update's interface): each row writes
    its one new token at its own column, `columns` ([B] device tensor), and attends to its columns
    `first_columns`..`columns` ([B] device tensor: left padding lies before the first, columns not
    written yet or stale from an earlier batch after the last), through `attend`. Neither the
    shapes nor the write position are Python values, so a CUDA graph can capture the step once and
    replay it.

    How it attends is fixed when it is made: by the rows' column bounds on a GPU
    (`ops.decode_attention.reads_bounds`: the Triton kernel, whose logits repeat call after call),
    else SDPA over all max_len columns under one additive key mask, built here once a step
    (`decode_key_mask`).

    The write (`write_kv_columns`) rounds RoPE(k) exactly as every other cache write does, so the
    static and the eager decode keep the same cache, bit for bit.
    """

    def __init__(self, cache: KVCache, columns: torch.Tensor, first_columns: torch.Tensor) -> None:
        _, batch, max_len, _, head_dim = cache.k.shape
        for name, t in (("columns", columns), ("first_columns", first_columns)):
            if t.shape != (batch,) or t.dtype != torch.long:
                raise ValueError(
                    f"{name} must be an int64 [B] = [{batch}] tensor, got {t.dtype} {tuple(t.shape)}"
                )
        self.cache = cache
        self.length = max_len  # every column is a candidate; first_columns and columns say which are real
        self.columns = columns
        self.first_columns = first_columns
        dtype, device = cache.k.dtype, cache.k.device
        self.key_mask = (
            None
            if reads_bounds(dtype, device, head_dim)
            else decode_key_mask(first_columns, columns, max_len, dtype)
        )

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of q ([B, 1, heads, head_dim], token-major) over the rows' columns of k and v
        (`update`'s views); [B, 1, heads, head_dim]."""
        if self.key_mask is None:
            return decode_attention(q, k, v, self.first_columns, self.columns)
        return sdpa_one_query(q, k, v, self.key_mask)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write RoPE(k) and v (k, v: [B, 1, kv_heads, head_dim] before RoPE) at each row's column of
        `layer`; return the layer's whole cache as [B, kv_heads, max_len, head_dim] views."""
        if torch.compiler.is_compiling():
            # As in KVCache.update: traced, the scatter into a view of the cache (a graph input)
            # would be functionalized into a copy of the whole cache; the op's declared mutation
            # stays in place.
            torch.ops.sparse_llm.kv_cache_write_columns(
                self.cache.k, self.cache.v, layer, self.columns, k, v, cos, sin
            )
        else:
            write_kv_columns(self.cache.k, self.cache.v, layer, self.columns, k, v, cos, sin)
        k_layer, v_layer = self.cache.k[layer], self.cache.v[layer]
        return k_layer.transpose(1, 2), v_layer.transpose(1, 2)


def decode_key_mask(
    first_columns: torch.Tensor, columns: torch.Tensor, max_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive attention mask of a static decode step, [B, 1, 1, max_len]: 0 on the columns a
    row's new token sees (its first real column up to its own), -inf elsewhere (left padding,
    columns not written yet, stale columns of an earlier batch). Additive and built once per step:
    SDPA would convert a bool mask in every layer."""
    keep = column_range_mask(first_columns, columns, max_len)
    mask = torch.zeros(keep.shape, device=columns.device, dtype=dtype).masked_fill_(~keep, float("-inf"))
    return mask[:, None, None, :]
