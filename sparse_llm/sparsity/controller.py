"""Target-sparsity control of the L1 coefficient (docs/design.md section 2).

With `sparsity.target_l0` (or `target_sparsity`) set, lambda is no longer a fixed schedule: after
every optimizer step the controller compares a step's measured L0 (active units per token,
summed over micro-batches and processes, so the same on every rank) with the target and moves
lambda in log space, a PI controller. The trainer reads a step's L0 on the host one step late
(training/step_scalars.py: no step waits for the GPU), so step s's L0 sets the lambda of step s + 2:

    e = log((L0 + eps) / target_l0)          eps = EPS_FRACTION x target_l0
    log(I) += gain x e                       the integral part, starting at `sparsity.l1_coeff`
    lambda  = I x exp(p_gain x e)            (p_gain = 0: lambda = I, the pure integral rule)

both clamped to [coeff_min, coeff_max]: lambda rises while the model is denser than the target
and falls while it is sparser, by factors that depend on the ratio, not on lambda's scale. Before
`l1_warmup_end` the fixed ramp applies and nothing adapts. With `controller.per_layer` each layer
has its own lambda driven by its own L0, and the penalty is the mean over layers of lambda_i x L1_i.

Everything is plain Python floats computed from exact integer counts, so every process, and a
resumed run, computes bit-identical coefficients; the state is JSON (floats round-trip exactly).

Defaults (sparse_llm.config.L1ControllerConfig), measured on the tiny CPU model (H = 64, 2 layers,
lr 1e-2 or 1e-3, 128 or 512 tokens a step, a 60-step warm-up; targets L0 6 to 20 approached from
lambda 3e-3, 30x too small, and from 0.1, 10x too large; 300-900 steps), the gain also on 1b runs:
- p_gain 1: the P term damps the loop. Against p_gain 0 it lowered the tracking error (RMS of
  log(L0 / target) over 20-step windows, 6 runs each) in 7 of 8 settings and matched it in one,
  by 10% typically: 0.31 against 0.32 at gain 0.02 and 0.29 against 0.35 at 0.05 (128 tokens a
  step), 0.45 against 0.58 and 0.39 against 0.42 (512 tokens). Its per-step noise does not
  accumulate; the integral carries the level.
- gain 0.15: L0 drifts during training (at a fixed lambda it falls, then climbs as the model
  learns), and an integral controller trails a drift by drift / gain: in log space, L0 sits at
  target x exp(drift / gain). On the 1b whole run (benchmarks/whole_run.py: 800 steps, lambda
  ramped to 1e-3 over 100 steps, target L0 30) the lambda that holds L0 rises ~8x over the last 400
  steps, 0.005 a step in log; at gain 0.05 L0 sat at 32.8-33.7 there in all seven runs (dense and
  `auto`, four commits; RMS of log(L0 / 30) 0.124-0.147), as 0.005 / 0.05 = 0.1 predicts (33.2).
  At 0.15 two runs (one ramping to 3e-4) held 30.9 and 31.2 (RMS 0.079 and 0.081), without an
  oscillation or a deeper dip after the ramp (benchmarks/results/l0_tracking_1b_h200_8b460dc.md).
  On the tiny model (byte tokenizer, lr 1e-2, 512 tokens a step, target 8, 300 steps, 6 seeds;
  the mean L0 of the last 150 steps over the target): from a lambda too small (3e-3) 1.02-1.09 at
  0.05 and at 0.15 alike, the RMS over the last 200 steps 0.11-0.15 against 0.13-0.19 (a faster
  integral follows more of a small batch's noise); from one too large (0.1) 0.78-1.08 against
  1.05-1.16, RMS 0.29-0.53 against 0.16-0.33. (An older tiny setup, 400 steps: within 6% of the
  target at 0.1, 19% below to 2% above at 0.05, 32% below to 11% above at 0.02.) A gain too high
  for the loop's delay overshoots, and an overshoot towards sparsity kills units that never come
  back (a ReLU unit that never fires gets no gradient through its gate); at 0.15 lambda moves 10x
  in ~15 steps while L0 is off by a factor e. Check `l1_coeff` against `l0/mean` over the first
  thousand steps of a new recipe (`python -m benchmarks.l0_tracking` on whole runs).
- The loop is asymmetric: lambda too large silences units, and silent units come back slowly
  (their gates get no gradient), so L0 recovers from below more slowly than it falls from above.
  Start from a lambda that is too small rather than too large, after a warm-up past the first
  collapse of L0: on the tiny model at gain 0.1, 16 runs from 3e-3 (L0 above the target; 8 seeds,
  1 and 2 threads) ended within 9% of it, 7 runs from 0.1 (L0 far below) 1-15% below it.
- reinit_hold_fraction 0.5: a dead-unit reinit that revives units (the reinit callback tells the
  controller, `reinit_revived_units`) is followed by a burst: the revived units fire on many
  tokens for a while (L0 several times the target), and an integral that follows that burst
  leaves lambda far too high afterwards: L0 then sits under the target until the next reinit (~20% under on the
  100m recipe, `recipe_100m_h200.md`). Holding the integral through the first half of each
  period removed that bias on the tiny CPU model (target L0 20, reinit every 50 steps, 400 steps,
  2 seeds; mean L0 over the second half of each period after step 100): 13.1 / 13.7 with no hold,
  18.0 / 17.4 holding 10 steps, 21.1 / 21.9 holding 25; lambda ended 5-7x lower and the
  validation loss a little lower (5.69 against 5.71, 5.75 against 5.85). Not yet measured at
  paper scale (the 100m table's reinit row predates it).
- EPS_FRACTION 1%: L0 can be exactly 0 (every unit silent on a step); e is then bounded
  (log 0.01 = -4.6) whatever the target's scale, instead of -inf.
- coeff_min 1e-8, coeff_max 1: far outside any useful value (the paper uses 2e-5 to 3e-4; the
  tiny model is ~99% sparse at 0.3): they only bound a controller chasing a target the model
  cannot hold, so it neither decays to 0 nor grows until the penalty swamps the cross-entropy.
  Tighten them to limit how far lambda may go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sparse_llm.config import SparsityConfig
from sparse_llm.metric_keys import layer_metric
from sparse_llm.sparsity.penalty import l1_coefficient

EPS_FRACTION = 0.01  # eps of the update rule, as a share of the target


class L1Controller:
    def __init__(self, cfg: SparsityConfig, num_layers: int, num_units: int) -> None:
        target = cfg.resolved_target_l0(num_units)
        if target is None or not 0 < target < num_units:
            raise ValueError(f"the L1 controller needs a target L0 in (0, {num_units}), got {target}")
        if cfg.l1_coeff <= 0:
            raise ValueError(f"the L1 controller starts from l1_coeff, which must be > 0, got {cfg.l1_coeff}")
        self.cfg = cfg
        self.target_l0 = target
        self.num_layers = num_layers
        self.per_layer = cfg.controller.per_layer
        n = num_layers if self.per_layer else 1
        # The integral part (a coefficient) and the last error log((L0 + eps) / target) of each
        # controlled coefficient; lambda = clamp(integral x exp(p_gain x error)).
        self._integral = [self._clamp(cfg.l1_coeff)] * n
        self._error = [0.0] * n
        self._hold = (0, 0)  # the steps [start, end) the integral holds still (after a reinit)

    def _clamp(self, value: float) -> float:
        return min(max(value, self.cfg.controller.coeff_min), self.cfg.controller.coeff_max)

    def adapting(self, step: int) -> bool:
        """Whether the coefficient at optimizer step `step` (0-based) is the controller's own: from
        `l1_warmup_end` on; before, the fixed warm-up ramp applies."""
        return step >= self.cfg.l1_warmup_end

    def coefficients(self, step: int) -> list[float]:
        """Lambda for optimizer step `step`: one value, or one per layer with `per_layer`."""
        if not self.adapting(step):
            return [l1_coefficient(self.cfg, step)] * len(self._integral)
        p_gain = self.cfg.controller.p_gain
        return [
            self._clamp(c * math.exp(p_gain * e)) for c, e in zip(self._integral, self._error, strict=True)
        ]

    def coefficient(self, step: int) -> float:
        """The single lambda, or the mean of the per-layer ones (what `l1_coeff` logs)."""
        values = self.coefficients(step)
        return values[0] if len(values) == 1 else math.fsum(values) / len(values)

    def metrics(self, step: int) -> dict[str, float]:
        """`l1_coeff/layer_NN` for every layer (per_layer only; named like the sparsity metrics)."""
        if not self.per_layer:
            return {}
        return {
            layer_metric("l1_coeff", i, self.num_layers): c for i, c in enumerate(self.coefficients(step))
        }

    def reinit_revived_units(self, completed_steps: int) -> None:
        """A dead-unit reinit after `completed_steps` optimizer steps revived units: their burst of
        activity shows from step `completed_steps` (0-based) on, and the integral holds still for
        the first `controller.reinit_hold_fraction` of the reinit period from there."""
        hold = round(self.cfg.controller.reinit_hold_fraction * self.cfg.reinit.every)
        self._hold = (completed_steps, completed_steps + hold)

    def holding(self, step: int) -> bool:
        """Whether the integral holds still at optimizer step `step` (0-based)."""
        start, end = self._hold
        return start <= step < end

    def update(self, l0_per_layer: Sequence[float], step: int) -> None:
        """Adapt after optimizer step `step` from that step's L0 of every layer (global over
        processes); the result applies from step `step + 1`."""
        if len(l0_per_layer) != self.num_layers:
            raise ValueError(f"expected the L0 of {self.num_layers} layers, got {len(l0_per_layer)}")
        if not self.adapting(step):
            return
        l0s = list(l0_per_layer) if self.per_layer else [math.fsum(l0_per_layer) / self.num_layers]
        eps = EPS_FRACTION * self.target_l0
        gain = self.cfg.controller.gain
        self._error = [math.log((l0 + eps) / self.target_l0) for l0 in l0s]
        if self.holding(step):
            return
        # log(c) += gain * error, as a product: c starts exactly at l1_coeff.
        self._integral = [
            self._clamp(c * math.exp(gain * e)) for c, e in zip(self._integral, self._error, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable; Python's JSON floats round-trip exactly."""
        return {
            "integral": list(self._integral),
            "error": list(self._error),
            "per_layer": self.per_layer,
            "hold": list(self._hold),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        integral = [float(v) for v in state["integral"]]
        error = [float(v) for v in state["error"]]
        if len(integral) != len(self._integral) or len(error) != len(integral):
            saved = "per layer" if state.get("per_layer") else "one for all layers"
            raise ValueError(
                f"the checkpoint's L1 controller has {len(integral)} coefficient(s) ({saved}), this run "
                f"{len(self._integral)} (sparsity.controller.per_layer={self.per_layer})"
            )
        self._integral, self._error = integral, error
        start, end = state.get("hold", (0, 0))  # absent: written before the hold existed
        self._hold = (int(start), int(end))
