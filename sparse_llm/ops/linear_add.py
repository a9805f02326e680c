"""out += x @ W^T in place: a projection added into the residual stream by the GEMM itself.

Written out of place (`out + F.linear(x, W)`), the sum costs a pass over the stream after the
GEMM, or, as `addmm`, a copy of `out` before it. In place, the GEMM reads `out` in its epilogue
(beta = 1) and writes the sum over it. The op declares the mutation, so torch.compile keeps it in
place on an intermediate of the graph.
"""

from __future__ import annotations

import torch

from sparse_llm.ops.in_place import check_in_place_output


@torch.library.custom_op("sparse_llm::linear_add_", mutates_args=("out",))
def _linear_add_op(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out ([M, N]) += x ([M, K]) @ weight^T."""
    out.addmm_(x, weight.t())


@_linear_add_op.register_fake
def _(out, x, weight):
    return None


def linear_add_(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out += x @ weight^T in place (out: [..., N] contiguous, x: [..., K] with out's leading
    shape, weight: [N, K], one dtype and device); returns out. No autograd."""
    if not (out.dtype == x.dtype == weight.dtype) or not (out.device == x.device == weight.device):
        raise ValueError(
            f"out, x and weight must share dtype and device, got {out.dtype}/{out.device}, "
            f"{x.dtype}/{x.device}, {weight.dtype}/{weight.device}"
        )
    if (
        weight.dim() != 2
        or out.shape[:-1] != x.shape[:-1]
        or (out.shape[-1], x.shape[-1]) != tuple(weight.shape)
    ):
        raise ValueError(
            f"need out [..., N], x [..., K], weight [N, K]; got {tuple(out.shape)}, {tuple(x.shape)}, "
            f"{tuple(weight.shape)}"
        )
    check_in_place_output("linear_add_", out, (x, weight))
    # A 2-D view is what the op mutates: Inductor's scheduler fails (KeyError in compute_ancestors,
    # torch 2.11-2.13) on a custom op mutating a [B, 1, N] tensor, e.g. a decode step's residual.
    _linear_add_op(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]), weight)
    return out
