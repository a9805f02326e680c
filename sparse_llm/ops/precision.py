"""Which dtype autocast computes in, for code that casts by itself (custom ops sit outside
autocast, and the fused loss and the norms cast explicitly)."""

from __future__ import annotations

import torch


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matmul of `t` in, or None where autocast is off for its device."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
