"""The model equals transformers' LlamaForCausalLM (hidden_act="relu") and reports true FFN statistics."""

import importlib.util
import weakref

import pytest
import torch
from transformers import LlamaForCausalLM

from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.model.ffn import GatedMLP
from sparse_llm.model.hf_export import to_hf_config


def small_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4
    )
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize("kv_heads,tied,act", [(0, True, "relu"), (2, False, "relu"), (0, True, "silu")])
def test_logits_match_transformers(kv_heads, tied, act):
    cfg = small_config(num_key_value_heads=kv_heads, tie_word_embeddings=tied, hidden_act=act)
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    theirs = LlamaForCausalLM(to_hf_config(cfg)).eval()
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ids = torch.randint(0, cfg.vocab_size, (3, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_parameter_names_match_transformers():
    cfg = small_config()
    ours = set(build_model(cfg).state_dict())
    theirs = set(LlamaForCausalLM(to_hf_config(cfg)).state_dict())
    assert ours == theirs


def test_ffn_stats_match_brute_force():
    cfg = small_config()
    torch.manual_seed(1)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    captured = []
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda mod, args, out: captured.append(args[0].detach()))
    out = model(ids, labels=ids, with_stats=True)
    stats = out.ffn_stats
    for i, layer in enumerate(model.model.layers):
        x = captured[i].flatten(0, 1)
        a = torch.relu(x @ layer.mlp.gate_proj.weight.T)
        h = a * (x @ layer.mlp.up_proj.weight.T)
        torch.testing.assert_close(stats.l1[i], h.abs().sum(-1).mean())
        assert torch.equal(stats.nnz_per_token[i], (a > 0).sum(-1))
        assert torch.equal(stats.fire_counts[i], (a > 0).sum(0))
    assert stats.l1.requires_grad


def test_loss_is_next_token_cross_entropy():
    cfg = small_config()
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    logits = model(ids).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    torch.testing.assert_close(model(ids, labels=ids).loss, expected)


@pytest.mark.parametrize("ffn_impl", ["dense", "reference"])
@pytest.mark.parametrize("memory_saver", ["activation_checkpointing", "recompute_norms"])
def test_memory_savers_give_same_gradients(memory_saver, ffn_impl):
    cfg = small_config(ffn_impl=ffn_impl)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    grads = []
    for enabled in (False, True):
        torch.manual_seed(2)
        model = build_model(
            cfg,
            recompute_norms=enabled and memory_saver == "recompute_norms",
            activation_checkpointing=enabled and memory_saver == "activation_checkpointing",
        )
        out = model(ids, labels=ids, with_stats=True)
        (out.loss + out.ffn_stats.l1.mean()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_package_is_a_clear_error():
    with pytest.raises(ValueError, match="flash-attn"):
        build_model(small_config(attn_impl="flash"))


@pytest.mark.parametrize("ffn_impl", ["reference", "auto"])
def test_sparse_ffn_impls_match_dense_logits_without_grad(ffn_impl):
    dense_cfg = small_config()
    torch.manual_seed(3)
    dense = build_model(dense_cfg).eval()
    sparse = build_model(small_config(ffn_impl=ffn_impl)).eval()
    sparse.load_state_dict(dense.state_dict())
    ids = torch.randint(0, dense_cfg.vocab_size, (2, 13))
    with torch.no_grad():
        # On a machine without a Hopper GPU, `auto` is dense.
        torch.testing.assert_close(sparse(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    # With gradients: `reference` trains through the reference training op, `auto` here densely.
    out = sparse(ids, labels=ids, with_stats=True)
    out.loss.backward()
    assert sparse.model.layers[0].mlp.gate_proj.weight.grad is not None


def _train_five_steps(ffn_impl: str):
    from sparse_llm.sparsity.penalty import l1_penalty

    torch.manual_seed(3)
    model = build_model(small_config(ffn_impl=ffn_impl))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    losses, stats = [], []
    for _ in range(5):
        ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=gen)
        out = model(ids, labels=ids, with_stats=True)
        loss = out.loss + 1e-2 * l1_penalty(out.ffn_stats)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        stats.append([s.detach() for s in out.ffn_stats])
    return torch.stack(losses), stats, model.state_dict()


def test_training_through_sparse_reference_equals_dense():
    """ffn_impl=reference trains through the sparse training op; same losses, weights and stats."""
    dense_losses, dense_stats, dense_state = _train_five_steps("dense")
    ref_losses, ref_stats, ref_state = _train_five_steps("reference")
    torch.testing.assert_close(ref_losses, dense_losses, rtol=1e-5, atol=1e-5)
    for name, value in dense_state.items():
        # AdamW divides by the root of the second moment: last-bit differences of near-zero
        # gradients (the two paths sum in different orders) move a weight by up to ~2e-5 in 5 steps.
        torch.testing.assert_close(ref_state[name], value, rtol=1e-4, atol=5e-5, msg=name)
    for got, want in zip(ref_stats, dense_stats, strict=True):
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)  # l1
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])  # nnz, fire counts


