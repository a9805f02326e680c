"""GPU tests of the TwELL kernels: the exactness contract of docs/design.md section 3 on any pattern.

Contract: relative Frobenius error vs float64 <= 2x the dense bf16 torch path's error (+ a tiny
floor), every output element written, on fresh random inputs and on adversarial patterns.
"""

import pytest
import torch
from ffn_patterns import ABS_FLOOR, PATTERNS, ffn64, gpu_pattern, needs_hopper, rel_err

from benchmarks.common import make_workload
from sparse_llm import ops
from sparse_llm.ops._extension import extension
from sparse_llm.ops.ffn.twell import TILE, n_tiles

pytestmark = pytest.mark.gpu


def _poison_allocator(numel: int) -> None:
    """Leave NaNs in the caching allocator's free blocks, so an unwritten output element shows."""
    junk = torch.full((numel * 4,), float("nan"), device="cuda", dtype=torch.bfloat16)
    del junk


def _check_exact(x, wg, wu, wd, **kwargs) -> tuple[float, float]:
    ref = ffn64(x, wg, wu, wd)
    dense = ops.ffn_forward(x, wg, wu, wd, impl="reference")
    _poison_allocator(max(x.numel(), wg.numel()))
    out = ops.ffn_forward(x, wg, wu, wd, impl="cuda", **kwargs)
    torch.cuda.synchronize()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    err, err_dense = rel_err(out, ref), rel_err(dense, ref)
    if ref.norm() == 0:
        assert out.abs().max().item() == 0
    else:
        assert err <= 2 * err_dense + ABS_FLOOR, f"error {err:.3e} vs dense bf16 {err_dense:.3e}"
    return err, err_dense


@needs_hopper
@pytest.mark.parametrize(("m", "nnz"), [(16384, 15), (16384, 30), (16384, 120), (65536, 30)])
def test_standard_workload_is_exact(m, nnz):
    """M = 65536 takes the masked gate GEMM and pack (masked_gate_min_rows), 16384 the plain ones."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
    w = make_workload(m, 2048, 5632, nnz, seed=seed, device="cuda")
    err, err_dense = _check_exact(w.x, w.wg, w.wu, w.wd)
    print(f"nnz {nnz} seed {seed}: ours {err:.3e}, dense bf16 {err_dense:.3e}")


@needs_hopper
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    ("m", "d", "h"), [(1, 8, 8), (13, 24, 40), (1003, 256, 1000), (4099, 2048, 5632), (65539, 64, 1000)]
)
def test_adversarial_patterns_are_exact(pattern, m, d, h):
    _check_exact(*gpu_pattern(pattern, m, d, h, seed=m + d + h))


@needs_hopper
@pytest.mark.parametrize("heavy_threshold", [0, 1, 16, 64, 512])
def test_every_heavy_threshold_is_exact(heavy_threshold):
    w = make_workload(3000, 512, 1536, 40, seed=heavy_threshold, device="cuda")
    _check_exact(w.x, w.wg, w.wu, w.wd, heavy_threshold=heavy_threshold)


@needs_hopper
def test_empty_batch():
    x, wg, wu, wd = gpu_pattern("random", 0, 64, 128, seed=4)
    assert ops.ffn_forward(x, wg, wu, wd, impl="cuda").shape == (0, 64)


@needs_hopper
def test_largest_dim_and_leading_batch_dims():
    x, wg, wu, wd = gpu_pattern("random", 300, 8192, 256, seed=5)
    _check_exact(x.view(3, 100, 8192), wg, wu, wd)


@needs_hopper
def test_pack_kernel_matches_reference():
    x, wg, _, _ = gpu_pattern("mixed_rows", 517, 256, 1000, seed=9)
    x[2::3] = torch.randn_like(x[2::3])  # plus rows that overflow some tiles only
    g = x @ wg.T
    _assert_same_pack(ops.twell_pack(g, 50, impl="cuda"), ops.twell_pack(g, 50, impl="reference"))


def _assert_same_pack(got, want) -> None:
    """Equal packs, up to the slots past each tile's count (the masked pack leaves empty tiles unset)."""
    got, want = ops.TwellPacked(*got), ops.TwellPacked(*want)
    for name in ("counts", "row_nnz", "heavy"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    used = torch.arange(ops.SLOTS, device=want.counts.device) < want.counts.unsqueeze(-1).long()
    for name in ("values", "cols"):
        assert torch.equal(getattr(got, name)[used], getattr(want, name)[used]), name


def _relu_bit_mask(a: torch.Tensor) -> torch.Tensor:
    """The gate GEMM's bit-mask layout built in PyTorch: [M, 4 * n_tiles] int32, bit j of word w of
    a row set where a[row, 32 w + j] > 0."""
    m, h = a.shape
    bits = torch.zeros(m, n_tiles(h) * TILE, dtype=torch.int64, device=a.device)
    bits[:, :h] = (a > 0).long()
    words = (bits.view(m, -1, 32) << torch.arange(32, device=a.device)).sum(-1)
    return (words - (words >= 2**31).long() * 2**32).int()  # as two's-complement int32


@needs_hopper
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("m", "d", "h"), [(1, 8, 8), (13, 24, 40), (1003, 256, 1000), (517, 2048, 5632)])
def test_gate_gemm_bit_mask(pattern, m, d, h):
    """cuBLASLt's ReLU epilogue: a = relu(x Wg^T) within bf16 rounding of the dense GEMM; every
    a > 0 has its bit set (cuBLASLt also sets it where g == 0, and leaves the bits past H
    unwritten: the pack skips zero values and those bits); the pack from it is the reference's."""
    x, wg, _, _ = gpu_pattern(pattern, m, d, h, seed=11)
    gate = extension().gate_relu_mask(x, wg)
    if gate is None:  # the FFN falls back to at::mm and the dense pack: fine for odd small shapes
        assert h < 5632, "cuBLASLt offered no algorithm for the standard shape"
        pytest.skip(f"cuBLASLt offers no ReLU-mask algorithm for {(m, d, h)}")
    a, mask = gate
    ref = torch.relu(x.double() @ wg.double().T)
    assert (a >= 0).all()
    assert rel_err(a, ref) <= 2 * rel_err(torch.relu(x @ wg.T), ref) + ABS_FLOOR
    bits = (mask.long()[..., None] >> torch.arange(32, device=a.device)) & 1
    bits = bits.flatten(1)[:, :h].bool()
    assert bits[a > 0].all()
    assert not bits[(x @ wg.T) < -1].any()  # clearly negative (beyond rounding): never set
    _assert_same_pack(extension().twell_pack_masked(a, mask, 64), ops.twell_pack(a, 64, impl="reference"))


