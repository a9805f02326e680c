"""Cross-entropy of rows of logits together with its gradient with respect to them: the step of the
chunked loss (sparse_llm.model.loss) between a chunk's logit GEMM and its two gradient GEMMs.

    loss_rows, grad = cross_entropy_rows(logits, labels, grad_scale)
    loss_rows = cross_entropy_rows_(logits, labels, grad_scale)  # the gradient over the logits

loss_rows[r] = logsumexp(logits[r]) - logits[r, labels[r]] (0 where the label is IGNORE_INDEX), in
float32 or wider; grad = (softmax(logits) - one_hot(labels)) * grad_scale on the rows with a label
(0 elsewhere), in the logits' dtype, or None when grad_scale is None. grad_scale is a 0-d tensor
(the loss's 1 / number of labels), so it needs no host read.

bf16 logits on a Hopper GPU take one CUDA kernel (kernels/cross_entropy.cu). Being an opaque op
to torch.compile is the point: Inductor then runs each chunk's logit GEMM, this kernel and the
gradient GEMMs in order, so one chunk's logits are alive at a time. Written in PyTorch, the
chunks' softmax gradients were fused into one kernel after all the logit GEMMs, and every chunk's
logits were alive at once (2.7 GiB at the 1b preset's training peak). Elsewhere the same
arithmetic runs in PyTorch; the in-place form (`cross_entropy_rows_`, the chunked loss's) is an
opaque op there too, so the chunks stay in order on any device. A label outside [0, vocab) that is not IGNORE_INDEX: the PyTorch path
raises (CPU) or asserts (CUDA) in its gather, the kernel gives a NaN loss.
"""

from __future__ import annotations

import torch

from sparse_llm.ops._extension import KernelsUnavailable, extension, kernels_unavailable

IGNORE_INDEX = -100


@torch.library.custom_op("sparse_llm::cross_entropy_rows_cuda", mutates_args=())
def cross_entropy_rows_cuda(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] bf16 contiguous CUDA; labels: [N] int64; grad_scale: None or a float32
    scalar. (loss_rows [N] float32, grad [N, V] bf16 or [0, V] without grad_scale)."""
    loss_rows, grad = extension().cross_entropy_rows(logits, labels, ignore_index, grad_scale, False)
    return loss_rows, grad


@cross_entropy_rows_cuda.register_fake
def _(logits, labels, ignore_index, grad_scale):
    rows = logits.shape[0] if grad_scale is not None else 0
    return logits.new_empty(logits.shape[0], dtype=torch.float32), logits.new_empty(rows, logits.shape[1])


@torch.library.custom_op("sparse_llm::cross_entropy_rows_cuda_", mutates_args=("logits",))
def cross_entropy_rows_cuda_(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor
) -> torch.Tensor:
    """cross_entropy_rows_cuda with the gradient written over the logits; returns loss_rows. The
    declared mutation lets the compiler hand the logit GEMM's output to it without a copy."""
    loss_rows, _ = extension().cross_entropy_rows(logits, labels, ignore_index, grad_scale, True)
    return loss_rows


@cross_entropy_rows_cuda_.register_fake
def _(logits, labels, ignore_index, grad_scale):
    return logits.new_empty(logits.shape[0], dtype=torch.float32)


def cross_entropy_rows_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The PyTorch computation (any dtype and device); see the module doc."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0).unsqueeze(-1)
    lse = torch.logsumexp(wide, dim=-1)
    target = wide.gather(-1, safe_labels).squeeze(-1)
    loss_rows = torch.where(valid, lse - target, 0.0)
    if grad_scale is None:
        return loss_rows, None
    scale = (valid.to(wide.dtype) * grad_scale).unsqueeze(-1)
    # softmax - one_hot(label), written elementwise (no scatter) so that the compiler fuses it
    # into one pass from the logits to the gradient, with no float32 [N, V] buffer in between.
    vocab_ids = torch.arange(wide.shape[-1], device=wide.device)
    one_hot = (vocab_ids == safe_labels).to(wide.dtype)
    grad = (torch.exp(wide - lse.unsqueeze(-1)) - one_hot) * scale
    return loss_rows, grad.to(logits.dtype)


# Rows per logsumexp in the PyTorch in-place op: its temporary stays one block of rows.
_LSE_ROWS = 512