def test_training_forward_uses_the_train_op_unless_fallen_back(monkeypatch):
    from sparse_llm.model import ffn as model_ffn
    from sparse_llm.ops.ffn import block

    calls = []
    real = block.ffn_block_train
    monkeypatch.setattr(model_ffn, "ffn_block_train", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = build_model(small_config(ffn_impl="reference"))
    ids = torch.randint(0, 97, (2, 7))
    model(ids, labels=ids, with_stats=True).loss.backward()
    assert len(calls) == 2
    model.set_ffn_dense_fallback([True, True])
    model(ids, labels=ids, with_stats=True).loss.backward()
    assert len(calls) == 2


def test_density_fallback_rule_switches_and_logs(caplog):
    import logging

    from sparse_llm.training.ffn_fallback import DensityFallback, wants_dense

    assert wants_dense(0.06, False, 0.05, 0.8) and not wants_dense(0.05, False, 0.05, 0.8)
    assert wants_dense(0.045, True, 0.05, 0.8) and not wants_dense(0.039, True, 0.05, 0.8)
    model = build_model(small_config(ffn_impl="reference"))  # H = 176
    fallback = DensityFallback(model, max_density=0.1, hysteresis=0.5)
    assert model.ffn_dense_fallback() == [True, True]  # a fresh run starts dense
    with caplog.at_level(logging.INFO, logger="sparse_llm.training.ffn_fallback"):
        fallback.observe([5.0, 30.0])
    assert model.ffn_dense_fallback() == [False, True]
    assert "layer 0" in caplog.text and "back from dense to reference" in caplog.text
    fallback.observe([30.0, 12.0])  # layer 0 over 0.1; layer 1 at 0.068, inside the band
    assert model.ffn_dense_fallback() == [True, True]
    metrics = fallback.metrics()
    assert metrics["ffn_fallback/layer_00"] == 1.0 and metrics["ffn_fallback/dense_layers"] == 2.0
    assert metrics["ffn_fallback/switches"] == 2.0 and metrics["ffn_fallback/flips"] == 2.0
    fallback.observe([5.0, 8.0])  # both under 0.05: back to sparse
    metrics = fallback.metrics()
    assert model.ffn_dense_fallback() == [False, False]
    assert metrics["ffn_fallback/switches"] == 2.0 and metrics["ffn_fallback/flips"] == 4.0
    assert fallback.metrics()["ffn_fallback/switches"] == 0.0  # a new window
    with pytest.raises(ValueError, match="training FFN is dense"):
        DensityFallback(build_model(small_config()))


def test_dense_fallback_recomputes_its_ffn_in_the_backward():
    """A layer falling back to dense keeps no [tokens, H] activation for its backward (it recomputes
    them), and its gradients are those of the plain dense FFN; with whole-layer activation
    checkpointing it does not recompute a second time."""
    cfg = small_config(ffn_impl="reference")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    tokens = ids.numel()

    def hidden_sized_saved(model) -> tuple[int, list[torch.Tensor]]:
        count = []

        def pack(t):
            count.append(t.shape[-1] == cfg.intermediate_size and t.numel() == tokens * cfg.intermediate_size)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, labels=ids, with_stats=True).loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return sum(count), grads

    torch.manual_seed(0)
    dense = build_model(small_config())
    torch.manual_seed(0)
    fallback = build_model(cfg)
    fallback.set_ffn_dense_fallback([True, True])
    dense_saved, dense_grads = hidden_sized_saved(dense)
    fallback_saved, fallback_grads = hidden_sized_saved(fallback)
    assert dense_saved >= 2 * cfg.num_hidden_layers and fallback_saved == 0
    for got, want in zip(fallback_grads, dense_grads, strict=True):
        torch.testing.assert_close(got, want)
    torch.manual_seed(0)
    checkpointed = build_model(cfg, activation_checkpointing=True)
    assert not any(layer.ffn.recompute_fallback for layer in checkpointed.model.layers)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_fallback_recompute_in_chunks_matches_the_dense_ffn_and_remakes_one_chunk_at_a_time(act):
    """The falling-back layer's recompute by token chunks (21 tokens in chunks of 5, the last one
    short) gives the dense FFN's output, statistics and gradients, and in the backward each chunk's
    gate activations are remade only after the previous chunk's are freed: one chunk's [tokens, H]
    tensors alive at a time."""
    torch.manual_seed(0)
    mlp = GatedMLP(small_config(hidden_act=act))
    x = torch.randn(3, 7, 64)
    remade: list[weakref.ref] = []
    alive_when_remade: list[int] = []
    in_backward = False

    def count_alive(module, inputs, output):
        if in_backward:
            alive_when_remade.append(sum(ref() is not None for ref in remade))
            remade.append(weakref.ref(output))

    mlp.gate_proj.register_forward_hook(count_alive)

    def run(chunk_tokens: int | None):
        nonlocal in_backward
        xi = x.clone().requires_grad_()
        y, stats = (
            mlp._dense(xi, True) if chunk_tokens is None else mlp._dense_recomputed(xi, True, chunk_tokens)
        )
        in_backward = chunk_tokens is not None
        (y.square().sum() + stats.l1).backward()
        in_backward = False
        grads = [xi.grad, *(p.grad.clone() for p in mlp.parameters())]
        mlp.zero_grad(set_to_none=True)
        return y, stats, grads

    want_y, want_stats, want_grads = run(None)
    got_y, got_stats, got_grads = run(5)
    torch.testing.assert_close(got_y, want_y)
    torch.testing.assert_close(got_stats.l1, want_stats.l1)
    assert torch.equal(got_stats.nnz_per_token, want_stats.nnz_per_token)
    assert torch.equal(got_stats.fire_counts, want_stats.fire_counts)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want)
    assert alive_when_remade == [0] * 5
    empty, empty_stats = mlp._dense_recomputed(torch.randn(0, 7, 64), True, 5)
    assert empty.shape == (0, 7, 64) and empty_stats.nnz_per_token.shape == (0,)


