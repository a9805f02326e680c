"""CPU tests of the ops front: reference accuracy, the TwELL format, input checks, the workload."""

import pytest
import torch

from benchmarks.common import make_workload
from sparse_llm import ops
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.ffn.twell import SLOTS, TILE, twell_pack_reference, twell_unpack


def _ffn64(x, wg, wu, wd):
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    return (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _weights(d: int, h: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    wg = torch.randn(h, d, generator=gen) / d**0.5
    wu = torch.randn(h, d, generator=gen) / d**0.5
    wd = torch.randn(d, h, generator=gen) / h**0.5
    return wg.to(dtype), wu.to(dtype), wd.to(dtype)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_reference_matches_float64(dtype, tol):
    wg, wu, wd = _weights(64, 96, dtype)
    x = torch.randn(3, 5, 64).to(dtype)
    y = ops.ffn_forward(x, wg, wu, wd, impl="reference")
    assert y.shape == x.shape and y.dtype == dtype
    assert _rel_err(y, _ffn64(x, wg, wu, wd)) < tol


def _adversarial_g(rows: int, hidden: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    random = torch.randn(rows, hidden, generator=gen)
    one_hot = torch.full((rows, hidden), -1.0)
    one_hot[:, hidden // 2] = 3.0
    full_tile = torch.full((rows, hidden), -1.0)
    full_tile[:, :SLOTS] = 1.0  # exactly the slot budget in tile 0
    over_tile = full_tile.clone()
    over_tile[::2, SLOTS : SLOTS + 1] = 2.0  # one more in every other row: overflow (if H > SLOTS)
    mixed = torch.where(torch.rand(rows, hidden, generator=gen) < 0.01, random.abs() + 0.1, -random.abs())
    mixed[0] = -1.0  # empty row
    mixed[1] = random[1].abs() + 0.1  # fully dense row
    return {
        "empty": -torch.rand(rows, hidden, generator=gen),
        "zeros": torch.zeros(rows, hidden),
        "dense": random.abs() + 0.1,
        "random": random,
        "one_hot": one_hot,
        "full_tile": full_tile,
        "over_tile": over_tile,
        "mixed": mixed,
    }


@pytest.mark.parametrize("hidden", [8, 200, 2 * TILE, 5632])
@pytest.mark.parametrize("pattern", list(_adversarial_g(2, 32)))
def test_twell_round_trip(pattern, hidden):
    g = _adversarial_g(9, hidden)[pattern].to(torch.bfloat16)
    packed = twell_pack_reference(g, heavy_threshold=40)
    a = torch.relu(g)
    nnz = (a > 0).sum(dim=1)
    tile_counts = torch.nn.functional.pad(a > 0, (0, packed.counts.shape[1] * TILE - hidden))
    overflow = tile_counts.view(g.shape[0], -1, TILE).sum(-1).gt(SLOTS).any(dim=1)
    assert torch.equal(packed.row_nnz, nnz.int())
    assert torch.equal(packed.heavy, (nnz > 40) | overflow)
    if bool(overflow.any()):
        with pytest.raises(ValueError, match="overflowed"):
            twell_unpack(packed, hidden)
        light = ~overflow
        sub = ops.TwellPacked(*(t[light] for t in packed))
        assert torch.equal(twell_unpack(sub, hidden), a[light])
    else:
        assert torch.equal(twell_unpack(packed, hidden), a)


def test_twell_pack_front_on_cpu_and_layout():
    g = torch.tensor([[-1.0, 2.0, 0.0, 3.0] + [0.0] * 4], dtype=torch.bfloat16)
    packed = ops.twell_pack(g, heavy_threshold=1, impl="reference")
    assert packed.values.shape == (1, 1, SLOTS) and packed.cols.dtype == torch.uint8
    assert (
        packed.counts.tolist() == [[2]] and packed.row_nnz.tolist() == [2] and packed.heavy.tolist() == [True]
    )
    assert packed.cols[0, 0, :2].tolist() == [1, 3]
    assert packed.values[0, 0, :2].float().tolist() == [2.0, 3.0]


@pytest.mark.parametrize(
    ("shapes", "error", "match"),
    [
        (((4, 16), (24, 16), (24, 16), (16, 24)), None, None),
        (((4, 12), (24, 16), (24, 16), (16, 24)), ValueError, "x must be"),
        (((4, 16), (24, 16), (24, 8), (16, 24)), ValueError, "Wu must be"),
        (((4, 16), (24, 16), (24, 16), (24, 16)), ValueError, "Wd must be"),
        (((4, 16), (24,), (24, 16), (16, 24)), ValueError, "Wg must be"),
    ],
)
def test_input_shape_checks(shapes, error, match):
    x, wg, wu, wd = (torch.randn(s) for s in shapes)
    if error is None:
        ops.ffn_forward(x, wg, wu, wd, "reference")
    else:
        with pytest.raises(error, match=match):
            ops.ffn_forward(x, wg, wu, wd, "reference")


def test_input_dtype_and_impl_checks():
    wg, wu, wd = _weights(16, 24)
    x = torch.randn(4, 16)
    with pytest.raises(TypeError, match="one dtype"):
        ops.ffn_forward(x.double(), wg, wu, wd, "reference")
    with pytest.raises(TypeError, match="floating-point"):
        ops.ffn_forward(x.long(), wg, wu, wd, "reference")
    with pytest.raises(ValueError, match="impl must be"):
        ops.ffn_forward(x, wg, wu, wd, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):  # deciding is select_ffn's job
        ops.ffn_forward(x, wg, wu, wd, impl="auto")
    with pytest.raises(KernelsUnavailable, match="impl=cuda cannot run the kernels"):
        ops.ffn_forward(x, wg, wu, wd, impl="cuda")
    with pytest.raises(ValueError, match="heavy_threshold"):
        ops.ffn_forward(x, wg, wu, wd, "reference", heavy_threshold=-1)


def test_workload_hits_target_sparsity():
    w = make_workload(512, 256, 1024, nnz_target=12, seed=3, calib_tokens=512)
    g = w.x.float() @ w.wg.float().T
    nnz = (g > 0).sum(dim=1).double()
    assert abs(nnz.mean().item() - 12) < 1.5  # bf16 rounding of x and Wg moves a few units
    assert nnz.median() < nnz.mean()  # heavy tail from the per-token scale
    assert (g > 0).any(dim=0).double().mean() < 0.75  # the dead 30% never fire
    assert torch.all(w.x[:, 0] == 1)


def test_fake_kernel_gives_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(5, 16, dtype=torch.bfloat16)
        w = torch.empty(24, 16, dtype=torch.bfloat16)
        y = torch.ops.sparse_llm.twell_ffn_forward(x, w, w, w.t(), None, 8)
        packed = torch.ops.sparse_llm.twell_pack(torch.empty(5, 200, dtype=torch.bfloat16), 8)
    assert y.shape == (5, 16)
    assert packed[0].shape == (5, 2, SLOTS) and packed[4].dtype == torch.bool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ffn_add_is_out_plus_forward_in_place(dtype):
    wg, wu, wd = _weights(32, 48, dtype)
    x = torch.randn(2, 5, 32).to(dtype)
    out = torch.randn(2, 5, 32).to(dtype)
    expected = out + ops.ffn_forward(x, wg, wu, wd, "reference")
    got = ops.ffn_add_(out, x, wg, wu, wd, "reference")
    assert got is out
    assert torch.equal(out, expected)


def test_ffn_add_input_checks():
    wg, wu, wd = _weights(16, 24)
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="out must be shaped like x"):
        ops.ffn_add_(torch.zeros(3, 16), x, wg, wu, wd, "reference")
    with pytest.raises(ValueError, match="out must be shaped like x"):
        ops.ffn_add_(torch.zeros(4, 16, dtype=torch.float64), x, wg, wu, wd, "reference")
    with pytest.raises(ValueError, match="contiguous"):
        ops.ffn_add_(torch.zeros(16, 4).t(), x, wg, wu, wd, "reference")
    with pytest.raises(ValueError, match="share memory with x"):
        ops.ffn_add_(x, x, wg, wu, wd, "reference")
    with pytest.raises(RuntimeError, match="no autograd"):
        ops.ffn_add_(torch.zeros(4, 16), x, wg.requires_grad_(), wu, wd, "reference")
    with torch.no_grad():
        ops.ffn_add_(torch.zeros(4, 16), x, wg, wu, wd, "reference")  # fine without gradients


def test_fake_ffn_add_mutates_nothing_it_should_not():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.empty(2, 5, 16, dtype=torch.bfloat16)
        x = torch.empty(10, 16, dtype=torch.bfloat16)
        w = torch.empty(24, 16, dtype=torch.bfloat16)
        assert torch.ops.sparse_llm.twell_ffn_add_(out, x, w, w, w.t(), None, 8) is None
    assert out.shape == (2, 5, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_add_adds_the_projection_in_place(dtype):
    out = torch.randn(2, 3, 8).to(dtype)
    x = torch.randn(2, 3, 5).to(dtype)
    w = torch.randn(8, 5).to(dtype)
    expected = out.float() + x.float() @ w.float().T
    with torch.no_grad():
        got = ops.linear_add_(out, x, w)
    assert got is out
    torch.testing.assert_close(
        out.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2
    )
    torch.library.opcheck(torch.ops.sparse_llm.linear_add_, (out.clone().view(6, 8), x.view(6, 5), w))


def test_linear_add_compiles_on_a_decode_steps_residual():
    """Residual adds into a [B, 1, D] stream (a decode step), traced by Inductor: the op mutates
    a 2-D view, where mutating the 3-D tensor failed in Inductor's scheduler (KeyError)."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 64) * 0.1 for _ in range(4)]

    def norm(h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    def step(h: torch.Tensor) -> torch.Tensor:
        for w_out, w_add in zip(weights[::2], weights[1::2], strict=True):
            h = h + norm(h) @ w_out  # a layer's two residual adds: out of place, then in place
            h = ops.linear_add_(h, norm(h), w_add)
        return norm(h)[:, -1]

    h = torch.randn(8, 1, 64)
    with torch.no_grad():
        expected = step(h.clone())
        got = torch.compile(step, fullgraph=True)(h.clone())
    torch.testing.assert_close(got, expected)


def test_linear_add_input_checks():
    out, x, w = torch.zeros(4, 8), torch.randn(4, 5), torch.randn(8, 5)
    with pytest.raises(ValueError, match="dtype and device"):
        ops.linear_add_(out.double(), x, w)
    with pytest.raises(ValueError, match=r"weight \[N, K\]"):
        ops.linear_add_(out, x, w.T)
    with pytest.raises(ValueError, match="contiguous"):
        ops.linear_add_(torch.zeros(8, 4).T, x, w)
    with pytest.raises(RuntimeError, match="no autograd"):
        ops.linear_add_(out, x, w.requires_grad_())
