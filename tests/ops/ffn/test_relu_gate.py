"""The dense FFN's gate product with its statistics in one pass (sparse_llm/ops/relu_gate.py)."""

from __future__ import annotations

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.ops.activation_counts import activation_counts_reference
from sparse_llm.ops.ffn.relu_gate import relu_gate_stats, relu_gate_stats_reference


def _inputs(rows: int, hidden: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """Gate and up projections with the patterns that matter: a row with no active unit, a row
    with every unit active, a unit that never fires."""
    gen = torch.Generator(device=device).manual_seed(seed)
    g = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    u = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
    g[0] = -1.0
    g[1] = g[1].abs() + 0.5
    g[:, 3] = -1.0
    return g, u


def test_values_and_statistics_are_those_of_the_plain_ops():
    g, u = _inputs(9, 40, torch.float32)
    h, l1, nnz, fire = relu_gate_stats(g, u)
    plain = torch.relu(g) * u
    assert torch.equal(h, plain)
    assert torch.equal(l1, plain.abs().sum(-1, dtype=torch.float32))
    want_nnz, want_fire = activation_counts_reference(torch.relu(g))
    assert torch.equal(nnz, want_nnz) and torch.equal(fire, want_fire)
    assert nnz[0] == 0 and nnz[1] == 39 and fire[3] == 0


def test_l1_sums_h_as_rounded():
    """The dense FFN's L1 and the sparse op's (the hot units' share of it): |h| with h rounded to
    its dtype, summed in float32 for bf16 operands and in float64 for float64 ones."""
    g, u = _inputs(9, 40, torch.bfloat16)
    h, l1, _, _ = relu_gate_stats(g, u)
    assert l1.dtype == torch.float32 and torch.equal(l1, h.float().abs().sum(-1))
    assert not torch.equal(l1, (torch.relu(g).float() * u.float()).abs().sum(-1))  # h's rounding counts
    g64, u64 = (t.double() for t in (g, u))
    l1_64 = relu_gate_stats(g64, u64)[1]
    assert l1_64.dtype == torch.float64 and torch.equal(l1_64, (torch.relu(g64) * u64).abs().sum(-1))


def test_gradients_are_those_of_the_plain_ops():
    """Through h and through the per-row L1 (fp32, as the loss sums it)."""
    g, u = (t.double().requires_grad_() for t in _inputs(6, 24, torch.float32))
    w, c = torch.randn(6, 24, dtype=torch.float64), torch.randn(6)
    h, l1, _, _ = relu_gate_stats(g, u)
    ((h * w).sum() + (l1 * c).sum()).backward()
    g2, u2 = (t.detach().clone().requires_grad_() for t in (g, u))
    h2 = torch.relu(g2) * u2
    ((h2 * w).sum() + (h2.abs().sum(-1, dtype=torch.float32) * c).sum()).backward()
    torch.testing.assert_close(g.grad, g2.grad)
    torch.testing.assert_close(u.grad, u2.grad)


def test_operands_of_other_shapes_or_dtypes_are_refused():
    g, u = _inputs(5, 16, torch.float32)
    for bad_u in (u[:, :8], u.double()):
        with pytest.raises(ValueError, match="one \\[M, H\\] shape, dtype and device"):
            relu_gate_stats(g, bad_u)
    with pytest.raises(ValueError, match="one \\[M, H\\] shape"):
        relu_gate_stats(g[None], u[None])


def test_op_registration():
    g, u = _inputs(5, 16, torch.float32)
    torch.library.opcheck(relu_gate_stats, (g.requires_grad_(), u.requires_grad_()))
    torch.library.opcheck(relu_gate_stats, (g.double().requires_grad_(), u.double().requires_grad_()))


@needs_hopper
@pytest.mark.gpu
@pytest.mark.parametrize(("rows", "hidden"), [(37, 200), (16384, 5632), (16384, 1408)])
def test_the_triton_kernel_equals_the_reference(rows, hidden):
    """bf16 on the GPU: h and the counts exactly the reference's, the L1 rows within fp32 summation
    order; the gradients of a loss through h and the L1 rows those of the reference's autograd."""
    g, u = _inputs(rows, hidden, torch.bfloat16, "cuda", seed=rows)
    got, want = relu_gate_stats(g, u), relu_gate_stats_reference(g, u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-3)

    w = torch.randn(g.shape, device="cuda")
    c = torch.randn(g.shape[0], device="cuda")
    for got_grad, want_grad in zip(
        _gradients(relu_gate_stats, g, u, w, c),
        _gradients(relu_gate_stats_reference, g, u, w, c),
        strict=True,
    ):
        torch.testing.assert_close(got_grad, want_grad)


def _gradients(fn, g: torch.Tensor, u: torch.Tensor, w: torch.Tensor, c: torch.Tensor):
    """Of <h, w> + <l1, c> in g and u."""
    g1, u1 = g.clone().requires_grad_(), u.clone().requires_grad_()
    h, l1, _, _ = fn(g1, u1)
    ((h.to(w.dtype) * w).sum() + (l1.to(c.dtype) * c).sum()).backward()
    return g1.grad, u1.grad


@needs_hopper
@pytest.mark.gpu
def test_a_nan_gate_gives_a_nan_product_as_torch_relu_does():
    """A diverging run shows in h: the kernel's relu keeps NaN (torch.relu(nan) is nan)."""
    g, u = _inputs(40, 300, torch.bfloat16, "cuda", seed=5)
    g[2, 5] = float("nan")
    h = relu_gate_stats(g, u)[0]
    assert torch.isnan(h[2, 5]) and torch.isnan(relu_gate_stats_reference(g, u)[0][2, 5])
    assert torch.isfinite(h[3:]).all()


@needs_hopper
@pytest.mark.gpu
def test_the_kernel_compiles_once_for_every_width():
    """The hot units' width changes at each refresh and differs by layer: a kernel compiled per width
    cost ~1 s a refresh in a 1b run (benchmarks/results/run_1b_hot_ab_h200.md). Widths that are
    multiples of 64 (as S's are) share one compilation. Counted in Triton's per-device kernel cache
    (`JITFunction.device_caches`, Triton 3.2 and later)."""
    from sparse_llm.ops.ffn import relu_gate

    compiled = relu_gate._relu_gate_stats_kernel.device_caches[torch.cuda.current_device()][0]
    relu_gate_stats(*_inputs(256, 64, torch.bfloat16, "cuda"))
    before = len(compiled)
    for hidden in (128, 192, 640, 1408):
        relu_gate_stats(*_inputs(256, hidden, torch.bfloat16, "cuda"))
    assert len(compiled) == before