def test_fallback_recompute_in_chunks_under_autocast_sums_weight_gradients_in_fp32():
    """Under bf16 autocast with fp32 weights, 16 chunks' weight gradients are as close to float64's
    as one chunk's: each chunk casts the weights itself, so its bf16 gradients reach the fp32 weights
    through their own cast (autocast's shared cast would sum them in bf16 first: dWd's error then
    1.6x one chunk's)."""
    torch.manual_seed(0)
    mlp = GatedMLP(small_config())
    x = torch.randn(16, 256, 64)

    def weight_grads(chunk_tokens: int | None, dtype: torch.dtype) -> list[torch.Tensor]:
        model = mlp.to(dtype)
        xi = x.to(dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.float32):
            y, stats = (
                model._dense(xi, True)
                if chunk_tokens is None
                else model._dense_recomputed(xi, True, chunk_tokens)
            )
        (y.double().square().mean() + stats.l1).backward()
        grads = [p.grad.double() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return grads

    want = weight_grads(None, torch.float64)
    whole = weight_grads(None, torch.float32)
    chunked = weight_grads(256, torch.float32)
    for got, one_chunk, exact in zip(chunked, whole, want, strict=True):
        assert (got - exact).norm() <= 1.1 * (one_chunk - exact).norm()


def test_benchmark_model_tiny_runs_end_to_end(tmp_path):
    import json

    from benchmarks.model_step import main

    out = tmp_path / "bench.json"
    args = ["--tiny", "--sparsify-steps", "2", "--steps", "2", "--warmup", "1", "--json", str(out)]
    # --no-fallback: the tiny model's layers (near half dense) would otherwise all run dense.
    args += ["--recompute-norms", "off", "on", "--no-fallback"]
    main([*args, "--md", str(tmp_path / "bench.md")])
    result = json.loads(out.read_text())
    dense, sparse, dense_recomputing, sparse_recomputing = result["results"]
    assert [r["impl"] for r in result["results"]] == ["dense", "cuda"] * 2 and result["meta"]["commit"]
    assert [r["recompute_norms"] for r in result["results"]] == ["off", "off", "on", "on"]
    assert sparse["dense_fallback_layers"] == sparse_recomputing["dense_fallback_layers"] == 0
    assert sparse["loss_last"] == pytest.approx(dense["loss_last"], rel=1e-4)
    assert sparse["l0_mean"] == pytest.approx(dense["l0_mean"])
    # Recomputing the norms changes where they are computed, not the step's result.
    assert sparse_recomputing["loss_last"] == pytest.approx(sparse["loss_last"], rel=1e-4)
    assert dense_recomputing["loss_last"] == pytest.approx(dense["loss_last"], rel=1e-4)
    md = (tmp_path / "bench.md").read_text()
    assert "| dense |" in md
    # The cross pairings: each sparse variant against both dense ones, with the speed ratio.
    speed = dense["ms_step"] / sparse_recomputing["ms_step"]
    assert f"| 2 | cuda | on | off | {speed:.3f}x |" in md
    assert md.count("| 2 | cuda |") == 4


def test_attention_residual_in_the_gemm_epilogue_matches_the_separate_add():
    """Without autograd a bf16 model adds o_proj's output into the residual stream inside the GEMM
    (ops.linear_add_); the logits stay those of the separate add (with autograd) up to bf16
    rounding, and the residual tensor given is the one returned, updated in place."""
    cfg = small_config()
    torch.manual_seed(5)
    model = build_model(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    separate = model(ids).logits.float()
    with torch.no_grad():
        fused = model(ids).logits.float()
        x = torch.randn(2, 11, cfg.hidden_size, dtype=torch.bfloat16)
        layer = model.model.layers[0]
        cos, sin = model.model.rotary_emb(11, x.dtype)
        expected = layer.self_attn(layer.input_layernorm(x), cos, sin) + x
    assert ((fused - separate).norm() / separate.norm()).item() < 1e-2
    with torch.no_grad():
        residual = x.clone()
        got = layer.self_attn(layer.input_layernorm(x), cos, sin, residual=residual)
    assert got is residual  # updated in place
    torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)


def test_compiled_sparse_training_step_keeps_one_token_sized_residual_per_layer():
    """With few active units, the compiled sparse training step keeps, per layer, the layer's input
    (fp32 residual) and its attention norm's output, and for the FFN half only the active rows:
    no FFN output, no second residual, no FFN input (what torch.compile's partitioner chose
    before the FFN block op returned the active rows itself)."""
    from sparse_llm.model.compiling import compile_model

    layers = 3
    cfg = small_config(ffn_impl="reference", num_hidden_layers=layers)
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for layer in model.model.layers:  # one unit can fire (on about half the tokens)
            layer.mlp.gate_proj.weight[1:] = 0.0
    # More tokens than 2 x hidden size, as in training: with fewer, saving the loss's logit
    # gradients and hidden states is cheaper than saving its weight gradient, and the partitioner
    # rightly moves the weight gradient's GEMM into the backward.
    ids = torch.randint(0, cfg.vocab_size, (4, 40))
    token_sized = []

    def pack(t):
        if t.shape[-1] == cfg.hidden_size and t.numel() == ids.numel() * cfg.hidden_size:
            token_sized.append(t.dtype)
        return t

    step = compile_model(model)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        out = step(ids, labels=ids, with_stats=True)
    assert 0 < out.ffn_stats.nnz_per_token.sum() < ids.numel() * layers
    # Per layer its fp32 input and its attention norm's bf16 output; then the final norm's pair.
    assert sorted(token_sized, key=str) == sorted([torch.float32, torch.bfloat16] * (layers + 1), key=str)


def test_swiglu_runs_dense_and_refuses_the_sparse_paths():
    """hidden_act=silu (SwiGLU, the dense baseline): auto is dense and says why; the sparse paths,
    which need a ReLU gate, are refused before anything runs."""
    from sparse_llm.ops import KernelsUnavailable

    model = build_model(small_config(hidden_act="silu", ffn_impl="auto"))
    assert model.ffn_plan.impl("train") == "dense"
    assert "needs a ReLU gate" in model.ffn_plan.train.reason
    for impl in ("reference", "cuda"):
        with pytest.raises(KernelsUnavailable, match="needs a ReLU gate"):
            build_model(small_config(hidden_act="silu", ffn_impl=impl))
    ids = torch.randint(0, 97, (2, 9))
    out = model(ids, labels=ids, with_stats=True)
    out.loss.backward()
    assert out.ffn_stats.l1.shape == (2,)


def test_derived_weights_refresh_in_place_and_are_shared():
    """Inference's derived weights (Wd^T, [Wq; Wk; Wv]): remade when a source weight changes, at
    the same address (a captured CUDA graph keeps it), and one copy for models that share their
    weights."""
    from sparse_llm.model.derived_weights import DerivedWeight, stacked_rows, transposed

    weight = torch.randn(4, 6)
    cache = DerivedWeight(transposed)
    first = cache.get([weight], torch.float32)
    assert torch.equal(first, weight.t()) and first.is_contiguous()
    with torch.no_grad():
        weight.mul_(2)
    again = cache.get([weight], torch.float32)
    assert again is first and torch.equal(again, weight.t())
    # One tensor per dtype: asking for another keeps the first (a graph may read its address).
    doubled = cache.get([weight], torch.float64)
    assert doubled.dtype == torch.float64 and cache.get([weight], torch.float32) is first
    cpu = torch.device("cpu")
    assert cache.traced(torch.float64, cpu) is doubled and cache.traced(torch.bfloat16, cpu) is None
    assert cache.traced(torch.float32, torch.device("meta")) is None  # made on another device

    # Made under inference mode, refreshed in place outside it (an inference tensor could not be).
    in_inference = DerivedWeight(transposed)
    with torch.inference_mode():
        made = in_inference.get([weight], torch.float32)
    with torch.no_grad():
        weight.add_(1)
    assert in_inference.get([weight], torch.float32) is made and torch.equal(made, weight.t())

    a, b = torch.randn(4, 6), torch.randn(2, 6)
    stacked = DerivedWeight(stacked_rows)
    first = stacked.get([a, b], torch.float32)
    assert torch.equal(first, torch.cat([a, b]))
    with torch.no_grad():
        b.add_(1)  # a change to any source remakes it
    assert stacked.get([a, b], torch.float32) is first and torch.equal(first[4:], b)

    model = build_model(small_config())
    other = model.with_ffn_plan(model.ffn_plan)
    for mine, theirs in zip(model.model.layers, other.model.layers, strict=True):
        assert mine.mlp.down_t_cache is theirs.mlp.down_t_cache
        assert mine.self_attn.qkv_cache is theirs.self_attn.qkv_cache


def test_a_decode_step_projects_qkv_in_one_gemm_with_the_same_result():
    """At a decode step (one token a row over a KV cache, no autograd) q, k and v come from one
    GEMM over [Wq; Wk; Wv]: the logits equal those of the three projections (the model without a
    cache), and the stacked copy follows a change of the weights."""
    from sparse_llm.model import KVCache

    torch.manual_seed(0)
    model = build_model(small_config()).eval()
    ids = torch.randint(0, 97, (2, 7))

    def decoded_logits() -> torch.Tensor:
        cache = KVCache(model.config, 2, 16, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache)  # the prefill: three GEMMs
            return model(ids[:, -1:], cache=cache).logits[:, -1]

    for _ in range(2):
        with torch.no_grad():
            plain = model(ids).logits[:, -1]
        torch.testing.assert_close(decoded_logits(), plain, rtol=1e-5, atol=1e-5)
        layer = model.model.layers[0].self_attn
        stacked = layer.qkv_cache.traced(torch.float32, torch.device("cpu"))
        assert stacked is not None and torch.equal(stacked, torch.cat(layer._projection_weights()))
        with torch.no_grad():
            layer.k_proj.weight.mul_(-1.5)  # the next round must see the new weight


def test_a_compiled_decode_step_sees_weights_changed_in_place_once_refreshed():
    """A trace reads the stacked q/k/v copy made before it; after the weights change, the refresh
    that StaticDecoder.slot and a compiled prefill run (`prepare_inference`) updates that copy in
    place, and the compiled step computes with the new weights."""
    from sparse_llm.inference.decode import StaticDecoder
    from sparse_llm.model import KVCache

    torch.manual_seed(0)
    model = build_model(small_config()).eval()
    ids = torch.randint(0, 97, (1, 5))
    model.prepare_inference()
    compiled = torch.compile(model, backend="aot_eager")

    def decoded(m) -> torch.Tensor:
        cache = KVCache(model.config, 1, 16, device="cpu", dtype=torch.float32)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache)
            return m(ids[:, -1:], cache=cache).logits[:, -1]

    decoder = StaticDecoder(model, capture=False)
    torch.testing.assert_close(decoded(compiled), decoded(model))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(-3)  # e.g. load_state_dict into the same tensors
    decoder.slot(1, 8, 0)  # a decoder refreshes them for every batch
    torch.testing.assert_close(decoded(compiled), decoded(model))


