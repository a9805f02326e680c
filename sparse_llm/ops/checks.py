"""Input checks shared by every implementation, raised before any compute."""

from __future__ import annotations

import torch

# What the CUDA kernels accept (kernels/twell.cuh): bf16, 16-byte rows, bounded D.
CUDA_MAX_DIM = 8192
CUDA_ALIGN = 8  # D and H must be multiples of 8 (16-byte rows of bf16)
# The training backward orders its entries by unit with a shared-memory histogram of H counters
# (kernels/csr.cuh, kMaxColumnSortHidden).
CUDA_TRAIN_MAX_HIDDEN = 49152


def check_ffn_inputs(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> None:
    """x: [..., D]; wg, wu: [H, D]; wd: [D, H] (Hugging Face layout); one float dtype, one device."""
    for name, t in (("x", x), ("Wg", wg), ("Wu", wu), ("Wd", wd)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if wg.dim() != 2:
        raise ValueError(f"Wg must be [H, D], got shape {tuple(wg.shape)}")
    hidden, dim = wg.shape
    if tuple(wu.shape) != (hidden, dim):
        raise ValueError(f"Wu must be [H, D] = {(hidden, dim)} like Wg, got {tuple(wu.shape)}")
    if tuple(wd.shape) != (dim, hidden):
        raise ValueError(f"Wd must be [D, H] = {(dim, hidden)}, got {tuple(wd.shape)}")
    if x.dim() < 1 or x.shape[-1] != dim:
        raise ValueError(f"x must be [..., D] with D = {dim}, got shape {tuple(x.shape)}")
    if len({t.dtype for t in (x, wg, wu, wd)}) != 1:
        raise TypeError(
            f"x, Wg, Wu, Wd must share one dtype, got {x.dtype}, {wg.dtype}, {wu.dtype}, {wd.dtype}"
        )
    if len({t.device for t in (x, wg, wu, wd)}) != 1:
        raise ValueError(
            f"x, Wg, Wu, Wd must be on one device, got {x.device}, {wg.device}, {wu.device}, {wd.device}"
        )


def cuda_unsupported_reason(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> str | None:
    """Why the CUDA kernels cannot take these (already checked) inputs, or None if they can."""
    hidden, dim = wg.shape
    if x.device.type != "cuda":
        return f"tensors are on {x.device}, not a CUDA device"
    if x.dtype != torch.bfloat16:
        return f"the CUDA kernels take bfloat16, got {x.dtype}"
    if dim % CUDA_ALIGN or not CUDA_ALIGN <= dim <= CUDA_MAX_DIM:
        return (
            f"the CUDA kernels need D a multiple of {CUDA_ALIGN} in [{CUDA_ALIGN}, {CUDA_MAX_DIM}], got {dim}"
        )
    if hidden % CUDA_ALIGN:
        return f"the CUDA kernels need H a multiple of {CUDA_ALIGN}, got {hidden}"
    for name, t in (("Wg", wg), ("Wu", wu), ("Wd", wd)):
        if not t.is_contiguous():
            return f"{name} must be contiguous for the CUDA kernels"
    return None


def check_in_place_output(op: str, out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    """What the in-place ops (ffn_add_, linear_add_) need of `out`, the tensor they update."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is updated in place")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, *inputs)):
        raise RuntimeError(f"{op} has no autograd: run it under torch.no_grad()")
