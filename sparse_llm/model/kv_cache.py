"""The KV cache of incremental decoding, and its write: RoPE applied to k on the way in."""

from __future__ import annotations

import torch

from sparse_llm.config import ModelConfig
from sparse_llm.model.rope import apply_rotary
from sparse_llm.ops._extension import extension, kernels_unavailable
from sparse_llm.ops.decode_attention import column_range_mask, decode_attention, reads_bounds, sdpa_one_query


class KVCache:
    """Keys (after RoPE) and values of every layer, preallocated for `max_len` positions.

    Column s of the cache holds the token at input column s (padding included); which columns a
    row may attend to is the caller's padding mask. `length` columns are filled. The layout is
    [layers, B, max_len, kv_heads, head_dim], the projections' token-major layout. On a Hopper GPU
    with the extension, one kernel applies RoPE to k and writes k and v (kernels/kv_cache.cu):
    the generic copies of a rotated k and of v were 8% of a compiled 1B prefill.
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

    How it attends is fixed when it is made: by the rows' column bounds where that kernel is the
    faster (`ops.decode_attention.reads_bounds`: one row on a GPU), else SDPA over all max_len
    columns under one additive key mask, built here once a step (`decode_key_mask`).

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
            if reads_bounds(batch, dtype, device, head_dim)
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


def write_kv_columns(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    columns: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """k_cache[layer, b, columns[b]] = RoPE(k[b, 0]) and v_cache[...] = v[b, 0] for every row b, in
    place (k, v: [B, 1, kv_heads, head_dim]; columns: int64 [B], each in [0, max_len): the
    caller's contract, not checked here, which would read the device). On Hopper the fused kernel
    writes each row at its column (one launch, RoPE(k) rounded as in every other cache write; it
    never writes outside the cache); elsewhere through a one-column staging cache by `write_kv`,
    then a scatter (which raises on a column out of range)."""
    if k.shape[1] != 1:
        raise ValueError(f"write_kv_columns writes one token a row, got k of shape {tuple(k.shape)}")
    if (
        _fused_write_applies(k_cache, v_cache, k, v, cos, sin)
        and columns.device == k.device
        and columns.is_contiguous()
    ):
        extension().kv_cache_write_rope_columns(k_cache, v_cache, layer, columns, k, v, cos, sin)
        return
    batch, _, heads, head_dim = k.shape
    stage_k = torch.empty((1, batch, 1, heads, head_dim), device=k_cache.device, dtype=k_cache.dtype)
    stage_v = torch.empty_like(stage_k)
    write_kv(stage_k, stage_v, 0, 0, k, v, cos, sin)
    index = columns.view(batch, 1, 1, 1).expand(batch, 1, heads, head_dim)
    k_cache[layer].scatter_(1, index, stage_k[0])
    v_cache[layer].scatter_(1, index, stage_v[0])


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


def _fused_write_applies(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Whether kernels/kv_cache.cu takes these inputs: bf16 on a Hopper GPU with the extension;
    contiguous caches; k and v contiguous but for their token stride."""
    tokens, head_dim = k.shape[1], k.shape[3]
    token_stride = k.stride(1)
    return (
        k.is_cuda
        and all(t.dtype == torch.bfloat16 for t in (k, v, cos, sin))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and k.stride() == v.stride() == (tokens * token_stride, token_stride, head_dim, 1)
        and token_stride % 8 == 0
        and k.data_ptr() % 16 == 0
        and v.data_ptr() % 16 == 0
        and head_dim % 16 == 0
        and kernels_unavailable(k.device) is None
    )


def _check_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    layers, batch, max_len, heads, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"k_cache, v_cache must match and k, v too; got {k_cache.shape}, {v_cache.shape}, {k.shape}"
        )
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, heads, head_dim):
        raise ValueError(
            f"k, v must be [B, T, heads, head_dim] matching the cache {tuple(k_cache.shape)}, got {k.shape}"
        )
    if not 0 <= layer < layers or start < 0 or start + k.shape[1] > max_len:
        raise ValueError(
            f"layer {layer}, columns [{start}, {start + k.shape[1]}) exceed the cache's {layers} x {max_len}"
        )


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layer: int,
    start: int,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """k_cache[layer, :, start:start + T] = RoPE(k) and v_cache[...] = v, in place."""
    _check_write(k_cache, v_cache, layer, start, k, v)
    if _fused_write_applies(k_cache, v_cache, k, v, cos, sin):
        extension().kv_cache_write_rope(k_cache, v_cache, layer, start, k, v, cos, sin)
        return
    end = start + k.shape[1]
    k_cache[layer, :, start:end].copy_(apply_rotary(k, cos, sin))
    v_cache[layer, :, start:end].copy_(v)


# `write_kv` as an op with a declared mutation (what torch.compile traces; eager calls write_kv).
kv_cache_write = torch.library.custom_op(
    "sparse_llm::kv_cache_write", write_kv, mutates_args=("k_cache", "v_cache")
)


@kv_cache_write.register_fake
def _(k_cache, v_cache, layer, start, k, v, cos, sin) -> None:
    return None


# `write_kv_columns` as an op with a declared mutation (what torch.compile traces in a static step).
kv_cache_write_columns = torch.library.custom_op(
    "sparse_llm::kv_cache_write_columns", write_kv_columns, mutates_args=("k_cache", "v_cache")
)


@kv_cache_write_columns.register_fake
def _(k_cache, v_cache, layer, columns, k, v, cos, sin) -> None:
    return None
