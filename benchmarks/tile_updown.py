"""Design 2 of issue 50 (docs/kernels.md, design review parts 2 and 3) as a measured prototype: the
training op's up/down and its backward's dh and dx, computed per tile of T consecutive tokens over
the union of the units active in that tile, as tensor-core GEMMs whose weight operand is a panel of
gathered rows (Triton), instead of the op's per-entry kernels (`csr_updown`, the backward's rows
kernel: a weight row read per active entry) and its heavy rows' GEMMs over all H.

Every row takes the one path: a tile whose union is all of H is a dense GEMM, a tile with few
units a thin one. Its matmul work is `row_density.py`'s tile bound; what this measures is whether
the tensor cores and the panel's reuse (a unit's row loaded once a tile, not once an entry) beat
the per-entry reads the op pays at every density.

    python -m benchmarks.tile_updown --nnz 5 30 100 --tile 64 128 --block-u 64 128 --sorted
    python -m benchmarks.tile_updown --model runs/sparse_1b --inputs DIR --layers 0 3 12 16 17

On the synthetic workload of `benchmarks/ffn.py`, or with `--model` on a trained model's layers
(their FFN inputs from one forward over held-out text, or those `row_density.py --save-inputs`
kept: `--inputs`), per case: the error of y against float64 next to the dense bf16 path's; the GPU
time of the plan (the tiles' unions, with torch ops) and of the two up/down kernels; the package's
plan on the device (`ops.ffn.tile_plan`: two CUDA kernels, no host read) and the kernels driven by
it (a slot of H units a tile; the y it gives must equal the other plan's); the kernels as the
training op would run them: the forward's (the h kernel also writing u at the active entries into
the op's record and its share of L1) and the backward's (dh over the union, dg and du at the
record's entries, for the per-unit weight gradients, then dx), with their errors against the
references (the record's layout, each row's active units as words and their ranks, from the plan's
kernels, timed with the plan: the count pass would write it); the op's forward, its forward less the gate GEMM and
its backward (`ffn_forward_train`); and the dense up/down.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from benchmarks import common
from benchmarks.row_density import lowest_unit_order, model_inputs, model_parser
from sparse_llm.ops._extension import extension
from sparse_llm.ops.activation_counts import activation_counts
from sparse_llm.ops.ffn.tile_plan import TileUnionPlan, tile_union_plan, tile_union_plan_from_record

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the plan and its PyTorch reference only
    triton = None

# Units a program of the h kernel computes, and a panel of the y kernel reduces over: the plan's
# padding. Larger blocks read fewer bytes from L2 per FLOP (docs/kernels.md, design review part 2).
DEFAULT_BLOCK_U = 64


@dataclass(frozen=True)
class TilePlan:
    """Each tile's union of active units, laid out block by block: tile t's units are
    units[starts[t] : starts[t] + counts[t]] (ascending), padded with unit 0 up to the next
    multiple of block_u (the padding is masked out)."""

    tile: int
    block_u: int
    units: torch.Tensor  # int32 [starts[-1]]
    starts: torch.Tensor  # int32 [tiles + 1], multiples of block_u
    counts: torch.Tensor  # int32 [tiles]
    max_blocks: int  # the most blocks a tile has (the launch grid's second dimension)
    slots: bool = False  # each tile's units in a slot of H entries (the device's plan), not packed

    @classmethod
    def in_slots(cls, found: TileUnionPlan, tile: int, block_u: int) -> TilePlan:
        """The device's plan (`ops.ffn.tile_plan`) as the kernels take it: tile t's blocks start at
        t * H and the grid covers H / block_u blocks a tile, those past its count returning at once."""
        tiles, hidden = found.units.shape
        starts = torch.arange(0, (tiles + 1) * hidden, hidden, dtype=torch.int32, device=found.units.device)
        return cls(tile, block_u, found.units.view(-1), starts, found.counts, hidden // block_u, slots=True)


@dataclass(frozen=True)
class Launch:
    """How the Triton kernels are launched: warps a program and software-pipeline stages of their
    K loops (Triton's own defaults: 4 and 3)."""

    num_warps: int = 4
    num_stages: int = 3

    def kwargs(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def slot_plan(g: torch.Tensor, tile: int, block_u: int = DEFAULT_BLOCK_U) -> TilePlan:
    """The package's plan of g (`tile_union_plan`: on the device, no host read), in slots."""
    m, hidden = g.shape
    if m % tile or hidden % block_u:
        raise ValueError(
            f"M = {m} and H = {hidden} must be multiples of the tile ({tile}) and block ({block_u})"
        )
    return TilePlan.in_slots(tile_union_plan(g, tile), tile, block_u)


def tile_plan(active: torch.Tensor, tile: int, block_u: int = DEFAULT_BLOCK_U) -> TilePlan:
    """The plan of active [M, H] (bool; M a multiple of `tile`)."""
    m, h = active.shape
    if m % tile:
        raise ValueError(f"M = {m} tokens is not a multiple of the tile ({tile})")
    union = active.view(m // tile, tile, h).any(dim=1)
    counts = union.sum(dim=1)
    padded = (counts + block_u - 1) // block_u * block_u
    starts = torch.zeros(len(counts) + 1, dtype=torch.long, device=active.device)
    torch.cumsum(padded, 0, out=starts[1:])
    pairs = union.nonzero()  # (tile, unit), tile-major and ascending: each tile's units in order
    first_of_tile = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(pairs), device=active.device) - first_of_tile[pairs[:, 0]]
    units = torch.zeros(int(starts[-1]), dtype=torch.int32, device=active.device)
    units[starts[pairs[:, 0]] + position] = pairs[:, 1].to(torch.int32)
    blocks = max(1, int(padded.max()) // block_u)  # a grid dimension: at least 1
    return TilePlan(tile, block_u, units, starts.to(torch.int32), counts.to(torch.int32), blocks)


def tile_updown_reference(
    x: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, plan: TilePlan
) -> torch.Tensor:
    """The tile computation in PyTorch (any device), rounding as the kernels do: u to the input
    dtype, h = relu(g) * u rounded, y = h Wd[:, union]^T accumulated in float32 (or wider)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = torch.empty(x.shape[0], wd.shape[0], device=x.device, dtype=x.dtype)
    for t in range(len(plan.counts)):
        rows = slice(t * plan.tile, (t + 1) * plan.tile)
        start = int(plan.starts[t])
        units = plan.units[start : start + int(plan.counts[t])].long()
        u = (x[rows].to(acc) @ wu[units].to(acc).T).to(x.dtype)
        h = (torch.relu(g[rows][:, units]).to(acc) * u.to(acc)).to(x.dtype)
        y[rows] = (h.to(acc) @ wd[:, units].to(acc).T).to(x.dtype)
    return y


@dataclass(frozen=True)
class RecordLayout:
    """Where the forward writes u for the backward: the training op's record, CSR over the rows
    (entries of a row ascending by unit, row r's at row_ptr[r] ...), and what finds an entry's place
    from its (row, unit): each row's active units as 32-unit words and each word's rank in the row
    (`ops.ffn.tile_plan`'s row layout)."""

    words: torch.Tensor  # int32 [M, H / 32]: bit b of word w set where unit 32 w + b is active
    ranks: torch.Tensor  # int32 [M, H / 32]: the row's active units before word w
    row_ptr: torch.Tensor  # int64 [M + 1]: the record's row offsets
    entries: int  # the record's length, row_ptr[-1], known on the host

    @classmethod
    def of(cls, g: torch.Tensor, tile: int = 64) -> RecordLayout:
        """The layout of g's active entries, by the package's plan (CUDA kernels on a GPU)."""
        if g.shape[1] % 32:
            raise ValueError(f"H = {g.shape[1]} is not a multiple of 32")
        plan = tile_union_plan(g, tile, row_layout=True)
        row_ptr = torch.zeros(len(g) + 1, dtype=torch.int64, device=g.device)
        torch.cumsum((g > 0).sum(dim=1), 0, out=row_ptr[1:])
        return cls(plan.row_words, plan.row_ranks, row_ptr, int(row_ptr[-1]))


def tile_forward_reference(
    x: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, g: torch.Tensor, plan: TilePlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, L1 summed over the rows, u at the active entries in the record's order): what the
    training forward's up/down owes the op, y by the tile computation, u rounded to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    u = (x.to(acc) @ wu.to(acc).T).to(x.dtype)
    l1 = (torch.relu(g).to(acc) * u.to(acc)).abs().sum()
    return tile_updown_reference(x, wu, wd, g, plan), l1, u[g > 0]


def tile_backward_reference(
    grad_y: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    active: torch.Tensor,
    a_record: torch.Tensor,
    u_record: torch.Tensor,
    l1_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dg and du at the active entries in the record's order) of the training backward from the
    record (a = relu(g) and u at the active entries): dh = grad_y Wd + l1_scale sign(h) there,
    dg = dh u, du = dh a, dx = dg Wg + du Wu, in float32 (or wider)."""
    acc = torch.promote_types(grad_y.dtype, torch.float32)
    a = torch.zeros(active.shape, dtype=acc, device=active.device)
    u = torch.zeros_like(a)
    a[active], u[active] = a_record.to(acc), u_record.to(acc)
    dh = grad_y.to(acc) @ wd.to(acc) + l1_scale * torch.sign(u) * active
    dg, du = dh * u, dh * a
    return dg @ wg.to(acc) + du @ wu.to(acc), dg[active], du[active]


def weight_grads_reference(
    x: torch.Tensor,
    grad_y: torch.Tensor,
    active: torch.Tensor,
    a_record: torch.Tensor,
    u_record: torch.Tensor,
    dg_record: torch.Tensor,
    du_record: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dWg, dWu, dWd) from the record and dg, du at its entries, in float32 (or wider): dWg = dg^T x,
    dWu = du^T x, dWd = grad_y^T h with h = a u at the entries."""
    acc = torch.promote_types(x.dtype, torch.float32)

    def dense(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(active.shape, dtype=acc, device=active.device)
        out[active] = values.to(acc)
        return out

    h = dense(a_record) * dense(u_record)
    return dense(dg_record).T @ x.to(acc), dense(du_record).T @ x.to(acc), grad_y.to(acc).T @ h


def split_weight_grads(
    x: torch.Tensor,
    grad_y: torch.Tensor,
    row_ptr: torch.Tensor,
    cols: torch.Tensor,
    records: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    hidden: int,
    heavy_threshold: int,
    per_unit: Callable[..., tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dWg, dWu, dWd) in float32 as the op splits them: the rows with more than `heavy_threshold`
    active units by GEMMs over those rows (their dg, du and h = a u scattered into [rows, H] blocks of
    x's dtype, the products rounded to it as a bf16 GEMM's output is), the other rows' entries by
    `per_unit` (`csr_weight_grads`'s signature: the per-unit kernel). `records`: a, u, dg and du at the
    record's entries (CSR over the rows by `row_ptr`, columns `cols`)."""
    a, u, dg, du = records
    nnz = row_ptr.diff()
    heavy = nnz > heavy_threshold
    entry_rows = torch.repeat_interleave(torch.arange(len(nnz), device=x.device), nnz)
    in_heavy = heavy[entry_rows]
    light = ~in_heavy
    light_row_ptr = torch.zeros_like(row_ptr)
    torch.cumsum(nnz.masked_fill(heavy, 0), 0, out=light_row_ptr[1:])
    dwg, dwu, dwd = per_unit(
        x, grad_y, light_row_ptr, cols[light], a[light], u[light], dg[light], du[light], hidden, torch.float32
    )
    heavy_rows = heavy.nonzero().squeeze(1)
    position = torch.full_like(nnz, -1)
    position[heavy_rows] = torch.arange(len(heavy_rows), device=x.device)
    at = (position[entry_rows[in_heavy]], cols[in_heavy].long())

    def block(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(heavy_rows), hidden, device=x.device, dtype=x.dtype)
        out[at] = values.to(x.dtype)
        return out

    h = a[in_heavy].float() * u[in_heavy].float()
    x_heavy, grad_y_heavy = x[heavy_rows], grad_y[heavy_rows]
    dwg += (block(dg[in_heavy]).T @ x_heavy).float()
    dwu += (block(du[in_heavy]).T @ x_heavy).float()
    dwd += (grad_y_heavy.T @ block(h)).float()
    return dwg, dwu, dwd


if triton is not None:

    @triton.jit
    def _panel_product(a_ptr, w_ptr, rows, units, live, D, TILE: tl.constexpr, BLOCK_U: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
        # a[rows] W[units]^T [TILE, BLOCK_U] in float32: the tile's rows of a [M, D] against a panel of
        # gathered rows of W [H, D] (units past the tile's count, `live` false, read as zero rows).
        k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((TILE, BLOCK_U), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            a = tl.load(a_ptr + rows[:, None] * D + k0 + k[None, :])
            w = tl.load(w_ptr + units[None, :] * D + k0 + k[:, None], mask=live[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
        return acc

    @triton.jit
    def _block_units(units_ptr, starts_ptr, count, t, block, TILE: tl.constexpr, BLOCK_U: tl.constexpr):
        # A (tile, block) program's place in the plan: which of the block's columns hold a unit (none
        # past the tile's count), those units, the tile's rows, and where the block's [TILE, BLOCK_U]
        # values sit in the tiles' blocks (stored contiguous from the block's first slot).
        start = tl.load(starts_ptr + t) + block * BLOCK_U
        cols = tl.arange(0, BLOCK_U)
        live = block * BLOCK_U + cols < count
        units = tl.load(units_ptr + start + cols, mask=live, other=0).to(tl.int64)
        rows = (t * TILE + tl.arange(0, TILE)).to(tl.int64)
        at = start.to(tl.int64) * TILE + tl.arange(0, TILE)[:, None] * BLOCK_U + cols[None, :]
        return live, units, rows, at

    @triton.jit
    def _popcount32(v):
        # Bits set in the low 32 bits of int64 v (SWAR: pairs, nibbles, bytes, then their sum).
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return ((v * 0x01010101) & 0xFFFFFFFF) >> 24

    @triton.jit
    def _row_words(words_ptr, rows, units, live, H):
        # Each (row, unit)'s 32-unit word of the row layout, as the 32 bits in an int64.
        at = rows[:, None] * (H // 32) + (units // 32)[None, :]
        return at, tl.load(words_ptr + at, mask=live[None, :], other=0).to(tl.int64) & 0xFFFFFFFF

    @triton.jit
    def _entry_place(word_at, word, ranks_ptr, row_ptr_ptr, rows, units, active):
        # Where the active (row, unit) entries sit in the record: the row's offset, the word's rank in
        # the row, and the row's units below the unit in its word.
        below = word & ((tl.full(units.shape, 1, tl.int64) << (units % 32)) - 1)[None, :]
        rank = tl.load(ranks_ptr + word_at, mask=active, other=0).to(tl.int64) + _popcount32(below)
        return tl.load(row_ptr_ptr + rows)[:, None] + rank

    @triton.jit
    def _union_block_product(acc, blocks_ptr, w_ptr, at, units, live, n, D):
        # acc + a tile's [TILE, BLOCK_U] block (stored contiguous at `at`) times the gathered rows
        # W[units, n] of W [H, D].
        w = tl.load(w_ptr + units[:, None] * D + n[None, :], mask=live[:, None], other=0.0)
        return tl.dot(tl.load(blocks_ptr + at), w, acc)

    @triton.jit
    def _h_block(x_ptr, wu_ptr, g_ptr, h_ptr, live, units, rows, at, D, H,
                 TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        # A (tile, block) program's h = relu(g) * (x_tile Wu[units]^T), stored at `at` in h's dtype;
        # returns u as stored, g and h (float32) for the caller's epilogue.
        u_stored = _panel_product(x_ptr, wu_ptr, rows, units, live, D, TILE, BLOCK_U, BLOCK_K)
        u_stored = u_stored.to(h_ptr.dtype.element_ty)
        g = tl.load(g_ptr + rows[:, None] * H + units[None, :], mask=live[None, :], other=0.0).to(tl.float32)
        h = tl.maximum(g, 0.0) * u_stored.to(tl.float32)
        tl.store(h_ptr + at, h.to(h_ptr.dtype.element_ty))
        return u_stored, g, h

    @triton.jit
    def _tile_h_kernel(
        x_ptr, wu_ptr, g_ptr, units_ptr, starts_ptr, counts_ptr, h_ptr, D, H,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, block): h[tile rows, the block's units] = relu(g) * (x_tile Wu[units]^T),
        # stored as one contiguous [TILE, BLOCK_U] block of the tile's h.
        t = tl.program_id(0)
        block = tl.program_id(1)
        count = tl.load(counts_ptr + t)
        if block * BLOCK_U >= count:
            return
        live, units, rows, at = _block_units(units_ptr, starts_ptr, count, t, block, TILE, BLOCK_U)
        _h_block(x_ptr, wu_ptr, g_ptr, h_ptr, live, units, rows, at, D, H, TILE, BLOCK_U, BLOCK_K)

    @triton.jit
    def _tile_h_record_kernel(
        x_ptr, wu_ptr, g_ptr, units_ptr, starts_ptr, counts_ptr, h_ptr,
        words_ptr, ranks_ptr, row_ptr_ptr, u_rec_ptr, l1_ptr, D, H, MAX_BLOCKS,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # _tile_h_kernel's block of h, and what the training forward owes its backward: u at the
        # block's active entries, stored at their places in the record (the row's offset plus the
        # unit's rank in the row), and the block's sum of |h| (added in a fixed order afterwards).
        t = tl.program_id(0)
        block = tl.program_id(1)
        count = tl.load(counts_ptr + t)
        if block * BLOCK_U >= count:
            return
        live, units, rows, at = _block_units(units_ptr, starts_ptr, count, t, block, TILE, BLOCK_U)
        u_stored, g, h = _h_block(
            x_ptr, wu_ptr, g_ptr, h_ptr, live, units, rows, at, D, H, TILE, BLOCK_U, BLOCK_K
        )
        tl.store(l1_ptr + t * MAX_BLOCKS + block, tl.sum(tl.sum(tl.abs(h), axis=1), axis=0))
        active = (g > 0.0) & live[None, :]
        word_at, word = _row_words(words_ptr, rows, units, live, H)
        place = _entry_place(word_at, word, ranks_ptr, row_ptr_ptr, rows, units, active)
        tl.store(u_rec_ptr + place, u_stored, mask=active)

    @triton.jit
    def _tile_dgdu_kernel(
        gy_ptr, wdt_ptr, units_ptr, starts_ptr, counts_ptr, words_ptr, ranks_ptr, row_ptr_ptr,
        a_rec_ptr, u_rec_ptr, dg_rec_ptr, du_rec_ptr, dg_ptr, du_ptr, l1_scale, D, H,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, block): dh[tile rows, the block's units] = grad_y_tile Wd[:, units] (one
        # GEMM over D), then at the active entries (the row's words say which; the record holds a and
        # u there) dh + l1_scale sign(h), dg = dh u and du = dh a: written at their places in the
        # record (float32, for the per-unit weight gradients) and as the tile's blocks (for dx).
        t = tl.program_id(0)
        block = tl.program_id(1)
        count = tl.load(counts_ptr + t)
        if block * BLOCK_U >= count:
            return
        live, units, rows, at = _block_units(units_ptr, starts_ptr, count, t, block, TILE, BLOCK_U)
        dh = _panel_product(gy_ptr, wdt_ptr, rows, units, live, D, TILE, BLOCK_U, BLOCK_K)
        word_at, word = _row_words(words_ptr, rows, units, live, H)
        active = (((word >> (units % 32)[None, :]) & 1) == 1) & live[None, :]
        place = _entry_place(word_at, word, ranks_ptr, row_ptr_ptr, rows, units, active)
        a = tl.load(a_rec_ptr + place, mask=active, other=0.0).to(tl.float32)
        u = tl.load(u_rec_ptr + place, mask=active, other=0.0).to(tl.float32)
        sign = tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
        dh = tl.where(active, dh + l1_scale * sign, 0.0)
        dg = dh * u
        du = dh * a
        tl.store(dg_rec_ptr + place, dg, mask=active)
        tl.store(du_rec_ptr + place, du, mask=active)
        tl.store(dg_ptr + at, dg.to(dg_ptr.dtype.element_ty))
        tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty))

    @triton.jit
    def _tile_dh_kernel(
        gy_ptr, wdt_ptr, units_ptr, starts_ptr, counts_ptr, dh_ptr, dg_ptr, du_ptr, D,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, block): dh[tile rows, the block's units] = grad_y_tile Wd[:, units] in float32,
        # stored as the tile's block: the GEMM of _tile_dgdu_kernel without its entries' epilogue
        # (left to _tile_entries_kernel, a thread an entry), and the block of dg and du zeroed for it
        # (only the blocks in use: a slot plan's storage is mostly past the tiles' counts).
        t = tl.program_id(0)
        block = tl.program_id(1)
        count = tl.load(counts_ptr + t)
        if block * BLOCK_U >= count:
            return
        live, units, rows, at = _block_units(units_ptr, starts_ptr, count, t, block, TILE, BLOCK_U)
        dh = _panel_product(gy_ptr, wdt_ptr, rows, units, live, D, TILE, BLOCK_U, BLOCK_K)
        tl.store(dh_ptr + at, dh)
        zero = tl.zeros((TILE, BLOCK_U), dtype=dg_ptr.dtype.element_ty)
        tl.store(dg_ptr + at, zero)
        tl.store(du_ptr + at, zero)

    @triton.jit
    def _tile_entries_kernel(
        dh_ptr, entry_rows_ptr, cols_ptr, slot_ptr, starts_ptr, a_rec_ptr, u_rec_ptr, dg_rec_ptr,
        du_rec_ptr, dg_ptr, du_ptr, l1_scale, entries, H,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_E: tl.constexpr,
    ):  # fmt: skip
        # A program a run of BLOCK_E record entries: dh at the entry's place in its tile's blocks (its
        # unit's position in the tile's union, `slot`), plus the L1 term, then dg = dh u and du = dh a
        # as _tile_dgdu_kernel computes them, written into the record (float32) and into the tiles'
        # zeroed bf16 blocks (for dx).
        e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
        live = e < entries
        row = tl.load(entry_rows_ptr + e, mask=live, other=0).to(tl.int64)
        unit = tl.load(cols_ptr + e, mask=live, other=0).to(tl.int64)
        t = row // TILE
        pos = tl.load(slot_ptr + t * H + unit, mask=live, other=0).to(tl.int64)
        column = pos % BLOCK_U
        at = (tl.load(starts_ptr + t, mask=live, other=0).to(tl.int64) + pos - column) * TILE
        at += (row % TILE) * BLOCK_U + column
        dh = tl.load(dh_ptr + at, mask=live, other=0.0)
        a = tl.load(a_rec_ptr + e, mask=live, other=0.0).to(tl.float32)
        u = tl.load(u_rec_ptr + e, mask=live, other=0.0).to(tl.float32)
        dh = dh + l1_scale * tl.where(u > 0.0, 1.0, tl.where(u < 0.0, -1.0, 0.0))
        dg = dh * u
        du = dh * a
        tl.store(dg_rec_ptr + e, dg, mask=live)
        tl.store(du_rec_ptr + e, du, mask=live)
        tl.store(dg_ptr + at, dg.to(dg_ptr.dtype.element_ty), mask=live)
        tl.store(du_ptr + at, du.to(du_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _tile_dx_kernel(
        dg_ptr, du_ptr, wg_ptr, wu_ptr, units_ptr, starts_ptr, counts_ptr, dx_ptr, D,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, column block): dx[tile rows, columns] = dg_tile Wg[units, columns] +
        # du_tile Wu[units, columns], over the tile's union a block of gathered rows at a time.
        t = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        count = tl.load(counts_ptr + t)
        start = tl.load(starts_ptr + t)
        cols = tl.arange(0, BLOCK_U)
        n = n0 + tl.arange(0, BLOCK_N)
        r = tl.arange(0, TILE)
        acc = tl.zeros((TILE, BLOCK_N), dtype=tl.float32)
        for u0 in range(0, count, BLOCK_U):
            live = u0 + cols < count
            units = tl.load(units_ptr + start + u0 + cols, mask=live, other=0).to(tl.int64)
            at = (start + u0).to(tl.int64) * TILE + r[:, None] * BLOCK_U + cols[None, :]
            acc = _union_block_product(acc, dg_ptr, wg_ptr, at, units, live, n, D)
            acc = _union_block_product(acc, du_ptr, wu_ptr, at, units, live, n, D)
        rows = (t * TILE + r).to(tl.int64)
        tl.store(dx_ptr + rows[:, None] * D + n[None, :], acc.to(dx_ptr.dtype.element_ty))

    @triton.jit
    def _tile_y_kernel(
        h_ptr, wdt_ptr, units_ptr, starts_ptr, counts_ptr, y_ptr, D,
        TILE: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        # Program (tile, column block): y[tile rows, columns] = h_tile Wd^T[units, columns], the
        # reduction over the tile's union, a panel of BLOCK_U gathered Wd^T rows at a time.
        t = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        count = tl.load(counts_ptr + t)
        start = tl.load(starts_ptr + t)
        cols = tl.arange(0, BLOCK_U)
        n = n0 + tl.arange(0, BLOCK_N)
        r = tl.arange(0, TILE)
        acc = tl.zeros((TILE, BLOCK_N), dtype=tl.float32)
        for u0 in range(0, count, BLOCK_U):
            live = u0 + cols < count
            units = tl.load(units_ptr + start + u0 + cols, mask=live, other=0).to(tl.int64)
            at = (start + u0).to(tl.int64) * TILE + r[:, None] * BLOCK_U + cols[None, :]
            acc = _union_block_product(acc, h_ptr, wdt_ptr, at, units, live, n, D)
        rows = (t * TILE + r).to(tl.int64)
        tl.store(y_ptr + rows[:, None] * D + n[None, :], acc.to(y_ptr.dtype.element_ty))


def check_tile_shapes(m: int, d: int, hidden: int, plan: TilePlan, block_n: int) -> None:
    """What the kernels assume (their loads and stores of rows and columns are unmasked): whole tiles,
    whole unit blocks in a slot plan's grid, D in whole 64-column steps and output blocks."""
    if m % plan.tile or (plan.slots and hidden % plan.block_u) or d % 64 or d % block_n:
        raise ValueError(
            f"M = {m}, H = {hidden} and D = {d} must be multiples of the tile ({plan.tile}), the unit block "
            f"({plan.block_u}) and of 64 and the output block ({block_n})"
        )


def tile_updown(
    x: torch.Tensor,
    wu: torch.Tensor,
    wdt: torch.Tensor,
    g: torch.Tensor,
    plan: TilePlan,
    block_n: int = 128,
    launch: Launch = Launch(),
) -> torch.Tensor:
    """y [M, D] by the two kernels: x [M, D], wu [H, D], wdt = Wd^T [H, D], g = x Wg^T [M, H], all
    contiguous in one 16-bit dtype on a CUDA device; D a multiple of 64 and of block_n."""
    m, d = x.shape
    check_tile_shapes(m, d, wu.shape[0], plan, block_n)
    h_blocks = torch.empty(plan.units.numel() * plan.tile, device=x.device, dtype=x.dtype)
    y = torch.empty(m, d, device=x.device, dtype=x.dtype)
    tiles = len(plan.counts)
    _tile_h_kernel[(tiles, plan.max_blocks)](
        x, wu, g, plan.units, plan.starts, plan.counts, h_blocks, d, wu.shape[0],
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_K=64, **launch.kwargs(),
    )  # fmt: skip
    _tile_y_kernel[(tiles, d // block_n)](
        h_blocks, wdt, plan.units, plan.starts, plan.counts, y, d,
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_N=block_n, **launch.kwargs(),
    )  # fmt: skip
    return y


def tile_forward(
    x: torch.Tensor,
    wu: torch.Tensor,
    wdt: torch.Tensor,
    g: torch.Tensor,
    plan: TilePlan,
    layout: RecordLayout,
    block_n: int = 128,
    launch: Launch = Launch(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, L1 summed over the rows, u of the record) by the record-writing h kernel and the y kernel:
    what `tile_forward_reference` computes; inputs as `tile_updown`'s."""
    m, d = x.shape
    check_tile_shapes(m, d, wu.shape[0], plan, block_n)
    h_blocks = torch.empty(plan.units.numel() * plan.tile, device=x.device, dtype=x.dtype)
    y = torch.empty(m, d, device=x.device, dtype=x.dtype)
    u_record = torch.empty(layout.entries, device=x.device, dtype=x.dtype)
    tiles = len(plan.counts)
    l1_blocks = torch.zeros(tiles * plan.max_blocks, device=x.device, dtype=torch.float32)
    _tile_h_record_kernel[(tiles, plan.max_blocks)](
        x, wu, g, plan.units, plan.starts, plan.counts, h_blocks, layout.words, layout.ranks,
        layout.row_ptr, u_record, l1_blocks, d, wu.shape[0], plan.max_blocks,
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_K=64, **launch.kwargs(),
    )  # fmt: skip
    _tile_y_kernel[(tiles, d // block_n)](
        h_blocks, wdt, plan.units, plan.starts, plan.counts, y, d,
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_N=block_n, **launch.kwargs(),
    )  # fmt: skip
    return y, l1_blocks.sum(), u_record


def tile_dgdu(
    grad_y: torch.Tensor,
    wdt: torch.Tensor,
    plan: TilePlan,
    layout: RecordLayout,
    a_record: torch.Tensor,
    u_record: torch.Tensor,
    l1_scale: float,
    hidden: int,
    launch: Launch = Launch(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's first kernel: (dg and du at the record's entries in float32, then as the tiles'
    bf16 blocks for `tile_dx`)."""
    blocks = plan.units.numel() * plan.tile
    dg_blocks = torch.empty(blocks, device=grad_y.device, dtype=grad_y.dtype)
    du_blocks = torch.empty_like(dg_blocks)
    dg_record = torch.empty(len(a_record), device=grad_y.device, dtype=torch.float32)
    du_record = torch.empty_like(dg_record)
    _tile_dgdu_kernel[(len(plan.counts), plan.max_blocks)](
        grad_y, wdt, plan.units, plan.starts, plan.counts, layout.words, layout.ranks, layout.row_ptr,
        a_record, u_record, dg_record, du_record, dg_blocks, du_blocks, l1_scale, grad_y.shape[1], hidden,
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_K=64, **launch.kwargs(),
    )  # fmt: skip
    return dg_record, du_record, dg_blocks, du_blocks


def tile_dx(
    dg_blocks: torch.Tensor,
    du_blocks: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    plan: TilePlan,
    m: int,
    block_n: int = 128,
    launch: Launch = Launch(),
) -> torch.Tensor:
    """The backward's second kernel: dx = dg Wg + du Wu over each tile's union, from `tile_dgdu`'s blocks."""
    d = wg.shape[1]
    dx = torch.empty(m, d, device=wg.device, dtype=dg_blocks.dtype)
    _tile_dx_kernel[(len(plan.counts), d // block_n)](
        dg_blocks, du_blocks, wg, wu, plan.units, plan.starts, plan.counts, dx, d,
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_N=block_n, **launch.kwargs(),
    )  # fmt: skip
    return dx


@dataclass(frozen=True)
class EntryLayout:
    """Where each record entry's value sits in its tile's blocks, for the entry-parallel backward:
    each entry's row, and each (tile, unit)'s position in the tile's union (-1 where absent). Built by
    torch ops here; the plan's pass and the record's fill would write them."""

    rows: torch.Tensor  # int32 [entries]
    cols: torch.Tensor  # int32 [entries]: the record's columns
    slots: torch.Tensor  # int32 [tiles, H]

    @classmethod
    def of(cls, plan: TilePlan, row_ptr: torch.Tensor, cols: torch.Tensor, hidden: int) -> EntryLayout:
        device = plan.units.device
        rows = torch.repeat_interleave(torch.arange(len(row_ptr) - 1, device=device), row_ptr.diff())
        tiles = len(plan.counts)
        at = torch.arange(plan.units.numel(), device=device)
        tile = torch.searchsorted(plan.starts[1:].long(), at, right=True)
        position = at - plan.starts[tile].long()
        live = position < plan.counts[tile].long()
        slots = torch.full((tiles, hidden), -1, dtype=torch.int32, device=device)
        slots[tile[live], plan.units[at[live]].long()] = position[live].to(torch.int32)
        return cls(rows.to(torch.int32), cols.to(torch.int32), slots)


def tile_dgdu_by_entries(
    grad_y: torch.Tensor,
    wdt: torch.Tensor,
    plan: TilePlan,
    entries: EntryLayout,
    a_record: torch.Tensor,
    u_record: torch.Tensor,
    l1_scale: float,
    launch: Launch = Launch(),
    block_e: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tile_dgdu`'s outputs (bitwise) by two kernels: dh's GEMM alone into float32 blocks, then a
    thread an entry for the L1 term, dg and du (into the record and the zeroed bf16 blocks), with no
    per-element lookup of which entries are active."""
    check_tile_shapes(len(grad_y), grad_y.shape[1], entries.slots.shape[1], plan, 64)
    blocks = plan.units.numel() * plan.tile
    dh = torch.empty(blocks, device=grad_y.device, dtype=torch.float32)
    dg_blocks = torch.empty(blocks, device=grad_y.device, dtype=grad_y.dtype)
    du_blocks = torch.empty_like(dg_blocks)
    dg_record = torch.empty(len(a_record), device=grad_y.device, dtype=torch.float32)
    du_record = torch.empty_like(dg_record)
    _tile_dh_kernel[(len(plan.counts), plan.max_blocks)](
        grad_y, wdt, plan.units, plan.starts, plan.counts, dh, dg_blocks, du_blocks, grad_y.shape[1],
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_K=64, **launch.kwargs(),
    )  # fmt: skip
    _tile_entries_kernel[(triton.cdiv(len(a_record), block_e),)](
        dh, entries.rows, entries.cols, entries.slots, plan.starts, a_record, u_record, dg_record, du_record,
        dg_blocks, du_blocks, l1_scale, len(a_record), entries.slots.shape[1],
        TILE=plan.tile, BLOCK_U=plan.block_u, BLOCK_E=block_e,
    )  # fmt: skip
    return dg_record, du_record, dg_blocks, du_blocks


def tile_backward(
    grad_y: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wdt: torch.Tensor,
    plan: TilePlan,
    layout: RecordLayout,
    a_record: torch.Tensor,
    u_record: torch.Tensor,
    l1_scale: float,
    block_n: int = 128,
    launch: Launch = Launch(),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dg and du at the record's entries) by the two backward kernels: what
    `tile_backward_reference` computes, dx from bf16 blocks of dg and du (as a dense bf16 backward
    rounds them); grad_y [M, D], the weights [H, D] (wdt = Wd^T), contiguous, one 16-bit dtype."""
    m, d = grad_y.shape
    check_tile_shapes(m, d, wg.shape[0], plan, block_n)
    dg, du, dg_blocks, du_blocks = tile_dgdu(
        grad_y, wdt, plan, layout, a_record, u_record, l1_scale, wg.shape[0], launch
    )
    return tile_dx(dg_blocks, du_blocks, wg, wu, plan, m, block_n, launch), dg, du


def design2_step(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    wdt: torch.Tensor,
    grad_y: torch.Tensor,
    tile: int,
    block_u: int,
    block_n: int,
    l1_scale: float,
    launch: Launch = Launch(),
) -> tuple[torch.Tensor, ...]:
    """Design 2's forward and backward of one layer end to end, as an op would run them:
    (y, l1, dx, dWg, dWu, dWd). Forward: the gate GEMM, the counts, the record's offsets, its one
    host read (the record's length, which an op would size by a capacity instead), the record from
    g, the plan with the row layout, the tile kernels. Backward: the plan and layout from the
    record, the tile kernels, the per-unit weight gradients. x and grad_y in the tokens' order."""
    ext = extension()
    g = x @ wg.T
    hidden = g.shape[1]
    nnz, _fire_counts = activation_counts(g)
    row_ptr = torch.zeros(len(x) + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(nnz, 0, out=row_ptr[1:])
    entries = int(row_ptr[-1])
    cols, a_record = ext.csr_fill_record(g, row_ptr, entries)

    def plan_of(found: TileUnionPlan) -> tuple[TilePlan, RecordLayout]:
        return TilePlan.in_slots(found, tile, block_u), RecordLayout(
            found.row_words, found.row_ranks, row_ptr, entries
        )

    plan, layout = plan_of(tile_union_plan(g, tile, row_layout=True))
    y, l1, u_record = tile_forward(x, wu, wdt, g, plan, layout, block_n, launch)
    del g  # the backward keeps the record, not g
    plan, layout = plan_of(tile_union_plan_from_record(row_ptr, cols, hidden, tile))
    dx, dg, du = tile_backward(
        grad_y, wg, wu, wdt, plan, layout, a_record, u_record, l1_scale, block_n, launch
    )
    dwg, dwu, dwd = ext.csr_weight_grads(
        x, grad_y, row_ptr, cols, a_record, u_record, dg, du, hidden, wg.dtype
    )
    return y, l1 / len(x), dx, dwg, dwu, dwd


def bench_case(
    x,
    wg,
    wu,
    wd,
    tile: int,
    block_u: int,
    block_n: int,
    sort: bool,
    reps: int,
    heavy_threshold: int,
    launch: Launch = Launch(),
) -> dict:
    """One case on the GPU: errors against float64, GPU times (ms) of every part."""
    from benchmarks.ffn import rel_err64, train_ours
    from sparse_llm import ops

    g = x @ wg.T
    order = lowest_unit_order(g > 0) if sort else None
    xs, gs = (x[order].contiguous(), g[order].contiguous()) if sort else (x, g)
    wdt = wd.T.contiguous()
    plan = tile_plan(gs > 0, tile, block_u)
    y = tile_updown(xs, wu, wdt, gs, plan, block_n, launch)
    slots = slot_plan(gs, tile, block_u)
    same_units_y = torch.equal(tile_updown(xs, wu, wdt, gs, slots, block_n, launch), y)
    if sort:
        y = torch.empty_like(y).index_copy_(0, order, y)
    ours = train_ours("cuda", heavy_threshold)
    active = g > 0
    row = {
        "tile": tile,
        "block_u": block_u,
        "block_n": block_n,
        "sorted": sort,
        "nnz": active.sum(1).double().mean().item(),
        "union_mean": plan.counts.double().mean().item(),
        "err_tile": rel_err64(y, x, wg, wu, wd),
        "err_dense_bf16": rel_err64(ops.ffn_forward_reference(x, wg, wu, wd), x, wg, wu, wd),
        "ms_plan": common.gpu_busy_ms(lambda: tile_plan(gs > 0, tile, block_u), reps),
        "ms_tile_kernels": common.gpu_busy_ms(
            lambda: tile_updown(xs, wu, wdt, gs, plan, block_n, launch), reps
        ),
        "ms_plan_kernels": common.gpu_busy_ms(lambda: tile_union_plan(gs, tile), reps),
        "ms_tile_kernels_slots": common.gpu_busy_ms(
            lambda: tile_updown(xs, wu, wdt, gs, slots, block_n, launch), reps
        ),
        "slot_plan_same_y": same_units_y,
        "ms_gate": common.gpu_busy_ms(lambda: x @ wg.T, reps),
        "ms_dense_updown": common.gpu_busy_ms(lambda: (torch.relu(g) * (x @ wu.T)) @ wd.T, reps),
        "ms_op_forward": common.gpu_busy_ms(lambda: ours(x, wg, wu, wd), reps),
    }
    if sort:
        row["ms_sort"] = common.gpu_busy_ms(lambda: (lowest_unit_order(g > 0), x[order], g[order]), reps)
    row["ms_op_forward_after_gate"] = row["ms_op_forward"] - row["ms_gate"]
    row |= training_parts(xs, gs, wg, wu, wd, slots, block_n, reps, heavy_threshold, launch)
    row["ms_op_backward"] = op_backward_ms(x, wg, wu, wd, heavy_threshold, reps) - row["ms_op_forward"]
    # Design 2 as the op would run it, against the op: the forward after the gate (the plan with the
    # row layout, the counts and record, the tile kernels) and the backward (the plan from the
    # record, the tile kernels, the per-unit weight gradients).
    row["ms_design2_forward_after_gate"] = (
        row["ms_plan_with_layout_kernels"] + row["ms_forward_record_kernels"] + row["ms_tile_forward_kernels"]
    )
    row["ms_design2_backward"] = (
        row["ms_backward_plan_kernels"] + row["ms_tile_backward_kernels"] + row["ms_weight_grads_kernels"]
    )
    # The same with the faster of each alternative: dg/du fused or by entries, the weight gradients
    # per unit or split as the op splits them.
    row["ms_design2_backward_best"] = (
        row["ms_backward_plan_kernels"]
        + min(row["ms_dgdu_kernel"], row["ms_dgdu_by_entries_kernels"])
        + row["ms_dx_kernel"]
        + min(row["ms_weight_grads_kernels"], row["ms_weight_grads_split"])
    )
    row |= whole_steps(x, wg, wu, wd, tile, block_u, block_n, reps, heavy_threshold, launch)
    return row


def whole_steps(
    x, wg, wu, wd, tile: int, block_u: int, block_n: int, reps: int, heavy_threshold: int, launch: Launch
) -> dict:
    """Design 2's whole layer step (`design2_step`, the gate included) against the op's forward and
    backward, event-timed (what the host's launches cost shows) and in GPU busy time; and the step's
    error against the op's (dx and the weight gradients)."""
    from benchmarks.ffn import forward_backward, train_ours
    from sparse_llm import ops

    wdt = wd.T.contiguous()
    gen = torch.Generator(device=x.device).manual_seed(1)
    grad_y = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    l1_grad = 2e-5
    ours = design2_step(x, wg, wu, wd, wdt, grad_y, tile, block_u, block_n, l1_grad / len(x), launch)
    inputs = [t.detach().clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    out = ops.ffn_forward_train(*inputs, impl="cuda", heavy_threshold=heavy_threshold)
    torch.autograd.backward((out.y, out.l1), (grad_y, torch.tensor(l1_grad, device=x.device)))
    errors = {  # before the timed op steps drop these gradients
        "design2_vs_op_grad_err": max(relative(a, b.grad) for a, b in zip(ours[2:], inputs, strict=True)),
        "design2_vs_op_y_err": relative(ours[0], out.y),
    }
    op_step = forward_backward(train_ours("cuda", heavy_threshold), torch.tensor(l1_grad, device=x.device))

    def step() -> tuple[torch.Tensor, ...]:
        return design2_step(x, wg, wu, wd, wdt, grad_y, tile, block_u, block_n, l1_grad / len(x), launch)

    return errors | {
        "ms_design2_step_event": common.median_ms(step, x.device, warmup=3, reps=reps),
        "ms_design2_step_busy": common.gpu_busy_ms(step, reps),
        "ms_op_step_event": common.median_ms(lambda: op_step(*inputs), x.device, warmup=3, reps=reps),
    }


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def training_parts(
    xs,
    gs,
    wg,
    wu,
    wd,
    slots: TilePlan,
    block_n: int,
    reps: int,
    heavy_threshold: int,
    launch: Launch = Launch(),
) -> dict:
    """The kernels of design 2 as the training op would run them on one case (its tokens as the
    plan has them): the forward's (y, the record's u, L1) and the backward's (dg and du at the
    record's entries, dx), their GPU times, the record layout's by torch ops, and the errors
    against the references."""
    wdt = wd.T.contiguous()
    active = gs > 0
    layout = RecordLayout.of(gs, slots.tile)
    y, l1, u_record = tile_forward(xs, wu, wdt, gs, slots, layout, block_n, launch)
    y_ref, l1_ref, u_ref = tile_forward_reference(xs, wu, wd, gs, slots)
    gen = torch.Generator(device=xs.device).manual_seed(0)
    grad_y = torch.randn(xs.shape, generator=gen, device=xs.device).to(xs.dtype)
    a_record, l1_scale = torch.relu(gs)[active], 1e-3 / len(xs)
    backward_args = (grad_y, wg, wu, wdt, slots, layout, a_record, u_record, l1_scale, block_n, launch)
    dx, dg, du = tile_backward(*backward_args)
    dgdu_args = (grad_y, wdt, slots, layout, a_record, u_record, l1_scale, wg.shape[0], launch)
    dgdu_blocks = tile_dgdu(*dgdu_args)[2:]
    cols = active.nonzero()[:, 1].to(torch.int32)
    hidden = gs.shape[1]
    entries = EntryLayout.of(slots, layout.row_ptr, cols, hidden)
    by_entries_args = (grad_y, wdt, slots, entries, a_record, u_record)
    dg_e, du_e, *blocks_e = tile_dgdu_by_entries(*by_entries_args, l1_scale, launch)
    dx_e = tile_dx(*blocks_e, wg, wu, slots, len(xs), block_n, launch)
    # The backward keeps the record, not g: its plan and layout come from the record's columns; the
    # weight gradients from the per-unit kernel over every row's entries (the op's own, unchanged).
    ext = extension()

    def weight_grads() -> tuple[torch.Tensor, ...]:
        return ext.csr_weight_grads(
            xs, grad_y, layout.row_ptr, cols, a_record, u_record, dg, du, hidden, wg.dtype
        )

    def weight_grads_split() -> tuple[torch.Tensor, ...]:
        records = (a_record, u_record, dg, du)
        return split_weight_grads(
            xs, grad_y, layout.row_ptr, cols, records, hidden, heavy_threshold, ext.csr_weight_grads
        )

    dw = weight_grads()
    dw_ref = weight_grads_reference(xs, grad_y, active, a_record, u_record, dg, du)
    dw_split = weight_grads_split()

    def forward_record() -> tuple[torch.Tensor, ...]:
        # What the forward writes besides y, u and L1: the counts (L0, fire counts), the record's
        # offsets, and its columns and a values from g.
        nnz, _fire_counts = activation_counts(gs)
        row_ptr = torch.zeros(len(gs) + 1, dtype=torch.int64, device=gs.device)
        torch.cumsum(nnz, 0, out=row_ptr[1:])
        return ext.csr_fill_record(gs, row_ptr, len(cols))

    filled_cols, filled_a = forward_record()
    dx_ref, dg_ref, du_ref = tile_backward_reference(grad_y, wg, wu, wd, active, a_record, u_record, l1_scale)
    return {
        "ms_plan_with_layout_kernels": common.gpu_busy_ms(
            lambda: tile_union_plan(gs, slots.tile, True), reps
        ),
        "ms_tile_forward_kernels": common.gpu_busy_ms(
            lambda: tile_forward(xs, wu, wdt, gs, slots, layout, block_n, launch), reps
        ),
        "ms_tile_backward_kernels": common.gpu_busy_ms(lambda: tile_backward(*backward_args), reps),
        # Its two kernels apart: dh's GEMM with the entries' epilogue, and dx's two union GEMMs.
        "ms_dgdu_kernel": common.gpu_busy_ms(lambda: tile_dgdu(*dgdu_args), reps),
        "ms_dx_kernel": common.gpu_busy_ms(
            lambda: tile_dx(*dgdu_blocks, wg, wu, slots, len(xs), block_n, launch), reps
        ),
        "ms_dgdu_by_entries_kernels": common.gpu_busy_ms(
            lambda: tile_dgdu_by_entries(*by_entries_args, l1_scale, launch), reps
        ),
        "dgdu_by_entries_same": torch.equal(dg_e, dg) and torch.equal(du_e, du) and torch.equal(dx_e, dx),
        "ms_backward_plan_kernels": common.gpu_busy_ms(
            lambda: tile_union_plan_from_record(layout.row_ptr, cols, hidden, slots.tile), reps
        ),
        "ms_weight_grads_kernels": common.gpu_busy_ms(weight_grads, reps),
        # The op's split: heavy rows by GEMMs (their blocks scattered by torch ops), the rest per unit.
        "ms_weight_grads_split": common.gpu_busy_ms(weight_grads_split, reps),
        "weight_grads_split_err": max(
            relative(got, want) for got, want in zip(dw_split, dw_ref, strict=True)
        ),
        "ms_forward_record_kernels": common.gpu_busy_ms(forward_record, reps),
        "record_fill_same": torch.equal(filled_cols, cols) and torch.equal(filled_a, a_record),
        "weight_grads_err": max(relative(got, want) for got, want in zip(dw, dw_ref, strict=True)),
        "y_err_vs_tile_reference": relative(y, y_ref),
        "u_record_err": relative(u_record, u_ref),
        "l1_rel_diff": abs(l1.item() - l1_ref.item()) / max(abs(l1_ref.item()), 1e-30),
        "dx_err": relative(dx, dx_ref),
        "dg_du_record_err": max(relative(dg, dg_ref), relative(du, du_ref)),
    }


def op_backward_ms(x, wg, wu, wd, heavy_threshold: int, reps: int) -> float:
    """GPU busy ms of the op's forward and backward (the L1 term's gradient included)."""
    from benchmarks.ffn import forward_backward, train_ours

    inputs = [t.detach().clone().requires_grad_(True) for t in (x, wg, wu, wd)]
    step = forward_backward(train_ours("cuda", heavy_threshold), torch.tensor(2e-5, device=x.device))
    return common.gpu_busy_ms(lambda: step(*inputs), reps)


def markdown(meta: dict, rows: list[dict]) -> str:
    workload = f"model {meta['model']}, {meta['text']}" if "model" in meta else "synthetic"
    lines = [
        f"# Design 2's kernels (tile unions, Triton) against the op's: {meta['device']}\n",
        f"commit `{meta['commit']}`, {meta['date']}; {workload}; M {meta['M']}, D {meta['D']}, H {meta['H']}; "
        "GPU busy ms a call (`common.gpu_busy_ms`); errors: y relative to float64, dx to the float32 "
        "backward from the same record.\n",
        "| layer | nnz | tile | block u | block n | sorted | warps, stages | union | err tile | err dense bf16 | "
        "plan | sort | "
        "tile kernels | plan, kernels | tile kernels, slots | forward kernels (record, L1) | backward kernels "
        "(dg/du; dx) | dg/du by entries | dx err | backward plan | weight grads (per unit) | op forward | op forward less the gate | "
        "op backward | dense up/down |",
        "|" + "---|" * 25,
    ]
    for r in rows:
        lines.append(
            f"| {r.get('layer', '')} | {r['nnz']:.1f} | {r['tile']} | {r['block_u']} | {r['block_n']} | {r['sorted']} | "
            f"{r.get('num_warps', 4)}, {r.get('num_stages', 3)} | "
            f"{r['union_mean']:.0f} | {r['err_tile']:.2e} | "
            f"{r['err_dense_bf16']:.2e} | {r['ms_plan']:.3f} | {r.get('ms_sort', 0.0):.3f} | "
            f"{r['ms_tile_kernels']:.3f} | {r['ms_plan_kernels']:.3f} | {r['ms_tile_kernels_slots']:.3f}"
            f"{'' if r['slot_plan_same_y'] else ' (y differs)'} | {r['ms_tile_forward_kernels']:.3f} | "
            f"{r['ms_tile_backward_kernels']:.3f} ({r['ms_dgdu_kernel']:.3f}; {r['ms_dx_kernel']:.3f}) | "
            f"{r['ms_dgdu_by_entries_kernels']:.3f}{'' if r['dgdu_by_entries_same'] else ' (differs)'} | "
            f"{r['dx_err']:.1e} | {r['ms_backward_plan_kernels']:.3f} | {r['ms_weight_grads_kernels']:.3f} | "
            f"{r['ms_op_forward']:.3f} | {r['ms_op_forward_after_gate']:.3f} | {r['ms_op_backward']:.3f} | "
            f"{r['ms_dense_updown']:.3f} |"
        )
    lines += [
        "",
        "Design 2 as the training op would run it against the op, GPU busy ms a call: the forward after the gate "
        "(plan and row layout, counts and record, tile kernels) and the backward (plan from the record, tile "
        "kernels, per-unit weight gradients).",
        "",
        "| layer | nnz | tile | block u | sorted | warps, stages | design 2 forward after the gate | op's | "
        "design 2 backward | with its faster parts | op's | weight grads: per unit, split | "
        "forward + backward, op / design 2 (faster parts) | whole step, event-timed: design 2 | "
        "op's | gradients vs the op's |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        ours = r["ms_design2_forward_after_gate"] + r["ms_design2_backward"]
        best = r["ms_design2_forward_after_gate"] + r["ms_design2_backward_best"]
        op = r["ms_op_forward_after_gate"] + r["ms_op_backward"]
        lines.append(
            f"| {r.get('layer', '')} | {r['nnz']:.1f} | {r['tile']} | {r['block_u']} | {r['sorted']} | "
            f"{r.get('num_warps', 4)}, {r.get('num_stages', 3)} | {r['ms_design2_forward_after_gate']:.3f} | "
            f"{r['ms_op_forward_after_gate']:.3f} | {r['ms_design2_backward']:.3f} | "
            f"{r['ms_design2_backward_best']:.3f} | {r['ms_op_backward']:.3f} | "
            f"{r['ms_weight_grads_kernels']:.3f}, {r['ms_weight_grads_split']:.3f} | "
            f"{op / ours:.2f}x ({op / best:.2f}x) | {r['ms_design2_step_event']:.3f} | {r['ms_op_step_event']:.3f} | "
            f"{r['design2_vs_op_grad_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)  # --model, --inputs, --rows, --seq-len, --heavy-threshold, --json, --md
    p.add_argument(
        "--layers", type=int, nargs="+", default=None, help="with --model: these layers (default all)"
    )
    p.add_argument(
        "--nnz", type=float, nargs="+", default=[5.0, 30.0, 100.0], help="synthetic: non-zeros a token"
    )
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--H", type=int, default=5632)
    p.add_argument("--tile", type=int, nargs="+", default=[64])
    p.add_argument(
        "--block-u", type=int, nargs="+", default=[DEFAULT_BLOCK_U], help="units a block (h kernel)"
    )
    p.add_argument("--block-n", type=int, nargs="+", default=[128], help="output columns a block (y kernel)")
    p.add_argument("--sorted", action="store_true", help="also time each case with its tokens sorted")
    p.add_argument("--warps", type=int, nargs="+", default=[Launch.num_warps], help="warps a Triton program")
    p.add_argument(
        "--stages", type=int, nargs="+", default=[Launch.num_stages], help="pipeline stages of the K loops"
    )
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    if args.tiny:
        p.error("--tiny: the kernels need a CUDA device; give --model, or neither for the synthetic workload")
    if (args.layers or args.inputs) and args.model is None:
        p.error("--layers and --inputs go with --model")
    if triton is None or not torch.cuda.is_available():
        p.error("the kernels need Triton and a CUDA device")
    return args


Case = tuple[dict, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (labels, x, weights)


def synthetic_cases(args: argparse.Namespace) -> Iterator[Case]:
    """`benchmarks/ffn.py`'s workload at each of --nnz, made when its turn comes."""
    for nnz in args.nnz:
        w = common.make_workload(args.M, args.D, args.H, nnz, seed=0, device="cuda")
        yield {}, w.x, (w.wg, w.wu, w.wd)


def layer_cases(args: argparse.Namespace, device: torch.device) -> tuple[str, list[Case]]:
    """(what the text is, a case for each of --layers of --model): the layer's FFN input and weights."""
    model, inputs, text, _ = model_inputs(args, device)
    found = []
    for layer in args.layers if args.layers is not None else range(len(inputs)):
        weights = common.ffn_weights(model.model.layers[layer].mlp, torch.bfloat16)
        found.append(({"layer": layer}, inputs[layer].to(torch.bfloat16), weights))
    return text, found


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.model is None:
        workload, todo = {}, synthetic_cases(args)
    else:
        text, todo = layer_cases(args, torch.device("cuda"))
        workload = {"model": str(args.model), "text": text}
    rows = []
    for case, x, (wg, wu, wd) in todo:
        shapes = itertools.product(
            args.tile,
            args.block_u,
            args.block_n,
            (False, True) if args.sorted else (False,),
            args.warps,
            args.stages,
        )
        for tile, block_u, block_n, sort, warps, stages in shapes:
            launch = Launch(warps, stages)
            row = bench_case(
                x, wg, wu, wd, tile, block_u, block_n, sort, args.reps, args.heavy_threshold, launch
            )
            rows.append(case | row | {"num_warps": warps, "num_stages": stages})
            print(json.dumps(rows[-1]), flush=True)
    meta = common.run_meta("cuda", M=len(x), D=wu.shape[1], H=wu.shape[0], **workload)
    text = markdown(meta, rows)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if args.md:
        args.md.write_text(text)
    return rows


if __name__ == "__main__":
    main()
