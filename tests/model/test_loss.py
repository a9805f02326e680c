"""The chunked linear + cross-entropy against F.cross_entropy on the whole logits."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from sparse_llm.model.loss import IGNORE_INDEX, default_chunk_tokens, linear_cross_entropy
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.cross_entropy import (
    cross_entropy_rows,
    cross_entropy_rows_,
    cross_entropy_rows_reference,
    runs_on_kernel,
)
from sparse_llm.ops.matmul_accumulate import matmul_accumulate_


def _inputs(tokens: int, dim: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, tokens, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * 0.3
    labels = torch.randint(0, vocab, (2, tokens), generator=gen)
    labels[0, :3] = IGNORE_INDEX  # padding positions
    labels[1, -1] = IGNORE_INDEX
    return hidden, weight, labels


def _reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = hidden @ weight.t()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64, None])
def test_loss_and_gradients_match_unfused(chunk: int | None) -> None:
    hidden, weight, labels = _inputs(tokens=13, dim=8, vocab=37, seed=chunk or 0)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ours = linear_cross_entropy(h1, w1, labels, chunk_tokens=chunk)
    ref = _reference(h2, w2, labels)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    (3.0 * ours).backward()  # the incoming gradient scales the stored ones
    (3.0 * ref).backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-9, atol=1e-12)


def test_without_grad_gives_the_same_loss() -> None:
    hidden, weight, labels = _inputs(tokens=9, dim=4, vocab=11, seed=3)
    with torch.no_grad():
        ours = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(ours, _reference(hidden, weight, labels), rtol=1e-10, atol=1e-12)


def test_bf16_autocast_matches_unfused_autocast() -> None:
    hidden, weight, labels = (t.float() if t.is_floating_point() else t for t in _inputs(64, 32, 101, 5))
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h1, w1, labels, chunk_tokens=32)
        ref = F.cross_entropy(
            (h2 @ w2.t()).float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
        )
    ours.backward()
    ref.backward()
    assert h1.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # Both round the logits' gradient to bf16 before the projection's backward.
    torch.testing.assert_close(h1.grad, h2.grad, rtol=2e-2, atol=2e-4)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=2e-2, atol=2e-4)


def test_every_label_ignored_gives_nan_like_f() -> None:
    hidden, weight, labels = _inputs(tokens=4, dim=4, vocab=7, seed=1)
    labels.fill_(IGNORE_INDEX)
    assert torch.isnan(linear_cross_entropy(hidden, weight, labels)).item()
    assert torch.isnan(_reference(hidden, weight, labels)).item()


def test_default_chunk_is_a_power_of_two_that_bounds_the_logits() -> None:
    for vocab in (7, 512, 32000, 49152, 128256):
        chunk = default_chunk_tokens(vocab)
        assert chunk & (chunk - 1) == 0
        assert chunk * vocab <= 1 << 28 < 2 * chunk * vocab


def test_bad_inputs_are_refused() -> None:
    hidden, weight, labels = _inputs(tokens=4, dim=4, vocab=7, seed=1)
    with pytest.raises(ValueError, match="labels of shape"):
        linear_cross_entropy(hidden, weight, labels[:, :3])
    with pytest.raises(ValueError, match="does not project"):
        linear_cross_entropy(hidden, weight[:, :3], labels)
    with pytest.raises(TypeError, match="integer"):
        linear_cross_entropy(hidden, weight, labels.float())
    with pytest.raises(ValueError, match="chunk_tokens"):
        linear_cross_entropy(hidden, weight, labels, chunk_tokens=-2)
    with pytest.raises(ValueError, match="impl must be"):
        linear_cross_entropy(hidden, weight, labels, impl="triton")
    with pytest.raises(KernelsUnavailable, match="impl='cuda' cannot run: tensors are on cpu"):
        linear_cross_entropy(hidden, weight, labels, impl="cuda")


def test_cross_entropy_rows_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        cross_entropy_rows(torch.zeros(4, 7), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        cross_entropy_rows(torch.zeros(2, 4, 7), torch.zeros(2, 4, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_cross_entropy_rows_in_place_writes_the_gradient_over_the_logits(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(1100, 13, generator=gen)).to(dtype)  # more rows than one logsumexp block
    labels = torch.randint(0, 13, (1100,), generator=gen)
    labels[::4] = IGNORE_INDEX
    scale = torch.tensor(1 / 7, dtype=torch.float64)
    want_loss, want_grad = cross_entropy_rows(logits, labels, scale)
    buffer = logits.data_ptr()
    loss = cross_entropy_rows_(logits, labels, scale)
    assert logits.data_ptr() == buffer and logits.dtype == dtype
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    torch.testing.assert_close(logits, want_grad, rtol=0, atol=0)


def test_cross_entropy_rows_in_place_refuses_what_it_cannot_write_over() -> None:
    labels = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="must be contiguous"):
        cross_entropy_rows_(torch.zeros(7, 4).t(), labels, torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        cross_entropy_rows_(torch.zeros(3, 7), labels, torch.tensor(1.0))


def test_compiled_reference_loss_keeps_its_chunks_one_after_the_other() -> None:
    """Compiled on CPU (the PyTorch path), each chunk's loss step is one opaque op between that
    chunk's logit GEMM and the next one's: traced, Inductor had fused every chunk's softmax into
    one kernel after all the logit GEMMs, keeping every chunk's logits alive."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 40, (64,), generator=gen)
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=16))

    def step() -> torch.Tensor:
        hidden.grad = weight.grad = None
        loss = compiled(hidden, weight, labels)
        loss.backward()
        return loss.detach()

    loss, codes = run_and_get_code(step)
    calls = [
        "op" if "cross_entropy_rows_pytorch_" in line else "mm"
        for line in "\n".join(codes).splitlines()
        if "cross_entropy_rows_pytorch_.default(" in line or "extern_kernels.mm(" in line
    ]
    steps = [i for i, call in enumerate(calls) if call == "op"]
    assert len(steps) == 4, calls
    # A logit GEMM before the first step and between any two: never two chunks' steps in a row.
    assert steps[0] > 0 and all(b - a > 1 for a, b in pairwise(steps)), calls
    grads = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    want = linear_cross_entropy(hidden, weight, labels, chunk_tokens=16)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    torch.testing.assert_close(grads, (hidden.grad, weight.grad))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
            ],
        ),
    ],
)
@pytest.mark.parametrize(
    ("acc_dtype", "dtype"), [(torch.float64, torch.float64), (torch.float32, torch.bfloat16)]
)
def test_matmul_accumulate_adds_the_product_in_place(device: str, acc_dtype, dtype) -> None:
    """acc += a @ b in acc's dtype, twice into the same buffer (a transposed view for a, as the
    loss passes it), against float64: with bf16 operands the product is not rounded to bf16."""
    gen = torch.Generator(device=device).manual_seed(0)
    acc = torch.randn(24, 40, device=device, generator=gen, dtype=acc_dtype)
    want = acc.double().clone()
    buffer = acc.data_ptr()
    for _ in range(2):
        a = torch.randn(56, 24, device=device, generator=gen).to(dtype).t()
        b = torch.randn(56, 40, device=device, generator=gen).to(dtype)
        matmul_accumulate_(acc, a, b)
        want = want + a.double() @ b.double()
    assert acc.dtype == acc_dtype and acc.data_ptr() == buffer
    tol = 1e-12 if acc_dtype == torch.float64 else 1e-5
    torch.testing.assert_close(acc.double(), want, rtol=tol, atol=tol)


