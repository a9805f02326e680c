"""Synthetic sparse-FFN workload of DESIGN.md section 5, shared by every FFN benchmark.

x rows ~ N(0, s_t^2) with a per-token scale s_t ~ LogNormal(0, 0.3); input feature 0 is held
at 1.0 and gate column 0 holds minus a per-unit threshold, (base + 0.5 * N(0, 1)) standard
deviations of that unit's pre-activation; 30% of the units never fire. `base` is found by
bisection so that the mean number of non-zeros of relu(g) per token hits a target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SCALE_SIGMA = 0.3  # sigma of the per-token LogNormal scale
_SPREAD = 0.5  # per-unit threshold spread, in standard deviations
_DEAD_FRACTION = 0.3
_DEAD_THRESHOLD = 50.0  # standard deviations: such a unit never fires


@dataclass
class FFNWorkload:
    x: torch.Tensor  # [M, D]
    wg: torch.Tensor  # [H, D]
    wu: torch.Tensor  # [H, D]
    wd: torch.Tensor  # [D, H]
    base: float  # the bisected threshold base, in standard deviations


def make_inputs(m: int, d: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Token rows with the per-token LogNormal scale and feature 0 held at 1.0 (float32)."""
    scale = torch.exp(_SCALE_SIGMA * torch.randn(m, 1, generator=generator, device=device))
    x = torch.randn(m, d, generator=generator, device=device) * scale
    x[:, 0] = 1.0
    return x


def _mean_nnz(pre: torch.Tensor, thresholds: torch.Tensor) -> float:
    return (pre > thresholds).sum(dim=1, dtype=torch.float64).mean().item()


def make_workload(
    m: int,
    d: int,
    h: int,
    nnz_target: float,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    calib_tokens: int = 4096,
) -> FFNWorkload:
    """Build (x, Wg, Wu, Wd) whose relu(x Wg^T) has about `nnz_target` non-zeros per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    wg = torch.randn(h, d, generator=gen, device=device) / d**0.5
    wu = torch.randn(h, d, generator=gen, device=device) / d**0.5
    wd = torch.randn(d, h, generator=gen, device=device) / h**0.5
    # Std of each unit's pre-activation over tokens without the threshold feature:
    # ||w_j|| * sqrt(E[s^2]), E[s^2] = exp(2 sigma^2) for s ~ LogNormal(0, sigma).
    sigma = wg[:, 1:].norm(dim=1) * torch.exp(torch.tensor(_SCALE_SIGMA**2, device=device))
    offset = _SPREAD * torch.randn(h, generator=gen, device=device)
    dead = torch.rand(h, generator=gen, device=device) < _DEAD_FRACTION
    offset[dead] = _DEAD_THRESHOLD

    x = make_inputs(m, d, gen, device)
    calib = x[: min(m, calib_tokens)]
    pre = calib[:, 1:] @ wg[:, 1:].T  # pre-activations without the threshold feature
    lo, hi = -10.0, 20.0  # mean nnz decreases as base grows
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _mean_nnz(pre, (mid + offset) * sigma) > nnz_target:
            lo = mid
        else:
            hi = mid
    base = 0.5 * (lo + hi)
    wg[:, 0] = -(base + offset) * sigma
    return FFNWorkload(x.to(dtype), wg.to(dtype), wu.to(dtype), wd.to(dtype), base)
