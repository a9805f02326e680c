"""TwELL (tile-wise ELLPACK) activation format, in plain PyTorch (runs on CPU; the test oracle).

The H columns of a = relu(g) are cut into tiles of TILE columns. Each (row, tile) stores up to
SLOTS non-zeros as (value, column-in-tile) pairs, in column order, plus its true count. A count
above SLOTS marks an overflowed tile; such rows, and rows with more than `heavy_threshold`
non-zeros, are flagged heavy and take the exact dense path: the format never silently drops data.
Must match kernels/twell.cuh.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

TILE = 128  # columns per tile: the gate GEMM's N tile
SLOTS = 16  # stored non-zeros per (row, tile): TILE / C with compression factor C = 8


class TwellPacked(NamedTuple):
    values: torch.Tensor  # [M, n_tiles, SLOTS], dtype of g; slots past min(count, SLOTS): 0 (the
    # CUDA packs leave empty tiles' slots unwritten: readers stop at the count)
    cols: torch.Tensor  # [M, n_tiles, SLOTS] uint8, column inside the tile
    counts: torch.Tensor  # [M, n_tiles] int32, true non-zeros of the tile (may exceed SLOTS)
    row_nnz: torch.Tensor  # [M] int32, true non-zeros of the row
    heavy: torch.Tensor  # [M] bool: the row overflows a tile or holds > heavy_threshold non-zeros


def n_tiles(hidden: int) -> int:
    return (hidden + TILE - 1) // TILE


def twell_pack_reference(g: torch.Tensor, heavy_threshold: int) -> TwellPacked:
    """Pack relu(g) ([M, H]) into TwELL (unused slots hold zero, as in the CUDA kernel)."""
    if g.dim() != 2:
        raise ValueError(f"g must be [M, H], got shape {tuple(g.shape)}")
    if heavy_threshold < 0:
        raise ValueError(f"heavy_threshold must be >= 0, got {heavy_threshold}")
    rows, hidden = g.shape
    tiles = n_tiles(hidden)
    a = torch.zeros(rows, tiles * TILE, dtype=g.dtype, device=g.device)
    a[:, :hidden] = torch.relu(g)
    a = a.view(rows, tiles, TILE)
    nonzero = a > 0
    rank = nonzero.to(torch.int32).cumsum(dim=-1) - 1  # slot of each non-zero inside its tile
    keep = nonzero & (rank < SLOTS)
    m_idx, t_idx, c_idx = keep.nonzero(as_tuple=True)
    s_idx = rank[m_idx, t_idx, c_idx].long()
    values = torch.zeros(rows, tiles, SLOTS, dtype=g.dtype, device=g.device)
    cols = torch.zeros(rows, tiles, SLOTS, dtype=torch.uint8, device=g.device)
    values[m_idx, t_idx, s_idx] = a[m_idx, t_idx, c_idx]
    cols[m_idx, t_idx, s_idx] = c_idx.to(torch.uint8)
    counts = nonzero.sum(dim=-1, dtype=torch.int32)
    row_nnz = counts.sum(dim=-1, dtype=torch.int32)
    heavy = (row_nnz > heavy_threshold) | (counts > SLOTS).any(dim=-1)
    return TwellPacked(values, cols, counts, row_nnz, heavy)


def twell_unpack(packed: TwellPacked, hidden: int) -> torch.Tensor:
    """Dense a ([M, H]) from the stored slots; rows with an overflowed tile raise (they are not stored)."""
    values, cols, counts = packed.values, packed.cols, packed.counts
    if bool((counts > SLOTS).any()):
        raise ValueError("some tiles overflowed their slots: those rows live on the dense path only")
    rows, tiles, _ = values.shape
    valid = torch.arange(SLOTS, device=values.device) < counts.unsqueeze(-1).long()
    m_idx, t_idx, s_idx = valid.nonzero(as_tuple=True)
    dense = torch.zeros(rows, tiles * TILE, dtype=values.dtype, device=values.device)
    dense[m_idx, t_idx * TILE + cols[m_idx, t_idx, s_idx].long()] = values[m_idx, t_idx, s_idx]
    return dense[:, :hidden]
