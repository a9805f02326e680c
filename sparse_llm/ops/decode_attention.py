"""Attention of one new token per row over a static KV cache: the attention of a decode step.

A static decode step (inference/decode.py) attends over every column of the cache, and which
columns are real is a mask; as SDPA that is three kernels a layer (the mask's expansion, cuDNN's
attention and its reduction), ~10.7 us a 1b layer at batch 1 and context 1024 on an H100, a sixth
of a captured step, for 8 MB of keys and values. But a row's real columns are one range,
[first_columns[b], columns[b]] (left padding before it, columns not written yet after it), so on a
GPU a Triton kernel reads only those: each (row, query head)'s range is cut into chunks, enough
programs to fill the GPU at batch 1 (flash decoding), each chunk an online softmax in fp32; a second
kernel merges the chunks of a row and head in a fixed order (deterministic). Elsewhere, SDPA under
the equivalent mask.

A static decode step uses the kernel at every row count on a GPU (`reads_bounds`). At one row it
is also the faster: 9.0 us a 1b layer against SDPA's 10.4 (H100, context 1024;
benchmarks/results/decode_attention_h100.md). From 8 rows cuDNN's attention reads the cache faster
(26.7 against 33.8 us at 8 rows, 180 against 197 at 64), but it does not repeat itself: two identical
seeded generate calls of 11 rows gave step logits that differed from the 7th step on (by up to 0.02),
captured or not, whatever the masked columns held, while with this kernel they were equal bit for
bit (issue 51; tests/inference/test_static_decode.py). A seed that does not give the same text
twice is a bug a user sees; a tenth of a step's attention time is not.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the PyTorch path only
    triton = None

MAX_CHUNKS = 32
PROGRAMS_PER_MULTIPROCESSOR = 8  # chunks enough for this many programs a multiprocessor, at most MAX_CHUNKS
LOG2_E = 1.4426950408889634


def column_range_mask(first_columns: torch.Tensor, columns: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool: True on each row's columns first_columns[b]..columns[b]."""
    cols = torch.arange(max_len, device=columns.device)
    return (cols >= first_columns[:, None]) & (cols <= columns[:, None])


