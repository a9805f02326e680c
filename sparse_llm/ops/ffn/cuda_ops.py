"""The inference FFN kernels as torch.library custom ops (with fake kernels, so torch.compile can
trace them). The training kernels' ops are sparse_llm.ops.ffn.training's."""

from __future__ import annotations

import torch

from sparse_llm.ops._extension import extension
from sparse_llm.ops.ffn.twell import SLOTS, n_tiles


@torch.library.custom_op("sparse_llm::twell_ffn_forward", mutates_args=())
def twell_ffn_forward(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wd_t: torch.Tensor | None,
    heavy_threshold: int,
) -> torch.Tensor:
    """x: [M, D]; wg, wu: [H, D]; wd: [D, H]; bf16 contiguous. wd_t: Wd^T ([H, D]) if the caller
    keeps one, else the op transposes Wd. Exact on every pattern."""
    return extension().ffn_forward(x, wg, wu, wd, wd_t, heavy_threshold)


@twell_ffn_forward.register_fake
def _(x, wg, wu, wd, wd_t, heavy_threshold):
    return x.new_empty(x.shape)


@torch.library.custom_op("sparse_llm::twell_ffn_add_", mutates_args=("out",))
def twell_ffn_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wd_t: torch.Tensor | None,
    heavy_threshold: int,
) -> None:
    """out += twell_ffn_forward(x, ...) in place (x, out: [M, D], bf16 contiguous, not
    overlapping). The declared mutation lets Inductor keep it in place on an intermediate such as
    the residual stream, where the rows with no active unit cost nothing."""
    extension().ffn_add_(out, x, wg, wu, wd, wd_t, heavy_threshold)


@twell_ffn_add_.register_fake
def _(out, x, wg, wu, wd, wd_t, heavy_threshold):
    return None


@torch.library.custom_op("sparse_llm::ffn_decode_add_", mutates_args=("out",))
def ffn_decode_add_(
    out: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd_t: torch.Tensor,
    splits: int = 0,
) -> None:
    """out += ffn(x) for a few rows (x: [M, D], M <= DECODE_MAX_ROWS; wg, wu, wd_t = Wd^T: [H, D];
    out: [M, D]; bf16 contiguous) with no host read, so a decode step can be captured in a
    CUDA graph (kernels/decode_ffn.cu). Exact on every pattern. `splits` is a speed knob for
    tuning: 0 for the kernels' plan (one row: the whole FFN in one launch), else up/down as its
    own launch over that many CTAs a row."""
    extension().ffn_decode_add_(out, x, wg, wu, wd_t, splits)


@ffn_decode_add_.register_fake
def _(out, x, wg, wu, wd_t, splits=0):
    return None


@torch.library.custom_op("sparse_llm::twell_pack", mutates_args=())
def twell_pack(
    g: torch.Tensor, heavy_threshold: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """relu(g) ([M, H] bf16) into TwELL: (values, cols, counts, row_nnz, heavy)."""
    return tuple(extension().twell_pack(g, heavy_threshold))


@twell_pack.register_fake
def _(g, heavy_threshold):
    rows, tiles = g.shape[0], n_tiles(g.shape[1])
    return (
        g.new_empty(rows, tiles, SLOTS),
        g.new_empty(rows, tiles, SLOTS, dtype=torch.uint8),
        g.new_empty(rows, tiles, dtype=torch.int32),
        g.new_empty(rows, dtype=torch.int32),
        g.new_empty(rows, dtype=torch.bool),
    )
