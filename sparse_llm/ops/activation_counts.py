"""Counts of active (positive) FFN gate entries, as an op that the compiler does not fuse.

Inductor (torch 2.11, H200) miscompiled the column reduction `(a > 0).sum(0)` inside a whole
compiled model at large token counts: it returned garbage (even uninitialised memory), which
made healthy units look dead. As a custom op the counts run as plain kernels inside the compiled
graph, with no graph break; `tests/test_model_gpu.py` guards against a regression.

bf16 on a Hopper GPU takes one CUDA kernel (kernels/activation_counts.cu: one read of `a`);
elsewhere `(a > 0)` and its two sums (a bool copy of `a`, read twice).
"""

from __future__ import annotations

import torch

from sparse_llm.ops._extension import extension, kernels_unavailable

# What the kernel takes: 16-byte rows, one shared-memory counter per column (activation_counts.cuh).
KERNEL_ALIGN, KERNEL_MAX_COLUMNS = 8, 12288


def runs_on_kernel(a: torch.Tensor) -> bool:
    """Whether activation_counts takes the CUDA kernel for `a`."""
    return (
        a.is_cuda
        and a.dtype == torch.bfloat16
        and a.dim() == 2
        and a.is_contiguous()
        and a.shape[1] % KERNEL_ALIGN == 0
        and a.shape[1] <= KERNEL_MAX_COLUMNS
        and kernels_unavailable(a.device) is None
    )


def activation_counts_reference(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch computation (any dtype and device)."""
    active = a > 0
    return active.sum(-1), active.sum(0)


@torch.library.custom_op("sparse_llm::activation_counts", mutates_args=())
def activation_counts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a: [M, H], how many entries are > 0 per row ([M], int64) and per column ([H], int64)."""
    if runs_on_kernel(a):
        row_counts, col_counts = extension().activation_counts(a)
        return row_counts, col_counts
    return activation_counts_reference(a)


@activation_counts.register_fake
def _(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return a.new_empty(a.shape[0], dtype=torch.int64), a.new_empty(a.shape[1], dtype=torch.int64)
