"""GPU: the compiled model reports the same FFN statistics as eager mode.

Regression test: with the counts computed inside the compiled graph, Inductor (torch 2.11,
H200) returned corrupted fire counts at the token counts of real training (64 x 1024 tokens,
12 layers): garbage totals, blocks of units always zero, healthy units reported dead.
"""

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])
def test_compiled_stats_match_eager(grad):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=4096, hidden_size=768, intermediate_size=2112, num_hidden_layers=12, num_attention_heads=12
    )
    model = build_model(cfg, device="cuda", compute_dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, cfg.vocab_size, (64, 1024), device="cuda")
    with torch.set_grad_enabled(grad), torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(ids, labels=ids, with_stats=True).ffn_stats
        compiled = torch.compile(model)(ids, labels=ids, with_stats=True).ffn_stats
    # bf16 rounding may flip a handful of near-zero gates between the two graphs, nothing more.
    total = eager.fire_counts.sum().item()
    assert abs(compiled.fire_counts.sum().item() - total) <= 1e-4 * total
    assert (compiled.fire_counts - eager.fire_counts).abs().max().item() <= 64
    assert torch.equal(compiled.nnz_per_token.sum(-1), compiled.fire_counts.sum(-1))
    assert (compiled.nnz_per_token - eager.nnz_per_token).abs().max().item() <= 16
    torch.testing.assert_close(compiled.l1, eager.l1, rtol=2e-2, atol=0)


def _dense_and_cuda_models(dtype: torch.dtype | None = None):
    """A small dense model and the same weights with ffn_impl="cuda", both in eval mode (in `dtype`
    where given), and token ids for them."""
    torch.manual_seed(0)
    dense_cfg = ModelConfig(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4
    )
    models = [
        build_model(cfg, device="cuda", compute_dtype=torch.bfloat16).cuda().to(dtype).eval()
        for cfg in (dense_cfg, ModelConfig(**{**dense_cfg.__dict__, "ffn_impl": "cuda"}))
    ]
    dense, sparse = models
    sparse.load_state_dict(dense.state_dict())
    return dense, sparse, torch.randint(0, dense_cfg.vocab_size, (4, 200), device="cuda")


@pytest.mark.gpu
def test_cuda_ffn_impl_matches_dense_logits():
    dense, sparse, ids = _dense_and_cuda_models()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = dense(ids).logits.float()
        got = sparse(ids).logits.float()
    error = (got - expected).norm() / expected.norm()
    assert error < 2e-2, error


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("cached", [False, True])
def test_bf16_cuda_inference_adds_into_the_residual_eager_and_compiled(cached):
    """A bf16 model (as inference loads it) adds the FFN into the residual stream in place: the
    logits match dense, eager and compiled (where the op mutates an intermediate of the graph).
    Compiled and eager differ by bf16 roundings only (Inductor keeps fused intermediates in fp32),
    so the check is the dense model's own compiled-vs-eager gap, which a lost add would exceed."""
    from sparse_llm.model.kv_cache import KVCache

    dense, sparse, ids = _dense_and_cuda_models(torch.bfloat16)

    def logits(model):
        cache = KVCache(model.config, 4, 200, "cuda", torch.bfloat16) if cached else None
        with torch.no_grad():
            return model(ids, cache=cache).logits.float()

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    dense_eager, dense_compiled = logits(dense), logits(torch.compile(dense))
    eager, compiled = logits(sparse), logits(torch.compile(sparse))
    assert rel(eager, dense_eager) < 2e-2
    assert rel(compiled, dense_compiled) < 2e-2
    assert rel(compiled, eager) <= 2 * rel(dense_compiled, dense_eager) + 1e-3


