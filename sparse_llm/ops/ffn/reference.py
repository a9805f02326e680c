"""Pure-PyTorch reference of the sparse FFN op: the CPU path, the fallback and the test oracle.

Inference: `ffn_forward_reference`, the dense formula (transformers' LlamaMLP with a ReLU gate).

Training: a forward with L1/L0 and counts, and an exact backward, both plain functions on 2-D
tensors; `sparse_llm.ops.ffn.training` registers them as custom ops and ties them together with
autograd. What the forward hands to the backward is x (kept by the caller) plus a compact record of
the active entries of a = relu(x Wg^T), in CSR order (row-major, columns ascending within a row):

    nnz_per_token [M] int64       how many units are active in each row (the row lengths)
    cols          [nnz] int16     column of each active entry (int32 when H > 32767)
    a_vals        [nnz] x.dtype   a = relu(g) > 0 at that entry
    u_vals        [nnz] x.dtype   u = (x Wu^T) at that entry

nnz is whatever the input gives (0 ... M * H): no capacity, nothing dropped, fully dense rows
included. At bf16 this is 6 bytes per non-zero plus 8 per token, against 3 * M * H * 2 bytes
(gate, up and hidden) that dense autograd keeps. The forward and backward may use dense M x H
temporaries; none of them outlives its call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT16_MAX_UNITS = 32767  # column indices fit int16 below this many units


def ffn_forward_reference(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> torch.Tensor:
    """y = (relu(x Wg^T) * (x Wu^T)) Wd^T, as transformers' LlamaMLP with hidden_act="relu"."""
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of L1 (and of the L1-gradient arithmetic): float32 for half types, else the input's."""
    return torch.promote_types(dtype, torch.float32)


def col_dtype(hidden: int) -> torch.dtype:
    return torch.int16 if hidden <= INT16_MAX_UNITS else torch.int32


def ffn_train_forward_reference(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """x: [M, D]; wg, wu: [H, D]; wd: [D, H]. Returns
    (y [M, D], l1 [] acc dtype, nnz_per_token [M] int64, fire_counts [H] int64, cols, a_vals, u_vals).

    l1 = mean over rows of sum over units of |h|, h = relu(g) * u; y = h Wd^T as the dense
    formula computes it (same matmuls, so the same rounding)."""
    g = x @ wg.T
    active = g > 0
    nnz_per_token = active.sum(-1)
    fire_counts = active.sum(0)
    a = torch.relu(g)
    u = x @ wu.T
    h = a * u
    y = h @ wd.T
    # Row-major nonzero: CSR order, columns ascending within a row.
    rows, cols = active.nonzero(as_tuple=True)
    a_vals, u_vals = a[rows, cols], u[rows, cols]
    h_vals = a_vals * u_vals
    l1 = h_vals.to(acc_dtype(x.dtype)).abs().sum() / x.shape[0]
    return y, l1, nnz_per_token, fire_counts, cols.to(col_dtype(wg.shape[0])), a_vals, u_vals


def ffn_train_backward_reference(
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    nnz_per_token: torch.Tensor,
    cols: torch.Tensor,
    a_vals: torch.Tensor,
    u_vals: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dWg, dWu, dWd) of <grad_y, y> + grad_l1 * l1, with the L1 term folded into dh:

    dh = grad_y Wd + grad_l1 * sign(h) / M        (needed at the active entries only)
    dg = dh * u,  du = dh * a                       (zero where a = 0: relu'(g) = [g > 0])
    dx = dg Wg + du Wu,  dWg = dg^T x,  dWu = du^T x,  dWd = grad_y^T h
    """
    m, hidden = x.shape[0], wg.shape[0]
    rows = torch.repeat_interleave(torch.arange(m, device=x.device), nnz_per_token)
    cols = cols.long()
    h_vals = a_vals * u_vals
    dh = (grad_y @ wd)[rows, cols]
    acc = acc_dtype(x.dtype)
    dh = (dh.to(acc) + grad_l1.to(acc) * torch.sign(h_vals).to(acc) / max(m, 1)).to(x.dtype)

    def scatter(vals: torch.Tensor) -> torch.Tensor:
        dense = x.new_zeros(m, hidden)
        dense[rows, cols] = vals
        return dense

    dg, du = scatter(dh * u_vals), scatter(dh * a_vals)
    dx = dg @ wg + du @ wu
    return dx, dg.T @ x, du.T @ x, grad_y.T @ scatter(h_vals)