@needs_hopper
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("heavy_threshold", [0, 50, 512])
def test_masked_pack_matches_dense_pack(pattern, heavy_threshold):
    x, wg, _, _ = gpu_pattern(pattern, 517, 256, 1000, seed=12)
    a = torch.relu(x @ wg.T)
    a[3, 7] = 1e-40  # a bf16 subnormal: positive, so active
    mask = _relu_bit_mask(a)
    mask[5, 0] |= 1  # a set bit over a zero value (an fp32 product that bf16 rounds to 0): inactive
    a[5, 0] = 0.0
    got = extension().twell_pack_masked(a, mask, heavy_threshold)
    _assert_same_pack(got, ops.twell_pack(a, heavy_threshold=heavy_threshold, impl="reference"))


@needs_hopper
@pytest.mark.parametrize(
    ("d", "h", "match"), [(12, 64, "multiple of 8"), (8200, 64, "multiple of 8"), (64, 20, "H a multiple")]
)
def test_illegal_shapes_are_rejected(d, h, match):
    x, wg, wu, wd = (
        torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in [(4, d), (h, d), (h, d), (d, h)]
    )
    with pytest.raises(ValueError, match=match):
        ops.ffn_forward(x, wg, wu, wd, impl="cuda")


@needs_hopper
def test_non_contiguous_weights_and_wrong_dtype_are_rejected():
    x, wg, wu, wd = gpu_pattern("random", 8, 64, 128, seed=1)
    with pytest.raises(ValueError, match="contiguous"):
        ops.ffn_forward(x, wg, wu, wd.t().contiguous().t(), impl="cuda")
    with pytest.raises(ValueError, match="bfloat16"):
        ops.ffn_forward(x.half(), wg.half(), wu.half(), wd.half(), impl="cuda")


@needs_hopper
def test_opcheck_and_torch_compile():
    x, wg, wu, wd = gpu_pattern("random", 100, 128, 256, seed=3)
    for wd_t in (None, wd.t().contiguous()):
        torch.library.opcheck(torch.ops.sparse_llm.twell_ffn_forward, (x, wg, wu, wd, wd_t, 16))
    compiled = torch.compile(lambda *a: ops.ffn_forward(*a, impl="cuda"), fullgraph=True)
    torch.testing.assert_close(compiled(x, wg, wu, wd), ops.ffn_forward(x, wg, wu, wd, impl="cuda"))


@needs_hopper
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("m", "d", "h"), [(13, 24, 40), (4099, 2048, 5632), (65539, 64, 1000)])
def test_ffn_add_equals_out_plus_forward(pattern, m, d, h):
    """In place into a residual: bit for bit the separate forward and add, rows without an active
    unit included (the kernel leaves them as they are), on both gate paths (65539 rows: masked)."""
    x, wg, wu, wd = gpu_pattern(pattern, m, d, h, seed=m + h)
    out = torch.randn(x.shape, device="cuda").bfloat16()
    expected = out + ops.ffn_forward(x, wg, wu, wd, impl="cuda")
    assert ops.ffn_add_(out, x, wg, wu, wd, impl="cuda") is out
    assert torch.equal(out, expected)


@needs_hopper
@pytest.mark.parametrize(("m", "nnz"), [(16384, 30), (65536, 30)])
def test_ffn_add_standard_workload(m, nnz):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    w = make_workload(m, 2048, 5632, nnz, seed=seed, device="cuda")
    out = torch.randn(w.x.shape, device="cuda").bfloat16()
    expected = out + ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda")
    ops.ffn_add_(out, w.x, w.wg, w.wu, w.wd, impl="cuda", wd_t=w.wd.t().contiguous())
    assert torch.equal(out, expected), f"seed {seed}"


@needs_hopper
def test_ffn_add_opcheck_and_torch_compile_keep_it_in_place():
    x, wg, wu, wd = gpu_pattern("random", 100, 128, 256, seed=5)
    out = torch.randn(4, 25, 128, device="cuda").bfloat16()
    torch.library.opcheck(torch.ops.sparse_llm.twell_ffn_add_, (out.clone(), x, wg, wu, wd, None, 16))

    def residual_block(h, x):
        h = h * 2  # an intermediate, as the residual stream is in the model
        return ops.ffn_add_(h, x, wg, wu, wd, impl="cuda")

    compiled = torch.compile(residual_block, fullgraph=True)
    torch.testing.assert_close(
        compiled(out, x.view(4, 25, 128)), residual_block(out, x.view(4, 25, 128)), rtol=0, atol=0
    )
