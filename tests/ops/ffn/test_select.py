"""ops.ffn.select: the one answer to "which FFN implementation runs here, and why not the kernels"."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.config import ModelConfig
from sparse_llm.model import FFNPlan, build_model
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.ffn.select import select_ffn

SHAPE = dict(hidden_size=64, intermediate_size=256)


def test_explicit_dense_and_reference_run_as_asked():
    for impl in ("dense", "reference"):
        selection = select_ffn(impl, "train", device="cpu", dtype=torch.float32, **SHAPE)
        assert selection.impl == impl and "asked for" in selection.reason


def test_auto_is_dense_where_the_kernels_cannot_run_and_says_why():
    selection = select_ffn("auto", "decode", device="cpu", dtype=torch.bfloat16, **SHAPE)
    assert selection.impl == "dense" and "tensors are on cpu" in selection.reason


def test_cuda_where_the_kernels_cannot_run_is_an_error_naming_the_setting():
    with pytest.raises(KernelsUnavailable, match=r"model.ffn_impl=cuda cannot run the kernels \(prefill\)"):
        select_ffn("cuda", "prefill", device="cpu", dtype=torch.bfloat16, where="model.ffn_impl", **SHAPE)


def test_bad_values_are_clear_errors():
    with pytest.raises(ValueError, match="must be one of auto, dense, reference, cuda"):
        select_ffn("sparse", "train", device="cpu", dtype=torch.float32, **SHAPE)
    with pytest.raises(ValueError, match="phase must be one of"):
        select_ffn("auto", "serve", device="cpu", dtype=torch.float32, **SHAPE)


def test_the_model_fixes_its_plan_at_build():
    cfg = ModelConfig(vocab_size=64, ffn_impl="reference", **SHAPE)
    model = build_model(cfg, ffn={"train": "reference", "decode": "auto"})
    assert model.ffn_plan.impl("train") == "reference"
    assert model.ffn_plan.impl("eval") == "dense"  # phases not named are dense
    assert model.ffn_plan.impl("decode") == "dense"  # auto on CPU
    assert "decode=dense (tensors are on cpu" in model.ffn_plan.describe()
    assert (
        build_model(cfg).ffn_plan.describe()
        == "train+eval+prefill+decode=reference (model.ffn_impl=reference was asked for)"
    )
    assert build_model(cfg).ffn_plan.impl("prefill") == "reference"  # default: cfg.ffn_impl everywhere
    with pytest.raises(KernelsUnavailable, match=r"model\.ffn_impl=cuda"):
        build_model(ModelConfig(vocab_size=64, ffn_impl="cuda", **SHAPE))
    with pytest.raises(ValueError, match="unknown FFN phases"):
        FFNPlan.resolve({"serve": "dense"}, cfg, "cpu", torch.float32)


def test_with_ffn_plan_shares_the_weights_and_keeps_the_fallback():
    cfg = ModelConfig(vocab_size=64, num_hidden_layers=2, ffn_impl="reference", **SHAPE)
    model = build_model(cfg)
    model.set_ffn_dense_fallback([True, False])
    other = model.with_ffn_plan(FFNPlan.dense())
    assert other.ffn_plan.impl("train") == "dense" and model.ffn_plan.impl("train") == "reference"
    assert other.lm_head.weight is model.lm_head.weight is other.model.embed_tokens.weight
    assert other.ffn_dense_fallback() == [True, False]
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(other(ids).logits, model(ids).logits)
