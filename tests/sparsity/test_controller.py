"""The target-sparsity controller of the L1 coefficient: its update rule, its state, its config."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from sparse_llm.config import ConfigError, L1ControllerConfig, ReinitConfig, SparsityConfig, load_config
from sparse_llm.model import FFNStats
from sparse_llm.sparsity import L1Controller, SparsityMonitor, l1_coefficient, l1_penalty
from sparse_llm.sparsity.controller import EPS_FRACTION
from sparse_llm.train import CONFIG_DIR

H, LAYERS = 64, 2


def controller(
    target_l0: float = 8.0, l1_coeff: float = 1e-3, layers: int = LAYERS, warmup_end: int = 0, **ctl
) -> L1Controller:
    cfg = SparsityConfig(
        l1_coeff=l1_coeff,
        l1_warmup_end=warmup_end,
        target_l0=target_l0,
        controller=L1ControllerConfig(**ctl),
    )
    return L1Controller(cfg, layers, H)


# --- the update rule --------------------------------------------------------------------------


def test_starts_at_l1_coeff_exactly():
    assert controller(l1_coeff=3e-4).coefficients(0) == [3e-4]
    assert controller(l1_coeff=3e-4, per_layer=True).coefficients(0) == [3e-4, 3e-4]


@pytest.mark.parametrize("p_gain", [0.0, 1.0])
def test_moves_up_when_denser_than_the_target_and_down_when_sparser(p_gain):
    up, down = controller(p_gain=p_gain, gain=0.05), controller(p_gain=p_gain, gain=0.05)
    up.update([16.0, 16.0], step=0)  # twice the target
    down.update([4.0, 4.0], step=0)  # half the target
    assert up.coefficient(1) > 1e-3 > down.coefficient(1)
    # The rule in log space: the integral moves by gain x e, lambda by (gain + p_gain) x e.
    e_up = math.log((16.0 + EPS_FRACTION * 8.0) / 8.0)
    assert up.coefficient(1) == pytest.approx(1e-3 * math.exp((0.05 + p_gain) * e_up), rel=1e-12)
    e_down = math.log((4.0 + EPS_FRACTION * 8.0) / 8.0)
    assert down.coefficient(1) == pytest.approx(1e-3 * math.exp((0.05 + p_gain) * e_down), rel=1e-12)


def test_integral_accumulates_and_holds_at_the_target():
    ctl = controller(p_gain=0.0, gain=0.1)
    for step in range(10):
        ctl.update([16.0, 16.0], step)
    ratio = math.log((16.0 + 0.08) / 8.0)
    assert ctl.coefficient(10) == pytest.approx(1e-3 * math.exp(10 * 0.1 * ratio), rel=1e-12)
    held = ctl.coefficient(10)
    ctl.update([8.0 - 0.08] * 2, step=10)  # L0 + eps == target: e = 0
    assert ctl.coefficient(11) == pytest.approx(held, rel=1e-15)


def test_integral_holds_still_after_a_reinit_while_the_p_term_acts():
    """After a reinit that revived units at completed step 10 (reinit every 10, hold 0.3 of that):
    the updates of steps 10-12 (the revived units' burst) leave the integral as it was; the P term
    still answers their error; the hold is in the state and resumes."""
    cfg = SparsityConfig(
        l1_coeff=1e-3,
        target_l0=8.0,
        reinit=ReinitConfig(enabled=True, every=10),
        controller=L1ControllerConfig(gain=0.1, p_gain=1.0, reinit_hold_fraction=0.3),
    )
    held, free = L1Controller(cfg, LAYERS, H), controller(gain=0.1, p_gain=1.0)
    for step in range(10):  # no reinit yet: both move alike
        held.update([16.0, 16.0], step)
        free.update([16.0, 16.0], step)
    assert held.state_dict()["integral"] == free.state_dict()["integral"]
    held.reinit_revived_units(10)
    assert [s for s in range(30) if held.holding(s)] == [10, 11, 12]
    integral = held.state_dict()["integral"]
    held.update([64.0, 64.0], step=10)  # the burst
    assert held.state_dict()["integral"] == integral
    e = math.log((64.0 + EPS_FRACTION * 8.0) / 8.0)
    assert held.coefficient(11) == pytest.approx(integral[0] * math.exp(e), rel=1e-12)
    resumed = L1Controller(cfg, LAYERS, H)
    resumed.load_state_dict(json.loads(json.dumps(held.state_dict())))
    assert [s for s in range(30) if resumed.holding(s)] == [10, 11, 12]
    held.update([16.0, 16.0], step=13)  # past the hold: the integral moves again
    assert held.state_dict()["integral"][0] > integral[0]


def test_global_coefficient_follows_the_mean_over_layers():
    ctl = controller(p_gain=0.0)
    ctl.update([2.0, 14.0], step=0)  # the mean, 8, is the target: only eps moves it
    error = math.log((8.0 + EPS_FRACTION * 8.0) / 8.0)
    assert ctl.coefficient(1) == pytest.approx(1e-3 * math.exp(ctl.cfg.controller.gain * error), rel=1e-12)


def test_clamps_to_the_bounds():
    ctl = controller(coeff_min=5e-4, coeff_max=2e-3)
    for step in range(200):
        ctl.update([64.0, 64.0], step)
    assert ctl.coefficient(200) == 2e-3
    for step in range(200, 400):
        ctl.update([0.0, 0.0], step)  # every unit silent: e is bounded (eps), lambda falls to the floor
    assert ctl.coefficient(400) == 5e-4


def test_silent_step_is_a_bounded_finite_move():
    ctl = controller(p_gain=0.0, gain=0.1)
    ctl.update([0.0, 0.0], step=0)
    assert ctl.coefficient(1) == pytest.approx(1e-3 * EPS_FRACTION**0.1, rel=1e-12)


def test_per_layer_coefficients_are_independent():
    ctl = controller(per_layer=True)
    ctl.update([16.0, 4.0], step=0)
    first, second = ctl.coefficients(1)
    assert first > 1e-3 > second
    # Each layer's coefficient is the global rule applied to that layer's L0 alone.
    alone = controller()
    alone.update([16.0, 16.0], step=0)
    assert first == alone.coefficient(1)
    assert ctl.coefficient(1) == pytest.approx((first + second) / 2, rel=1e-15)
    assert ctl.metrics(1) == {"l1_coeff/layer_00": first, "l1_coeff/layer_01": second}
    assert controller().metrics(1) == {}


def test_no_adaptation_before_the_end_of_the_warm_up():
    cfg = SparsityConfig(l1_coeff=1e-3, l1_warmup_start=2, l1_warmup_end=6, target_l0=8.0)
    ctl = L1Controller(cfg, LAYERS, H)
    for step in range(6):
        assert ctl.coefficient(step) == l1_coefficient(cfg, step)  # the fixed ramp
        ctl.update([64.0, 64.0], step)  # ignored
    assert ctl.coefficient(6) == 1e-3
    ctl.update([64.0, 64.0], step=6)  # the first adaptation
    assert ctl.coefficient(7) > 1e-3


def test_state_round_trips_through_json_exactly():
    for per_layer in (False, True):
        ctl = controller(per_layer=per_layer)
        for step, l0 in enumerate(([30.0, 20.0], [3.1, 7.7], [12.345, 0.0])):
            ctl.update(l0, step)
        state = json.loads(json.dumps(ctl.state_dict()))
        fresh = controller(per_layer=per_layer)
        fresh.load_state_dict(state)
        assert fresh.coefficients(3) == ctl.coefficients(3)
        fresh.update([9.0, 11.0], 3)
        ctl.update([9.0, 11.0], 3)
        assert fresh.state_dict() == ctl.state_dict()
    with pytest.raises(ValueError, match="per_layer"):
        controller(per_layer=True).load_state_dict(controller(per_layer=False).state_dict())


def test_rejects_the_wrong_number_of_layers():
    with pytest.raises(ValueError, match="2 layers"):
        controller().update([1.0], step=0)


# --- what the controller reads and what the loss uses ------------------------------------------


def test_last_step_l0_is_the_step_l0_the_logs_report():
    torch.manual_seed(0)
    monitor = SparsityMonitor(LAYERS, H, dead_window_tokens=10**9)
    for tokens in (5, 11):  # two micro-batches of unequal size
        nnz = torch.randint(0, H + 1, (LAYERS, tokens))
        monitor.update(FFNStats(torch.zeros(LAYERS), nnz, torch.zeros(LAYERS, H, dtype=torch.int64)))
    monitor.end_step(lambda t: t)
    l0 = monitor.last_step_l0()
    metrics = monitor.summary()
    assert l0 == pytest.approx([metrics[f"l0/layer_{i:02d}"] for i in range(LAYERS)], rel=1e-15)


def test_per_layer_penalty_is_the_mean_of_coefficient_times_l1():
    l1 = torch.tensor([2.0, 6.0], requires_grad=True)
    stats = FFNStats(l1, torch.zeros(LAYERS, 1, dtype=torch.int64), torch.zeros(LAYERS, H, dtype=torch.int64))
    penalty = l1_penalty(stats, torch.tensor([1e-2, 1e-3]))
    assert penalty.item() == pytest.approx((1e-2 * 2.0 + 1e-3 * 6.0) / 2)
    penalty.backward()
    torch.testing.assert_close(l1.grad, torch.tensor([1e-2, 1e-3]) / 2)
    assert l1_penalty(stats).item() == 4.0  # no coefficients: the plain mean, as before
    with pytest.raises(ValueError, match="coefficients"):
        l1_penalty(stats, torch.ones(3))


# --- config -------------------------------------------------------------------------------------


def sparsity_config(model: dict | None = None, **sparsity) -> SparsityConfig:
    raw = {"model": {"intermediate_size": H, **(model or {})}, "sparsity": {"l1_coeff": 1e-3, **sparsity}}
    return load_config(raw).sparsity


def test_both_spellings_of_the_target():
    assert sparsity_config(target_l0=8).resolved_target_l0(H) == 8
    assert sparsity_config(target_sparsity=0.875).resolved_target_l0(H) == 8
    none = sparsity_config()
    assert none.target_l0 is none.target_sparsity is None and none.resolved_target_l0(H) is None


@pytest.mark.parametrize(
    ("sparsity", "key"),
    [
        (dict(target_l0=8, target_sparsity=0.5), "sparsity.target_sparsity"),  # both set
        (dict(target_l0=H), "sparsity.target_l0"),  # not below H
        (dict(target_l0=1000.5), "sparsity.target_l0"),
        (dict(target_l0=0), "sparsity.target_l0"),
        (dict(target_l0=-3), "sparsity.target_l0"),
        (dict(target_sparsity=1.0), "sparsity.target_sparsity"),
        (dict(target_sparsity=0.0), "sparsity.target_sparsity"),
        (dict(target_sparsity=1.5), "sparsity.target_sparsity"),
        (dict(target_l0=8, l1_coeff=0.0), "sparsity.l1_coeff"),  # the controller starts from it
        (dict(target_l0=8, l1_coeff=2.0), "sparsity.l1_coeff"),  # above coeff_max
        (dict(controller=dict(coeff_min=1e-2, coeff_max=1e-3)), "sparsity.controller.coeff_min"),
        (dict(controller=dict(gain=0)), "sparsity.controller.gain"),
        (dict(controller=dict(p_gain=-1)), "sparsity.controller.p_gain"),
    ],
)
def test_bad_targets_are_one_line_naming_the_key(sparsity, key):
    with pytest.raises(ConfigError) as err:
        sparsity_config(**sparsity)
    message = str(err.value)
    assert f"'{key}'" in message and "\n" not in message, message


@pytest.mark.parametrize("preset", ["cpu", "none", "paper", "target"])
def test_every_preset_takes_a_target_on_the_command_line(preset):
    overrides = [f"sparsity={preset}", "sparsity.target_l0=30", "sparsity.target_sparsity=null"]
    overrides += ["sparsity.l1_coeff=1e-3", "sparsity.controller.per_layer=true"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = load_config(compose("config", overrides=overrides))
    assert cfg.sparsity.resolved_target_l0(cfg.model.intermediate_size) == 30
    assert cfg.sparsity.controller.per_layer


def test_target_preset_composes_for_the_paper_models():
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        raw = compose("config", overrides=["model=1b", "sparsity=target"])
    cfg = load_config(raw)
    assert cfg.sparsity.target_sparsity == 0.995
    assert cfg.sparsity.resolved_target_l0(cfg.model.intermediate_size) == pytest.approx(28.16)
    assert cfg.sparsity.l1_coeff > 0
