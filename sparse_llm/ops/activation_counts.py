"""Counts of active (positive) FFN gate entries, as an op that the compiler does not fuse.

Inductor (torch 2.11, H200) miscompiled the column reduction `(a > 0).sum(0)` inside a whole
compiled model at large token counts: it returned garbage (even uninitialised memory), which
made healthy units look dead. As a custom op the counts run as plain eager kernels inside the
compiled graph, with no graph break; `tests/test_model_gpu.py` guards against a regression.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("sparse_llm::activation_counts", mutates_args=())
def activation_counts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a: [M, H], how many entries are > 0 per row ([M], int64) and per column ([H], int64)."""
    active = a > 0
    return active.sum(-1), active.sum(0)


@activation_counts.register_fake
def _(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.new_empty(a.shape[0], dtype=torch.int64), a.new_empty(a.shape[1], dtype=torch.int64)
