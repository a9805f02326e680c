"""GPU tests of the CUDA training kernels (ffn_forward_train(impl="cuda")): the outputs, the
statistics and all four gradients against the float64 dense computation on every pattern of the
exactness contract (docs/design.md section 3), and the op under torch.compile, checkpointing and autocast.

Contract: relative Frobenius error vs float64 <= 2x the dense bf16 torch path's (+ a floor) for
y, l1, dx, dWg, dWu, dWd; the integer statistics equal the dense bf16 path's (same bf16 gate).
The floor is tiny, except where fewer than SMALL_SUPPORT entries are active: then each error is
one or two bf16 roundings and the ratio of two of them is noise, so the floor is two bf16 unit
roundoffs (2 x 2^-9: one rounding of an intermediate such as du, one of the output), three for
the gradients (the output gradient's cast to bf16 is one more). A quarter of a roundoff was too
tight: one active unit, D = H = 8, gave dWu errors 3.5e-3 (ours) vs 5.6e-4 (dense) on one draw of
the random output gradient; two were too tight once in ~300 draws (dWg, one token, D = H = 8).
"""

import pytest
import torch
from ffn_patterns import (
    ABS_FLOOR,
    PATTERNS,
    SMALL_SUPPORT,
    SMALL_SUPPORT_FLOOR,
    SMALL_SUPPORT_GRAD_FLOOR,
    gpu_pattern,
    needs_hopper,
    rel_err,
)
from torch.utils.checkpoint import checkpoint

from benchmarks.common import make_workload
from sparse_llm.ops.ffn.training import dense_unit_min_fires, ffn_forward_train

pytestmark = pytest.mark.gpu

LAMBDA = 0.7  # weight of l1 in the test loss: exercises the fused L1 gradient
NAMES = ("y", "l1", "nnz_per_token", "fire_counts", "dx", "dWg", "dWu", "dWd")


def dense(x, wg, wu, wd):
    """The model's dense path: y, l1 and the integer statistics."""
    a = torch.relu(x @ wg.T)
    h = a * (x @ wu.T)
    active = a > 0
    return h @ wd.T, h.abs().sum(-1).mean(), active.sum(-1), active.sum(0)


def cuda(x, wg, wu, wd, heavy_threshold=64):
    out = ffn_forward_train(x, wg, wu, wd, impl="cuda", heavy_threshold=heavy_threshold)
    return out.y, out.l1, out.nnz_per_token, out.fire_counts


def outputs_and_grads(fn, inputs, r):
    """fn's outputs and the gradients of <r, y> + LAMBDA * l1 in x, Wg, Wu, Wd."""
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    y, l1, nnz, fire = fn(*inputs)
    ((y * r.to(y.dtype)).sum() + LAMBDA * l1).backward()
    return (y, l1, nnz, fire, *(t.grad for t in inputs))


def check_contract(inputs, heavy_threshold=64, output_grad=True) -> dict[str, tuple[float, float]]:
    """Assert the contract for every output; return {name: (ours, dense bf16)} relative errors.
    The output gradient r is fresh every run (zero without `output_grad`: the gradients are then
    the L1 term's alone); a failure names its seed."""
    r_seed = int(torch.randint(0, 2**31 - 1, ()).item())
    generator = torch.Generator(device="cuda").manual_seed(r_seed)
    r = torch.randn(inputs[0].shape, device="cuda", dtype=torch.float64, generator=generator) * float(
        output_grad
    )
    got = outputs_and_grads(lambda *a: cuda(*a, heavy_threshold=heavy_threshold), inputs, r)
    dense_bf16 = outputs_and_grads(dense, inputs, r)
    want = outputs_and_grads(dense, [t.double() for t in inputs], r)
    small = dense_bf16[2].sum() < SMALL_SUPPORT
    errors = {}
    for name, g, d, w in zip(NAMES, got, dense_bf16, want, strict=True):
        assert g.shape == w.shape, name
        if w.dtype == torch.int64:
            assert torch.equal(g, d), name
            continue
        assert torch.isfinite(g).all(), name
        if w.norm() == 0:
            assert g.abs().max().item() == 0, name
            continue
        floor = (
            ABS_FLOOR
            if not small
            else SMALL_SUPPORT_GRAD_FLOOR
            if name.startswith("d")
            else SMALL_SUPPORT_FLOOR
        )
        errors[name] = (rel_err(g, w), rel_err(d, w))
        assert errors[name][0] <= 2 * errors[name][1] + floor, (name, errors[name], f"r seed {r_seed}")
    return errors


@needs_hopper
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("m", "d", "h"), [(1, 8, 8), (13, 24, 40), (1003, 256, 1000), (2051, 2048, 5632)])
def test_adversarial_patterns_match_fp64(pattern, m, d, h):
    check_contract(gpu_pattern(pattern, m, d, h, seed=m + d + h))


