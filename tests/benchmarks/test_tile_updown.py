"""benchmarks/tile_updown.py on the CPU: the tile plan (each tile's union of active units, in order,
padded to whole blocks) and the tile computation it drives equal the dense up/down."""

from __future__ import annotations

import argparse

import pytest
import torch
from ffn_patterns import needs_hopper

from benchmarks.tile_updown import (
    EntryLayout,
    RecordLayout,
    layer_cases,
    markdown,
    slot_plan,
    split_weight_grads,
    tile_backward,
    tile_backward_reference,
    tile_dgdu,
    tile_dgdu_by_entries,
    tile_dx,
    tile_forward,
    tile_forward_reference,
    tile_plan,
    tile_updown,
    tile_updown_reference,
    weight_grads_reference,
)


def _active(m: int, h: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    active = torch.rand(m, h, generator=gen) < 0.05
    active[:8] = False  # a tile with no active unit
    active[8:16, :] = True  # and one whose union is every unit
    return active


@pytest.mark.parametrize("block_u", [64, 128])
def test_the_plan_lists_each_tiles_union_in_order_padded_to_whole_blocks(block_u):
    active = _active(64, 150, seed=0)
    plan = tile_plan(active, tile=8, block_u=block_u)
    unions = active.view(8, 8, 150).any(dim=1)
    assert plan.counts.tolist() == unions.sum(dim=1).tolist()
    assert plan.counts[0] == 0 and plan.counts[1] == 150
    assert (plan.starts % block_u == 0).all() and plan.starts[0] == 0
    for t in range(8):
        start, count = int(plan.starts[t]), int(plan.counts[t])
        assert plan.units[start : start + count].tolist() == unions[t].nonzero().flatten().tolist()
        assert int(plan.starts[t + 1]) - start == -(-count // block_u) * block_u
    assert plan.max_blocks == -(-150 // block_u)


def test_the_plan_refuses_a_partial_tile():
    with pytest.raises(ValueError, match="not a multiple of the tile"):
        tile_plan(torch.zeros(10, 4, dtype=torch.bool), tile=8)


def test_a_models_layers_are_cases_of_its_inputs_and_weights():
    args = argparse.Namespace(model=None, tiny=True, inputs=None, rows=2, seq_len=64, layers=[1, 0])
    text, cases = layer_cases(args, torch.device("cpu"))
    assert text and [labels for labels, _, _ in cases] == [{"layer": 1}, {"layer": 0}]
    _, x, (wg, wu, wd) = cases[0]
    assert x.shape == (2 * 64, wg.shape[1]) and x.dtype == torch.bfloat16
    assert wg.shape == wu.shape == wd.T.shape and wd.dtype == torch.bfloat16


def _float64_layer(seed: int, m: int, d: int, h: int) -> tuple[torch.Tensor, ...]:
    """x [m, d], Wg and Wu [h, d], Wd [d, h]: seeded float64 normals."""
    gen = torch.Generator().manual_seed(seed)
    x, wg, wu = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((m, d), (h, d), (h, d)))
    return x, wg, wu, torch.randn(d, h, generator=gen, dtype=torch.float64)


def test_the_tile_computation_equals_the_dense_up_down():
    x, wg, wu, wd = _float64_layer(seed=1, m=32, d=16, h=150)
    g = x @ wg.T
    g[:8] = -1.0  # a tile with no active unit
    plan = tile_plan(g > 0, tile=8)
    want = (torch.relu(g) * (x @ wu.T)) @ wd.T
    torch.testing.assert_close(tile_updown_reference(x, wu, wd, g, plan), want)


def test_the_devices_slot_plan_holds_the_same_units_as_the_packed_plan():
    x, wg, wu, wd = _float64_layer(seed=2, m=32, d=16, h=128)
    g = x @ wg.T - 1.0
    g[:8] = -1.0
    slots, packed = slot_plan(g, tile=8, block_u=64), tile_plan(g > 0, tile=8, block_u=64)
    assert slots.starts.tolist() == [0, 128, 256, 384, 512] and slots.max_blocks == 2
    assert torch.equal(slots.counts, packed.counts)
    assert torch.equal(
        tile_updown_reference(x, wu, wd, g, slots), tile_updown_reference(x, wu, wd, g, packed)
    )
    with pytest.raises(ValueError, match="multiples of the tile"):
        slot_plan(g[:, :96], tile=8, block_u=64)


def test_the_record_layout_places_each_active_entry_where_the_record_holds_it():
    """The arithmetic of the record-writing kernel, in Python: row offset + the word's first rank +
    the set bits below the unit in its word is the entry's index in the record (row-major, units
    ascending), for every active entry."""
    gen = torch.Generator().manual_seed(3)
    active = torch.rand(24, 96, generator=gen) < 0.2
    active[0] = False
    active[1] = True
    active[2, [0, 31, 32, 95]] = True
    layout = RecordLayout.of(active.float(), tile=8)
    rows, units = active.nonzero(as_tuple=True)
    assert layout.row_ptr[-1] == len(rows) and layout.row_ptr[0] == 0
    for index, (row, unit) in enumerate(zip(rows.tolist(), units.tolist(), strict=True)):
        word = int(layout.words[row, unit // 32]) & 0xFFFFFFFF  # int32 holding 32 bits
        below = bin(word & ((1 << (unit % 32)) - 1)).count("1")
        assert int(layout.row_ptr[row]) + int(layout.ranks[row, unit // 32]) + below == index
        assert word >> (unit % 32) & 1
    with pytest.raises(ValueError, match="multiple of 32"):
        RecordLayout.of(active[:, :40].float())


def test_the_forwards_reference_owes_y_l1_and_u_at_the_active_entries():
    x, wg, wu, wd = _float64_layer(seed=4, m=16, d=8, h=64)
    g = x @ wg.T
    y, l1, u_record = tile_forward_reference(x, wu, wd, g, tile_plan(g > 0, tile=8))
    torch.testing.assert_close(y, (torch.relu(g) * (x @ wu.T)) @ wd.T)
    torch.testing.assert_close(l1, (torch.relu(g) * (x @ wu.T)).abs().sum())
    torch.testing.assert_close(u_record, (x @ wu.T)[g > 0])


def test_the_backwards_reference_is_autograds_gradient_with_the_l1_term():
    """dx from the record (a and u at the active entries) equals autograd's through the dense FFN for
    the loss <grad_y, y> + l1_scale sum |h|; dg and du at the entries are its gate and up gradients,
    and the weight gradients from them are autograd's."""
    gen = torch.Generator().manual_seed(5)
    m, d, h = 12, 8, 32
    x = torch.randn(m, d, generator=gen, dtype=torch.float64, requires_grad=True)
    wg, wu = (torch.randn(h, d, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    wd = torch.randn(d, h, generator=gen, dtype=torch.float64, requires_grad=True)
    grad_y = torch.randn(m, d, generator=gen, dtype=torch.float64)
    g, u = x @ wg.T, x @ wu.T
    g.retain_grad()
    u.retain_grad()
    hidden = torch.relu(g) * u
    l1_scale = 0.3
    ((hidden @ wd.T) * grad_y).sum().add(l1_scale * hidden.abs().sum()).backward()
    active = g.detach() > 0
    a_record, u_record = torch.relu(g.detach())[active], u.detach()[active]
    dx, dg, du = tile_backward_reference(
        grad_y, wg.detach(), wu.detach(), wd.detach(), active, a_record, u_record, l1_scale
    )
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dg, g.grad[active])
    torch.testing.assert_close(du, u.grad[active])
    dwg, dwu, dwd = weight_grads_reference(x.detach(), grad_y, active, a_record, u_record, dg, du)
    torch.testing.assert_close(dwg, wg.grad)
    torch.testing.assert_close(dwu, wu.grad)
    torch.testing.assert_close(dwd, wd.grad)


def _patterned_inputs(tile: int, h: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    m, d = 4 * tile, 256
    x, wg, wu = (torch.randn(*s, generator=gen, device="cuda") for s in ((m, d), (h, d), (h, d)))
    wd = torch.randn(d, h, generator=gen, device="cuda") / h**0.5
    x, wg, wu, wd = (t.to(torch.bfloat16) for t in (x, wg / d**0.5, wu / d**0.5, wd))
    g = x @ wg.T
    g[:tile] = -1.0  # no unit active
    g[tile : 2 * tile] = g[tile : 2 * tile].abs() + 0.1  # every unit
    g[2 * tile : 3 * tile] = -1.0
    g[2 * tile + 5, 17] = 1.0  # one unit, one token
    return x, wu, wd, g


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("tile", "block_u"), [(64, 64), (128, 128)])
def test_the_devices_slot_plan_drives_the_kernels_to_the_same_y(tile, block_u):
    x, wu, wd, g = _patterned_inputs(tile, h=384, seed=torch.seed() % 2**31)
    wdt = wd.T.contiguous()
    packed = tile_updown(x, wu, wdt, g, tile_plan(g > 0, tile, block_u))
    assert torch.equal(tile_updown(x, wu, wdt, g, slot_plan(g, tile, block_u)), packed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("tile", "block_u", "block_n"), [(64, 64, 128), (128, 64, 128), (128, 128, 64)])
def test_the_kernels_equal_the_reference_on_every_pattern(tile, block_u, block_n):
    """The Triton kernels against the PyTorch tile computation on fresh inputs: tiles with no unit,
    with every unit, with one, and random ones (bf16, the same roundings: equal up to the float32
    sums' order)."""
    x, wu, wd, g = _patterned_inputs(tile, h=300, seed=torch.seed() % 2**31)
    plan = tile_plan(g > 0, tile, block_u)
    got = tile_updown(x, wu, wd.T.contiguous(), g, plan, block_n)
    want = tile_updown_reference(x, wu, wd, g, plan)
    assert torch.equal(got[:tile], torch.zeros_like(got[:tile]))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("tile", "block_u"), [(64, 64), (128, 128)])
def test_the_forward_kernels_write_the_record_and_l1_the_reference_owes(tile, block_u):
    """The record-writing h kernel: y bitwise the plain kernels', every active entry's u in its place
    (a roundoff of the reference's at most: the GEMMs sum in different orders), L1 to float32 sums."""
    x, wu, wd, g = _patterned_inputs(tile, h=384, seed=torch.seed() % 2**31)
    wdt = wd.T.contiguous()
    plan = slot_plan(g, tile, block_u)
    y, l1, u_record = tile_forward(x, wu, wdt, g, plan, RecordLayout.of(g, tile))
    _, l1_ref, u_ref = tile_forward_reference(x, wu, wd, g, plan)
    assert torch.equal(y, tile_updown(x, wu, wdt, g, plan))
    assert u_record.shape == u_ref.shape
    torch.testing.assert_close(u_record.float(), u_ref.float(), rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(l1, l1_ref.float(), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@needs_hopper
# tile 128 with 128-unit blocks needs more shared memory than an H100/H200 SM has (dx: 262 KB at 3 stages)
@pytest.mark.parametrize(("tile", "block_u"), [(64, 64), (64, 128), (128, 64)])
def test_the_backward_kernels_give_the_references_gradients(tile, block_u):
    """dg and du at every active entry (float32, to the sums' order), dx within the bf16 rounding of
    dg and du that a dense bf16 backward makes too."""
    x, wu, wd, g = _patterned_inputs(tile, h=384, seed=torch.seed() % 2**31)
    wg = torch.randn(wu.shape, device="cuda").to(wu.dtype)  # any Wg: g is given
    active = g > 0
    layout = RecordLayout.of(g, tile)
    a_record, u_record = torch.relu(g)[active], (x.float() @ wu.float().T).to(x.dtype)[active]
    grad_y = torch.randn(x.shape, device="cuda").to(x.dtype)
    plan = slot_plan(g, tile, block_u)
    dx, dg, du = tile_backward(grad_y, wg, wu, wd.T.contiguous(), plan, layout, a_record, u_record, 1e-2)
    dx_ref, dg_ref, du_ref = tile_backward_reference(grad_y, wg, wu, wd, active, a_record, u_record, 1e-2)
    torch.testing.assert_close(dg, dg_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(du, du_ref, rtol=1e-4, atol=1e-4)
    assert ((dx.double() - dx_ref.double()).norm() / dx_ref.double().norm()).item() < 1e-2


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_the_per_unit_kernel_gives_the_weight_gradients_of_a_record_of_every_row(grad_dtype):
    """`csr_weight_grads` (the op's per-unit kernel alone) on a record of every row, heavy ones included,
    against the float32 reference: the units' sums in another order, rounded once to grad_dtype."""
    from sparse_llm.ops._extension import extension

    x, wu, _wd, g = _patterned_inputs(64, h=384, seed=torch.seed() % 2**31)
    active = g > 0
    row_ptr = torch.zeros(len(x) + 1, dtype=torch.int64, device="cuda")
    row_ptr[1:] = active.sum(dim=1).cumsum(0)
    cols = active.nonzero()[:, 1].to(torch.int32)
    a_record = torch.relu(g)[active]
    u_record = (x.float() @ wu.float().T).to(x.dtype)[active]
    dg, du = (torch.randn(len(cols), device="cuda") for _ in range(2))
    grad_y = torch.randn(x.shape, device="cuda").to(x.dtype)
    got = extension().csr_weight_grads(x, grad_y, row_ptr, cols, a_record, u_record, dg, du, 384, grad_dtype)
    want = weight_grads_reference(x, grad_y, active, a_record, u_record, dg, du)
    for name, a, b in zip(("dWg", "dWu", "dWd"), got, want, strict=True):
        assert a.dtype == grad_dtype and a.shape == b.shape, name
        err = ((a.double() - b.double()).norm() / b.double().norm()).item()
        assert err < (1e-2 if grad_dtype == torch.bfloat16 else 1e-5), f"{name}: {err:.2e}"


@pytest.mark.gpu
@needs_hopper
def test_the_record_of_every_row_holds_each_rows_active_units_in_order():
    from sparse_llm.ops._extension import extension

    _x, _wu, _wd, g = _patterned_inputs(64, h=384, seed=torch.seed() % 2**31)
    active = g > 0
    row_ptr = torch.zeros(len(g) + 1, dtype=torch.int64, device="cuda")
    row_ptr[1:] = active.sum(dim=1).cumsum(0)
    cols, a_vals = extension().csr_fill_record(g, row_ptr, int(row_ptr[-1]))
    assert torch.equal(cols, active.nonzero()[:, 1].to(torch.int32))
    assert torch.equal(a_vals, torch.relu(g)[active])


@pytest.mark.parametrize("slots", [False, True])
def test_the_entry_layout_places_every_entry_in_its_tiles_union(slots):
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(32, 96, generator=gen) - 1.5  # ~7% active: unions well short of every unit
    g[:8] = -1.0  # a tile with none
    active = g > 0
    plan = slot_plan(g, 8, 32) if slots else tile_plan(active, 8, 32)
    row_ptr = torch.zeros(33, dtype=torch.int64)
    torch.cumsum(active.sum(dim=1), 0, out=row_ptr[1:])
    rows, cols = active.nonzero().unbind(1)
    entries = EntryLayout.of(plan, row_ptr, cols.to(torch.int32), 96)
    assert torch.equal(entries.rows.long(), rows) and torch.equal(entries.cols.long(), cols)
    for t in range(4):
        union = plan.units[int(plan.starts[t]) : int(plan.starts[t]) + int(plan.counts[t])].long()
        assert 0 <= len(union) < 90
        expected = torch.full((96,), -1, dtype=torch.int32)
        expected[union] = torch.arange(len(union), dtype=torch.int32)
        assert torch.equal(entries.slots[t], expected)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("tile", "block_u", "slots"), [(64, 64, True), (64, 128, True), (64, 64, False)])
def test_dg_and_du_by_entries_are_the_fused_kernels_bitwise(tile, block_u, slots):
    x, wu, wd, g = _patterned_inputs(tile, h=384, seed=tile + block_u)
    gen = torch.Generator(device="cuda").manual_seed(block_u)
    wg = torch.randn(wu.shape, device="cuda", generator=gen).to(wu.dtype)
    active = g > 0
    layout = RecordLayout.of(g, tile)
    a_record, u_record = torch.relu(g)[active], (x.float() @ wu.float().T).to(x.dtype)[active]
    grad_y, wdt = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype), wd.T.contiguous()
    plan = slot_plan(g, tile, block_u) if slots else tile_plan(active, tile, block_u)
    fused = tile_dgdu(grad_y, wdt, plan, layout, a_record, u_record, 1e-2, wu.shape[0])
    entries = EntryLayout.of(plan, layout.row_ptr, active.nonzero()[:, 1].to(torch.int32), wu.shape[0])
    split = tile_dgdu_by_entries(grad_y, wdt, plan, entries, a_record, u_record, 1e-2)
    assert torch.equal(split[0], fused[0]) and torch.equal(split[1], fused[1])
    dx = [tile_dx(*parts[2:], wg, wu, plan, len(x)) for parts in (fused, split)]
    assert torch.equal(dx[0], dx[1])


def _per_unit_reference(x, grad_y, row_ptr, cols, a, u, dg, du, hidden, dtype):
    """csr_weight_grads's results by the reference (the per-unit kernel's signature, on the CPU)."""
    active = torch.zeros(len(x), hidden, dtype=torch.bool)
    rows = torch.repeat_interleave(torch.arange(len(x)), row_ptr.diff())
    active[rows, cols.long()] = True
    return tuple(t.to(dtype) for t in weight_grads_reference(x, grad_y, active, a, u, dg, du))


def test_the_ops_split_of_the_weight_gradients_is_the_reference():
    gen = torch.Generator().manual_seed(3)
    m, d, hidden = 48, 32, 96
    active = torch.rand(m, hidden, generator=gen) < 0.05
    active[:6] = torch.rand(6, hidden, generator=gen) < 0.6  # heavy rows (> 16 units)
    active[40:] = False  # rows with none
    x, grad_y = torch.randn(m, d, generator=gen), torch.randn(m, d, generator=gen)
    n = int(active.sum())
    a, u, dg, du = (torch.randn(n, generator=gen) for _ in range(4))
    row_ptr = torch.zeros(m + 1, dtype=torch.int64)
    torch.cumsum(active.sum(dim=1), 0, out=row_ptr[1:])
    cols = active.nonzero()[:, 1].to(torch.int32)
    assert int((row_ptr.diff() > 16).sum()) == 6
    split = split_weight_grads(x, grad_y, row_ptr, cols, (a, u, dg, du), hidden, 16, _per_unit_reference)
    for got, want in zip(split, weight_grads_reference(x, grad_y, active, a, u, dg, du), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_report_has_a_cell_for_every_column():
    ms = {
        k: 1.0
        for k in ("nnz", "union_mean", "err_tile", "err_dense_bf16", "dx_err", "design2_vs_op_grad_err")
    }
    ms |= {
        f"ms_{k}": 1.0
        for k in (
            "plan", "tile_kernels", "plan_kernels", "tile_kernels_slots", "tile_forward_kernels",
            "tile_backward_kernels", "dgdu_kernel", "dx_kernel", "dgdu_by_entries_kernels", "backward_plan_kernels",
            "weight_grads_kernels", "weight_grads_split", "op_forward", "op_forward_after_gate", "op_backward",
            "dense_updown", "design2_forward_after_gate", "design2_backward", "design2_backward_best",
            "design2_step_event", "op_step_event",
        )
    }  # fmt: skip
    row = ms | {"tile": 64, "block_u": 128, "block_n": 128, "sorted": False}
    row |= {"slot_plan_same_y": True, "dgdu_by_entries_same": False}
    meta = {"device": "GPU", "commit": "abc", "date": "today", "M": 64, "D": 32, "H": 96}
    for table in markdown(meta, [row]).split("\n\n"):
        lines = [line for line in table.splitlines() if line.startswith("|")]
        if lines:  # header, separator, the row: as many cells each
            assert len({line.count("|") for line in lines}) == 1, table
    assert "(differs)" in markdown(meta, [row])