@pytest.mark.gpu
@needs_hopper
def test_cuda_ffn_impl_trains_like_dense():
    """Five AdamW steps with the CUDA training kernels (bf16 autocast, fp32 master weights, compiled)
    follow the dense model: same losses within bf16 noise, identical per-unit statistics at step 0."""
    cfg = ModelConfig(
        vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4
    )
    ids = torch.randint(
        0, cfg.vocab_size, (8, 129), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    runs = {}
    for impl in ("dense", "cuda"):
        torch.manual_seed(0)
        model = (
            build_model(
                ModelConfig(**{**cfg.__dict__, "ffn_impl": impl}), device="cuda", compute_dtype=torch.bfloat16
            )
            .cuda()
            .train()
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        forward = torch.compile(model)
        losses, stats = [], []
        for _ in range(5):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = forward(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
                loss = out.loss + 1e-3 * out.ffn_stats.l1.mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.item())
            stats.append(out.ffn_stats)
        runs[impl] = losses, stats
    (dense_losses, dense_stats), (cuda_losses, cuda_stats) = runs["dense"], runs["cuda"]
    torch.testing.assert_close(torch.tensor(cuda_losses), torch.tensor(dense_losses), rtol=1e-2, atol=1e-2)
    assert torch.equal(cuda_stats[0].fire_counts.sum(-1), cuda_stats[0].nnz_per_token.sum(-1))
    assert (cuda_stats[0].fire_counts - dense_stats[0].fire_counts).abs().max().item() <= 8
    torch.testing.assert_close(cuda_stats[0].l1, dense_stats[0].l1, rtol=2e-2, atol=0)


@pytest.mark.gpu
@needs_hopper
def test_compile_model_runs_the_cuda_training_step_in_one_graph_per_region():
    """Under bf16 autocast with fp32 weights, compile_model captures the CUDA training FFN (its
    records of data-dependent length) in the layers' one graph, and loss, statistics and gradients stay those
    of the eager step up to bf16 rounding."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from sparse_llm.model.compiling import compile_model

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_impl="cuda",
    )
    model = build_model(cfg, device="cuda", compute_dtype=torch.bfloat16).cuda()
    ids = torch.randint(0, cfg.vocab_size, (4, 257), device="cuda")

    def step(forward):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
        (out.loss + 1e-3 * out.ffn_stats.l1.mean()).backward()
        grads = [p.grad.float() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return out.loss.detach(), out.ffn_stats.fire_counts, grads

    torch._dynamo.reset()
    eager = step(model)  # before compile_model, which compiles the model's regions in place
    counter = CompileCounterWithBackend("inductor")
    compiled = compile_model(model, backend=counter)
    for _ in range(2):
        got = step(compiled)
    assert counter.frame_count == 2  # one graph shared by the layers, one for the head
    torch.testing.assert_close(got[0], eager[0], rtol=1e-2, atol=0)
    assert (got[1] - eager[1]).abs().max().item() <= 8  # near-zero gates may flip under bf16
    for g, e in zip(got[2], eager[2], strict=True):
        assert (g - e).norm() <= 5e-2 * e.norm() + 1e-6


def _compiled_cuda_steps(cfg: ModelConfig, batches: list, sync_free: bool, monkeypatch) -> torch.Tensor:
    """Losses of compiled AdamW steps on `batches`; with `sync_free`, the steps after the first
    three run under set_sync_debug_mode("error") and must rebuild no FFN record."""
    from sparse_llm.model.compiling import compile_model
    from sparse_llm.ops.ffn import training

    torch.manual_seed(0)
    model = build_model(cfg, device="cuda", compute_dtype=torch.bfloat16, ffn_sync_free=sync_free).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = compile_model(model)

    def step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = compiled(ids[:, :-1], labels=ids[:, 1:], with_stats=True)
            loss = out.loss + 1e-3 * out.ffn_stats.l1.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    losses = [step(ids) for ids in batches[:3]]
    rebuilds = []
    if sync_free:
        rebuild = training.rebuild_heavy_record
        monkeypatch.setattr(training, "rebuild_heavy_record", lambda *a: rebuilds.append(1) or rebuild(*a))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        losses += [step(ids) for ids in batches[3:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rebuilds == []
    if sync_free:  # every row is heavy at this initialisation (ReLU of random weights: half the units)
        assert all(layer.ffn.train_capacities[1] > 0 for layer in model.model.layers)
    return torch.stack(losses).float().cpu()


@pytest.mark.gpu
@needs_hopper
def test_compiled_cuda_training_steps_never_wait_on_the_gpu_after_warm_up(monkeypatch):
    """After warm-up steps (compile; the FFN layers' capacities set), compiled training steps with the
    CUDA kernels run under torch.cuda.set_sync_debug_mode("error") (any synchronising CUDA call
    raises) and never rebuild an FFN record, the one path that reads sizes on the host; their losses
    stay those of the host-read path (ffn_sync_free=False) up to bf16 noise."""
    cfg = ModelConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn_impl="cuda",
    )
    gen = torch.Generator("cuda").manual_seed(2)
    batches = [torch.randint(0, cfg.vocab_size, (8, 129), device="cuda", generator=gen) for _ in range(8)]
    with_read = _compiled_cuda_steps(cfg, batches, False, monkeypatch)
    sync_free = _compiled_cuda_steps(cfg, batches, True, monkeypatch)
    torch.testing.assert_close(sync_free, with_read, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_fallback_recompute_in_chunks_holds_one_chunk_in_the_backward(compiled):
    """The falling-back layer's recompute by token chunks: the backward's memory high-water mark
    over what the forward left falls by more than two whole-layer [tokens, H] bf16 tensors when the
    8192 tokens go in chunks of 2048 rather than at once (eager, and compiled as a run compiles its
    layers), with the same gradients."""
    from sparse_llm.model.ffn import GatedMLP

    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64, hidden_size=256, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=4
    )
    mlp = GatedMLP(cfg).cuda()
    x = torch.randn(4, 2048, cfg.hidden_size, device="cuda")
    tokens = x.shape[0] * x.shape[1]

    def backward_peak(chunk_tokens: int) -> tuple[int, list[torch.Tensor]]:
        def loss(xi: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y, stats = mlp._dense_recomputed(xi, True, chunk_tokens)
            return y.float().square().mean() + stats.l1

        step = torch.compile(loss) if compiled else loss
        step(x.clone().requires_grad_()).backward()  # compiles both graphs outside the measured window
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        value = step(xi)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        value.backward()
        torch.cuda.synchronize()
        grads = [xi.grad, *(p.grad.clone() for p in mlp.parameters())]
        mlp.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - before, grads

    whole_peak, whole_grads = backward_peak(tokens)
    chunked_peak, chunked_grads = backward_peak(2048)
    assert chunked_peak < whole_peak - 2 * tokens * cfg.intermediate_size * 2, (chunked_peak, whole_peak)
    for got, want in zip(chunked_grads, whole_grads, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 1e-2
