"""Design 2's plan (sparse_llm.ops.ffn.tile_plan): each token tile's union of active units. The
reference against a plain reading of the definition on CPU; the CUDA kernels against the reference,
bitwise, on the GPU, on patterns that stress them (empty and full tiles, a short last tile, NaN and
-0.0, one hot unit, the widest g)."""

from __future__ import annotations

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.ops.ffn.tile_plan import (
    KERNEL_MAX_HIDDEN,
    runs_on_kernel,
    tile_union_plan,
    tile_union_plan_from_record,
    tile_union_plan_from_record_reference,
    tile_union_plan_reference,
)

UNSIGNED = 0xFFFFFFFF  # a row word is an int32 holding 32 bits


def _expected_units(g: torch.Tensor, tile: int) -> list[list[int]]:
    m = g.shape[0]
    return [
        sorted(
            {
                unit
                for row in range(start, min(start + tile, m))
                for unit in (g[row] > 0).nonzero().flatten().tolist()
            }
        )
        for start in range(0, m, tile)
    ]


def _check_plan(units: torch.Tensor, counts: torch.Tensor, expected: list[list[int]], hidden: int) -> None:
    assert units.dtype == counts.dtype == torch.int32
    assert tuple(units.shape) == (len(expected), hidden) and tuple(counts.shape) == (len(expected),)
    for t, want in enumerate(expected):
        assert int(counts[t]) == len(want)
        assert units[t, : len(want)].tolist() == want