@needs_hopper
@pytest.mark.parametrize("nnz", [15, 30, 120])
def test_standard_workload_matches_fp64(nnz):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
    print(f"nnz {nnz} workload seed {seed}")  # shown with a failure
    w = make_workload(4096, 2048, 5632, nnz, seed=seed, device="cuda")
    errors = check_contract([w.x, w.wg, w.wu, w.wd])
    print(", ".join(f"{k} {a:.2e}/{b:.2e}" for k, (a, b) in errors.items()))


@needs_hopper
@pytest.mark.parametrize("heavy_threshold", [0, 1, 16, 64, 1 << 20])
def test_every_heavy_threshold_matches_fp64(heavy_threshold):
    """All rows dense (0), all sparse (huge) and splits between: the same exact answer."""
    w = make_workload(3000, 512, 1536, 40, seed=heavy_threshold % 1000, device="cuda")
    check_contract([w.x, w.wg, w.wu, w.wd], heavy_threshold)


HEAVY_BACKWARD_CHUNK_ROWS = 4096  # kHeavyBackwardChunkRows in kernels/train_bindings.cpp


def heavy_row_count(w, heavy_threshold: int) -> int:
    """Rows of the workload with more than `heavy_threshold` active units (the op's heavy rows)."""
    return int((((w.x @ w.wg.T) > 0).sum(-1) > heavy_threshold).sum().item())


@needs_hopper
@pytest.mark.parametrize("output_grad", [True, False])
@pytest.mark.parametrize("heavy_threshold", [0, 16])
def test_heavy_rows_past_one_backward_chunk_match_fp64(heavy_threshold, output_grad):
    """More heavy rows than the backward takes at once (kHeavyBackwardChunkRows): 9000 rows, 6000+
    of them heavy, in two or three chunks whose weight-gradient products are summed (for bf16 weights
    in fp32, rounded once): exact by the contract as one chunk is; also with the L1 term's gradient
    alone (its scale divides by all the rows, not a chunk's)."""
    w = make_workload(9000, 256, 1024, 40, seed=heavy_threshold + 5, device="cuda")
    assert heavy_row_count(w, heavy_threshold) > HEAVY_BACKWARD_CHUNK_ROWS
    check_contract([w.x, w.wg, w.wu, w.wd], heavy_threshold, output_grad)


@needs_hopper
def test_largest_dim_and_empty_batch():
    check_contract(gpu_pattern("random", 67, 8192, 128, seed=3))
    x, wg, wu, wd = gpu_pattern("random", 0, 64, 128, seed=4)
    out = ffn_forward_train(x, wg, wu, wd, impl="cuda")
    assert out.y.shape == (0, 64) and out.nnz_per_token.shape == (0,)


