"""Which FFN implementation runs, and why not the CUDA kernels: the one place that decides.

Every caller (the model's training, evaluation, prefill and decode paths, the ops front, the
benchmarks) asks `select_ffn` and gets an `FFNSelection`: the implementation that runs and, when
it is not the kernels, why. The values, the same everywhere:

  dense      the plain PyTorch FFN (three matmuls); what a transformers LlamaMLP computes
  reference  the sparse ops' PyTorch reference (same arithmetic; the kernels' test oracle)
  cuda       the TwELL / hybrid CUDA kernels; an error where they cannot run
  auto       the kernels where they can run, `dense` elsewhere

What the kernels need: a Hopper GPU (sm_90) with the extension built (nvcc and ninja present),
bfloat16, D a multiple of 8 in [8, 8192], H a multiple of 8, and for training H <= 49152 (the
backward's column sort keeps one shared-memory counter per unit). Other kernel-backed ops (loss,
activation counts, KV-cache write) ask `ops._extension.kernels_unavailable` for the device and
toolchain part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_llm.ops._extension import KernelsUnavailable, kernels_unavailable

# What `model.ffn_impl` (and a phase's FFN) may ask for; the config schema reads it from here.
FFN_IMPLS = ("auto", "dense", "reference", "cuda")
PHASES = ("train", "eval", "prefill", "decode")

# What the CUDA kernels accept (kernels/twell.cuh): 16-byte rows of bf16, bounded D.
CUDA_MAX_DIM = 8192
KERNEL_DTYPE = torch.bfloat16  # the only dtype the CUDA kernels compute in
CUDA_ALIGN = 8
# The training backward orders its entries by unit with a shared-memory histogram of H counters
# (kernels/csr.cuh, kMaxColumnSortHidden).
CUDA_TRAIN_MAX_HIDDEN = 49152


@dataclass(frozen=True)
class FFNSelection:
    impl: str  # what runs: "dense", "reference" or "cuda"
    reason: str | None  # why not the kernels (None when they run)


def select_ffn(
    requested: str,
    phase: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    hidden_size: int,
    intermediate_size: int,
    contiguous: bool = True,
    where: str = "impl",
    activation: str = "relu",
) -> FFNSelection:
    """The FFN implementation that runs for `requested` in `phase` on these inputs, and why not the
    kernels. `where` names the setting in errors (e.g. 'model.ffn_impl'). The sparse paths are
    for a ReLU gate only: with another `activation` (SwiGLU's silu) every request but dense is
    refused and auto is dense."""
    if requested not in FFN_IMPLS:
        raise ValueError(f"{where} must be one of {', '.join(FFN_IMPLS)}, got {requested!r}")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
    if requested == "dense":
        return FFNSelection(requested, f"{where}={requested} was asked for")
    if activation != "relu":
        reason = f"the sparse FFN needs a ReLU gate, the model's is {activation}"
        if requested == "auto":
            return FFNSelection("dense", reason)
        raise KernelsUnavailable(f"{where}={requested} cannot run: {reason}")
    if requested == "reference":
        return FFNSelection(requested, f"{where}={requested} was asked for")
    device = torch.device(device)
    reason = None
    if device.type != "cuda":
        reason = f"tensors are on {device}, the kernels need a CUDA (Hopper) GPU"
    if reason is None:
        reason = _inputs_unsupported(phase, dtype, hidden_size, intermediate_size, contiguous)
    if reason is None:  # last: this one may build the extension
        reason = kernels_unavailable(device)
    if reason is None:
        return FFNSelection("cuda", None)
    if requested == "cuda":
        raise KernelsUnavailable(f"{where}=cuda cannot run the kernels ({phase}): {reason}")
    return FFNSelection("dense", reason)


def _inputs_unsupported(
    phase: str, dtype: torch.dtype, dim: int, hidden: int, contiguous: bool
) -> str | None:
    if dtype != KERNEL_DTYPE:
        return f"the kernels take bfloat16, got {dtype}"
    if dim % CUDA_ALIGN or not CUDA_ALIGN <= dim <= CUDA_MAX_DIM:
        return f"the kernels need D a multiple of {CUDA_ALIGN} in [{CUDA_ALIGN}, {CUDA_MAX_DIM}], got {dim}"
    if hidden % CUDA_ALIGN:
        return f"the kernels need H a multiple of {CUDA_ALIGN}, got {hidden}"
    if phase == "train" and hidden > CUDA_TRAIN_MAX_HIDDEN:
        return f"the training kernels need H <= {CUDA_TRAIN_MAX_HIDDEN}, got {hidden}"
    if not contiguous:
        return "the kernels need contiguous weights"
    return None


def select_for_tensors(
    requested: str, phase: str, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> FFNSelection:
    """`select_ffn` for an op's (checked) inputs: x [..., D], Wg, Wu [H, D], Wd [D, H]."""
    hidden, dim = wg.shape
    return select_ffn(
        requested,
        phase,
        device=x.device,
        dtype=x.dtype,
        hidden_size=dim,
        intermediate_size=hidden,
        contiguous=all(t.is_contiguous() for t in (wg, wu, wd)),
    )
