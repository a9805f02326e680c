"""One front for the sparse FFN ops: picks the CUDA kernels or the PyTorch reference."""

from __future__ import annotations

from typing import Literal

import torch

from sparse_llm.ops import _extension
from sparse_llm.ops.checks import check_ffn_inputs, check_in_place_output, cuda_unsupported_reason
from sparse_llm.ops.reference import ffn_forward_reference
from sparse_llm.ops.twell import TwellPacked, twell_pack_reference

Impl = Literal["auto", "cuda", "reference"]

# Rows with more non-zeros than this take the dense path (Tensor Cores on the gathered rows);
# the rest take the sparse gather path. A speed knob only: every value gives the exact answer.
DEFAULT_HEAVY_THRESHOLD = 64


def use_cuda_kernels(impl: str, reason: str | None) -> bool:
    """Whether `impl` runs the CUDA kernels, given why they cannot take the inputs (or None):
    'auto' falls back to the reference quietly, 'cuda' raises the reason."""
    if impl == "reference":
        return False
    if impl == "cuda":
        if reason is not None:
            raise ValueError(f"impl='cuda' cannot run: {reason}")
        if not _extension.available():
            raise RuntimeError(f"impl='cuda' cannot run: {_extension.unavailable_reason()}")
        return True
    if impl == "auto":
        return reason is None and _extension.available()
    raise ValueError(f"impl must be 'auto', 'cuda' or 'reference', got {impl!r}")


def _check_threshold_and_wd_t(heavy_threshold: int, wd: torch.Tensor, wd_t: torch.Tensor | None) -> None:
    if not 0 <= heavy_threshold <= 512:
        raise ValueError(f"heavy_threshold must be in [0, 512], got {heavy_threshold}")
    if wd_t is not None and (tuple(wd_t.shape) != tuple(wd.shape[::-1]) or not wd_t.is_contiguous()):
        raise ValueError(f"wd_t must be a contiguous [H, D] = {tuple(wd.shape[::-1])} tensor (Wd^T)")


def ffn_forward(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: Impl = "auto",
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
    wd_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (relu(x Wg^T) * (x Wu^T)) Wd^T for x: [..., D], Wg, Wu: [H, D], Wd: [D, H].

    impl="auto" runs the TwELL kernels when they can take the inputs, else the reference;
    impl="cuda" raises instead of falling back. The kernels take: bfloat16 tensors on a Hopper GPU
    (sm_90), D a multiple of 8 in [8, 8192], H a multiple of 8, contiguous weights (x of any
    layout and leading shape, any M >= 0). The result equals the dense computation up to bf16
    rounding for every input (heavy rows take an exact dense path; nothing is dropped).
    `heavy_threshold` (0..512) only moves work between the two paths. `wd_t` may pass a cached
    contiguous Wd^T ([H, D]) to skip the per-call transpose. The CUDA path reads the number of
    heavy rows on the host once per call, so it cannot be captured in a CUDA graph.
    """
    check_ffn_inputs(x, wg, wu, wd)
    _check_threshold_and_wd_t(heavy_threshold, wd, wd_t)
    if not use_cuda_kernels(impl, cuda_unsupported_reason(x, wg, wu, wd)):
        return ffn_forward_reference(x, wg, wu, wd)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.ops.sparse_llm.twell_ffn_forward(x2, wg, wu, wd, wd_t, heavy_threshold)
    return y.view(x.shape)


def ffn_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: Impl = "auto",
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
    wd_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """out += ffn_forward(x, Wg, Wu, Wd) in place; returns out. For a residual stream:
    `h = ffn_add_(h, norm(h), ...)` is `h + ffn_forward(norm(h), ...)` to the bit (the FFN output
    is rounded to out's dtype before the add, as a separate add would), but on the CUDA path a
    row with no active unit is never read or written. out must be contiguous, shaped like x, of
    x's dtype and device, and must not share memory with x or the weights. No autograd: use
    ffn_forward_train to train."""
    check_ffn_inputs(x, wg, wu, wd)
    _check_threshold_and_wd_t(heavy_threshold, wd, wd_t)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"out must be shaped like x {tuple(x.shape)} ({x.dtype}, {x.device}), "
            f"got {tuple(out.shape)} ({out.dtype}, {out.device})"
        )
    check_in_place_output("ffn_add_", out, (x, wg, wu, wd))
    if not torch.compiler.is_compiling():  # traced tensors have no storage to compare
        for name, t in (("x", x), ("Wg", wg), ("Wu", wu), ("Wd", wd)):
            if out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                raise ValueError(f"out must not share memory with {name}")
    if not use_cuda_kernels(impl, cuda_unsupported_reason(x, wg, wu, wd)):
        return out.add_(ffn_forward_reference(x, wg, wu, wd))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    torch.ops.sparse_llm.twell_ffn_add_(out, x2, wg, wu, wd, wd_t, heavy_threshold)
    return out


def twell_pack(
    g: torch.Tensor, heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD, impl: Impl = "auto"
) -> TwellPacked:
    """Pack relu(g) ([M, H]) into TwELL (see sparse_llm.ops.twell)."""
    if g.dim() != 2:
        raise ValueError(f"g must be [M, H], got shape {tuple(g.shape)}")
    reason = None
    if g.device.type != "cuda" or g.dtype != torch.bfloat16:
        reason = "the CUDA pack takes a bfloat16 CUDA tensor"
    elif g.shape[1] % 8 or not g.is_contiguous():
        reason = "the CUDA pack needs a contiguous g with H a multiple of 8"
    if not use_cuda_kernels(impl, reason):
        return twell_pack_reference(g, heavy_threshold)
    return TwellPacked(*torch.ops.sparse_llm.twell_pack(g, heavy_threshold))