def sdpa_one_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of one query a row, q: [B, 1, heads, head_dim] token-major, over k, v: [B, kv_heads,
    max_len, head_dim] under `mask` ([B, 1, 1, max_len], bool or additive); [B, 1, heads, head_dim]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[2]
    )
    return out.transpose(1, 2)


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_columns: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """SDPA of q over the columns first_columns[b]..columns[b] of k and v (see decode_attention)."""
    mask = column_range_mask(first_columns, columns, k.shape[2])[:, None, None, :]
    return sdpa_one_query(q, k, v, mask).contiguous()


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        q_ptr, k_ptr, v_ptr, first_ptr, last_ptr, m_ptr, total_ptr, acc_ptr,
        q_heads, group, sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, scale_log2,
        HEAD_DIM: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        chunk = tl.program_id(1)
        b = row_head // q_heads
        kv_head = (row_head % q_heads) // group
        first = tl.load(first_ptr + b)
        end = tl.load(last_ptr + b) + 1
        per_chunk = tl.cdiv(tl.maximum(end - first, 0), CHUNKS)
        lo = first + chunk * per_chunk
        hi = tl.minimum(lo + per_chunk, end)
        d = tl.arange(0, HEAD_DIM)
        # log2-domain scores: exp2 is the hardware's instruction.
        q = tl.load(q_ptr + b * sq_b + (row_head % q_heads) * sq_h + d).to(tl.float32) * scale_log2
        k_row = k_ptr + b.to(tl.int64) * sk_b + kv_head * sk_h
        v_row = v_ptr + b.to(tl.int64) * sv_b + kv_head * sv_h
        m = tl.full([], float("-inf"), tl.float32)
        total = tl.zeros([], tl.float32)  # the softmax's denominator
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            ok = n < hi
            keys = tl.load(k_row + n[:, None].to(tl.int64) * sk_s + d[None, :], mask=ok[:, None], other=0.0)
            s = tl.where(ok, tl.sum(keys.to(tl.float32) * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=0))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new)
            values = tl.load(v_row + n[:, None].to(tl.int64) * sv_s + d[None, :], mask=ok[:, None], other=0.0)
            acc = acc * alpha + tl.sum(p[:, None] * values.to(tl.float32), axis=0)
            total = total * alpha + tl.sum(p, axis=0)
            m = m_new
        part = row_head * CHUNKS + chunk
        tl.store(m_ptr + part, m)
        tl.store(total_ptr + part, total)
        tl.store(acc_ptr + part * HEAD_DIM + d, acc)

    @triton.jit
    def _merge_kernel(
        m_ptr, total_ptr, acc_ptr, out_ptr, HEAD_DIM: tl.constexpr, CHUNKS: tl.constexpr,
    ):  # fmt: skip
        row_head = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        d = tl.arange(0, HEAD_DIM)
        m = tl.load(m_ptr + row_head * CHUNKS + c)
        top = tl.max(m, axis=0)
        weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))  # an empty chunk adds nothing
        total = tl.sum(tl.load(total_ptr + row_head * CHUNKS + c) * weight, axis=0)
        acc = tl.load(acc_ptr + (row_head * CHUNKS + c)[:, None] * HEAD_DIM + d[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / total
        tl.store(out_ptr + row_head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def chunks_for(programs: int, columns: int, multiprocessors: int) -> int:
    """Chunks a (row, head)'s range is cut into: a power of two, enough for
    PROGRAMS_PER_MULTIPROCESSOR programs a multiprocessor, at most MAX_CHUNKS, and no more than
    columns / 32 (a chunk takes 32 columns or more). Measured best at one row, with keys_per_step."""
    wanted = max(1, math.ceil(PROGRAMS_PER_MULTIPROCESSOR * multiprocessors / programs))
    most = max(1, min(MAX_CHUNKS, columns // 32))
    return min(1 << (wanted - 1).bit_length(), 1 << (most.bit_length() - 1))


def keys_per_step(columns: int, chunks: int) -> int:
    """Keys a program loads at once: 32 for chunks of 32 columns or fewer, else 64."""
    return 32 if columns <= 32 * chunks else 64


def _kernel_takes(dtype: torch.dtype, head_dim: int) -> bool:
    return (
        triton is not None and dtype in (torch.bfloat16, torch.float16) and head_dim in (16, 32, 64, 128, 256)
    )


def reads_bounds(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a static decode step attends by its rows' column bounds (the Triton kernel: the same
    logits every call, module docstring) rather than SDPA over the whole cache under a key mask:
    on a GPU, wherever the kernel takes the operands."""
    return device.type == "cuda" and _kernel_takes(dtype, head_dim)


def kernel_applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_columns: torch.Tensor, columns: torch.Tensor
) -> bool:
    """Whether the Triton kernels take these (checked) operands: on a CUDA device, bf16 or fp16, a
    power-of-two head dimension, the head dimension and the bounds contiguous, at least one row;
    any number of rows (the op runs them; where a step uses it is `reads_bounds`' choice)."""
    return (
        q.is_cuda
        and q.shape[0] > 0
        and _kernel_takes(q.dtype, q.shape[-1])
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and first_columns.stride(0) == columns.stride(0) == 1
    )


def decode_attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_columns: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """The Triton kernels (any device Triton runs on, e.g. its CPU interpreter in a test)."""
    batch, _, q_heads, head_dim = q.shape
    kv_heads, max_len = k.shape[1], k.shape[2]
    programs = batch * q_heads
    sms = _multiprocessors(q.device.index or 0) if q.is_cuda else 1
    chunks = chunks_for(programs, max_len, sms)
    m = torch.empty(programs * chunks, device=q.device, dtype=torch.float32)
    totals = torch.empty_like(m)
    acc = torch.empty(programs * chunks * head_dim, device=q.device, dtype=torch.float32)
    out = torch.empty((batch, 1, q_heads, head_dim), device=q.device, dtype=q.dtype)
    scale_log2 = LOG2_E / math.sqrt(head_dim)
    # Triton launches on the current device: make it the tensors' (a model on a second GPU).
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _chunk_kernel[(programs, chunks)](
            q, k, v, first_columns, columns, m, totals, acc,
            q_heads, q_heads // kv_heads, q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), scale_log2,
            HEAD_DIM=head_dim, CHUNKS=chunks, BLOCK_N=keys_per_step(max_len, chunks), num_warps=2, num_stages=3,
        )  # fmt: skip
        _merge_kernel[(programs,)](m, totals, acc, out, HEAD_DIM=head_dim, CHUNKS=chunks, num_warps=4)
    return out


def _check_operands(q, k, v, first_columns, columns) -> None:
    batch = q.shape[0]
    problems = []
    if q.dim() != 4 or q.shape[1] != 1:
        problems.append(f"q must be [B, 1, heads, head_dim], got {tuple(q.shape)}")
    elif k.dim() != 4 or k.shape != v.shape or k.shape[0] != batch or k.shape[3] != q.shape[3]:
        problems.append(
            f"k and v must be [B, kv_heads, max_len, head_dim] like q's, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    elif q.shape[2] % k.shape[1]:
        problems.append(f"kv_heads {k.shape[1]} must divide heads {q.shape[2]}")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        problems.append("q, k and v must share a dtype and a device")
    for name, t in (("first_columns", first_columns), ("columns", columns)):
        if t.shape != (batch,) or t.dtype != torch.int64 or t.device != q.device:
            problems.append(f"{name} must be an int64 [B] tensor on q's device")
    if problems:
        raise ValueError("decode_attention: " + "; ".join(problems))


@torch.library.custom_op("sparse_llm::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_columns: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """Softmax attention (scale 1/sqrt(head_dim)) of one query per row, q: [B, 1, heads, head_dim],
    over the columns first_columns[b]..columns[b] (inclusive; int64 [B] on the device, not read on
    the host) of k and v: [B, kv_heads, max_len, head_dim] (kv_heads dividing heads); returns
    [B, 1, heads, head_dim], contiguous. Every row must have a column (first <= columns)."""
    _check_operands(q, k, v, first_columns, columns)
    if kernel_applies(q, k, v, first_columns, columns):
        return decode_attention_kernel(q, k, v, first_columns, columns)
    return decode_attention_reference(q, k, v, first_columns, columns)


@decode_attention.register_fake
def _(q, k, v, first_columns, columns):
    _check_operands(q, k, v, first_columns, columns)
    return torch.empty_like(q, memory_format=torch.contiguous_format)
