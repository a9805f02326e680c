"""Attention of one token per row over its columns of a static KV cache (sparse_llm/ops/decode_attention.py)."""

from __future__ import annotations

import math

import pytest
import torch
from ffn_patterns import rel_err

from sparse_llm.ops import decode_attention as decode_attention_module
from sparse_llm.ops.decode_attention import (
    chunks_for,
    decode_attention,
    decode_attention_reference,
    kernel_applies,
    keys_per_step,
    reads_bounds,
)


def _operands(batch, heads, kv_heads, max_len, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """q [B, 1, heads, D]; k, v as a static step reads the cache: [B, kv_heads, max_len, D] views of
    a token-major [B, max_len, kv_heads, D] layer; each row's columns [first, last] drawn at random,
    with the edge cases in the first rows: one column, then the whole cache."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(batch, 1, heads, head_dim, generator=gen, device=device).to(dtype)
    layer_k, layer_v = (
        torch.randn(batch, max_len, kv_heads, head_dim, generator=gen, device=device).to(dtype) for _ in "kv"
    )
    first = torch.randint(0, max_len // 2, (batch,), generator=gen, device=device)
    last = torch.randint(max_len // 2, max_len, (batch,), generator=gen, device=device)
    first[0] = last[0]
    if batch > 1:
        first[1], last[1] = 0, max_len - 1
    return q, layer_k.transpose(1, 2), layer_v.transpose(1, 2), first, last


def _softmax_attention(q, k, v, first, last):
    """Written out in float64: each row's softmax over its columns."""
    batch, _, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(batch, 1, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        cols = slice(int(first[b]), int(last[b]) + 1)
        for h in range(heads):
            keys, values = k[b, h // group, cols].double(), v[b, h // group, cols].double()
            weights = torch.softmax(keys @ q[b, 0, h].double() / math.sqrt(head_dim), dim=0)
            out[b, 0, h] = weights @ values
    return out


@pytest.mark.parametrize(("batch", "heads", "kv_heads"), [(3, 4, 4), (2, 8, 2)])
def test_reference_is_the_softmax_over_each_rows_columns(batch, heads, kv_heads):
    q, k, v, first, last = _operands(batch, heads, kv_heads, 40, 16, torch.float64)
    got = decode_attention(q, k, v, first, last)
    assert got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, _softmax_attention(q, k, v, first, last))
    torch.testing.assert_close(
        got[0], v.transpose(1, 2)[0, int(first[0])].repeat_interleave(heads // kv_heads, 0)[None]
    )


def test_chunks_fill_the_gpu_and_never_outnumber_the_keys():
    # A 1b model's 32 heads on an H100's 132 multiprocessors.
    assert chunks_for(32, 1024, 132) == 32  # batch 1, context 1024: chunks of 32 columns
    assert keys_per_step(1024, 32) == 32 and keys_per_step(2048, 32) == 64
    assert chunks_for(8 * 32, 1024, 132) == 8
    assert chunks_for(64 * 32, 1024, 132) == 1
    assert chunks_for(32, 200, 132) == 4  # 200 columns: six chunks of 32 at most, a power of two is 4
    assert chunks_for(4, 10, 132) == 1


def test_a_step_reads_bounds_on_a_gpu_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # at any row count (its logits repeat, issue 51), where Triton is installed
    assert reads_bounds(torch.bfloat16, cuda, 64) == (decode_attention_module.triton is not None)
    assert not reads_bounds(torch.bfloat16, cpu, 64)
    assert not reads_bounds(torch.float32, cuda, 64)
    assert not reads_bounds(torch.bfloat16, cuda, 80)


def test_bad_operands_are_clear_errors():
    q, k, v, first, last = _operands(2, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="q must be"):
        decode_attention(q.expand(2, 3, 4, 8), k, v, first, last)
    with pytest.raises(ValueError, match="k and v must be"):
        decode_attention(q, k, v[:, :, :8], first, last)
    with pytest.raises(ValueError, match="must divide heads"):
        decode_attention(q[:, :, :3], k, v, first, last)
    with pytest.raises(ValueError, match="share a dtype"):
        decode_attention(q.double(), k, v, first, last)
    with pytest.raises(ValueError, match="columns must be an int64"):
        decode_attention(q, k, v, first, last.int())


# --- the Triton kernels on a GPU ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "max_len", "head_dim"),
    [
        (1, 32, 32, 1024, 64),
        (8, 32, 32, 1024, 64),
        (64, 32, 32, 1024, 64),
        (3, 8, 2, 300, 128),
        (2, 4, 4, 64, 32),
    ],
)
def test_kernel_within_twice_sdpas_error_against_float64(batch, heads, kv_heads, max_len, head_dim):
    q, k, v, first, last = _operands(
        batch, heads, kv_heads, max_len, head_dim, torch.bfloat16, "cuda", seed=batch
    )
    assert kernel_applies(q, k, v, first, last)
    assert not kernel_applies(q, k, v, torch.stack([first, first], 1)[:, 0], last)  # strided bounds
    got = decode_attention(q, k, v, first, last)
    want = decode_attention_reference(*(t.double() for t in (q, k, v)), first, last)
    sdpa = decode_attention_reference(q, k, v, first, last)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    assert rel_err(got, want) <= 2 * rel_err(sdpa, want) + 1e-4, (rel_err(got, want), rel_err(sdpa, want))
    # One column: the value itself, rounded once.
    assert torch.equal(
        got[0], v.transpose(1, 2)[0, int(first[0])].repeat_interleave(heads // kv_heads, 0)[None]
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_captured_call_replays_on_new_columns():
    """The bounds are read on the device: a CUDA graph replayed after they change gives the eager
    result of the new bounds."""
    q, k, v, first, last = _operands(2, 8, 8, 512, 64, torch.bfloat16, "cuda")
    decode_attention(q, k, v, first, last)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, first, last)
    for new_first, new_last in (([0, 5], [100, 6]), ([7, 0], [511, 300])):
        first.copy_(torch.tensor(new_first))
        last.copy_(torch.tensor(new_last))
        graph.replay()
        assert torch.equal(out, decode_attention(q, k, v, first, last))
