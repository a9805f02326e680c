"""benchmarks/lean_llama.py: the lean Llama computes what ours computes (same weights, fp32, CPU),
which is what makes its step a like-for-like yardstick for ours; and the benchmark end to end."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.lean_llama import lean_model, lean_state, main, parse_args
from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
SIZE_ARGS = ["--preset", "tiny", "--hidden", "64", "--intermediate", "96"]
SIZE_ARGS += ["--layers", "2", "--heads", "4", "--seq-len", "16", "--micro-batch", "2"]


def test_lean_model_matches_ours_in_fp32_loss_and_gradients():
    cfg = ModelConfig(**SMALL)
    torch.manual_seed(0)
    ours = build_model(cfg)
    lean = lean_model(cfg, ours.state_dict(), "cpu", bf16=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 17))
    loss_ours = ours(ids[:, :-1], labels=ids[:, 1:]).loss
    loss_lean = lean(ids[:, :-1], ids[:, 1:])
    # The same arithmetic in the same order up to the loss, whose mean ours takes chunk-wise.
    assert loss_lean.item() == pytest.approx(loss_ours.item(), rel=1e-6)
    loss_ours.backward()
    loss_lean.backward()
    lean_params = dict(lean.named_parameters())
    ours_grads = {name: p.grad for name, p in ours.named_parameters()}  # the tied head: the embedding
    for lean_name, grad in lean_state(ours_grads).items():
        expected = lean_params[lean_name].grad
        assert (grad - expected).norm() <= 1e-5 * expected.norm(), lean_name


def test_lean_state_renames_every_parameter_and_drops_the_tied_head():
    cfg = ModelConfig(**SMALL)
    ours = build_model(cfg).state_dict()
    lean = lean_model(cfg, ours, "cpu", bf16=False)
    renamed = lean_state(ours)
    assert set(renamed) == set(lean.state_dict())
    assert len(renamed) == len(ours) - 1  # lm_head.weight is the embedding
    assert lean.embed.weight.data_ptr() != ours["model.embed_tokens.weight"].data_ptr()  # a copy
    assert torch.equal(lean.layers[1].w_down.weight, ours["model.layers.1.mlp.down_proj.weight"])


def test_lean_model_refuses_shapes_it_does_not_have():
    with pytest.raises(ValueError, match="multi-head"):
        lean_model(ModelConfig(**{**SMALL, "num_key_value_heads": 2}), {}, "cpu", bf16=False)
    with pytest.raises(ValueError, match="tied head"):
        lean_model(ModelConfig(**{**SMALL, "hidden_act": "silu"}), {}, "cpu", bf16=False)


def test_parse_args_takes_explicit_sizes_over_the_preset():
    args = parse_args([*SIZE_ARGS, "--steps", "2", "--no-compile", "--variants", "ours", "lean"])
    assert (args.hidden, args.layers, args.steps, args.compile) == (64, 2, 2, False)
    assert args.variants == ["ours", "lean"]
    assert parse_args([]).compile and parse_args([]).micro_batch == 8 and parse_args([]).seq_len == 2048
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


def test_benchmark_times_ours_and_lean_from_the_same_losses(tmp_path):
    """Each variant on the same weights and tokens: ours (the trainer's step, through
    model_step.time_impl) and lean start from the same fp32 loss and, after the same AdamW steps
    (both clipped), still agree."""
    json_path, md_path = tmp_path / "lean.json", tmp_path / "lean.md"
    files = ["--json", str(json_path), "--md", str(md_path)]
    rows = main([*SIZE_ARGS, "--steps", "2", "--warmup", "0", "--no-compile", *files])
    ours, lean, lean_bf16 = rows
    assert [r["variant"] for r in rows] == ["ours", "lean", "lean_bf16"]
    # fp32 round-off of two implementations after the three untimed steps: ~1e-6
    assert lean["loss_first"] == pytest.approx(ours["loss_first"], rel=5e-6)
    assert lean["loss_last"] == pytest.approx(ours["loss_last"], rel=1e-5)
    assert lean_bf16["loss_first"] == pytest.approx(ours["loss_first"], rel=2e-2)  # bf16 weights
    assert lean["ours_over_this_ms"] == pytest.approx(ours["ms_step"] / lean["ms_step"])
    assert ours["ours_over_this_ms"] == 1.0
    report = json.loads(json_path.read_text())
    assert report["meta"]["commit"] and report["meta"]["device"] and report["meta"]["date"]
    assert [r["variant"] for r in report["results"]] == ["ours", "lean", "lean_bf16"]
    md = md_path.read_text()
    assert "| lean, fp32 master + bf16 autocast |" in md and "no autocast" in md
