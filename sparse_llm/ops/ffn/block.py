"""The FFN half of a decoder layer on the sparse training path, as one differentiable op:

    out = ffn_block_train(x, norm_weight, eps, Wg, Wu, Wd, impl)  # "reference" or "cuda", as decided
    out.y              x + FFN(rms_norm(x)), like x
    out.l1, out.nnz_per_token, out.fire_counts   as ffn_forward_train gives them

Why one op: written as three (norm, ffn_forward_train, residual add), autograd keeps the norm's
input (the residual stream, float32 under autocast) and the FFN's input (the norm's output) for
every token. A token with no active unit gets exactly zero from the FFN and no gradient through
its norm, so this op keeps, on the rows with an active unit only, the norm's normalised rows
(before its scale) and 1 / rms per row, and rebuilds the norm's output there in the backward. Under
autocast the normalised rows are kept in the compute dtype (bf16: half the fp32 residual's bytes;
at L0 ~30 about 95% of tokens have an active unit, so this is most of what the op keeps). The
gradients are the unfused ones up to that rounding: within the exactness contract (twice the dense
bf16 path's error against float64; tests/ops/ffn/test_block.py), float32-exact without
autocast. The norm is transformers' LlamaRMSNorm (sparse_llm.ops.rms_norm). Under autocast the op casts the FFN weights
itself and keeps the fp32 parameters for the backward, whose op casts them again: autograd (and
torch.compile) would otherwise keep the bf16 casts from the forward to the backward.

Under torch.compile the partitioner chooses from the whole graph what to keep; the active rows
come out of the FFN's custom op (its `keep` input), which it cannot move into the backward, so it
keeps them and the layer's output (the next layer's input) rather than the block's whole input
and the FFN's output (checked on the AOT graph of a CPU model with TORCH_LOGS=aot_graphs; kept by
tests/model/test_model.py::test_compiled_sparse_training_step_keeps_one_token_sized_residual_per_layer).
"""

from __future__ import annotations

import torch

from sparse_llm.ops.ffn.checks import DEFAULT_HEAVY_THRESHOLD
from sparse_llm.ops.ffn.hot_units import check_hot_units, hot_backward, hot_forward, hot_panels
from sparse_llm.ops.ffn.reference import acc_dtype
from sparse_llm.ops.ffn.training import (
    FFNTrainOutput,
    TrainRecord,
    check_train_weights,
    train_backward,
    train_forward,
)
from sparse_llm.ops.precision import autocast_dtype
from sparse_llm.ops.rms_norm import rms_norm_backward_from, rms_norm_stats


