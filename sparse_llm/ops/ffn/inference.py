"""The inference front of the sparse FFN op: the CUDA kernels or the PyTorch reference, as the
caller decided (`sparse_llm.ops.ffn.select`)."""

from __future__ import annotations

import torch

from sparse_llm.ops.ffn.checks import DEFAULT_HEAVY_THRESHOLD, check_ffn_inputs, check_heavy_threshold
from sparse_llm.ops.ffn.reference import ffn_forward_reference
from sparse_llm.ops.ffn.select import CUDA_ALIGN, KernelInputs, check_impl, kernel_inputs
from sparse_llm.ops.ffn.twell import TwellPacked, twell_pack_reference
from sparse_llm.ops.in_place import check_in_place_output

# Up to this many rows (a decode step: one token per sequence) the CUDA path is the decode FFN of
# kernels/decode_ffn.cu: the gate's active units compacted on the GPU, up and down over those rows
# of Wu and Wd^T only, and no host read (so the step can be captured in a CUDA graph). Above, the
# TwELL kernels. Both are exact; the split is speed only.
DECODE_MAX_ROWS = 64
DECODE_MAX_DIM = 2048  # kernels/decode_ffn.cuh kDecodeMaxDim: a row's output lives in registers


def decode_kernel_fits(rows: int, dim: int) -> bool:
    """Whether the CUDA path of `rows` rows of width `dim` is the decode FFN (no host read, so a
    CUDA graph can capture it) rather than the TwELL kernels (one host read a call)."""
    return rows <= DECODE_MAX_ROWS and dim <= DECODE_MAX_DIM


def _down_t(wd: torch.Tensor, wd_t: torch.Tensor | None) -> torch.Tensor:
    return wd_t if wd_t is not None else wd.t().contiguous()


def _check_threshold_and_wd_t(heavy_threshold: int, wd: torch.Tensor, wd_t: torch.Tensor | None) -> None:
    check_heavy_threshold(heavy_threshold, inference=True)
    if wd_t is not None and (tuple(wd_t.shape) != tuple(wd.shape[::-1]) or not wd_t.is_contiguous()):
        raise ValueError(f"wd_t must be a contiguous [H, D] = {tuple(wd.shape[::-1])} tensor (Wd^T)")


def ffn_forward(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: str,
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
    wd_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (relu(x Wg^T) * (x Wu^T)) Wd^T for x: [..., D], Wg, Wu: [H, D], Wd: [D, H].

    `impl` is the implementation decided for the inputs (sparse_llm.ops.ffn.select): "reference",
    or "cuda", the TwELL kernels, which raise KernelsUnavailable where they cannot run (no fallback
    here). The kernels take: bfloat16 tensors on a Hopper GPU (sm_90), D a multiple of 8 in
    [8, 8192], H a multiple of 8, contiguous weights (x of any layout and leading shape, any
    M >= 0). The result equals the dense computation up to bf16
    rounding for every input (heavy rows take an exact dense path; nothing is dropped).
    `heavy_threshold` (0..512) only moves work between the two paths. `wd_t` may pass a cached
    contiguous Wd^T ([H, D]) to skip the per-call transpose. Up to DECODE_MAX_ROWS rows (and
    D <= DECODE_MAX_DIM) the CUDA path is the decode FFN, with no host read (capturable in a CUDA
    graph); above, it reads the number of heavy rows on the host once per call.
    """
    check_ffn_inputs(x, wg, wu, wd)
    _check_threshold_and_wd_t(heavy_threshold, wd, wd_t)
    check_impl(impl, False, kernel_inputs(x, wg, wu, wd))
    if impl == "reference":
        return ffn_forward_reference(x, wg, wu, wd)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    if decode_kernel_fits(*x2.shape):
        y = torch.zeros_like(x2)
        torch.ops.sparse_llm.ffn_decode_add_(y, x2, wg, wu, _down_t(wd, wd_t))
        return y.view(x.shape)
    y = torch.ops.sparse_llm.twell_ffn_forward(x2, wg, wu, wd, wd_t, heavy_threshold)
    return y.view(x.shape)


def ffn_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: str,
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
    check_impl(impl, False, kernel_inputs(x, wg, wu, wd))
    if impl == "reference":
        return out.add_(ffn_forward_reference(x, wg, wu, wd))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    # The ops mutate a 2-D view of out: Inductor's scheduler fails (KeyError in compute_ancestors,
    # torch 2.11-2.13) on a custom op mutating a [B, 1, D] tensor, e.g. a decode step's residual.
    out2 = out.view(-1, out.shape[-1])
    if decode_kernel_fits(*x2.shape):
        torch.ops.sparse_llm.ffn_decode_add_(out2, x2, wg, wu, _down_t(wd, wd_t))
        return out
    torch.ops.sparse_llm.twell_ffn_add_(out2, x2, wg, wu, wd, wd_t, heavy_threshold)
    return out


def twell_pack(g: torch.Tensor, heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD, *, impl: str) -> TwellPacked:
    """Pack relu(g) ([M, H]) into TwELL (see sparse_llm.ops.ffn.twell) with `impl`, "reference"
    or "cuda" (as for ffn_forward)."""
    if g.dim() != 2:
        raise ValueError(f"g must be [M, H], got shape {tuple(g.shape)}")
    # The pack reads g alone: D plays no part, so the check passes a D the kernels take.
    check_impl(impl, False, KernelInputs(g.device, g.dtype, CUDA_ALIGN, g.shape[1], g.is_contiguous()))
    if impl == "reference":
        return twell_pack_reference(g, heavy_threshold)
    return TwellPacked(*torch.ops.sparse_llm.twell_pack(g, heavy_threshold))
