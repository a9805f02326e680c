"""The model equals transformers' LlamaForCausalLM (hidden_act="relu") and reports true FFN statistics."""

import importlib.util

import pytest
import torch
from transformers import LlamaForCausalLM

from sparse_llm.config import ModelConfig
from sparse_llm.export import to_hf_config
from sparse_llm.model import build_model


def small_config(**overrides) -> ModelConfig:
    base = dict(
        vocab_size=97, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4
    )
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize("kv_heads,tied", [(0, True), (2, False)])
def test_logits_match_transformers(kv_heads, tied):
    cfg = small_config(num_key_value_heads=kv_heads, tie_word_embeddings=tied)
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


def test_activation_checkpointing_gives_same_gradients():
    cfg = small_config()
    torch.manual_seed(2)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        out = model(ids, labels=ids, with_stats=True)
        (out.loss + out.ffn_stats.l1.mean()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_package_is_a_clear_error():
    with pytest.raises(ValueError, match="flash-attn"):
        build_model(small_config(attn_impl="flash"))


@pytest.mark.parametrize("ffn_impl", ["reference", "cuda"])
def test_sparse_ffn_impls_match_dense_logits_without_grad(ffn_impl):
    dense_cfg = small_config()
    torch.manual_seed(3)
    dense = build_model(dense_cfg).eval()
    sparse = build_model(small_config(ffn_impl=ffn_impl)).eval()
    sparse.load_state_dict(dense.state_dict())
    ids = torch.randint(0, dense_cfg.vocab_size, (2, 13))
    with torch.no_grad():
        # On a machine without a Hopper GPU, `cuda` falls back to the reference (with a warning).
        torch.testing.assert_close(sparse(ids).logits, dense(ids).logits, rtol=1e-5, atol=1e-5)
    # With gradients (training), every impl runs the dense FFN until the training kernels exist.
    out = sparse(ids, labels=ids, with_stats=True)
    out.loss.backward()
    assert sparse.model.layers[0].mlp.gate_proj.weight.grad is not None
