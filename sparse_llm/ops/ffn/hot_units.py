"""The hot units of the sparse training FFN: the units that fire on many of a step's tokens, computed
as a dense FFN over their columns (tensor-core GEMMs over every token) while the other units' entries
go through the sparse op. docs/kernels.md, design review part 5, has the measurements behind it.

Why: the sparse op's per-entry kernels read a weight row (or an x and a grad_y row) per active entry
and do a few TFLOP/s of useful work, where a dense GEMM column over all M tokens runs at cuBLAS's rate;
so a unit firing on more than ~1% of the tokens costs less computed densely. A trained layer puts
most of its entries on few units (at L0 6, 320 of 5632 units hold 95% of them).

Exact for any choice of hot units S: with a = relu(x Wg^T), y = sum over units j of a_j u_j Wd[:, j]
and the L1 term sum |a_j u_j| split over units, so y = FFN(units outside S) + FFN(S), and so do
their gradients. The block op (ops/ffn/block.py) runs the sparse op on Wg with S's rows zeroed (those
units never fire there: g = 0 is not active) and the functions below on S's panels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_llm.ops.ffn.relu_gate import relu_gate_stats
from sparse_llm.ops.matmul_accumulate import matmul_accumulate_

# |S| is rounded up to this: a bf16 GEMM with a size off a multiple of 8 falls off cuBLAS's fast
# kernels (2-5x slower at |S| = 2678 than at 2144 on an H200, benchmarks/column_hybrid.py); 64
# fills whole GEMM tiles.
HOT_UNITS_MULTIPLE = 64


def choose_hot_units(
    fire_counts: torch.Tensor,
    tokens: int,
    share: float,
    multiple: int = HOT_UNITS_MULTIPLE,
    max_units: int | None = None,
) -> torch.Tensor:
    """S for a layer: the units whose `fire_counts` ([H], on how many of `tokens` tokens each unit
    fired) reach share x tokens, then the next most firing ones up to a multiple of `multiple` (or
    all H), and at most the `max_units` most firing (rounded down to the multiple); ascending int64
    indices, on fire_counts' device. Empty where no unit reaches the share."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"the hot-unit share is a fraction of the step's tokens in (0, 1]; got {share}")
    wanted = int((fire_counts >= share * tokens).sum())
    count = min(fire_counts.shape[0], -(-wanted // multiple) * multiple)
    if max_units is not None:
        count = min(count, max_units // multiple * multiple)
    # Ties at the boundary: topk's order, fixed for given counts on a device.
    return torch.topk(fire_counts, count, sorted=False).indices.sort().values


def check_hot_units(hot: torch.Tensor, hidden: int, device: torch.device) -> None:
    """What can be checked without reading the indices back: a 1-D int64 tensor on the FFN's device,
    no longer than H. (Values must be unique units in [0, H), as `choose_hot_units` makes them.)"""
    if hot.dtype != torch.int64 or hot.dim() != 1:
        raise ValueError(
            f"hot units must be a 1-D int64 tensor of unit indices; got {hot.dtype} {tuple(hot.shape)}"
        )
    if hot.device != device:
        raise ValueError(f"hot units must be on the FFN's device {device}; got {hot.device}")
    if hot.shape[0] > hidden:
        raise ValueError(f"{hot.shape[0]} hot units for an FFN of {hidden} units")


class HotPanels(NamedTuple):
    """S's rows of Wg and Wu ([|S|, D]) and columns of Wd ([D, |S|]), in the compute dtype."""

    wg: torch.Tensor
    wu: torch.Tensor
    wd: torch.Tensor


def hot_panels(
    wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, hot: torch.Tensor, dtype: torch.dtype
) -> HotPanels:
    return HotPanels(
        wg.index_select(0, hot).to(dtype),
        wu.index_select(0, hot).to(dtype),
        wd.index_select(1, hot).to(dtype),
    )


class HotForward(NamedTuple):
    y: torch.Tensor  # [M, D]: the sparse part's y plus S's share
    l1: torch.Tensor  # []: S's share of the L1 term (mean over rows of sum over S of |h|)
    nnz_per_token: torch.Tensor  # [M] int64: units of S active on each row
    fire_counts: torch.Tensor  # [|S|] int64: rows on which each unit of S fired
    g: torch.Tensor  # [M, |S|]: x Wg[S]^T, kept for the backward
    u: torch.Tensor  # [M, |S|]: x Wu[S]^T, kept for the backward


def hot_forward(y_sparse: torch.Tensor, x: torch.Tensor, panels: HotPanels) -> HotForward:
    """S's dense FFN on x [M, D] (the compute dtype), its output added to the sparse part's y (in
    place: the caller's y_sparse is the returned y) by the down GEMM."""
    g = x @ panels.wg.T
    u = x @ panels.wu.T
    # h, the L1 rows and the counts in one pass over g and u (one Triton kernel on a GPU: as torch
    # ops Inductor made the counts' column sum ~0.3 ms a layer at |S| = 1408 and the L1 sum ~0.1 ms,
    # ~6 ms of a 1b step). The L1 of h as rounded, as the sparse kernels sum theirs.
    h, l1_rows, nnz_per_token, fire_counts = relu_gate_stats(g, u)
    l1 = l1_rows.sum() / x.shape[0]
    # In place (y_sparse is the sparse op's fresh output): compiled, torch.addmm copied y first,
    # an [M, D] device copy a layer.
    matmul_accumulate_(y_sparse, h, panels.wd.T)
    return HotForward(y_sparse, l1, nnz_per_token, fire_counts, g, u)


def hot_backward(
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    grad_x: torch.Tensor,
    x: torch.Tensor,
    panels: HotPanels,
    g: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """S's share of the backward of <grad_y, y> + grad_l1 * l1: (grad_x plus S's share, dWg[S],
    dWu[S], dWd[:, S]), in the compute dtype (the dense FFN's roundings: dh, dg and du rounded to it
    before their GEMMs). grad_x: the sparse part's gradient of x, added to in place by the GEMMs (the
    returned grad_x is it); g and u: the forward's (`HotForward`)."""
    a = torch.relu(g)
    h = a * u
    # d(l1)/dh = sign(h) / M; dg = dh * u where a > 0, du = dh * a (zero where a = 0).
    dh = (grad_y @ panels.wd).float() + grad_l1.float() * torch.sign(h).float() / x.shape[0]
    dg = torch.where(a > 0, dh * u.float(), 0.0).to(x.dtype)
    du = (dh * a.float()).to(x.dtype)
    matmul_accumulate_(grad_x, dg, panels.wg)
    matmul_accumulate_(grad_x, du, panels.wu)
    return grad_x, dg.T @ x, du.T @ x, grad_y.T @ h
