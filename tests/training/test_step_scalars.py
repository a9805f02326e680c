"""A step's scalars read one step late (sparse_llm/training/step_scalars.py), on the CPU."""

from __future__ import annotations

import math

import torch

from sparse_llm.training.step_scalars import ScalarsInFlight, StepReadings, step_vector


def vector(ce: float, stop: float, l0: list[float], grad_norm: float | None = 1.5) -> torch.Tensor:
    scalars = torch.tensor([ce, 0.25, 0.0, stop])
    return step_vector(scalars, None if grad_norm is None else torch.tensor(grad_norm), torch.tensor(l0))


def reading(step: int, vec: torch.Tensor) -> ScalarsInFlight:
    return ScalarsInFlight(step, vec, l1_coeff=0.5, per_layer_penalty=False)


def test_a_steps_scalars_come_back_when_the_next_step_is_pushed():
    readings = StepReadings()
    assert readings.push(reading(0, vector(3.0, 0.0, [10.0, 20.0]))) is None
    first = readings.push(reading(1, vector(2.5, 1.0, [11.0, 21.0])))
    assert (first.step, first.ce, first.l1, first.stop, first.grad_norm) == (0, 3.0, 0.25, False, 1.5)
    assert first.l0_per_layer == [10.0, 20.0]
    latest = readings.latest()
    assert latest.step == 1 and latest.stop and latest.ce == 2.5


def test_a_checkpoint_keeps_the_last_scalars_but_not_a_stop_signal():
    readings = StepReadings()
    readings.push(reading(4, vector(2.0, 1.0, [7.0], grad_norm=None)))
    restored = StepReadings()
    restored.load_state_dict(readings.state_dict())
    back = restored.push(reading(5, vector(1.9, 0.0, [6.0])))
    assert back.step == 4 and back.l0_per_layer == [7.0] and math.isnan(back.grad_norm)
    assert not back.stop  # a signal to the process that wrote the checkpoint
    empty = StepReadings()
    empty.load_state_dict(None)
    assert empty.push(reading(0, vector(1.0, 0.0, [1.0]))) is None


def test_divergence_names_the_step_and_what_became_non_finite():
    readings = StepReadings()
    readings.push(reading(2, vector(float("nan"), 0.0, [1.0])))
    assert readings.latest().diverged(clipping=True)[0] == "loss became nan (L1 0.25) at step 3"
    readings.push(reading(3, vector(1.0, 0.0, [1.0], grad_norm=float("inf"))))
    assert "gradient norm became inf at step 4" in readings.latest().diverged(clipping=True)[0]
    readings.push(reading(4, vector(1.0, 0.0, [1.0], grad_norm=None)))
    assert readings.latest().diverged(clipping=False) is None
