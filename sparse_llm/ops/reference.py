"""Pure-PyTorch reference of every op: the CPU path, the fallback and the test oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ffn_forward_reference(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> torch.Tensor:
    """y = (relu(x Wg^T) * (x Wu^T)) Wd^T, as transformers' LlamaMLP with hidden_act="relu"."""
    return F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd)