class _FFNBlock(torch.autograd.Function):
    """x + FFN(rms_norm(x)) for x: [M, D]; saves the normalised rows on the active rows only (see
    the module doc).
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
        capacities: torch.Tensor | None,
        hot: torch.Tensor | None,
    ) -> tuple[torch.Tensor, ...]:
        # rms_norm, with the normalised rows kept for the backward rather than x: in the compute
        # dtype where it is narrower (bf16 under autocast: half the fp32 residual's bytes; at L0
        # ~30 nearly every token has an active unit), with r = 1 / rms(x) per row in float32.
        xhat, r = rms_norm_stats(x, eps)
        normed = (norm_weight * xhat).to(compute_dtype)
        kept = xhat.to(compute_dtype) if compute_dtype.itemsize < xhat.dtype.itemsize else xhat
        # The op returns those rows where a unit is active (`keep`): as an output of a custom op
        # they are what torch.compile saves, where an index_select here would be moved into the
        # backward and the whole input kept for it.
        # With hot units S, the sparse op runs on Wg with S's rows zeroed (a copy: the cast may be
        # the parameter itself) and S's dense FFN on its panels (ops/ffn/hot_units.py).
        sparse_wg = (
            wg.to(compute_dtype) if hot is None else wg.to(compute_dtype, copy=True).index_fill_(0, hot, 0)
        )
        out = train_forward(
            impl,
            normed,
            sparse_wg,
            *(w.to(compute_dtype) for w in (wu, wd)),
            heavy_threshold,
            keep=kept if hot is None else None,
            capacities=capacities,
        )
        record = out.record.tensors()  # flat: what save_for_backward and an output take
        ctx.capacity_path = out.record.host_sizes is not None
        # The capacity path (taken on the CUDA kernels when capacities are given) keeps every row,
        # reading no count of the active ones (no indexing then), and its backward sets the
        # capacities: they are kept for it. With hot units every row is kept too: a row active in S
        # only needs its input in the backward (at L0 ~30 nearly every row is active anyway).
        ctx.all_rows = ctx.capacity_path or hot is not None
        kept_rows = kept if hot is not None else out.kept_rows
        ctx.heavy_threshold = heavy_threshold
        y, l1, fire_counts = out.y, out.l1, out.fire_counts
        hot_saved: tuple[torch.Tensor, ...] = ()
        hot_nnz = x.new_empty(0, dtype=torch.int64)
        if hot is not None:
            part = hot_forward(y, normed, hot_panels(wg, wu, wd, hot, compute_dtype))
            y, l1, hot_nnz = part.y, l1 + part.l1, part.nnz_per_token
            fire_counts = fire_counts.index_add(0, hot, part.fire_counts)
            hot_saved = (hot, part.g, part.u)
        extra = (capacities,) if ctx.capacity_path else ()
        # The parameters, not their casts: a parameter costs nothing to keep, the bf16 casts of
        # the three FFN weights 66 MiB a layer on the 1b preset. The backward op casts again,
        # inside the op, where torch.compile cannot merge that cast with this one.
        ctx.save_for_backward(
            kept_rows, r, out.active_rows, norm_weight, wg, wu, wd, *extra, *hot_saved, *record
        )
        ctx.n_hot_saved = len(hot_saved)
        ctx.impl, ctx.rows, ctx.compute_dtype, ctx.x_dtype = impl, x.shape[0], compute_dtype, x.dtype
        # The saved tensors of data-dependent length are returned too (and dropped by the caller):
        # torch.compile traces this function only if every such length reaches an output.
        ctx.mark_non_differentiable(fire_counts, hot_nnz, kept_rows, out.active_rows, *record)
        return x + y, l1, fire_counts, hot_nnz, kept_rows, out.active_rows, *record

    @staticmethod
    def backward(ctx, grad_out, grad_l1, *_unused):
        saved = ctx.saved_tensors
        xhat_active, r, active_rows, norm_weight, wg, wu, wd = saved[:7]
        capacities = saved[7] if ctx.capacity_path else None
        rest = saved[8:] if ctx.capacity_path else saved[7:]
        hot_saved, record = rest[: ctx.n_hot_saved], rest[ctx.n_hot_saved :]
        dtype = ctx.compute_dtype
        xhat_active = xhat_active.to(ctx.x_dtype)  # as the forward had it, to the kept rounding
        if grad_out is None:
            grad_out = xhat_active.new_zeros((ctx.rows, xhat_active.shape[1]))
        if grad_l1 is None:
            grad_l1 = xhat_active.new_zeros((), dtype=acc_dtype(dtype))
        # The norm's output where the FFN reads it (rows with an active unit), zero on the other
        # rows: the reference's dense matmuls and the CUDA backward's dense-unit GEMMs run over every
        # row (a zero coefficient times an unwritten NaN would still be NaN).
        if ctx.all_rows:
            normed = (norm_weight * xhat_active).to(dtype)
        else:
            normed = xhat_active.new_zeros((ctx.rows, xhat_active.shape[1]), dtype=dtype)
            normed.index_copy_(0, active_rows, (norm_weight * xhat_active).to(dtype))
        # The residual add casts y's gradient to y's dtype, as autograd would.
        grad_y = grad_out.to(dtype).contiguous()
        # With hot units: the sparse op's backward on Wg as it is, told which rows its forward had
        # zeroed (no [H, D] copy: it reads them only to rebuild a record; its gradient rows of S
        # come out zero), then S's dense backward, which writes those rows.
        hot = hot_saved[0] if hot_saved else None
        grad_normed, grad_wg, grad_wu, grad_wd = train_backward(
            ctx.impl,
            grad_y,
            grad_l1,
            normed,
            wg,
            wu,
            wd,
            TrainRecord(*record),
            capacities,
            ctx.heavy_threshold,
            zeroed_units=hot,
        )
        if hot is not None:
            grad_normed, grad_hot_wg, grad_hot_wu, grad_hot_wd = hot_backward(
                grad_y, grad_l1, grad_normed, normed, hot_panels(wg, wu, wd, hot, dtype), *hot_saved[1:]
            )
            # In place: the gradients are the backward op's fresh outputs (no [H, D] copy a weight).
            grad_wg.index_copy_(0, hot, grad_hot_wg.to(grad_wg.dtype))
            grad_wu.index_copy_(0, hot, grad_hot_wu.to(grad_wu.dtype))
            grad_wd.index_copy_(1, hot, grad_hot_wd.to(grad_wd.dtype))
        if ctx.all_rows:
            grad_x_rows, grad_norm_weight = rms_norm_backward_from(
                grad_normed, xhat_active, r, norm_weight, ctx.x_dtype
            )
            grad_x = grad_out + grad_x_rows.to(grad_out.dtype)
        else:
            # Rows without an active unit get no gradient through the FFN: grad_normed is zero there.
            grad_x_active, grad_norm_weight = rms_norm_backward_from(
                grad_normed.index_select(0, active_rows),
                xhat_active,
                r.index_select(0, active_rows),
                norm_weight,
                ctx.x_dtype,
            )
            grad_x = grad_out.index_add(0, active_rows, grad_x_active.to(grad_out.dtype))
        return grad_x, grad_norm_weight, grad_wg, grad_wu, grad_wd, None, None, None, None, None, None


def ffn_block_train(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: str,
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
    capacities: torch.Tensor | None = None,
    hot_units: torch.Tensor | None = None,
) -> FFNTrainOutput:
    """x + FFN(rms_norm(x)) with the FFN's statistics, differentiable in x, the norm weight and
    the three FFN weights; `out.y` is that sum.

    `capacities` (ops.ffn.training.TrainCapacities, the layer's; 'cuda' only) selects the capacity
    path: the forward reads no size on the host (so the host never waits for the GPU there, and runs
    ahead to queue the next layer's work and a data-parallel wrapper's communication), keeps the
    normalised rows of every token rather than of the active ones, and its backward reads the
    sizes the GPU wrote (long done in steady state) and rebuilds a record that overflowed its
    capacity. Same function, same exactness.

    `hot_units` (S: ascending int64 unit indices on x's device, `ops.ffn.hot_units.choose_hot_units`)
    computes those units as a dense FFN over their columns and the others through the sparse op
    (ops/ffn/hot_units.py): the same function, faster where S holds most of the active entries.
    Empty or None: every unit through the sparse op.

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
    check_train_weights(ffn_input, wg, wu, wd, impl, heavy_threshold)
    if hot_units is not None:
        check_hot_units(hot_units, wg.shape[0], x.device)
        hot_units = hot_units if hot_units.shape[0] > 0 else None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    with torch.autocast(x.device.type, enabled=False):
        out, l1, fire_counts, hot_nnz, _kept, _active, *record = _FFNBlock.apply(
            x2, norm_weight, wg, wu, wd, compute_dtype, eps, impl, heavy_threshold, capacities, hot_units
        )
    nnz_per_token = TrainRecord(*record).nnz_per_token
    if hot_units is not None:
        nnz_per_token = nnz_per_token + hot_nnz
    l0 = nnz_per_token.to(acc_dtype(compute_dtype)).mean()
    return FFNTrainOutput(out.view(x.shape), l0, l1, nnz_per_token, fire_counts)