def test_prepare_inference_makes_wd_t_only_where_the_kernels_run():
    """Before a prefill or decode graph is traced (StaticDecoder, compile_prefill), each layer's
    Wd^T is made for a plan whose prefill or decode runs the kernels, in their bfloat16 (an fp32
    model runs them under autocast); a trace that found the cache empty would transpose Wd inside
    every replayed step."""
    from sparse_llm.model.ffn import FFNPlan
    from sparse_llm.ops.ffn.select import FFNSelection

    model = build_model(small_config())
    model.prepare_inference()  # dense everywhere: no Wd^T, only the stacked q/k/v weights
    cpu = torch.device("cpu")
    assert all(layer.mlp.down_t_cache.traced(torch.bfloat16, cpu) is None for layer in model.model.layers)
    assert all(
        layer.self_attn.qkv_cache.traced(torch.float32, cpu) is not None for layer in model.model.layers
    )
    dense = FFNSelection("dense", "dense was asked for")
    # The plan as resolve() gives it on a Hopper GPU (a CPU cannot resolve "cuda").
    decode_only = model.with_ffn_plan(FFNPlan(dense, dense, dense, FFNSelection("cuda", None)))
    decode_only.prepare_inference()
    for layer in decode_only.model.layers:
        wd_t = layer.mlp.down_t_cache.traced(torch.bfloat16, torch.device("cpu"))
        assert wd_t is not None and wd_t.dtype == torch.bfloat16 and wd_t.is_contiguous()
        assert torch.equal(wd_t, layer.mlp.down_proj.weight.t().to(torch.bfloat16))


