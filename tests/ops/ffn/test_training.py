"""The training FFN op: exact forward and gradients on every pattern, and it composes with
torch.compile, checkpointing, accumulation and autocast while saving no dense M x H tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from sparse_llm import ops
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.ffn.select import CUDA_TRAIN_MAX_HIDDEN, select_ffn
from sparse_llm.ops.ffn.training import TrainCapacities, dense_unit_min_fires, ffn_forward_train

LAMBDA = 0.7  # weight of l1 in the test loss: exercises the fused L1 gradient


def dense_formula(x, wg, wu, wd):
    """What the model's dense path computes: y and the per-layer statistics."""
    a = torch.relu(x @ wg.T)
    h = a * (x @ wu.T)
    h2, a2 = h.reshape(-1, h.shape[-1]), a.reshape(-1, a.shape[-1])
    l1 = h2.abs().sum(-1).mean()
    active = a2 > 0
    return h @ wd.T, l1, active.sum(-1), active.sum(0)


def make(m, d, h, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, d, generator=gen, dtype=torch.float64)
    wg = torch.randn(h, d, generator=gen, dtype=torch.float64) / d**0.5
    wu = torch.randn(h, d, generator=gen, dtype=torch.float64) / d**0.5
    wd = torch.randn(d, h, generator=gen, dtype=torch.float64) / h**0.5
    return [t.to(dtype) for t in (x, wg, wu, wd)]


