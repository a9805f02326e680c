"""Bitwise-reproducible steps, when a run asks for them (`train.deterministic`).

The same step on the same weights and batch is not always the same bits on a GPU: the attention
backward of PyTorch's default SDPA backend (cuDNN's fused attention on Hopper) adds the query
gradient's partial sums in whatever order its blocks finish (measured on an H100: now and then two
backwards differ from a q_proj gradient on, dense FFN or kernels alike,
benchmarks/results/determinism_h100.md). Under PyTorch's deterministic mode SDPA skips cuDNN for
flash attention with its ordered backward, and the few other ops that have one switch to it too;
our kernels need no switch. A resume is then bitwise the uninterrupted run, at the price of the
slower attention (flash's forward and backward ran at 0.63x cuDNN's, H200,
benchmarks/results/attention_h200.md)."""

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
