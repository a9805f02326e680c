"""The chunked linear + cross-entropy against F.cross_entropy on the whole logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparse_llm.loss import IGNORE_INDEX, default_chunk_tokens, linear_cross_entropy


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