needs_kernel = pytest.mark.skipif(
    not (torch.cuda.is_available() and runs_on_kernel(torch.empty(0, device="cuda", dtype=torch.bfloat16))),
    reason="the cross-entropy kernel needs the CUDA extension on a Hopper GPU",
)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize(("rows", "vocab"), [(1, 8), (3, 7), (257, 1000), (64, 49152), (5, 50257), (0, 16)])
@pytest.mark.parametrize("with_grad", [True, False])
def test_cross_entropy_kernel_matches_reference(rows: int, vocab: int, with_grad: bool) -> None:
    """The kernel (16-byte loads where V % 8 == 0, one value a load elsewhere) against the PyTorch
    computation on the same bf16 logits: wide logits, ignored rows, labels at both ends."""
    gen = torch.Generator(device="cuda").manual_seed(rows * 7 + vocab)
    logits = (8 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    labels[::3] = IGNORE_INDEX
    labels[1::5] = vocab - 1
    labels[2::7] = 0
    scale = torch.tensor(1 / max(rows, 1), device="cuda") if with_grad else None
    loss, grad = cross_entropy_rows(logits, labels, scale)
    want_loss, want_grad = cross_entropy_rows_reference(logits, labels, scale)
    assert loss.dtype == torch.float32 and loss.shape == (rows,)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5)
    if not with_grad:
        assert grad is None
        return
    assert grad.dtype == torch.bfloat16 and grad.shape == logits.shape
    # Both round the same fp32 value to bf16; expf and torch.exp may differ in its last fp32 bits.
    torch.testing.assert_close(grad.float(), want_grad.float(), rtol=2**-7, atol=1e-7)
    assert (grad[labels == IGNORE_INDEX] == 0).all()


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize(("rows", "vocab"), [(3, 7), (257, 1000), (64, 49152), (5, 50257)])
def test_cross_entropy_kernel_in_place_equals_out_of_place(rows: int, vocab: int) -> None:
    """Written over the logits (both load widths), the kernel gives the bits it gives into a new
    buffer, on wide logits with ignored, out-of-range and edge labels."""
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    logits = (8 * torch.randn(rows, vocab, device="cuda", generator=gen)).bfloat16()
    labels = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    labels[::3] = IGNORE_INDEX
    labels[1::5] = vocab - 1
    labels[2::7] = 0
    labels[-1] = vocab  # out of range: a NaN row either way
    scale = torch.tensor(1 / rows, device="cuda")
    want_loss, want_grad = cross_entropy_rows(logits, labels, scale)
    loss = cross_entropy_rows_(logits, labels, scale)
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(logits, want_grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@needs_kernel
def test_cross_entropy_kernel_marks_out_of_range_labels_nan() -> None:
    logits = torch.randn(3, 16, device="cuda").bfloat16()
    labels = torch.tensor([16, -1, 4], device="cuda")
    loss, grad = cross_entropy_rows(logits, labels, torch.tensor(1.0, device="cuda"))
    assert loss[:2].isnan().all() and grad[:2].isnan().all()
    assert loss[2].isfinite() and grad[2].isfinite().all()


def _peak_and_grads(loss_fn, hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
    """Peak bytes allocated above the start by loss_fn() and its backward; the loss and grads."""
    hidden.grad = weight.grad = None  # new tensors: the caller's earlier grads stay intact
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = loss_fn()
    loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, loss.detach(), hidden.grad, weight.grad


@pytest.mark.gpu
def test_cuda_bf16_compiled_matches_unfused_without_the_whole_logits() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, dim, vocab = 8192, 512, 32768  # whole logits: 512 MiB in bf16, 1 GiB in fp32
    hidden = torch.randn(tokens, dim, device="cuda", generator=gen).requires_grad_()
    weight = (0.05 * torch.randn(vocab, dim, device="cuda", generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels[:100] = IGNORE_INDEX
    fused = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_tokens=1024))

    def ours() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return fused(hidden, weight, labels)

    def unfused() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = hidden @ weight.t()
            return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)

    ours()  # compile outside the measurement
    peak_ours, loss_ours, gh_ours, gw_ours = _peak_and_grads(ours, hidden, weight)
    peak_ref, loss_ref, gh_ref, gw_ref = _peak_and_grads(unfused, hidden, weight)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-4, atol=1e-4)
    for ours_grad, ref_grad in ((gh_ours, gh_ref), (gw_ours, gw_ref)):
        err = (ours_grad - ref_grad).norm() / ref_grad.norm()
        assert err < 1e-2, err
    assert peak_ours < 0.4 * peak_ref, (peak_ours / 2**20, peak_ref / 2**20)