@needs_hopper
@pytest.mark.parametrize("heavy_threshold", [0, 16, 1 << 20])
def test_records_match_reference_record(heavy_threshold):
    """The light and the heavy rows' records hold the reference's entries of those rows (counts,
    columns, gate values), in CSR order; fire counts and l1 cover both; the dense units are the
    units with many light entries, ascending."""
    w = make_workload(777, 256, 1024, 30, seed=11, device="cuda")
    args = (w.x, w.wg, w.wu, w.wd)
    keep = torch.randn(w.x.shape[0], 5, device="cuda")
    _, l1, nnz, fire, active, kept, cols, a_vals, u_vals, heavy, heavy_cols, heavy_a, heavy_u, dense = (
        torch.ops.sparse_llm.ffn_train_fwd_cuda(*args, keep, heavy_threshold)
    )
    ref = torch.ops.sparse_llm.ffn_train_fwd_ref(*args, None)
    (_, l1_ref, nnz_ref, fire_ref, active_ref, _, cols_ref, a_ref, u_ref) = ref
    assert torch.equal(nnz, nnz_ref) and torch.equal(fire, fire_ref)
    assert torch.equal(active, active_ref) and torch.equal(active, (nnz > 0).nonzero().flatten())
    assert torch.equal(kept, keep[active])
    assert torch.equal(heavy, (nnz > heavy_threshold).nonzero().flatten())
    light_fires = torch.bincount(
        cols_ref[~torch.repeat_interleave(nnz > heavy_threshold, nnz)].long(), minlength=1024
    )
    dense_want = (light_fires >= dense_unit_min_fires(w.x.shape[0])).nonzero().flatten()
    assert dense.dtype == torch.int32 and torch.equal(dense.long(), dense_want)
    entry_heavy = torch.repeat_interleave(nnz > heavy_threshold, nnz)
    for kind, record in (
        (~entry_heavy, (cols, a_vals, u_vals)),
        (entry_heavy, (heavy_cols, heavy_a, heavy_u)),
    ):
        got_cols, got_a, got_u = record
        assert torch.equal(got_cols.long(), cols_ref[kind].long()) and torch.equal(got_a, a_ref[kind])
        torch.testing.assert_close(got_u.float(), u_ref[kind].float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(l1, l1_ref.float(), rtol=1e-2, atol=0)


DENSE_UNIT_CHUNK = 1024  # kDenseUnitChunk in kernels/train_bindings.cpp


@needs_hopper
@pytest.mark.parametrize(("nnz", "heavy_threshold"), [(120, 1 << 20), (200, 250)])
def test_dense_units_past_one_chunk_match_fp64(nnz, heavy_threshold):
    """More dense units than the backward's GEMMs take at once (kDenseUnitChunk): 1300-2200 of 4096
    units, in two or three chunks, each chunk's weight-gradient rows written (no heavy rows) or
    added to the heavy rows' GEMMs' (some rows heavy): exact by the contract as one chunk is."""
    w = make_workload(4096, 256, 4096, nnz, seed=21, device="cuda")
    dense_units = torch.ops.sparse_llm.ffn_train_fwd_cuda(w.x, w.wg, w.wu, w.wd, None, heavy_threshold)[-1]
    assert dense_units.numel() > DENSE_UNIT_CHUNK
    check_contract([w.x, w.wg, w.wu, w.wd], heavy_threshold)


@needs_hopper
def test_backward_is_deterministic():
    w = make_workload(2048, 512, 1536, 40, seed=5, device="cuda")
    r = torch.randn(w.x.shape, device="cuda", dtype=torch.float64)
    first = outputs_and_grads(cuda, [w.x, w.wg, w.wu, w.wd], r)
    second = outputs_and_grads(cuda, [w.x, w.wg, w.wu, w.wd], r)
    for name, a, b in zip(NAMES, first, second, strict=True):
        assert torch.equal(a, b), name


@needs_hopper
def test_opcheck():
    x, wg, wu, wd = gpu_pattern("random", 64, 128, 256, seed=2)
    for keep in (None, torch.randn(64, 16, device="cuda")):
        torch.library.opcheck(torch.ops.sparse_llm.ffn_train_fwd_cuda, (x, wg, wu, wd, keep, 4))


@needs_hopper
def test_compile_fullgraph_and_checkpointing_match_eager():
    w = make_workload(512, 256, 768, 30, seed=7, device="cuda")
    inputs = [w.x, w.wg, w.wu, w.wd]
    r = torch.randn(w.x.shape, device="cuda", dtype=torch.float64)
    eager = outputs_and_grads(cuda, inputs, r)
    compiled = outputs_and_grads(torch.compile(cuda, fullgraph=True), inputs, r)

    def checkpointed(*args):
        return checkpoint(cuda, *args, use_reentrant=False)

    recomputed = outputs_and_grads(checkpointed, inputs, r)
    for name, a, b, c in zip(NAMES, eager, compiled, recomputed, strict=True):
        assert torch.equal(a, b), f"compiled {name}"
        assert torch.equal(a, c), f"checkpointed {name}"


@needs_hopper
def test_autocast_with_fp32_master_weights():
    """Under bf16 autocast the op runs in bf16 and fp32 weights get fp32 gradients."""
    w = make_workload(1024, 256, 768, 30, seed=8, device="cuda", dtype=torch.float32)
    inputs = [w.x, w.wg, w.wu, w.wd]
    r = torch.randn(w.x.shape, device="cuda", dtype=torch.float64)

    def autocast(fn):
        def run(*args):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(*args)

        return run

    got = outputs_and_grads(autocast(cuda), inputs, r)
    dense_bf16 = outputs_and_grads(autocast(dense), inputs, r)
    want = outputs_and_grads(dense, [t.double() for t in inputs], r)
    for name, g, d, ref in zip(NAMES, got, dense_bf16, want, strict=True):
        if ref.dtype == torch.int64:
            assert torch.equal(g, d), name
        else:
            if name.startswith("d"):
                assert g.dtype == torch.float32, name
            assert rel_err(g, ref) <= 2 * rel_err(d, ref) + ABS_FLOOR, name


def backward_of_forward(x, weights, heavy_threshold: int, grad_seed: int):
    """Runs the CUDA forward op on bf16 weights (heavy rows exactly when heavy_threshold is 16) and
    returns a function giving the backward op's (dx, dWg, dWu, dWd) on its record for a fixed random
    grad_y and grad_l1 = 0.7, with the weights it is given (the casts, or float32 masters)."""
    out = torch.ops.sparse_llm.ffn_train_fwd_cuda(x, *weights, None, heavy_threshold)
    nnz_per_token, heavy_rows, record = out[2], out[9], out[6:]
    assert (heavy_rows.numel() > 0) == (heavy_threshold == 16)
    grad_y = torch.randn(
        x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(grad_seed)
    ).bfloat16()
    grad_l1 = torch.tensor(0.7, device="cuda")

    def backward(backward_weights):
        return torch.ops.sparse_llm.ffn_train_bwd_cuda(
            grad_y, grad_l1, x, *backward_weights, nnz_per_token, *record
        )

    return backward


@needs_hopper
@pytest.mark.parametrize(("m", "heavy_threshold"), [(1024, 768), (1024, 16), (9000, 16)])
def test_backward_with_float32_weights_rounds_once(m, heavy_threshold):
    """The backward op given float32 (master) weights reads bf16 casts of them and writes float32
    weight gradients: dx as with the casts; without heavy rows each float32 gradient rounds to the
    bf16 one exactly (same fp32 sums, one rounding fewer); with heavy rows (their products added
    in fp32 instead of onto a bf16 sum) they differ by about one bf16 rounding, also where the heavy
    rows' backward takes them in chunks (9000 rows), where the float32 gradients are also no further
    from float64's than the bf16 ones."""
    w = make_workload(m, 256, 768, 30, seed=9, device="cuda", dtype=torch.float32)
    if m > HEAVY_BACKWARD_CHUNK_ROWS:
        assert heavy_row_count(w, heavy_threshold) > HEAVY_BACKWARD_CHUNK_ROWS
    x = w.x.bfloat16()
    masters = [w.wg, w.wu, w.wd]
    casts = [t.bfloat16() for t in masters]
    backward = backward_of_forward(x, casts, heavy_threshold, grad_seed=3)
    dx16, *grads16 = backward(casts)
    dx32, *grads32 = backward(masters)
    assert torch.equal(dx16, dx32)
    # The exact gradients of the same loss (backward_of_forward's grad_y and grad_l1 = LAMBDA).
    grad_y = torch.randn(x.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).bfloat16()
    exact = outputs_and_grads(dense, [x.double(), *(c.double() for c in casts)], grad_y.double())[5:]
    for name, g16, g32, want in zip(("dWg", "dWu", "dWd"), grads16, grads32, exact, strict=True):
        assert g16.dtype == torch.bfloat16 and g32.dtype == torch.float32, name
        if heavy_threshold == 768:
            assert torch.equal(g32.bfloat16(), g16), name
        else:
            assert rel_err(g32, g16.float()) <= 2**-8, name
        if m > HEAVY_BACKWARD_CHUNK_ROWS:
            assert rel_err(g32, want) <= rel_err(g16, want) + 2**-9, name


@needs_hopper
def test_impl_cuda_rejects_float32_clearly():
    x, wg, wu, wd = (t.float() for t in gpu_pattern("random", 8, 64, 128, seed=1))
    with pytest.raises(ValueError, match="bfloat16"):
        ffn_forward_train(x, wg, wu, wd, impl="cuda")


def hot_units_inputs(m: int, d: int, h: int, seed: int):
    """Four units fire in every row, the others in ~0.1-2% of rows: the hot units' gradient rows sum
    over more entries than one warp takes (the per-unit kernel splits them over several warps)."""
    x, wg, wu, wd = gpu_pattern("empty", m, d, h, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bias = -2.0 - torch.rand(h, generator=gen, device="cuda")
    bias[:: max(1, h // 4)] = 50.0
    wg[:, 0] = bias.bfloat16()
    return x, wg, wu, wd


@needs_hopper
@pytest.mark.parametrize("heavy_threshold", [1 << 20, 16])
def test_hot_units_match_fp64_and_are_deterministic(heavy_threshold):
    """Hot units with and without heavy rows (the kernels' write and add paths), in bf16 and with
    float32 weights (one rounding of the same sums)."""
    inputs = hot_units_inputs(3000, 512, 1536, seed=heavy_threshold % 1000)
    check_contract(inputs, heavy_threshold)
    x, *casts = inputs
    backward = backward_of_forward(x, casts, heavy_threshold, grad_seed=1)
    first = backward(casts)
    again = backward(casts)
    for name, a, b in zip(("dx", "dWg", "dWu", "dWd"), first, again, strict=True):
        assert torch.equal(a, b), name
    _, *grads32 = backward([t.float() for t in casts])
    for name, g16, g32 in zip(("dWg", "dWu", "dWd"), first[1:], grads32, strict=True):
        if heavy_threshold == 1 << 20:
            assert torch.equal(g32.bfloat16(), g16), name
        else:
            assert rel_err(g32, g16.float()) <= 2**-8, name
