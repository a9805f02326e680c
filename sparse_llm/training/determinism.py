"""Bitwise-reproducible steps, when a run asks for them (`train.deterministic`).

The same step on the same weights and batch is not always the same bits on a GPU: PyTorch's flash
attention backward adds the query gradient's partial sums atomically, in whatever order the blocks
finish (measured: one or two gradient bits apart between two backwards, dense FFN or kernels,
`tests/model/test_determinism_gpu.py`). PyTorch's deterministic mode switches it, and the few other
ops that have one, to an ordered algorithm; our kernels need no switch. A resume is then bitwise
the uninterrupted run, at some cost in speed (docs/multi_gpu.md)."""

from __future__ import annotations

import os

import torch

# cuBLAS picks its reduction order per workspace; one fixed configuration makes it repeat. Read
# when the first cuBLAS handle is created, so it is set before the model's first matmul.
CUBLAS_WORKSPACE = ":4096:8"


def set_determinism(deterministic: bool) -> None:
    """PyTorch's deterministic algorithms on or off for this process (a process-wide switch, set
    once when the trainer is built; the config, not an earlier caller, decides)."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(deterministic)
