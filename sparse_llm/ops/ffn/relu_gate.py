"""h = relu(g) * u with the sparsity statistics of the same pass: the dense FFN's gate product.

The dense training step needs, per layer, h, the L1 term (per token: the sum of |h|), the active
units per token and each unit's fire count. As PyTorch ops the last is a column reduction that
Inductor once miscompiled (ops/activation_counts.py), so it ran as its own kernel: a second read
of the [tokens, H] activation, ~1.7 ms of a 1b step on an H100, most of the gap to a lean Llama
(benchmarks/results/lean_llama_1b_h100.md). On a GPU one Triton kernel here reads g and u once,
writes h and sums every statistic: rows in registers (a fixed order: deterministic), columns by
integer atomics (exact in any order). Elsewhere the same computation in PyTorch.

h is rounded as PyTorch's bf16 product (fp32, one rounding); the backward recomputes it from the
saved g and u rather than keeping it. The L1 rows sum |h| as rounded, as the dense FFN's bf16 h is
and as the sparse op's kernels sum theirs (the hot units' share of the sparse op's L1 comes from
here, ops/ffn/hot_units.py): in float32, or float64 for float64 operands.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the PyTorch path only
    triton = None

ROWS_PER_PROGRAM = 32
COLUMNS_PER_STEP = 256


def relu_gate_stats_reference(
    g: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, l1 per row (`l1_dtype`), active units per row (int64), fire count per unit (int64))."""
    h = torch.relu(g) * u
    active = g > 0
    return h, h.abs().sum(-1, dtype=l1_dtype(g.dtype)), active.sum(-1), active.sum(0)


def l1_dtype(dtype: torch.dtype) -> torch.dtype:
    """The L1 rows' dtype: float32, or float64 for float64 operands (the sparse op sums its L1 in
    its operands' precision there)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


if triton is not None:

    @triton.jit
    def _relu_gate_stats_kernel(
        g_ptr,
        u_ptr,
        h_ptr,
        l1_ptr,
        nnz_ptr,
        fire_ptr,
        rows,
        hidden,
        BLOCK_M: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):  # hidden at run time: the hot units' width changes at each refresh and differs by layer (as a
        # constant it compiled the kernel again each time: ~1 s a refresh in a 1b run)
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = row < rows
        l1 = tl.zeros([BLOCK_M], dtype=tl.float32)
        nnz = tl.zeros([BLOCK_M], dtype=tl.int32)
        for start in range(0, hidden, BLOCK_H):
            col = start + tl.arange(0, BLOCK_H)
            col_ok = col < hidden
            ok = row_ok[:, None] & col_ok[None, :]
            offset = row[:, None].to(tl.int64) * hidden + col[None, :]
            g = tl.load(g_ptr + offset, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + offset, mask=ok, other=0.0).to(tl.float32)
            # relu keeps a NaN gate's NaN, as torch.relu does: a diverging run shows in h.
            product = tl.maximum(g, 0.0, propagate_nan=tl.PropagateNan.ALL) * u
            h = product.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + offset, h, mask=ok)
            active = (g > 0.0).to(tl.int32)
            l1 += tl.sum(tl.abs(h.to(tl.float32)), axis=1)
            nnz += tl.sum(active, axis=1)
            tl.atomic_add(fire_ptr + col, tl.sum(active, axis=0), mask=col_ok)
        tl.store(l1_ptr + row, l1, mask=row_ok)
        tl.store(nnz_ptr + row, nnz.to(tl.int64), mask=row_ok)


def kernel_applies(g: torch.Tensor, u: torch.Tensor) -> bool:
    """Whether the Triton kernel takes (g, u) (checked operands: one [M, H] shape and dtype): on a
    CUDA device, both contiguous, narrower than float64 (whose sums it would round to float32)."""
    return (
        triton is not None
        and g.is_cuda
        and g.dtype != torch.float64
        and g.is_contiguous()
        and u.is_contiguous()
    )


def relu_gate_stats_kernel(
    g: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel (any device Triton runs on, e.g. its CPU interpreter in a test)."""
    rows, hidden = g.shape
    h = torch.empty_like(g)
    l1 = torch.empty(rows, device=g.device, dtype=torch.float32)
    nnz = torch.empty(rows, device=g.device, dtype=torch.int64)
    fire = torch.zeros(hidden, device=g.device, dtype=torch.int32)
    grid = (triton.cdiv(rows, ROWS_PER_PROGRAM),)
    _relu_gate_stats_kernel[grid](
        g,
        u,
        h,
        l1,
        nnz,
        fire,
        rows,
        hidden,
        BLOCK_M=ROWS_PER_PROGRAM,
        BLOCK_H=COLUMNS_PER_STEP,
    )
    return h, l1, nnz, fire.to(torch.int64)


def _check_operands(g: torch.Tensor, u: torch.Tensor) -> None:
    if g.dim() != 2 or g.shape != u.shape or g.dtype != u.dtype or g.device != u.device:
        raise ValueError(
            "relu_gate_stats takes g and u of one [M, H] shape, dtype and device; got "
            f"{g.dtype} {tuple(g.shape)} on {g.device} and {u.dtype} {tuple(u.shape)} on {u.device}"
        )


@torch.library.custom_op("sparse_llm::relu_gate_stats", mutates_args=())
def relu_gate_stats(
    g: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For the gate's pre-activation g and the up projection u ([M, H], one dtype):
    (h = relu(g) * u, l1 per row = sum |h| (`l1_dtype`), active units per row, fire count per
    unit); differentiable in g and u through h and l1."""
    _check_operands(g, u)
    if kernel_applies(g, u):
        return relu_gate_stats_kernel(g, u)
    return relu_gate_stats_reference(g, u)


@relu_gate_stats.register_fake
def _(g, u):
    _check_operands(g, u)
    rows, hidden = g.shape
    return (
        torch.empty_like(g),
        g.new_empty(rows, dtype=l1_dtype(g.dtype)),
        g.new_empty(rows, dtype=torch.int64),
        g.new_empty(hidden, dtype=torch.int64),
    )


def _setup_context(ctx, inputs, output) -> None:
    g, u = inputs
    ctx.save_for_backward(g, u)
    ctx.mark_non_differentiable(output[2], output[3])


def _backward(ctx, grad_h, grad_l1, _grad_nnz, _grad_fire):
    g, u = ctx.saved_tensors
    a = torch.relu(g)
    grad = torch.zeros_like(g) if grad_h is None else grad_h
    if grad_l1 is not None:  # d sum|h| / dh = sign(h), h recomputed as the forward rounded it
        grad = grad + (grad_l1[:, None] * torch.sign(a * u)).to(grad.dtype)
    return torch.where(g > 0, grad * u, 0), grad * a


relu_gate_stats.register_autograd(_backward, setup_context=_setup_context)
