"""Next-token cross-entropy fused with the output projection, in chunks of tokens.

`F.cross_entropy(lm_head(h))` keeps the whole [tokens, vocab] logits alive from the forward to
the backward, and materialises fp32 copies of them around the loss: on the 1b preset at 8 x 2048
tokens that is 1.5 GiB of bf16 logits plus their fp32 softmax and gradient, the largest single
term of the training peak after the optimizer state. Here the logits exist one chunk at a time:
the forward computes each chunk's loss and, while the chunk is in hand, its gradients with respect
to the hidden states and the projection weight (the loss is the last op of the graph, so its
backward is known to follow), and the backward only scales them by the incoming gradient. The
arithmetic is the same as the unfused path (logits in the compute dtype, softmax in fp32, mean
over the labels that are not `ignore_index`); the weight gradient is summed over chunks in fp32,
on CUDA by the GEMM itself (ops.matmul_accumulate_).

Under torch.compile the chunks must stay one after the other. The step between a chunk's logit
GEMM and its gradient GEMMs (ops.cross_entropy_rows_, which writes the gradient over the logits)
is an op opaque to Inductor, a CUDA kernel on a Hopper GPU and PyTorch elsewhere, and the weight
gradient's accumulation an in-place op: written in PyTorch and traced, Inductor
fused every chunk's softmax gradient into one kernel after all the logit GEMMs, and the chunks'
additions into one after the last, so all the chunks' logits and partial products were alive at
once.
"""

from __future__ import annotations

import torch

from sparse_llm.ops.cross_entropy import IGNORE_INDEX, cross_entropy_rows, cross_entropy_rows_, resolve_impl
from sparse_llm.ops.matmul_accumulate import matmul_accumulate_
from sparse_llm.ops.precision import autocast_dtype

# Tokens per chunk: the chunk's fp32 logits stay under ~1 GiB whatever the vocabulary.
_CHUNK_ELEMENTS = 1 << 28


def default_chunk_tokens(vocab_size: int) -> int:
    """The largest power of two of tokens whose [tokens, vocab] fp32 logits fit `_CHUNK_ELEMENTS`."""
    return 1 << max(0, (_CHUNK_ELEMENTS // max(1, vocab_size)).bit_length() - 1)


def _chunk_loss_and_logit_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_count: torch.Tensor | None,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(summed loss of a chunk, gradient of the mean loss w.r.t. its logits in the compute dtype,
    or None when `inv_count` is None)."""
    logits = hidden @ weight.t()
    if inv_count is None:
        loss_rows, _ = cross_entropy_rows(logits, labels, None, IGNORE_INDEX, impl)
        return loss_rows.sum(), None
    loss_rows = cross_entropy_rows_(logits, labels, inv_count, IGNORE_INDEX, impl)
    return loss_rows.sum(), logits  # now the gradient: one [chunk, V] buffer for both


def _chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    with_grads: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, and with `with_grads` its gradients w.r.t. hidden (compute dtype) and weight
    (fp32 or wider), else None, None); hidden and weight already in the compute dtype; impl as
    for ops.cross_entropy_rows."""
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    count = (labels != IGNORE_INDEX).sum()
    inv_count = 1.0 / count.to(acc_dtype)  # inf when every label is ignored: loss nan, as F does
    grad_hidden_chunks = []
    grad_weight = weight.new_zeros(weight.shape, dtype=acc_dtype) if with_grads else None
    loss_sum = torch.zeros((), dtype=acc_dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        chunk_loss, grad_logits = _chunk_loss_and_logit_grad(
            hidden[rows], weight, labels[rows], inv_count if with_grads else None, impl
        )
        loss_sum = loss_sum + chunk_loss
        if with_grads:
            grad_hidden_chunks.append(grad_logits @ weight)
            matmul_accumulate_(grad_weight, grad_logits.t(), hidden[rows])
    if not with_grads:
        return loss_sum * inv_count, None, None
    grad_hidden = torch.cat(grad_hidden_chunks) if grad_hidden_chunks else torch.zeros_like(hidden)
    return loss_sum * inv_count, grad_hidden, grad_weight


class _LinearCrossEntropy(torch.autograd.Function):
    """mean CE(hidden @ weight.T, labels) with the gradients computed in the forward, chunk by chunk."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
        impl: str,
    ) -> torch.Tensor:
        loss, grad_hidden, grad_weight = _chunked_loss(
            hidden.to(compute_dtype),
            weight.to(compute_dtype),
            labels,
            chunk_tokens,
            with_grads=True,
            impl=impl,
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        return (
            (grad_hidden * grad_loss).to(hidden_dtype),
            (grad_weight * grad_loss).to(weight_dtype),
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits `hidden @ weight.T` against `labels`, never
    holding more than `chunk_tokens` rows of logits.

    hidden: [..., D]; weight: [V, D] (the output projection, Hugging Face layout); labels: [...]
    token ids, `IGNORE_INDEX` (-100) for positions without a target. Under autocast the
    projection runs in autocast's dtype, as `nn.Linear` would. impl: how each chunk's loss and
    logit gradient are computed, as for `ops.cross_entropy_rows` ('auto': the CUDA kernel where
    it can run).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight of shape {tuple(weight.shape)} does not project hidden size {hidden.shape[-1]}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    hidden2d, labels1d = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    compute_dtype = autocast_dtype(hidden) or hidden.dtype
    # Resolved once, before any compute, on a stand-in with the logits' device and dtype.
    impl = resolve_impl(impl, hidden.new_empty((0, 0), dtype=compute_dtype))
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        h, w = hidden2d.to(compute_dtype), weight.to(compute_dtype)
        return _chunked_loss(h, w, labels1d, chunk, with_grads=False, impl=impl)[0]
    with torch.autocast(hidden.device.type, enabled=False):
        return _LinearCrossEntropy.apply(hidden2d, weight, labels1d, chunk, compute_dtype, impl)