def pattern(name, m, d, h, seed=0):
    """Inputs whose gate pattern is `name`; feature 0 of x is 1, gate column 0 a per-unit bias."""
    x, wg, wu, wd = make(m, d, h, seed)
    x[:, 0] = 1.0
    if name == "random":
        return x, wg, wu, wd
    wg[:, 0] = 0.0
    if name == "all_inactive":
        wg[:, 0] = -100.0
    elif name == "all_active":
        wg[:, 0] = 100.0
    elif name == "one_hot_unit":
        wg[:, 0] = -100.0
        wg[h // 2, 0] = 100.0
    elif name == "empty_and_dense_rows":
        # rows alternate: feature 1 large positive -> all fire; large negative -> none fire.
        wg[:, 0] = 0.0
        wg[:, 1] = 1.0
        x[:, 1] = torch.where(torch.arange(m) % 3 == 0, -100.0, 100.0)
        x[m // 2, 1] = 0.0  # one row left random-ish: its gate is the rest of x
    else:
        raise ValueError(name)
    return x, wg, wu, wd


def grads(fn, inputs):
    """(y, l1, nnz, fire, dx, dWg, dWu, dWd) of loss = <r, y> + LAMBDA * l1 for fixed r."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y, l1, nnz, fire = fn(*inputs)
    r = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y.dtype)
    ((y * r).sum() + LAMBDA * l1).backward()
    return (y, l1, nnz, fire, *(t.grad for t in inputs))


def ours(x, wg, wu, wd):
    out = ffn_forward_train(x, wg, wu, wd, impl="reference")
    return out.y, out.l1, out.nnz_per_token, out.fire_counts


def assert_matches_fp64(inputs, rtol=1e-4, atol=1e-5):
    got = grads(ours, inputs)
    want = grads(dense_formula, [t.double() for t in inputs])
    names = ("y", "l1", "nnz", "fire", "dx", "dWg", "dWu", "dWd")
    for name, g, w in zip(names, got, want, strict=True):
        if g.dtype == torch.int64:
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize(
    "m,d,h", [(1, 1, 1), (1, 2, 3), (7, 5, 11), (37, 16, 48), (130, 24, 40)], ids=lambda v: str(v)
)
def test_random_inputs_match_fp64_dense(m, d, h):
    for seed in range(2):
        assert_matches_fp64(make(m, d, h, seed))


@pytest.mark.parametrize("name", ["all_inactive", "all_active", "one_hot_unit", "empty_and_dense_rows"])
@pytest.mark.parametrize("m,h", [(1, 3), (29, 40)])
def test_adversarial_patterns_match_fp64_dense(name, m, h):
    inputs = pattern(name, m, 6, h)
    assert_matches_fp64(inputs)
    out = ffn_forward_train(*inputs, impl="reference")
    nnz = out.nnz_per_token
    if name == "all_inactive":
        assert nnz.sum() == 0 and out.l1 == 0
    if name == "all_active":
        assert torch.all(nnz == h)
    if name == "one_hot_unit":
        assert torch.all(nnz == 1) and out.fire_counts[h // 2] == m
    if name == "empty_and_dense_rows" and m > 3:
        assert (nnz == 0).any() and (nnz == h).any()
    torch.testing.assert_close(out.l0, nnz.float().mean())


def test_leading_dims_and_l0():
    x, wg, wu, wd = make(2 * 5, 8, 16)
    out = ffn_forward_train(x.view(2, 5, 8), wg, wu, wd, "reference")
    y, l1, nnz, fire = dense_formula(x, wg, wu, wd)
    assert out.y.shape == (2, 5, 8) and out.nnz_per_token.shape == (10,) and out.fire_counts.shape == (16,)
    torch.testing.assert_close(out.y.view(10, 8), y)
    torch.testing.assert_close(out.l1, l1)
    assert torch.equal(out.nnz_per_token, nnz) and torch.equal(out.fire_counts, fire)
    assert out.l0.dtype == torch.float32 and out.l1.dtype == torch.float32


def test_gradcheck_float64():
    x, wg, wu, wd = (t.requires_grad_(True) for t in make(6, 4, 9, seed=3, dtype=torch.float64))

    def fn(x, wg, wu, wd):
        out = ffn_forward_train(x, wg, wu, wd, "reference")
        return out.y, out.l1

    assert torch.autograd.gradcheck(fn, (x, wg, wu, wd))


def test_opcheck():
    x, wg, wu, wd = make(9, 4, 12, seed=2)
    keep = torch.randn(9, 3, dtype=torch.float64)
    for kept in (None, keep):
        torch.library.opcheck(torch.ops.sparse_llm.ffn_train_fwd_ref.default, (x, wg, wu, wd, kept))
    y, _, nnz, _, active, kept_rows, cols, a_vals, u_vals = torch.ops.sparse_llm.ffn_train_fwd_ref(
        x, wg, wu, wd, keep
    )
    assert torch.equal(active, (nnz > 0).nonzero().flatten()) and torch.equal(kept_rows, keep[active])
    torch.library.opcheck(
        torch.ops.sparse_llm.ffn_train_bwd_ref.default,
        (torch.randn_like(y), torch.tensor(0.3), x, wg, wu, wd, nnz, cols, a_vals, u_vals),
    )


def test_compile_fullgraph_matches_eager():
    inputs = make(17, 8, 24, seed=4)

    def fn(x, wg, wu, wd):
        out = ffn_forward_train(x, wg, wu, wd, "reference")
        return out.y, out.l1, out.nnz_per_token, out.fire_counts

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for got, want in zip(grads(compiled, inputs), grads(fn, inputs), strict=True):
        torch.testing.assert_close(got, want)


def test_checkpointing_gives_same_gradients():
    inputs = make(15, 8, 20, seed=6)

    def checkpointed(*args):
        return checkpoint(ours, *args, use_reentrant=False)

    for got, want in zip(grads(checkpointed, inputs), grads(ours, inputs), strict=True):
        torch.testing.assert_close(got, want)


def test_accumulation_over_two_micro_batches_equals_one_batch():
    x, wg, wu, wd = make(20, 8, 24, seed=7)
    weights = [w.clone().requires_grad_(True) for w in (wg, wu, wd)]
    r = torch.randn(20, 8, generator=torch.Generator().manual_seed(1))
    for half in (slice(0, 10), slice(10, 20)):
        out = ffn_forward_train(x[half], *weights, "reference")
        ((out.y * r[half]).sum() + LAMBDA * out.l1 / 2).backward()  # l1 is a per-micro-batch mean
    accumulated = [w.grad for w in weights]
    whole = [w.detach().clone().requires_grad_(True) for w in (wg, wu, wd)]
    out = ffn_forward_train(x, *whole, "reference")
    ((out.y * r).sum() + LAMBDA * out.l1).backward()
    for got, want in zip(accumulated, (w.grad for w in whole), strict=True):
        torch.testing.assert_close(got, want)


def test_bf16_autocast_with_fp32_weights_matches_dense_autocast():
    x, wg, wu, wd = make(64, 32, 96, seed=8)

    def dense(x, wg, wu, wd):  # the model's dense path under autocast
        a = torch.relu(torch.nn.functional.linear(x, wg))
        h = a * torch.nn.functional.linear(x, wu)
        y = torch.nn.functional.linear(h, wd)
        active = a > 0
        return y, h.float().abs().sum(-1).mean(), active.sum(-1), active.sum(0)

    results = []
    for fn in (ours, dense):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(grads(fn, (x, wg, wu, wd)))
    want = grads(dense_formula, [t.double() for t in (x, wg, wu, wd)])
    names = ("y", "l1", "nnz", "fire", "dx", "dWg", "dWu", "dWd")
    for name, g, d, w in zip(names, *results, want, strict=True):
        if name in ("dWg", "dWu", "dWd"):
            assert g.dtype == torch.float32, name  # gradients land on the fp32 master weights
        if name in ("nnz", "fire"):
            # bf16 rounding of the gate may flip units sitting at 0; both paths see the same g.
            assert torch.equal(g, d), name
            continue
        err_ours = ((g.double() - w).norm() / w.norm()).item()
        err_dense = ((d.double() - w).norm() / w.norm()).item()
        assert err_ours <= 2 * err_dense + 1e-6, (name, err_ours, err_dense)


def saved_bytes(fn, inputs):
    """Bytes and shapes of everything autograd saves for `fn`'s backward."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    unique = {t.untyped_storage().data_ptr(): t for t in saved}
    return sum(t.untyped_storage().nbytes() for t in unique.values()), [tuple(t.shape) for t in saved]


def test_saves_no_dense_hidden_tensor():
    m, d, h = 256, 16, 96
    x, wg, wu, wd = make(m, d, h, seed=9)
    x[:, 0] = 1.0
    wg[:, 0] = -3.0  # a sparse pattern: a few active units per token
    ours_bytes, shapes = saved_bytes(ours, (x, wg, wu, wd))
    dense_bytes, _ = saved_bytes(dense_formula, (x, wg, wu, wd))
    assert all(s[-1] != h or s[0] != m for s in shapes if len(s) == 2), shapes
    assert all(torch.Size(s).numel() < m * h for s in shapes), shapes
    nnz = int(ffn_forward_train(x, wg, wu, wd, "reference").nnz_per_token.sum())
    weights = 3 * h * d * 4
    budget = m * d * 4 + weights + m * 8 + nnz * (2 + 4 + 4)  # x, weights, row lengths, record
    assert ours_bytes <= budget, (ours_bytes, budget)
    assert ours_bytes - weights < (dense_bytes - weights) / 4


def test_impl_cuda_without_a_gpu_is_a_clear_error_and_bad_impl_rejected():
    x, wg, wu, wd = make(4, 8, 8)
    with pytest.raises(
        KernelsUnavailable, match=r"impl=cuda cannot run the kernels \(train\): tensors are on cpu"
    ):
        ffn_forward_train(x, wg, wu, wd, impl="cuda")
    with pytest.raises(ValueError, match="impl must be"):
        ffn_forward_train(x, wg, wu, wd, impl="fast")
    # The training kernels' own bound on H, as ops.ffn.select reports it for a CUDA device.
    too_wide = dict(hidden_size=8, intermediate_size=CUDA_TRAIN_MAX_HIDDEN + 8)
    with pytest.raises(
        KernelsUnavailable, match=f"need H <= {CUDA_TRAIN_MAX_HIDDEN}, got {CUDA_TRAIN_MAX_HIDDEN + 8}"
    ):
        select_ffn("cuda", "train", device="cuda", dtype=torch.bfloat16, **too_wide)
    assert select_ffn("auto", "eval", device="cpu", dtype=torch.bfloat16, **too_wide).impl == "dense"
    with pytest.raises(ValueError, match="Wd must be"):
        ffn_forward_train(x, wg, wu, wd.T.contiguous()[:3], impl="reference")
    assert ops.ffn_forward_train is ffn_forward_train


def test_cuda_ops_trace_under_fake_tensors():
    """The CUDA pair's schemas and fake kernels (what torch.compile sees), checked without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()):
        x, wg, wu, wd = (
            torch.empty(s, dtype=torch.bfloat16) for s in ((6, 16), (24, 16), (24, 16), (16, 24))
        )
        keep = torch.empty(6, 16)
        y, l1, nnz, fire, active, kept_rows, cols, a_vals, u_vals, heavy, *heavy_record, dense = (
            torch.ops.sparse_llm.ffn_train_fwd_cuda(x, wg, wu, wd, keep, 64)
        )
        assert y.shape == x.shape and l1.dtype == torch.float32 and nnz.shape == (6,) and fire.shape == (24,)
        assert active.dtype == torch.int64 and active.dim() == 1
        assert kept_rows.dtype == torch.float32 and kept_rows.shape == (active.shape[0], 16)
        assert cols.dtype == torch.int32 and a_vals.shape == cols.shape == u_vals.shape
        assert heavy.dtype == torch.int64 and heavy.dim() == 1
        heavy_cols, heavy_a, heavy_u = heavy_record
        assert heavy_cols.dtype == torch.int32 and heavy_a.shape == heavy_cols.shape == heavy_u.shape
        assert dense.dtype == torch.int32 and dense.dim() == 1
        grads = torch.ops.sparse_llm.ffn_train_bwd_cuda(
            y, l1, x, wg, wu, wd, nnz, cols, a_vals, u_vals, heavy, *heavy_record, dense
        )
        assert [g.shape for g in grads] == [x.shape, wg.shape, wu.shape, wd.shape]


def test_cuda_forward_traces_symbolically():
    """Every dynamic size of the CUDA forward's fake is among its outputs, as torch.compile's
    tracer requires (a size left pending raises)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def forward(x, wg, wu, wd, keep):
        return torch.ops.sparse_llm.ffn_train_fwd_cuda(x, wg, wu, wd, keep, 64)

    shapes = ((6, 16), (24, 16), (24, 16), (16, 24), (6, 16))
    traced = make_fx(forward, tracing_mode="symbolic")(
        *(torch.empty(s, dtype=torch.bfloat16) for s in shapes)
    )
    assert any("ffn_train_fwd_cuda" in str(node.target) for node in traced.graph.nodes)


@pytest.mark.parametrize(
    ("weight_dtype", "passed_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float64, torch.bfloat16)],
)
def test_cuda_backward_op_passes_float32_master_weights_through(monkeypatch, weight_dtype, passed_dtype):
    """The CUDA backward op hands float32 weights to the extension as they are (the kernels write
    their float32 gradients directly), casts any other dtype to x's, and returns each gradient in
    its weight's dtype. The extension is replaced by a recorder: this checks the op's routing."""
    from sparse_llm.ops.ffn import training

    seen = {}

    class RecordingExtension:
        def ffn_train_backward(self, grad_y, grad_l1, x, wg, wu, wd, *record):
            seen["dtypes"] = (wg.dtype, wu.dtype, wd.dtype)
            return torch.ones_like(x), torch.ones_like(wg), torch.ones_like(wu), torch.ones_like(wd)

    monkeypatch.setattr(training, "extension", RecordingExtension)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    wg, wu = (torch.randn(16, 8, dtype=weight_dtype) for _ in range(2))
    wd = torch.randn(8, 16, dtype=weight_dtype)
    record = (
        torch.zeros(4, dtype=torch.int64),
        *(torch.empty(0, dtype=t) for t in (torch.int32, x.dtype, x.dtype)),
    )
    heavy = (torch.empty(0, dtype=torch.int64), *record[1:])
    dense_units = torch.empty(0, dtype=torch.int32)
    dx, *grads = torch.ops.sparse_llm.ffn_train_bwd_cuda(
        torch.randn_like(x), torch.tensor(0.5), x, wg, wu, wd, *record, *heavy, dense_units
    )
    assert seen["dtypes"] == (passed_dtype,) * 3
    assert dx.dtype == x.dtype
    assert [g.dtype for g in grads] == [weight_dtype] * 3


def test_capacity_ops_trace_under_fake_tensors():
    """The capacity path's schemas and fakes (what torch.compile sees), checked without a GPU: every
    row kept (M rows, not a count), the light record with room for every row's most (M x
    min(threshold, H) entries), the heavy one of dynamic length, the dense units whole ([H]), the host
    sizes a CPU tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from sparse_llm.ops.ffn.training import HOST_SIZE_FIELDS

    capacities = TrainCapacities.new()
    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        x, wg, wu, wd = (
            torch.empty(s, dtype=torch.bfloat16) for s in ((6, 16), (24, 16), (24, 16), (16, 24))
        )
        keep = torch.empty(6, 16)
        outputs = torch.ops.sparse_llm.ffn_train_fwd_cuda_cap(x, wg, wu, wd, keep, 64, capacities)
        y, l1, nnz, fire, active, kept_rows, cols, a_vals, u_vals, heavy, *heavy_record, dense, host_sizes = (
            outputs
        )
        assert y.shape == x.shape and nnz.shape == (6,) and fire.shape == (24,)
        assert active.shape == (6,) and kept_rows.shape == (6, 16)
        assert cols.dtype == torch.int32 and a_vals.shape == cols.shape == u_vals.shape == (6 * 24,)
        assert heavy.dtype == torch.int64 and heavy.dim() == 1
        assert dense.dtype == torch.int32 and dense.shape == (24,)
        assert host_sizes.device.type == "cpu" and host_sizes.shape == (HOST_SIZE_FIELDS,)
        record = (nnz, cols, a_vals, u_vals, heavy, *heavy_record, dense, host_sizes)
        grads = torch.ops.sparse_llm.ffn_train_bwd_cuda_cap(
            y, l1, x, wg, wu, wd, *record, capacities, 64, None
        )
        assert [g.shape for g in grads] == [x.shape, wg.shape, wu.shape, wd.shape]


def test_train_capacities_grow_at_once_and_shrink_slowly():
    """A layer's capacities fit the heavy sizes just read (the second and third of the forward's
    five) with 2x headroom, rounded up to their granules, at once; when the sizes fall they come
    down 1% a step, never below what the last step needed; steps whose sizes were over a capacity
    are counted, in all and by size."""
    state = TrainCapacities.new()
    capacities = TrainCapacities.capacities
    TrainCapacities.update(state, [10_000, 100, 20_000, 500, 0])  # a fresh layer: every size overflows
    assert capacities(state).tolist() == [256, 40960] and TrainCapacities.overflows(state) == 1
    TrainCapacities.update(state, [90_000, 110, 19_000, 500, 0])  # within the headroom: kept
    assert capacities(state).tolist() == [256, 40960] and TrainCapacities.overflows(state) == 1
    TrainCapacities.update(state, [17_000, 300, 30_000, 500, 0])  # the heavy rows over: raised at once
    assert capacities(state).tolist() == [640, 61440] and TrainCapacities.overflows(state) == 2
    assert TrainCapacities.overflows_by_size(state) == {"heavy_rows": 2, "heavy_entries": 1}
    for _ in range(30):  # far too large: 1% lower a step (in whole granules)
        TrainCapacities.update(state, [100, 1, 100, 500, 0])
    assert capacities(state).tolist() == [512, 49152]
    for _ in range(1000):
        TrainCapacities.update(state, [100, 1, 100, 500, 0])
    # Down to one granule above what the sizes need, no further.
    assert capacities(state).tolist() == [64, 4096] and TrainCapacities.overflows(state) == 2
    with pytest.raises(ValueError, match="5 host sizes"):
        TrainCapacities.update(state, [100, 1, 100])


def test_heavy_rows_room_is_capped_where_the_gemms_pay_for_it():
    """Heavy rows get 2x room up to 1024 rows above the size, then 1024 rows or a quarter of the
    size, the more (their forward GEMMs run at the capacity); heavy entries keep 2x (memory only)."""
    need = TrainCapacities.need
    assert [need(0, n) for n in (0, 12, 1000, 1024)] == [0, 24, 2000, 2048]
    assert [need(0, n) for n in (2000, 4096, 7742)] == [3024, 5120, 9677]
    assert need(1, 2_000_000) == 4_000_000
    state = TrainCapacities.new()
    TrainCapacities.update(state, [80_000, 7742, 1_000_000, 16384, 0])
    assert TrainCapacities.capacities(state).tolist() == [9728, 2_002_944]


def test_dense_units_start_at_one_64th_of_the_rows():
    """A unit is a dense unit of the CUDA backward from light entries on 1/64 of the step's rows
    (rounded up; at least one entry, so an empty step lists none)."""
    assert dense_unit_min_fires(16384) == 256
    assert dense_unit_min_fires(2051) == 33
    assert dense_unit_min_fires(1) == dense_unit_min_fires(0) == 1


def test_a_capacity_keeps_room_for_heavy_rows_that_come_and_go():
    """A sparse layer has a few heavy rows every 60 steps: after the first, none overflows; a
    layer that stops having them drops their capacity to zero (no GEMMs to launch) within 64 steps."""
    state = TrainCapacities.new()
    for step in range(400):
        heavy = 12 if step % 60 == 0 else 0
        TrainCapacities.update(state, [80_000, heavy, heavy * 300, 16384, 0])
        assert TrainCapacities.capacities(state)[0] == 64
    assert TrainCapacities.overflows(state) == 1  # the fresh layer's first step
    for _ in range(64):
        TrainCapacities.update(state, [80_000, 0, 0, 16384, 0])
    # No heavy rows to compute (their entries' capacity the extension clamps to heavy rows x H).
    assert TrainCapacities.capacities(state)[0] == 0


# --- the capacity path's rebuild of an overflowed heavy record (ops.ffn.training) -----------------


def _integer_layer(m: int, d: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, Wg, Wu of small integers in float32: every product and sum is exact, so two GEMMs that
    sum in different orders agree on every gate's sign."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(-2, 3, shape, generator=gen).float() for shape in ((m, d), (h, d), (h, d)))


def _first_forward_record(x, wg, wu, threshold):
    """What a forward writes for its heavy rows, from g = x Wg^T: the counts, then the heavy rows
    ascending with their active units ascending, a = relu(g) and u = x Wu^T there."""
    g, u = x @ wg.t(), x @ wu.t()
    nnz = (g > 0).sum(1)
    rows = torch.nonzero(nnz > threshold).squeeze(1)
    entries = [(r, c) for r in rows.tolist() for c in torch.nonzero(g[r] > 0).squeeze(1).tolist()]
    r_idx, c_idx = (torch.tensor(v, dtype=torch.int64) for v in zip(*entries, strict=True))
    return nnz, rows, c_idx.int(), g[r_idx, c_idx], u[r_idx, c_idx]


@pytest.mark.parametrize("chunk_rows", [1024, 3])
def test_rebuild_heavy_record_on_the_forwards_input_is_its_record(chunk_rows, monkeypatch):
    from sparse_llm.ops.ffn import training

    monkeypatch.setattr(training, "REBUILD_CHUNK_ROWS", chunk_rows)
    x, wg, wu = _integer_layer(40, 16, 48, seed=1)
    threshold = 20
    nnz, rows, cols, a, u = _first_forward_record(x, wg, wu, threshold)
    assert 3 < rows.numel() < 40  # heavy and light rows both
    got = training.rebuild_heavy_record(x, wg, wu, nnz, threshold, rows.numel(), cols.numel())
    assert torch.equal(got[0], rows) and torch.equal(got[1], cols)
    assert torch.equal(got[2], a) and torch.equal(got[3], u)


@pytest.mark.parametrize("chunk_rows", [1024, 3])
def test_rebuild_heavy_record_keeps_the_forwards_layout_whatever_the_input(chunk_rows, monkeypatch):
    """On an input that fires other units (the backward's op input is not always the forward's bit
    for bit), the record keeps the forward's rows and each row's segment length: each segment holds
    its row's active units ascending up to its length, padded with units where a = u = 0."""
    from sparse_llm.ops.ffn import training

    monkeypatch.setattr(training, "REBUILD_CHUNK_ROWS", chunk_rows)
    x, wg, wu = _integer_layer(40, 16, 48, seed=2)
    threshold = 20
    nnz, rows, cols, _, _ = _first_forward_record(x, wg, wu, threshold)
    other = x + _integer_layer(40, 16, 48, seed=3)[0] * (torch.rand(40, 16) < 0.2)
    heavy_rows, got_cols, got_a, got_u = training.rebuild_heavy_record(
        other, wg, wu, nnz, threshold, rows.numel(), cols.numel()
    )
    assert torch.equal(heavy_rows, rows) and got_cols.numel() == cols.numel()
    g, u = other @ wg.t(), other @ wu.t()
    changed = 0
    offsets = torch.cumsum(nnz[rows], 0) - nnz[rows]
    for row, start, count in zip(rows.tolist(), offsets.tolist(), nnz[rows].tolist(), strict=True):
        seg = got_cols[start : start + count].long()
        assert torch.all(seg[1:] > seg[:-1]) and seg.min() >= 0 and seg.max() < 48
        active = torch.nonzero(g[row] > 0).squeeze(1)
        on = torch.isin(seg, active)
        assert torch.equal(seg[on], active[:count])  # its active units, ascending, first ones
        assert torch.equal(got_a[start : start + count][on], g[row, seg[on]])
        assert torch.equal(got_u[start : start + count][on], u[row, seg[on]])
        assert not got_a[start : start + count][~on].any() and not got_u[start : start + count][~on].any()
        changed += int(active.numel() != count)
    assert changed > 0  # the other input did move some rows' counts