def _patterned_g(m: int, hidden: int, seed: int, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(m, hidden, generator=gen) - 2.0  # ~2% of entries active
    g[:8] = -1.0  # the first tile of 8: no active unit
    g[8:16] = 1.0  # the second: every unit
    g[16:24] = -1.0
    g[16:24, 5] = 3.0  # the third: one hot unit
    g[24, :4] = torch.tensor([float("nan"), -0.0, 0.0, 1e-30])  # only the last is active
    return g.to(device=device, dtype=dtype)


@pytest.mark.parametrize("m, tile", [(64, 8), (61, 8), (100, 32), (7, 8)])
def test_the_reference_lists_each_tiles_active_units_in_order(m, tile):
    g = _patterned_g(max(m, 32), 96, seed=m)[:m]
    plan = tile_union_plan(g, tile)
    _check_plan(plan.units, plan.counts, _expected_units(g, tile), hidden=96)
    assert plan.row_words is None and plan.row_ranks is None


def test_the_row_layout_places_each_entry_at_its_rank_in_its_row():
    g = _patterned_g(40, 96, seed=1)
    plan = tile_union_plan(g, 8, row_layout=True)
    assert plan.row_words.dtype == plan.row_ranks.dtype == torch.int32
    assert tuple(plan.row_words.shape) == tuple(plan.row_ranks.shape) == (40, 3)
    for row in range(40):
        active = (g[row] > 0).nonzero().flatten().tolist()
        for rank, unit in enumerate(active):
            word = int(plan.row_words[row, unit // 32]) & UNSIGNED
            assert word >> (unit % 32) & 1
            assert (
                int(plan.row_ranks[row, unit // 32]) + bin(word & ((1 << (unit % 32)) - 1)).count("1") == rank
            )
        words = [int(w) & UNSIGNED for w in plan.row_words[row].tolist()]
        assert sum(bin(w).count("1") for w in words) == len(active)


def test_bad_inputs_are_refused_before_any_compute():
    g = torch.zeros(16, 32)
    for tile in (0, 12, -8, 8.0, True):
        with pytest.raises(ValueError, match="tile must be a positive multiple of 8"):
            tile_union_plan(g, tile)
    with pytest.raises(ValueError, match="2-D floating-point"):
        tile_union_plan(torch.zeros(16, 32, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="2-D floating-point"):
        tile_union_plan(torch.zeros(32), 8)
    with pytest.raises(ValueError, match="multiple of 32"):
        tile_union_plan(torch.zeros(16, 40), 8, row_layout=True)


def _record(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_ptr, cols) of g's active entries, each row's units ascending."""
    active = g > 0
    row_ptr = torch.zeros(len(g) + 1, dtype=torch.int64, device=g.device)
    row_ptr[1:] = active.sum(dim=1).cumsum(0)
    return row_ptr, active.nonzero()[:, 1].to(torch.int32)


@pytest.mark.parametrize("m, tile", [(40, 8), (37, 16)])
def test_the_plan_from_a_record_is_the_plan_from_g(m, tile):
    g = _patterned_g(max(m, 32), 96, seed=m)[:m]
    from_record = tile_union_plan_from_record(*_record(g), 96, tile)
    from_g = tile_union_plan(g, tile, row_layout=True)
    for got, want in zip(from_record, from_g, strict=True):
        assert torch.equal(got, want)


def test_a_bad_record_is_refused_before_any_compute():
    row_ptr, cols = torch.zeros(5, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="row_ptr must be 1-D int64"):
        tile_union_plan_from_record(row_ptr.int(), cols, 64, 8)
    with pytest.raises(ValueError, match="cols must be 1-D int32"):
        tile_union_plan_from_record(row_ptr, cols.long(), 64, 8)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 32"):
        tile_union_plan_from_record(row_ptr, cols, 40, 8)
    with pytest.raises(ValueError, match="tile must be a positive int"):
        tile_union_plan_from_record(row_ptr, cols, 64, 0)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "m, hidden, tile",
    # 352 and 800 units: a row's last step of 32 lanes only partly filled
    [(16384, 5632, 64), (16384, 5632, 128), (1000, 5632, 64), (32, 64, 8), (40, KERNEL_MAX_HIDDEN, 16),
     (200, 352, 8), (256, 800, 64)],
)  # fmt: skip
def test_the_kernels_give_the_references_plan(m, hidden, tile):
    g = _patterned_g(m, hidden, seed=hidden + m, device="cuda", dtype=torch.bfloat16)
    assert runs_on_kernel(g)
    torch.cuda.synchronize()
    plan = tile_union_plan(g, tile, row_layout=True)
    ref = tile_union_plan_reference(g, tile, row_layout=True)
    assert torch.equal(plan.counts, ref.counts)
    for t in range(len(plan.counts)):  # past a tile's count its slot is unspecified
        assert torch.equal(plan.units[t, : plan.counts[t]], ref.units[t, : plan.counts[t]])
    assert torch.equal(plan.row_words, ref.row_words) and torch.equal(plan.row_ranks, ref.row_ranks)
    # Without the row layout: the same plan.
    plain = tile_union_plan(g, tile)
    assert plain.row_words is None and torch.equal(plain.counts, plan.counts)
    # Every unit listed once per tile and active there (a bit set twice or lost would show).
    if m <= 1000:
        _check_plan(plan.units.cpu(), plan.counts.cpu(), _expected_units(g.float().cpu(), tile), hidden)


@pytest.mark.gpu
@needs_hopper
def test_a_g_the_kernels_cannot_take_falls_back_to_the_reference():
    g = torch.randn(64, 40, device="cuda", dtype=torch.bfloat16)  # 40 units: not whole 32-unit words
    assert not runs_on_kernel(g)
    plan, ref = tile_union_plan(g, 8), tile_union_plan_reference(g, 8)
    assert torch.equal(plan.units, ref.units) and torch.equal(plan.counts, ref.counts)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(
    "m, hidden, tile",
    # any tile from a record, 8 multiples or not
    [(16384, 5632, 64), (1000, 5632, 128), (32, 64, 8), (40, KERNEL_MAX_HIDDEN, 16), (100, 352, 5),
     (64, 800, 1), (50, 64, 3)],
)  # fmt: skip
def test_the_kernels_plan_from_a_record_is_the_references(m, hidden, tile):
    g = _patterned_g(m, hidden, seed=hidden + m + 1, device="cuda", dtype=torch.bfloat16)
    row_ptr, cols = _record(g)
    plan = tile_union_plan_from_record(row_ptr, cols, hidden, tile)
    ref = tile_union_plan_from_record_reference(row_ptr, cols, hidden, tile)
    assert torch.equal(plan.counts, ref.counts) and torch.equal(plan.row_words, ref.row_words)
    for t in range(len(plan.counts)):
        assert torch.equal(plan.units[t, : plan.counts[t]], ref.units[t, : plan.counts[t]])
    # Ranks are defined where a row has an entry in the word: there they are the reference's.
    has_entry = plan.row_words != 0
    assert torch.equal(plan.row_ranks[has_entry], ref.row_ranks[has_entry])
