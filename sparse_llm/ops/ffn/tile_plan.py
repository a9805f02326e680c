"""Design 2's plan (docs/kernels.md, design review part 3): for each tile of `tile` consecutive
tokens, the union of the FFN units active (g > 0) on any of its tokens, on the device with no host
read, so that a tile's up/down can run as GEMMs over a panel of its units' weight rows.

    units, counts = tile_union_plan(g, tile)
    units   [tiles, H] int32  tile t's units, ascending, in units[t, :counts[t]] (the rest of its
                              row unspecified: each tile has a slot of H entries, so no size is read)
    counts  [tiles]    int32

tiles = ceil(M / tile), the last tile possibly short; tile a multiple of 8. bf16 g on a GPU where the
kernels run takes two CUDA kernels (kernels/tile_plan.cu: one read of g, then a CTA a tile); any
other g takes torch ops (the reference, the same answer).
"""

from __future__ import annotations

import torch

from sparse_llm.ops._extension import extension, kernels_unavailable

# What the kernels take (kernels/tile_plan.cuh): tiles of whole 8-row CTAs; H in 32-unit words, a
# row's words held in shared memory.
TILE_MULTIPLE = 8
KERNEL_UNIT_WORD = 32
KERNEL_MAX_HIDDEN = 49152


def check_plan_inputs(g: torch.Tensor, tile: int) -> None:
    if not isinstance(g, torch.Tensor) or g.dim() != 2 or not g.is_floating_point():
        raise ValueError(f"g must be a 2-D floating-point tensor [M, H], got {getattr(g, 'shape', type(g))}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0 or tile % TILE_MULTIPLE:
        raise ValueError(f"tile must be a positive multiple of {TILE_MULTIPLE}, got {tile!r}")


def runs_on_kernel(g: torch.Tensor) -> bool:
    """Whether tile_union_plan takes the CUDA kernels for `g`."""
    return (
        g.is_cuda
        and g.dtype == torch.bfloat16
        and g.is_contiguous()
        and g.shape[1] % KERNEL_UNIT_WORD == 0
        and g.shape[1] <= KERNEL_MAX_HIDDEN
        and g.data_ptr() % 16 == 0
        and kernels_unavailable(g.device) is None
    )


def tile_union_plan_reference(g: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan by torch ops (any device and float dtype); a tile's slot holds its units first,
    then the units it lacks, each ascending."""
    check_plan_inputs(g, tile)
    m, hidden = g.shape
    tiles = -(-m // tile)
    active = torch.zeros(tiles * tile, hidden, dtype=torch.bool, device=g.device)
    active[:m] = g > 0
    union = active.view(tiles, tile, hidden).any(dim=1)
    # A stable sort on "not in the union" puts the tile's units first, in ascending order.
    units = torch.sort((~union).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    return units, union.sum(dim=1, dtype=torch.int32)


def tile_union_plan(g: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(units, counts) of g: [M, H] (see the module doc), on g's device."""
    check_plan_inputs(g, tile)
    if runs_on_kernel(g):
        return extension().tile_union_plan(g, tile)
    return tile_union_plan_reference(g, tile)
