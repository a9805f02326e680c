"""RMSNorm as a module: transformers' LlamaRMSNorm, optionally recomputed in the backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparse_llm.ops.precision import autocast_dtype
from sparse_llm.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm. Under autocast the output is already in the autocast dtype, the
    dtype its consumers (projections, the FFN ops) would cast it to.

    With `recompute` (train.recompute_norms, fixed at build), training recomputes the output in the
    backward from the input, which the backward keeps anyway, instead of every consumer saving it
    (the cast included): two [tokens, D] activations a layer less, for a few elementwise kernels."""

    def __init__(self, dim: int, eps: float, recompute: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._normalise, x, use_reentrant=False)
        return self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, autocast_dtype(x))
