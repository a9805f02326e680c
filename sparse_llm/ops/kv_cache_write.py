"""The KV-cache write of incremental decoding as an op: RoPE applied to k on the way in, k and v
written into the cache in place (the cache itself is sparse_llm.model.kv_cache's).

On a Hopper GPU with the extension, one kernel applies RoPE to k and writes k and v
(kernels/kv_cache.cu): the generic copies of a rotated k and of v were 8% of a compiled 1B
prefill. Elsewhere the same write in PyTorch, RoPE(k) rounded the same way. `write_kv` writes T
tokens of every row at one start column; `write_kv_columns` one token of each row at that row's
own device-side column (a static-shape decode step, which a CUDA graph can capture). Both are also
custom ops (`sparse_llm::kv_cache_write`, `sparse_llm::kv_cache_write_columns`) for traced callers.
"""

from __future__ import annotations

import torch

from sparse_llm.ops._extension import extension, kernels_unavailable
from sparse_llm.ops.rotary import apply_rotary


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
    """k_cache[layer, :, start:start + T] = RoPE(k) and v_cache[...] = v, in place (k, v:
    [B, T, kv_heads, head_dim] before RoPE; cos, sin as the model's rotary embedding gives them)."""
    _check_write(k_cache, v_cache, layer, start, k, v)
    if _fused_write_applies(k_cache, v_cache, k, v, cos, sin):
        extension().kv_cache_write_rope(k_cache, v_cache, layer, start, k, v, cos, sin)
        return
    end = start + k.shape[1]
    k_cache[layer, :, start:end].copy_(apply_rotary(k, cos, sin))
    v_cache[layer, :, start:end].copy_(v)


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


# The writes as ops with a declared mutation: what a traced caller calls (torch.compile would
# functionalize a write into a graph input into a copy of the whole cache; Inductor keeps a declared
# mutation in place). Eager callers call the functions, without the op's dispatch.
kv_cache_write = torch.library.custom_op(
    "sparse_llm::kv_cache_write", write_kv, mutates_args=("k_cache", "v_cache")
)


@kv_cache_write.register_fake
def _(k_cache, v_cache, layer, start, k, v, cos, sin) -> None:
    return None


kv_cache_write_columns = torch.library.custom_op(
    "sparse_llm::kv_cache_write_columns", write_kv_columns, mutates_args=("k_cache", "v_cache")
)


@kv_cache_write_columns.register_fake
def _(k_cache, v_cache, layer, columns, k, v, cos, sin) -> None:
    return None
