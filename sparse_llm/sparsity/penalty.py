"""The L1 activation penalty and its coefficient schedule (docs/design.md section 2).

The trainer forms `loss = ce + l1_coefficient(cfg, step) * l1_penalty(stats)` per micro-batch
and logs the three terms separately. With a sparsity target the coefficient comes from the
controller (controller.py) instead; per layer, the loss is `ce + l1_penalty(stats, coeffs)`.
"""

from __future__ import annotations

import torch

from sparse_llm.config import SparsityConfig
from sparse_llm.model import FFNStats


def l1_coefficient(cfg: SparsityConfig, step: int) -> float:
    """Lambda at optimizer step `step`: 0 before the warm-up, a linear ramp, then constant."""
    start, end = cfg.l1_warmup_start, cfg.l1_warmup_end
    if step < start:
        return 0.0
    if step >= end:  # also covers start == end: no warm-up, full coefficient from `start` on
        return cfg.l1_coeff
    return cfg.l1_coeff * (step - start) / (end - start)


def l1_penalty(stats: FFNStats, coeffs: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over layers of the per-layer L1 (each already a mean over tokens); differentiable.

    `coeffs` [L]: the per-layer coefficients, giving the mean over layers of coeff_i x L1_i (the
    whole penalty term, coefficients included)."""
    if coeffs is None:
        return stats.l1.mean()
    if coeffs.shape != stats.l1.shape:
        raise ValueError(f"{tuple(coeffs.shape)} coefficients for L1 of shape {tuple(stats.l1.shape)}")
    return (coeffs.to(stats.l1.dtype) * stats.l1).mean()
