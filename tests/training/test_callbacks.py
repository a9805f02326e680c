"""Callback API: dispatch, building from config entries, and the built-in dead-unit reinit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from callback_targets import Recorder

from sparse_llm.config import ConfigError, ModelConfig, ReinitConfig, RunConfig, SparsityConfig
from sparse_llm.model import FFNStats, build_model
from sparse_llm.sparsity import L1Controller, SparsityMonitor
from sparse_llm.training.callbacks import (
    Callback,
    CallbackList,
    DeadUnitReinitCallback,
    build_callbacks,
    default_callbacks,
)


def counts_from_hist(hist: torch.Tensor) -> torch.Tensor:
    """Per-token non-zero counts [L, M] having the histogram `hist` [L, H + 1]."""
    bins = torch.arange(hist.shape[1])
    return torch.stack([torch.repeat_interleave(bins, row) for row in hist])


H, LAYERS = 64, 2


def test_callback_list_dispatches_in_order_and_base_hooks_are_noops():
    log: list = []
    callbacks = CallbackList([Recorder("a", log), Callback(), Recorder("b", log)])
    metrics: dict = {}
    callbacks.on_train_start(None)
    callbacks.on_step_end(None, 3, metrics)
    callbacks.on_eval(None, 3, {})
    callbacks.on_checkpoint(None, 3, Path("ckpt"))
    callbacks.on_train_end(None)
    assert log == [
        ("a", "step", 3),
        ("b", "step", 3),
        ("a", "ckpt", Path("ckpt")),
        ("b", "ckpt", Path("ckpt")),
    ]
    assert metrics == {"a": 3, "b": 3}


def test_build_callbacks_instantiates_targets():
    entries = [
        {
            "_target_": "sparse_llm.training.callbacks.DeadUnitReinitCallback",
            "every": 5,
            "reset_up_down": True,
        },
        {"_target_": "callback_targets.Recorder", "name": "r", "log": []},
    ]
    built = build_callbacks(entries)
    assert isinstance(built[0], DeadUnitReinitCallback) and built[0].every == 5 and built[0].reset_up_down
    assert isinstance(built[1], Recorder)
    assert build_callbacks([]) == []


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"_target_": "no_such_pkg.Thing"}, r"callbacks\[1\].*no_such_pkg.Thing"),
        ({"_target_": "sparse_llm.training.callbacks.NoSuchCallback"}, r"callbacks\[1\].*NoSuchCallback"),
        ({"_target_": "callback_targets.NotACallback"}, r"callbacks\[1\].*NotACallback.*not a .*Callback"),
        ({"every": 3}, r"callbacks\[1\].*_target_"),
        (
            {"_target_": "sparse_llm.training.callbacks.DeadUnitReinitCallback", "bogus": 1},
            r"callbacks\[1\].*bogus",
        ),
    ],
)
def test_build_callbacks_errors_name_the_entry(entry, message):
    good = {"_target_": "sparse_llm.training.callbacks.Callback"}
    with pytest.raises(ConfigError, match=message):
        build_callbacks([good, entry])


def test_default_callbacks_follow_the_reinit_config():
    cfg = RunConfig()
    assert default_callbacks(cfg) == []
    cfg.sparsity.reinit.enabled, cfg.sparsity.reinit.every = True, 7
    (callback,) = default_callbacks(cfg)
    assert isinstance(callback, DeadUnitReinitCallback) and callback.every == 7


def make_trainer():
    """A stand-in with the attributes the trainer exposes to callbacks."""
    torch.manual_seed(0)
    cfg = RunConfig(
        model=ModelConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=H,
            num_hidden_layers=LAYERS,
            num_attention_heads=2,
        )
    )
    model = build_model(cfg.model)
    return SimpleNamespace(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        cfg=cfg,
        step=0,
        sparsity=SparsityMonitor(LAYERS, H, dead_window_tokens=10),
        run_dir=Path("."),
        reinit_generator=torch.Generator().manual_seed(0),
        l1_controller=None,
    )


def test_dead_unit_reinit_callback():
    trainer = make_trainer()
    # Units 3 (layer 0) and 9, 10 (layer 1) never fire for 10 tokens: dead.
    fire = torch.ones(LAYERS, H, dtype=torch.int64)
    fire[0, 3] = fire[1, 9] = fire[1, 10] = 0
    hist = torch.zeros(LAYERS, H + 1, dtype=torch.int64)
    hist[:, 5] = 10
    trainer.sparsity.update(FFNStats(torch.zeros(LAYERS), counts_from_hist(hist), fire))
    trainer.sparsity.end_step(lambda t: t)
    gate0 = trainer.model.model.layers[0].mlp.gate_proj.weight.detach().clone()

    callback = DeadUnitReinitCallback(every=2)
    metrics: dict = {}
    callback.on_step_end(trainer, 1, metrics)  # not a reinit step
    assert metrics == {}
    assert trainer.sparsity.dead_mask().sum() == 3

    callback.on_step_end(trainer, 2, metrics)
    assert metrics == {"reinit/revived": 3.0, "reinit/revived/layer_00": 1.0, "reinit/revived/layer_01": 2.0}
    assert not trainer.sparsity.dead_mask().any()  # counters restarted
    gate0_after = trainer.model.model.layers[0].mlp.gate_proj.weight.detach()
    assert not torch.equal(gate0_after[3], gate0[3])
    assert torch.equal(gate0_after[:3], gate0[:3]) and torch.equal(gate0_after[4:], gate0[4:])


def _with_dead_units(trainer, dead: bool) -> None:
    """One step's counts: unit 3 of layer 0 silent over 10 tokens (dead), or every unit firing."""
    fire = torch.ones(LAYERS, H, dtype=torch.int64)
    fire[0, 3] = 0 if dead else 1
    hist = torch.zeros(LAYERS, H + 1, dtype=torch.int64)
    hist[:, 5] = 10
    trainer.sparsity.update(FFNStats(torch.zeros(LAYERS), counts_from_hist(hist), fire))
    trainer.sparsity.end_step(lambda t: t)


@pytest.mark.parametrize("dead", [True, False])
def test_a_reinit_that_revives_units_holds_the_controllers_integral(dead):
    """Under a target, a reinit that revived units starts the controller's hold (half of the
    10-step period: steps 10-14); one that found no dead unit leaves the controller alone."""
    trainer = make_trainer()
    sparsity = SparsityConfig(l1_coeff=1e-3, target_l0=4.0, reinit=ReinitConfig(enabled=True, every=10))
    trainer.l1_controller = L1Controller(sparsity, LAYERS, H)
    _with_dead_units(trainer, dead)
    DeadUnitReinitCallback(every=10).on_step_end(trainer, 10, {})
    held = [step for step in range(30) if trainer.l1_controller.holding(step)]
    assert held == ([10, 11, 12, 13, 14] if dead else [])


def test_dead_unit_reinit_callback_rejects_bad_interval():
    with pytest.raises(ValueError, match="every"):
        DeadUnitReinitCallback(every=0)