@pytest.mark.gpu
@needs_kernel
def test_cuda_compiled_loss_runs_its_chunks_one_after_the_other() -> None:
    """Compiled, the chunks stay sequential: the peak is no higher than eager's, where each chunk's
    logits are freed before the next chunk's GEMM by construction (before the kernel, Inductor
    computed every chunk's logits first: 8 chunks of 64 MiB alive here)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    tokens, dim, vocab = 8192, 512, 32768
    hidden = torch.randn(tokens, dim, device="cuda", generator=gen).requires_grad_()
    weight = (0.05 * torch.randn(vocab, dim, device="cuda", generator=gen)).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)

    def run(fn):
        def step() -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return fn(hidden, weight, labels, chunk_tokens=1024)

        return step

    compiled = run(torch.compile(linear_cross_entropy))
    compiled()
    peak_compiled, loss_compiled, gh_compiled, gw_compiled = _peak_and_grads(compiled, hidden, weight)
    peak_eager, loss_eager, gh_eager, gw_eager = _peak_and_grads(run(linear_cross_entropy), hidden, weight)
    assert peak_compiled <= 1.05 * peak_eager, (peak_compiled / 2**20, peak_eager / 2**20)
    torch.testing.assert_close(loss_compiled, loss_eager)
    torch.testing.assert_close(gh_compiled, gh_eager)
    torch.testing.assert_close(gw_compiled, gw_eager)


def test_benchmark_loss_tiny_runs_end_to_end(tmp_path) -> None:
    import json

    from benchmarks.loss import main

    out, md = tmp_path / "loss.json", tmp_path / "loss.md"
    main(["--tiny", "--json", str(out), "--md", str(md)])
    result = json.loads(out.read_text())
    unfused, chunked = result["results"]
    assert (unfused["impl"], chunked["impl"]) == ("unfused", "reference") and result["meta"]["commit"]
    assert chunked["loss"] == pytest.approx(unfused["loss"], rel=1e-5)
    assert chunked["err_grad_hidden"] < 1e-2 and chunked["err_grad_weight"] < 1e-2
    assert "| reference |" in md.read_text()
