"""The training FFN as torch.library custom ops: forward, backward, fakes and autograd.

`sparse_llm::ffn_train_fwd_ref` / `sparse_llm::ffn_train_bwd_ref` wrap the PyTorch reference
(sparse_llm.ops.train_reference). The forward's compact outputs have a data-dependent length
(the number of active entries), declared to the compiler as an unbacked size, so
torch.compile(fullgraph=True) traces the pair without a graph break. Autograd saves x, the
three weights and the compact record; never a dense M x H tensor.

The CUDA kernels will register their own pair (same outputs y, l1, nnz_per_token,
fire_counts; their own compact layout between forward and backward) next to this one.
"""

from __future__ import annotations

import torch

from sparse_llm.ops.train_reference import (
    acc_dtype,
    col_dtype,
    ffn_train_backward_reference,
    ffn_train_forward_reference,
)

# Outputs of the forward op: the first four are the public results, the last three the
# compact record for the backward.
N_PUBLIC = 4


@torch.library.custom_op("sparse_llm::ffn_train_fwd_ref", mutates_args=())
def ffn_train_fwd_ref(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [M, D]; wg, wu: [H, D]; wd: [D, H]. (y, l1, nnz_per_token, fire_counts, cols, a_vals, u_vals)."""
    return ffn_train_forward_reference(x, wg, wu, wd)


@ffn_train_fwd_ref.register_fake
def _(x, wg, wu, wd):
    m, hidden = x.shape[0], wg.shape[0]
    nnz = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(m, x.shape[1]),
        x.new_empty((), dtype=acc_dtype(x.dtype)),
        x.new_empty(m, dtype=torch.int64),
        x.new_empty(hidden, dtype=torch.int64),
        x.new_empty(nnz, dtype=col_dtype(hidden)),
        x.new_empty(nnz),
        x.new_empty(nnz),
    )


@torch.library.custom_op("sparse_llm::ffn_train_bwd_ref", mutates_args=())
def ffn_train_bwd_ref(
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
    """(dx, dWg, dWu, dWd) from grad_y [M, D] and grad_l1 [] in one pass (see the reference)."""
    return ffn_train_backward_reference(grad_y, grad_l1, x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals)


@ffn_train_bwd_ref.register_fake
def _(grad_y, grad_l1, x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals):
    return x.new_empty(x.shape), wg.new_empty(wg.shape), wu.new_empty(wu.shape), wd.new_empty(wd.shape)


def _setup_context(ctx, inputs, output):
    x, wg, wu, wd = inputs
    _, _, nnz_per_token, fire_counts, cols, a_vals, u_vals = output
    ctx.save_for_backward(x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals)
    ctx.mark_non_differentiable(nnz_per_token, fire_counts, cols, a_vals, u_vals)


def _backward(ctx, grad_y, grad_l1, *_unused):
    x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals = ctx.saved_tensors
    if grad_y is None:
        grad_y = x.new_zeros(x.shape)
    if grad_l1 is None:
        grad_l1 = x.new_zeros((), dtype=acc_dtype(x.dtype))
    return ffn_train_bwd_ref(grad_y.contiguous(), grad_l1, x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals)


ffn_train_fwd_ref.register_autograd(_backward, setup_context=_setup_context)
