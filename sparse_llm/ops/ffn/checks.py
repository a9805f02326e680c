"""The FFN op's input checks, shared by every implementation, raised before any compute."""

from __future__ import annotations

import torch

# Rows with more active units than this take the dense path (Tensor Cores on the gathered rows),
# the others the sparse kernels, in inference and training alike. A speed knob only: every value
# gives the exact answer.
DEFAULT_HEAVY_THRESHOLD = 64
# The inference kernels keep a light row's entries in TwELL slots: at most this many
# (kernels/twell.cuh, kMaxLightRowNnz). The training kernels have no such bound.
MAX_LIGHT_ROW_NNZ = 512


def check_heavy_threshold(heavy_threshold: int, *, inference: bool) -> None:
    upper = MAX_LIGHT_ROW_NNZ if inference else None
    if heavy_threshold < 0 or (upper is not None and heavy_threshold > upper):
        bounds = f"in [0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"heavy_threshold must be {bounds}, got {heavy_threshold}")


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
