"""Which FFN implementation runs, and why not the CUDA kernels: the one place that decides.

The model's build (and inference calibration, and the benchmarks) asks `select_ffn` and gets an
`FFNSelection`: the implementation that runs and, when it is not the kernels, why. The values, the
same everywhere:

  dense      the plain PyTorch FFN (three matmuls); what a transformers LlamaMLP computes
  reference  the sparse ops' PyTorch reference (same arithmetic; the kernels' test oracle)
  cuda       the TwELL / hybrid CUDA kernels; an error where they cannot run
  auto       the kernels where they can run, `dense` elsewhere

The op fronts (inference, training, block) decide nothing: they take the decided implementation,
`reference` or `cuda`, and for `cuda` only check that the kernels take their inputs (`check_impl`),
raising where they cannot rather than falling back.

What the kernels need: a Hopper GPU (sm_90) with the extension built (nvcc and ninja present),
bfloat16, D a multiple of 8 in [8, 8192], H a multiple of 8, and for training H <= 49152 (the
backward's column sort keeps one shared-memory counter per unit). Other kernel-backed ops (loss,
activation counts, KV-cache write) ask `ops._extension.kernels_unavailable` for the device and
toolchain part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sparse_llm.ops._extension import KernelsUnavailable, kernels_unavailable

# What `model.ffn_impl` (and a phase's FFN) may ask for; the config schema reads it from here.
FFN_IMPLS = ("auto", "dense", "reference", "cuda")
PHASES = ("train", "eval", "prefill", "decode")
# What an op front runs: the implementation select_ffn decided, where it is not dense.
OP_IMPLS = ("reference", "cuda")

# What the CUDA kernels accept (kernels/twell.cuh): 16-byte rows of bf16, bounded D.
CUDA_MAX_DIM = 8192
KERNEL_DTYPE = torch.bfloat16  # the only dtype the CUDA kernels compute in
CUDA_ALIGN = 8
# The training backward orders its entries by unit with a shared-memory histogram of H counters
# (kernels/csr.cuh, kMaxColumnSortHidden).
CUDA_TRAIN_MAX_HIDDEN = 49152


class KernelInputs(NamedTuple):
    """What the kernels' support of an FFN's inputs depends on."""

    device: torch.device
    dtype: torch.dtype
    hidden_size: int  # D
    intermediate_size: int  # H
    contiguous: bool  # the weights


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
    inputs = KernelInputs(torch.device(device), dtype, hidden_size, intermediate_size, contiguous)
    reason = kernels_refuse(phase == "train", inputs)
    if reason is None:
        return FFNSelection("cuda", None)
    if requested == "cuda":
        raise KernelsUnavailable(f"{where}=cuda cannot run the kernels ({phase}): {reason}")
    return FFNSelection("dense", reason)


def kernels_refuse(training: bool, inputs: KernelInputs) -> str | None:
    """Why the CUDA kernels cannot run the FFN (the training op's when `training`) on these inputs,
    or None when they can."""
    if inputs.device.type != "cuda":
        return f"tensors are on {inputs.device}, the kernels need a CUDA (Hopper) GPU"
    reason = _inputs_unsupported(training, inputs)
    return reason if reason is not None else kernels_unavailable(inputs.device)  # last: it may build


def _inputs_unsupported(training: bool, inputs: KernelInputs) -> str | None:
    dim, hidden = inputs.hidden_size, inputs.intermediate_size
    if inputs.dtype != KERNEL_DTYPE:
        return f"the kernels take bfloat16, got {inputs.dtype}"
    if dim % CUDA_ALIGN or not CUDA_ALIGN <= dim <= CUDA_MAX_DIM:
        return f"the kernels need D a multiple of {CUDA_ALIGN} in [{CUDA_ALIGN}, {CUDA_MAX_DIM}], got {dim}"
    if hidden % CUDA_ALIGN:
        return f"the kernels need H a multiple of {CUDA_ALIGN}, got {hidden}"
    if training and hidden > CUDA_TRAIN_MAX_HIDDEN:
        return f"the training kernels need H <= {CUDA_TRAIN_MAX_HIDDEN}, got {hidden}"
    if not inputs.contiguous:
        return "the kernels need contiguous weights"
    return None


def check_impl(impl: str, training: bool, inputs: KernelInputs) -> None:
    """What an op front checks of the implementation it is given: one of OP_IMPLS, and for 'cuda'
    that the kernels take these inputs (KernelsUnavailable with the reason where they do not)."""
    if impl not in OP_IMPLS:
        raise ValueError(
            f"impl must be 'reference' or 'cuda' (the implementation select_ffn decided), got {impl!r}"
        )
    reason = kernels_refuse(training, inputs) if impl == "cuda" else None
    if reason is not None:
        raise KernelsUnavailable(
            f"impl=cuda cannot run the kernels ({'train' if training else 'inference'}): {reason}"
        )


def kernel_inputs(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> KernelInputs:
    """What the kernels' support depends on, for an op's (checked) inputs: x [..., D], Wg, Wu [H, D],
    Wd [D, H]."""
    hidden, dim = wg.shape
    return KernelInputs(x.device, x.dtype, dim, hidden, all(t.is_contiguous() for t in (wg, wu, wd)))