@torch.library.custom_op("sparse_llm::cross_entropy_rows_pytorch_", mutates_args=("logits",))
def cross_entropy_rows_pytorch_(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, grad_scale: torch.Tensor
) -> torch.Tensor:
    """cross_entropy_rows_cuda_ in PyTorch (any dtype and device): cross_entropy_rows_reference's
    arithmetic, bit for bit, on one float32-or-wider copy of the logits changed in place, then
    written over them; returns loss_rows. An opaque op for the kernel's reason (module doc):
    traced, the chunks' softmaxes were fused across chunks and every chunk's logits kept alive."""
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    valid = labels != ignore_index
    safe_labels = torch.where(valid, labels, 0).unsqueeze(-1)
    lse = torch.cat([torch.logsumexp(block, dim=-1) for block in wide.split(_LSE_ROWS)])
    loss_rows = torch.where(valid, lse - wide.gather(-1, safe_labels).squeeze(-1), 0.0)
    wide.sub_(lse.unsqueeze(-1)).exp_()  # softmax
    wide.scatter_add_(-1, safe_labels, -valid.to(wide.dtype).unsqueeze(-1))  # minus the one-hot
    wide.mul_((valid.to(wide.dtype) * grad_scale).unsqueeze(-1))
    logits.copy_(wide)
    return loss_rows


@cross_entropy_rows_pytorch_.register_fake
def _(logits, labels, ignore_index, grad_scale):
    return logits.new_empty(logits.shape[0], dtype=torch.promote_types(logits.dtype, torch.float32))


def runs_on_kernel(logits: torch.Tensor) -> bool:
    """Whether cross_entropy_rows(impl='auto') takes the CUDA kernel for these logits."""
    return resolve_impl("auto", logits) == "cuda"


def resolve_impl(impl: str, logits: torch.Tensor) -> str:
    """'cuda' or 'reference' for logits of this device and dtype (their shape is not read):
    'auto' takes the kernel where it can run, 'cuda' raises KernelsUnavailable where it cannot."""
    if impl not in ("auto", "cuda", "reference"):
        raise ValueError(f"impl must be 'auto', 'cuda' or 'reference', got {impl!r}")
    if impl == "reference":
        return impl
    unavailable = kernels_unavailable(logits.device)
    if unavailable is None and logits.dtype != torch.bfloat16:
        unavailable = f"the kernel takes bfloat16 logits, got {logits.dtype}"
    if impl == "cuda" and unavailable is not None:
        raise KernelsUnavailable(f"impl='cuda' cannot run: {unavailable}")
    return "reference" if unavailable is not None else "cuda"


def _check_rows(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, V] and labels [N], got {tuple(logits.shape)} and {tuple(labels.shape)}"
        )


def cross_entropy_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grad_scale: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss of each row, its gradient w.r.t. the logits times grad_scale, or None); logits: [N, V],
    labels: [N] integer. impl: 'auto' (the kernel where it can run, else PyTorch), 'cuda' (raises
    where the kernel cannot run) or 'reference' (PyTorch). See the module doc."""
    _check_rows(logits, labels)
    if resolve_impl(impl, logits) == "reference":
        return cross_entropy_rows_reference(logits, labels, grad_scale, ignore_index)
    if grad_scale is not None:
        grad_scale = grad_scale.to(torch.float32)
    loss_rows, grad = cross_entropy_rows_cuda(
        logits.contiguous(), labels.long().contiguous(), ignore_index, grad_scale
    )
    return loss_rows, grad if grad_scale is not None else None


def cross_entropy_rows_(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grad_scale: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    impl: str = "auto",
) -> torch.Tensor:
    """cross_entropy_rows with the gradient (times grad_scale) written over `logits`, which must
    be contiguous; returns the loss of each row. The chunked loss's form: a chunk's logits are
    dead once their gradient exists, so one [N, V] buffer serves both."""
    _check_rows(logits, labels)
    if not logits.is_contiguous():
        raise ValueError("cross_entropy_rows_ writes over the logits: they must be contiguous")
    if resolve_impl(impl, logits) == "reference":
        return cross_entropy_rows_pytorch_(logits, labels.long(), ignore_index, grad_scale)
    return cross_entropy_rows_cuda_(
        logits, labels.long().contiguous(), ignore_index, grad_scale.to(torch.float32)
    )
