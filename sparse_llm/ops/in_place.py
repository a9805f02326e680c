"""What an in-place op (ffn_add_, linear_add_) needs of the tensor it updates, checked before any
compute."""

from __future__ import annotations

import torch


def check_in_place_output(op: str, out: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> None:
    """What the in-place ops (ffn_add_, linear_add_) need of `out`, the tensor they update."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous: it is updated in place")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, *inputs)):
        raise RuntimeError(f"{op} has no autograd: run it under torch.no_grad()")
