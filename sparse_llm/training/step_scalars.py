"""A training step's scalars, read on the host one step late, so that no step waits for the GPU.

A step's loss, L1, gradient norm and per-layer L0 are what the host acts on: the divergence check,
the L1 controller, the dense fallback, a stop agreed between ranks. Reading them as the step ends
drains the GPU's queue: the GPU then idles while the host issues the next step's first kernels
(under FSDP2, its all-gathers too). Instead the trainer starts one device-to-host copy of them, in
page-locked memory, as the step's work is queued (`ScalarsInFlight`), and reads it at the end of
the next step, by which time the GPU is long past it. The controller and the fallback therefore act
on the step before last, a delay of one step for every run, whatever it logs or checkpoints; a
checkpoint holds the last step's scalars (`StepReadings.state_dict`), so a resumed run applies them
where the uninterrupted one would. Logging and checkpoint steps read the step's own scalars at once
(`StepReadings.latest`): those steps sync, as they already do to time and to save.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StepScalars:
    step: int  # the optimizer step (0-based) they were measured at
    l1_coeff: float  # the lambda the step used (per-layer coefficients: their mean)
    per_layer_penalty: bool  # the step's penalty was the per-layer one (`penalty`), not l1_coeff x l1
    ce: float
    l1: float
    penalty: float  # the per-layer penalty's mean (per-layer coefficients only; else 0)
    stop: bool  # some rank had received a stop signal by this step
    grad_norm: float  # before clipping; NaN without clipping
    l0_per_layer: list[float]  # global over ranks

    @property
    def loss(self) -> float:
        """What the step minimised: cross-entropy plus its L1 penalty."""
        return self.ce + (self.penalty if self.per_layer_penalty else self.l1_coeff * self.l1)

    def diverged(self, clipping: bool) -> tuple[str, str] | None:
        """What became non-finite and a hint, in words, or None; the gradient norm counts with
        `clipping` only (without, it is not computed)."""
        if not math.isfinite(self.ce) or not math.isfinite(self.l1):
            return (
                f"loss became {self.ce} (L1 {self.l1}) at step {self.step + 1}",
                "Try a lower train.lr, a longer train.warmup_steps or train.grad_clip > 0.",
            )
        if clipping and not math.isfinite(self.grad_norm):
            return f"the gradient norm became {self.grad_norm} at step {self.step + 1} (loss {self.ce})", ""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): all but `stop`, a signal to the process that wrote it."""
        state = asdict(self)
        del state["stop"]
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StepScalars:
        return cls(stop=False, **state)


def step_vector(
    scalars: torch.Tensor, grad_norm: torch.Tensor | None, l0_per_layer: torch.Tensor
) -> torch.Tensor:
    """The float64 vector one copy brings to the host, all from the device: `scalars` ([ce, l1,
    penalty, stop]), the gradient norm (None: NaN), then the per-layer L0 (`ScalarsInFlight.get`
    reads them in this order)."""
    if grad_norm is None:
        grad_norm = torch.full((), math.nan, device=scalars.device)
    elif hasattr(grad_norm, "full_tensor"):  # FSDP2: a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    return torch.cat((scalars.double(), grad_norm.reshape(1).double(), l0_per_layer.double()))


class ScalarsInFlight:
    """One step's scalars on their way to the host: on a GPU, a copy into page-locked memory and an
    event recorded after it; `get()` waits for that event only (on the CPU the values are there).
    `l1_coeff` and `per_layer_penalty` are the step's, known on the host."""

    def __init__(self, step: int, vector: torch.Tensor, l1_coeff: float, per_layer_penalty: bool) -> None:
        self.step, self.l1_coeff, self.per_layer_penalty = step, l1_coeff, per_layer_penalty
        self._ready: torch.cuda.Event | None = None
        if vector.is_cuda:
            self._host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
            self._host.copy_(vector, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = vector
        self._scalars: StepScalars | None = None

    def get(self) -> StepScalars:
        if self._scalars is None:
            if self._ready is not None:
                self._ready.synchronize()
            ce, l1, penalty, stop, grad_norm, *l0_per_layer = self._host.tolist()
            self._scalars = StepScalars(
                self.step,
                self.l1_coeff,
                self.per_layer_penalty,
                ce,
                l1,
                penalty,
                stop > 0,
                grad_norm,
                l0_per_layer,
            )
        return self._scalars


class StepReadings:
    """The last step's scalars, in flight until the next step ends (module docstring); a restored
    checkpoint's are already on the host."""

    def __init__(self) -> None:
        self._latest: ScalarsInFlight | StepScalars | None = None

    def push(self, reading: ScalarsInFlight) -> StepScalars | None:
        """Start reading a step's scalars; return the previous step's, now on the host (None for a
        run's first step)."""
        previous, self._latest = self._latest, reading
        return None if previous is None else _on_host(previous)

    def latest(self) -> StepScalars:
        """The last step's scalars, waiting for them if they are still in flight."""
        if self._latest is None:
            raise RuntimeError("no training step has run yet")
        return _on_host(self._latest)

    def state_dict(self) -> dict[str, Any] | None:
        return None if self._latest is None else _on_host(self._latest).state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self._latest = None if state is None else StepScalars.from_state_dict(state)


def _on_host(entry: ScalarsInFlight | StepScalars) -> StepScalars:
    return entry if isinstance(entry, StepScalars) else entry.get()
