"""The FFN half of a decoder layer on the sparse training path, as one differentiable op:

    out = ffn_block_train(x, norm_weight, eps, Wg, Wu, Wd, impl="auto")
    out.y              x + FFN(rms_norm(x)), like x
    out.l1, out.nnz_per_token, out.fire_counts   as ffn_forward_train gives them

Why one op: written as three (norm, ffn_forward_train, residual add), autograd keeps the norm's
input (the residual stream, float32 under autocast) and the FFN's input (the norm's output) for
every token. At >= 99% activation sparsity most tokens have no active unit: there the FFN adds
exactly zero and the norm's gradient is zero. So this op keeps the residual stream only on the
rows with an active unit and recomputes the norm there in the backward: a token with no active
unit costs nothing to save. The gradients are the unfused ones up to float32 rounding; the norm
is transformers' LlamaRMSNorm (sparse_llm.ops.rms_norm). Under autocast the op casts the FFN weights
itself and keeps the fp32 parameters for the backward, whose op casts them again: autograd (and
torch.compile) would otherwise keep the bf16 casts from the forward to the backward.

Under torch.compile the partitioner chooses from the whole graph what to keep; the active rows
come out of the FFN's custom op (its `keep` input), which it cannot move into the backward, so it
keeps them and the layer's output (the next layer's input) rather than the block's whole input
and the FFN's output (checked on the AOT graph of a CPU model; docs/notes/kernels_log.md).
"""

from __future__ import annotations

import torch

from sparse_llm.ops import train_ops
from sparse_llm.ops.checks import DEFAULT_HEAVY_THRESHOLD
from sparse_llm.ops.precision import autocast_dtype
from sparse_llm.ops.rms_norm import rms_norm, rms_norm_backward
from sparse_llm.ops.train import FFNTrainOutput, TrainImpl, check_train_weights
from sparse_llm.ops.train_reference import acc_dtype


class _FFNBlock(torch.autograd.Function):
    """x + FFN(rms_norm(x)) for x: [M, D]; saves x on the active rows only (see the module doc).
    Takes the FFN weights as the caller holds them (the parameters, fp32 under autocast) and casts
    them to the compute dtype for the forward; it saves the parameters, not the casts."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        norm_weight: torch.Tensor,
        wg: torch.Tensor,
        wu: torch.Tensor,
        wd: torch.Tensor,
        compute_dtype: torch.dtype,
        eps: float,
        impl: str,
        heavy_threshold: int,
    ) -> tuple[torch.Tensor, ...]:
        normed = rms_norm(x, norm_weight, eps, compute_dtype)
        # The op returns x's active rows (`keep`): as an output of a custom op they are what
        # torch.compile saves, where an index_select here would be moved into the backward and
        # the whole x kept for it.
        y, l1, nnz_per_token, fire_counts, active_rows, x_active, *record = train_ops.train_forward(
            impl, normed, *(w.to(compute_dtype) for w in (wg, wu, wd)), heavy_threshold, keep=x
        )
        # The parameters, not their casts: a parameter costs nothing to keep, the bf16 casts of
        # the three FFN weights 66 MiB a layer on the 1b preset. The backward op casts again,
        # inside the op, where torch.compile cannot merge that cast with this one.
        ctx.save_for_backward(x_active, active_rows, norm_weight, wg, wu, wd, nnz_per_token, *record)
        ctx.eps, ctx.impl, ctx.rows, ctx.compute_dtype = eps, impl, x.shape[0], compute_dtype
        # The saved tensors of data-dependent length are returned too (and dropped by the caller):
        # torch.compile traces this function only if every such length reaches an output.
        ctx.mark_non_differentiable(nnz_per_token, fire_counts, x_active, active_rows, *record)
        return x + y, l1, nnz_per_token, fire_counts, x_active, active_rows, *record

    @staticmethod
    def backward(ctx, grad_out, grad_l1, *_unused):
        x_active, active_rows, norm_weight, *saved = ctx.saved_tensors
        dtype = ctx.compute_dtype
        if grad_out is None:
            grad_out = x_active.new_zeros((ctx.rows, x_active.shape[1]))
        if grad_l1 is None:
            grad_l1 = x_active.new_zeros((), dtype=acc_dtype(dtype))
        # The norm's output where the FFN reads it (rows with an active unit). The CUDA kernels
        # never read the other rows, so they are left unwritten there (a [M, D] fill a layer less);
        # the reference's dense matmuls read them, so they are zero there.
        shape = (ctx.rows, x_active.shape[1])
        make = x_active.new_empty if ctx.impl == "cuda" else x_active.new_zeros
        normed = make(shape, dtype=dtype)
        normed.index_copy_(0, active_rows, rms_norm(x_active, norm_weight, ctx.eps, dtype))
        # The residual add casts y's gradient to y's dtype, as autograd would.
        grad_y = grad_out.to(dtype).contiguous()
        grad_normed, grad_wg, grad_wu, grad_wd = train_ops.train_backward(
            ctx.impl, grad_y, grad_l1, normed, *saved
        )
        # Rows without an active unit get no gradient through the FFN: grad_normed is zero there.
        grad_x_active, grad_norm_weight = rms_norm_backward(
            grad_normed.index_select(0, active_rows), x_active, norm_weight, ctx.eps
        )
        grad_x = grad_out.index_add(0, active_rows, grad_x_active.to(grad_out.dtype))
        return grad_x, grad_norm_weight, grad_wg, grad_wu, grad_wd, None, None, None, None


def ffn_block_train(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: TrainImpl = "auto",
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
) -> FFNTrainOutput:
    """x + FFN(rms_norm(x)) with the FFN's statistics, differentiable in x, the norm weight and
    the three FFN weights; `out.y` is that sum.

    x: [..., D] (the residual stream); norm_weight: [D]; Wg, Wu: [H, D]; Wd: [D, H]. The FFN
    runs in the autocast dtype (weights cast as autocast casts a matmul's), or in the weights'
    dtype without autocast; impl and heavy_threshold as for `ffn_forward_train`.
    """
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm_weight must be [D] = [{x.shape[-1]}], got {tuple(norm_weight.shape)}")
    compute_dtype = autocast_dtype(x) or wg.dtype
    # The FFN's input is the norm's output: x's shape in the compute dtype. An empty stand-in
    # carries what the checks read (D, dtype, device) without computing it twice.
    ffn_input = x.new_empty((0, x.shape[-1]), dtype=compute_dtype)
    wg, wu, wd = wg.contiguous(), wu.contiguous(), wd.contiguous()
    impl = check_train_weights(ffn_input, wg, wu, wd, impl, heavy_threshold)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    with torch.autocast(x.device.type, enabled=False):
        out, l1, nnz_per_token, fire_counts, *_saved = _FFNBlock.apply(
            x2, norm_weight, wg, wu, wd, compute_dtype, eps, impl, heavy_threshold
        )
    l0 = nnz_per_token.to(acc_dtype(compute_dtype)).mean()
    return FFNTrainOutput(out.view(x.shape), l0, l1, nnz_per_token, fire_counts)