def test_capacity_overflows_sum_over_the_layers_on_the_capacity_path():
    """The trainer's `ffn/capacity_overflows`: steps whose sparse op overflowed a record capacity, summed
    over the layers that hold capacities (the CUDA training path), then by size and by layer; nothing
    where none does (CPU, dense)."""
    from sparse_llm.ops.ffn.training import TrainCapacities

    model = build_model(small_config())
    assert model.ffn_capacity_overflows() == {}
    first, second = model.model.layers[0].ffn, model.model.layers[1].ffn
    first.train_capacities, second.train_capacities = TrainCapacities.new(), TrainCapacities.new()
    TrainCapacities.update(first.train_capacities, [100, 1, 100, 10, 0])  # a fresh layer's first step
    TrainCapacities.update(second.train_capacities, [100, 1, 100, 10, 0])
    TrainCapacities.update(second.train_capacities, [100, 90, 100, 10, 0])  # heavy rows past the capacity
    metrics = model.ffn_capacity_overflows()
    assert metrics["ffn/capacity_overflows"] == 3
    assert "ffn/capacity_overflows/light_entries" not in metrics  # the light record has no capacity
    assert metrics["ffn/capacity_overflows/heavy_rows"] == 3
    assert metrics["ffn/capacity_overflows/layer_00"] == 1 and metrics["ffn/capacity_overflows/layer_01"] == 2
