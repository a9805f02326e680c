"""The training FFN front: `ffn_forward_train`, differentiable, with the sparsity statistics.

    out = ffn_forward_train(x, Wg, Wu, Wd, impl="auto")
    out.y              [..., D]  like x; differentiable in x, Wg, Wu, Wd
    out.l0             []        mean number of active units (relu(g) > 0) per token (float32,
                                 float64 for float64 inputs)
    out.l1             []        mean over tokens of sum over units of |h| (float32, float64 for
                                 float64 inputs); differentiable
    out.nnz_per_token  [M] int64 active units per token (M = x.numel() // D, row-major)
    out.fire_counts    [H] int64 tokens on which each unit fired

so a model takes its FFNStats (l1, nnz_per_token, fire_counts) straight from one call, with no
second pass over the activations. The L1 weight lambda enters through autograd: the loss
`ce + lambda * mean_layers(l1)` hands each layer grad_l1 = lambda / L, and the backward op
consumes grad_y and grad_l1 together (dh = grad_y Wd + grad_l1 * sign(h) / M), so the L1
gradient costs no separate pass. Autograd saves x, the weights and a compact record of the
active entries (sparse_llm.ops.train_reference), never a dense M x H tensor.

Under autocast the op runs in the autocast dtype (inputs cast as autocast casts a matmul's);
gradients reach fp32 master weights through those casts.
"""

from __future__ import annotations

import warnings
from typing import Literal, NamedTuple

import torch

from sparse_llm.ops import train_ops
from sparse_llm.ops.checks import DEFAULT_HEAVY_THRESHOLD, check_ffn_inputs, check_heavy_threshold
from sparse_llm.ops.precision import autocast_dtype
from sparse_llm.ops.select import select_for_tensors
from sparse_llm.ops.train_reference import acc_dtype

TrainImpl = Literal["auto", "cuda", "reference"]


class FFNTrainOutput(NamedTuple):
    y: torch.Tensor
    l0: torch.Tensor
    l1: torch.Tensor
    nnz_per_token: torch.Tensor
    fire_counts: torch.Tensor


def resolve_train_impl(
    impl: str, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor
) -> str:
    """'cuda' or 'reference' for these (checked) inputs, as `ops.select` decides for the train
    phase: 'auto' takes the CUDA kernels where they can run and the reference elsewhere (with a
    warning when the tensors are on a GPU: the reference is exact but slower than dense there);
    'cuda' raises with the reason instead of falling back."""
    if impl not in ("auto", "cuda", "reference"):
        raise ValueError(f"impl must be 'auto', 'cuda' or 'reference', got {impl!r}")
    selection = select_for_tensors(impl, "train", x, wg, wu, wd)
    if selection.impl == "cuda":
        return "cuda"
    if impl == "auto" and x.is_cuda and not torch.compiler.is_compiling():
        warnings.warn(
            f"sparse training FFN: the CUDA training kernels cannot run ({selection.reason}); "
            "using the reference",
            stacklevel=5,  # the caller of ffn_forward_train or ffn_block_train
        )
    return "reference"


def prepare_train_weights(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, impl: str, heavy_threshold: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """(Wg, Wu, Wd cast as autocast casts a matmul's and made contiguous, the resolved impl), after
    checking them against the FFN's input x (already in the compute dtype)."""
    dtype = autocast_dtype(x)
    if dtype is not None:
        wg, wu, wd = (t.to(dtype) for t in (wg, wu, wd))
    check_ffn_inputs(x, wg, wu, wd)
    wg, wu, wd = wg.contiguous(), wu.contiguous(), wd.contiguous()
    return wg, wu, wd, _resolve_checked(x, wg, wu, wd, impl, heavy_threshold)


def check_train_weights(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, impl: str, heavy_threshold: int
) -> str:
    """The resolved impl, after checking the weights (one float dtype, possibly wider than x's:
    master weights that the caller casts) against the FFN's input x, in the compute dtype."""
    check_ffn_inputs(x.new_empty((0, x.shape[-1]), dtype=wg.dtype), wg, wu, wd)
    return _resolve_checked(x, wg, wu, wd, impl, heavy_threshold)


def _resolve_checked(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, impl: str, heavy_threshold: int
) -> str:
    """The resolved impl for inputs that passed check_ffn_inputs, after checking heavy_threshold."""
    check_heavy_threshold(heavy_threshold, inference=False)
    return resolve_train_impl(impl, x, wg, wu, wd)


def ffn_forward_train(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: TrainImpl = "auto",
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
) -> FFNTrainOutput:
    """Training forward of y = (relu(x Wg^T) * (x Wu^T)) Wd^T with L0, L1 and the unit counts.

    x: [..., D]; Wg, Wu: [H, D]; Wd: [D, H] (Hugging Face layout). impl: 'auto' (the CUDA kernels
    where they can run, else the reference), 'cuda' or 'reference'. Exact on every pattern. See
    the module docstring for the outputs and how the L1 gradient is fused. On the CUDA path, rows
    with more than `heavy_threshold` active units take dense GEMMs on the gathered rows (a speed
    knob: any value is exact); the forward reads the numbers of active entries and heavy rows on
    the host once (they size the records and the GEMMs) while the GPU packs and projects the light
    rows, and the backward reads nothing."""
    dtype = autocast_dtype(x)
    if dtype is not None:
        x = x.to(dtype)
    wg, wu, wd, impl = prepare_train_weights(x, wg, wu, wd, impl, heavy_threshold)
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y, l1, nnz_per_token, fire_counts, *_ = train_ops.train_forward(impl, x2, wg, wu, wd, heavy_threshold)
    l0 = nnz_per_token.to(acc_dtype(x.dtype)).mean()
    return FFNTrainOutput(y.view(x.shape), l0, l1, nnz_per_token, fire_counts)
