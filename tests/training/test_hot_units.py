"""Hot units while training (model.ffn_hot_share): chosen from the fire counts every few steps, the
same model function with them as without, and restored from a checkpoint on resume."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from tiny import TINY_MODEL, tiny_run_config

from sparse_llm.config import ModelConfig
from sparse_llm.model import build_model
from sparse_llm.training import trainer as trainer_module
from sparse_llm.training.callbacks import Callback
from sparse_llm.training.hot_units import HotUnits
from sparse_llm.training.trainer import Trainer


def sparse_model(**fields) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(**{**TINY_MODEL, "vocab_size": 97, "ffn_impl": "reference", **fields}))


def test_the_model_computes_the_same_with_hot_units():
    """Hot units change how the sparse training FFN computes, not what: the loss and every gradient
    with a layer's most firing units (and with every unit) as a dense block equal those without."""
    model = sparse_model()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        out = model(ids, labels=ids, with_stats=True)
        (out.loss + out.ffn_stats.l1.sum()).backward()
        return (
            out.loss.detach(),
            out.ffn_stats.nnz_per_token,
            {n: p.grad.clone() for n, p in model.named_parameters()},
        )

    want_loss, want_nnz, want = loss_and_grads()
    h = model.config.intermediate_size
    for units in ([torch.arange(0, h, 5)] * 2, [torch.arange(h)] * 2, [None, torch.arange(7, 40)]):
        model.set_ffn_hot_units(units)
        loss, nnz, grads = loss_and_grads()
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        assert torch.equal(nnz, want_nnz)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_hot_units_are_chosen_from_the_fire_counts_to_a_multiple_of_64():
    model = sparse_model(intermediate_size=512)
    chooser = HotUnits(model, share=0.25, refresh_steps=10)
    assert [chooser.due(step) for step in (1, 9, 10, 20)] == [False, False, True, True]
    fire = torch.zeros(2, 512, dtype=torch.int64)
    fire[0, :70] = 30  # 70 units on 30 of 100 tokens: 128 units once filled to a multiple of 64
    fire[1, 3] = 10  # nothing reaches 25 tokens: no hot units
    chooser.choose(fire, tokens=100)
    first, second = model.ffn_hot_units()
    assert first.shape == (128,) and set(range(70)) <= set(first.tolist()) and second is None
    assert chooser.metrics() == {"ffn_hot/layer_00": 128.0, "ffn_hot/layer_01": 0.0, "ffn_hot/units": 128.0}


def test_hot_units_stay_under_a_quarter_of_h_and_off_dense_layers():
    """A layer falling back to dense gets none (its counts are the dense phase's); a sparse layer
    where most units fire gets at most a quarter of H, its most firing units."""
    model = sparse_model(intermediate_size=512)
    chooser = HotUnits(model, share=0.01)
    fire = torch.arange(512).expand(2, 512).contiguous()  # unit j fired on j of 1000 tokens
    model.set_ffn_dense_fallback([True, False])
    chooser.choose(fire, tokens=1000)
    dense, sparse = model.ffn_hot_units()
    assert dense is None and sparse.tolist() == list(range(384, 512))  # 128 = 512 / 4, the top ones


def test_bad_hot_unit_settings_are_clear_errors():
    with pytest.raises(ValueError, match="needs a sparse training FFN"):
        HotUnits(sparse_model(ffn_impl="dense"), share=0.1)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        HotUnits(sparse_model(), share=1.5)
    with pytest.raises(ValueError, match="hot units for 1 layers"):
        sparse_model().set_ffn_hot_units([None])


class SimulatedKill(Exception):
    pass


class KillAfterCheckpoint(Callback):
    def on_checkpoint(self, trainer, step, path):
        if step == 4:
            raise SimulatedKill


def test_a_resumed_run_keeps_the_checkpoints_hot_units(tmp_path: Path, monkeypatch):
    """Units chosen every 3 steps (at 3 and 6): a run killed after its step-4 checkpoint resumes with
    the units of step 3 (a fresh trainer has none) and logs the uninterrupted run's losses bit for bit."""
    monkeypatch.setattr(trainer_module, "HotUnits", functools.partial(HotUnits, refresh_steps=3))
    # H = 256: a quarter of it holds one multiple of 64.
    model = {"ffn_impl": "reference", "ffn_dense_above": 1.0, "ffn_hot_share": 0.2, "intermediate_size": 256}
    run = dict(max_steps=8, checkpoint_every=4)
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    Trainer(tiny_run_config(straight_dir, model=model, **run), straight_dir).fit()
    with pytest.raises(SimulatedKill):
        Trainer(tiny_run_config(resumed_dir, model=model, **run), resumed_dir, [KillAfterCheckpoint()]).fit()
    resumed = Trainer(tiny_run_config(resumed_dir, model=model, resume="auto", **run), resumed_dir)
    resumed._maybe_resume()
    assert all(hot is not None and hot.numel() % 64 == 0 for hot in resumed.model.ffn_hot_units())
    resumed.fit()
    read = [
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (straight_dir, resumed_dir)
    ]
    assert [r["step"] for r in read[1]] == list(range(1, 9))
    assert read[0][2]["ffn_hot/units"] > 0 and read[0][1]["ffn_hot/units"] == 0  # chosen after step 3
    for a, b in zip(*read, strict=True):
        for key in ("loss", "ce", "l1", "grad_norm", "ffn_hot/units"):
            assert a[key] == b[key], (a["step"], key)


def test_the_compiled_model_takes_hot_units_of_any_length_in_one_more_graph():
    """Compiled layer by layer (model/compiling.py), a model whose hot units change length at every
    refresh compiles one graph with them (their length dynamic), not one a length, and computes what
    the eager model does."""
    from sparse_llm.model.compiling import compile_model, compiled_graphs

    model = sparse_model(intermediate_size=256, num_hidden_layers=1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    step = compile_model(model, backend="aot_eager")  # the graphs and their guards, without Inductor's code
    step(ids, labels=ids, with_stats=True).loss.backward()
    before = compiled_graphs()
    for length in (64, 128, 192):
        model.set_ffn_hot_units([torch.arange(length)])
        compiled = step(ids, labels=ids, with_stats=True).loss
        compiled.backward()
        eager = model(ids, labels=ids, with_stats=True).loss
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert compiled_graphs() - before <= 2  # the variant with hot units (and at most one re-trace)


def test_a_dense_training_ffn_ignores_the_hot_share(tmp_path: Path):
    """`auto` without the kernels trains dense: the same config runs, with no hot units."""
    cfg = tiny_run_config(tmp_path, model={"ffn_impl": "dense", "ffn_hot_share": 0.1}, max_steps=1)
    trainer = Trainer(cfg, tmp_path)
    assert trainer.hot_units is None
