"""Design 2's plan (docs/kernels.md, design review part 3): for each tile of `tile` consecutive
tokens, the union of the FFN units active (g > 0) on any of its tokens, on the device with no host
read, so that a tile's up/down can run as GEMMs over a panel of its units' weight rows.

    plan = tile_union_plan(g, tile, row_layout=False)
    plan.units       [tiles, H] int32  tile t's units, ascending, in units[t, :counts[t]] (the rest of
                                       its row unspecified: each tile has a slot of H entries, so no
                                       size is read)
    plan.counts      [tiles]    int32
    plan.row_words   [M, H/32]  int32  with row_layout: bit b of row_words[r, w] set where unit
                                       32 w + b is active on row r (else None)
    plan.row_ranks   [M, H/32]  int32  with row_layout: row r's active units below unit 32 w

The row layout places an entry (r, u) in a record of the rows' active entries (ascending by unit
within a row): at the row's offset + row_ranks[r, u // 32] + the set bits of row_words[r, u // 32]
below bit u % 32. tiles = ceil(M / tile), the last tile possibly short; tile a multiple of 8. bf16 g
on a GPU where the kernels run takes two CUDA kernels (kernels/tile_plan.cu: one read of g, then a
CTA a tile); any other g takes torch ops (the reference, the same answer).

A backward that keeps no [M, H] tensor has the forward's record instead (each row's active units,
ascending, at row_ptr[r] ... row_ptr[r + 1]): `tile_union_plan_from_record(row_ptr, cols, H, tile)`
gives the same plan and row layout from it, a row's ranks only at its words with an active unit
(the only ones the layout is read at).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparse_llm.ops._extension import extension, kernels_unavailable

# What the kernels take (kernels/tile_plan.cuh): tiles of whole 8-row CTAs; H in 32-unit words, a
# row's words held in shared memory.
TILE_MULTIPLE = 8
KERNEL_UNIT_WORD = 32
KERNEL_MAX_HIDDEN = 49152
MAX_TILE = 1 << 30  # the kernels take the tile as an int


class TileUnionPlan(NamedTuple):
    units: torch.Tensor
    counts: torch.Tensor
    row_words: torch.Tensor | None = None
    row_ranks: torch.Tensor | None = None


def _check_tile(tile: int, multiple: int) -> None:
    if isinstance(tile, bool) or not isinstance(tile, int) or not 0 < tile <= MAX_TILE or tile % multiple:
        kind = f"a positive multiple of {multiple}" if multiple > 1 else "a positive int"
        raise ValueError(f"tile must be {kind}, at most {MAX_TILE}, got {tile!r}")


def check_plan_inputs(g: torch.Tensor, tile: int, row_layout: bool = False) -> None:
    if not isinstance(g, torch.Tensor) or g.dim() != 2 or not g.is_floating_point():
        raise ValueError(f"g must be a 2-D floating-point tensor [M, H], got {getattr(g, 'shape', type(g))}")
    _check_tile(tile, TILE_MULTIPLE)
    if row_layout and g.shape[1] % KERNEL_UNIT_WORD:
        raise ValueError(f"the row layout needs H a multiple of {KERNEL_UNIT_WORD}, got {g.shape[1]}")


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


def row_layout_reference(active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_words, row_ranks) of active [M, H] (bool; H a multiple of 32) by torch ops."""
    m, hidden = active.shape
    groups = active.view(m, hidden // KERNEL_UNIT_WORD, KERNEL_UNIT_WORD)
    bit = torch.ones(KERNEL_UNIT_WORD, dtype=torch.int64, device=active.device) << torch.arange(
        KERNEL_UNIT_WORD, device=active.device
    )
    counts = groups.sum(dim=2, dtype=torch.int32)
    # Words above 2^31 wrap to negative int32: the same 32 bits.
    words = (groups.to(torch.int64) * bit).sum(dim=2).to(torch.int32)
    return words, counts.cumsum(dim=1, dtype=torch.int32) - counts


def tile_union_plan_reference(g: torch.Tensor, tile: int, row_layout: bool = False) -> TileUnionPlan:
    """The plan by torch ops (any device and float dtype)."""
    check_plan_inputs(g, tile, row_layout)
    active = g > 0
    units, counts = _union_reference(active, tile)
    if not row_layout:
        return TileUnionPlan(units, counts)
    return TileUnionPlan(units, counts, *row_layout_reference(active))


def _union_reference(active: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(units, counts) of active [M, H] (bool) by torch ops; a tile's slot holds its units first,
    then the units it lacks, each ascending."""
    m, hidden = active.shape
    tiles = -(-m // tile)
    padded = torch.zeros(tiles * tile, hidden, dtype=torch.bool, device=active.device)
    padded[:m] = active
    union = padded.view(tiles, tile, hidden).any(dim=1)
    # A stable sort on "not in the union" puts the tile's units first, in ascending order.
    units = torch.sort((~union).to(torch.uint8), dim=1, stable=True).indices.to(torch.int32)
    return units, union.sum(dim=1, dtype=torch.int32)


def tile_union_plan(g: torch.Tensor, tile: int, row_layout: bool = False) -> TileUnionPlan:
    """The plan of g: [M, H] (see the module doc), on g's device."""
    check_plan_inputs(g, tile, row_layout)
    if not runs_on_kernel(g):
        return tile_union_plan_reference(g, tile, row_layout)
    units, counts, row_words, row_ranks = extension().tile_union_plan(g, tile, row_layout)
    return TileUnionPlan(units, counts, row_words, row_ranks) if row_layout else TileUnionPlan(units, counts)


def check_record(row_ptr: torch.Tensor, cols: torch.Tensor, hidden: int, tile: int) -> None:
    if row_ptr.dim() != 1 or row_ptr.numel() < 1 or row_ptr.dtype != torch.int64:
        raise ValueError(
            f"row_ptr must be 1-D int64 with M + 1 offsets, got {row_ptr.dtype} {tuple(row_ptr.shape)}"
        )
    if cols.dim() != 1 or cols.dtype != torch.int32:
        raise ValueError(f"cols must be 1-D int32, got {cols.dtype} {tuple(cols.shape)}")
    if row_ptr.device != cols.device:
        raise ValueError(f"row_ptr and cols must be on one device, got {row_ptr.device} and {cols.device}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden <= 0 or hidden % KERNEL_UNIT_WORD:
        raise ValueError(f"hidden must be a positive multiple of {KERNEL_UNIT_WORD}, got {hidden!r}")
    _check_tile(tile, 1)


def tile_union_plan_from_record_reference(
    row_ptr: torch.Tensor, cols: torch.Tensor, hidden: int, tile: int
) -> TileUnionPlan:
    """The plan and row layout of the record's activation, by torch ops."""
    check_record(row_ptr, cols, hidden, tile)
    m = row_ptr.numel() - 1
    rows = torch.repeat_interleave(torch.arange(m, device=cols.device), row_ptr.diff())
    active = torch.zeros(m, hidden, dtype=torch.bool, device=cols.device)
    active[rows, cols.long()] = True
    return TileUnionPlan(*_union_reference(active, tile), *row_layout_reference(active))


def tile_union_plan_from_record(
    row_ptr: torch.Tensor, cols: torch.Tensor, hidden: int, tile: int
) -> TileUnionPlan:
    """(units, counts, row_words, row_ranks) of the activation whose record is (row_ptr, cols); on a
    GPU where the kernels run, the kernels (row_ranks unspecified at a row's words without an entry).
    The record is trusted, not read on the host: row_ptr from 0, non-decreasing, ending at cols'
    length; cols in [0, hidden), ascending within a row (the training forward's record)."""
    check_record(row_ptr, cols, hidden, tile)
    if (
        not (
            cols.is_cuda and hidden <= KERNEL_MAX_HIDDEN and row_ptr.is_contiguous() and cols.is_contiguous()
        )
        or kernels_unavailable(cols.device) is not None
    ):
        return tile_union_plan_from_record_reference(row_ptr, cols, hidden, tile)
    return TileUnionPlan(*extension().tile_union_plan_from_record(row_ptr, cols, hidden, tile))
