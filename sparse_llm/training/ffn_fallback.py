"""Per-layer fallback of the sparse training FFN to dense when a layer is too dense to gain.

The sparse training path costs more per active unit than dense costs per unit, so above some
density (l0 / H) a layer trains faster dense. The rule, per layer, on the density of the last step:

    sparse -> dense   when density > max_density
    dense  -> sparse  when density < hysteresis * max_density   (no flapping around the edge)

Both paths compute the same function (exactly), so a switch changes speed, never the result, and
under `compile_model` it compiles nothing once both paths have run (each layer is its own region).
A layer that falls back recomputes its dense FFN in the backward (model/ffn.py), so the rule is set
against that cost, measured on each layer of a 1b run's final weights on its own activations
(benchmarks/layer_ffn.py, H100; benchmarks/results/run_1b_layer_ffn_h100.md): the dense FFN
recomputed costs 6.9-7.2 ms a layer at 16384 tokens, the sparse op 2.2 ms at L0 6 and 5.3 ms at
L0 91, about 25 us more a unit there, so they cross near L0 160 (2.8% of H). Hence the default of
3% of H (169 of 5632 units; back to sparse under 135). A run from initialisation starts every
layer dense: a randomly initialised gate fires on about half the units, where the sparse path has
nothing to gain.

Decisions use the global (all-rank) L0 of the step, so every rank agrees. The trainer applies
the rule after every step whenever the model's training FFN is sparse (model.ffn_impl reference,
cuda, or auto where the kernels run), with max_density = model.ffn_dense_above.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sparse_llm.config import ModelConfig
from sparse_llm.metric_keys import layer_metric
from sparse_llm.model import SparseLlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_DENSITY = ModelConfig.ffn_dense_above  # 3% (module docstring)
DEFAULT_HYSTERESIS = 0.8


def wants_dense(density: float, is_dense: bool, max_density: float, hysteresis: float) -> bool:
    """The rule: should a layer at `density` (l0 / H) that is now dense (`is_dense`) run dense?"""
    if is_dense:
        return density >= hysteresis * max_density
    return density > max_density


def apply_density_fallback(
    model: SparseLlamaForCausalLM,
    l0_per_layer: Sequence[float],
    max_density: float = DEFAULT_MAX_DENSITY,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> int:
    """Apply the rule to every layer of `model` from its measured L0 (the model's training FFN must
    be sparse); log each switch. Returns how many layers switched."""
    if not 0 < max_density <= 1 or not 0 <= hysteresis <= 1:
        raise ValueError(
            f"need 0 < max_density <= 1 and 0 <= hysteresis <= 1, got {max_density}, {hysteresis}"
        )
    sparse_impl = model.ffn_plan.impl("train")
    if sparse_impl == "dense":
        raise ValueError("the model's training FFN is dense: there is nothing to fall back from")
    flags = model.ffn_dense_fallback()
    if len(l0_per_layer) != len(flags):
        raise ValueError(f"got L0 for {len(l0_per_layer)} layers, the model has {len(flags)}")
    hidden = model.config.intermediate_size
    new_flags = []
    for i, (is_dense, l0) in enumerate(zip(flags, l0_per_layer, strict=True)):
        density = float(l0) / hidden
        dense = wants_dense(density, is_dense, max_density, hysteresis)
        if dense != is_dense:
            logger.info(
                "layer %d: density %.4f %s; training FFN switches %s",
                i,
                density,
                f"> {max_density:g}" if dense else f"< {hysteresis * max_density:g}",
                f"from {sparse_impl} to dense" if dense else f"back from dense to {sparse_impl}",
            )
        new_flags.append(dense)
    model.set_ffn_dense_fallback(new_flags)
    return sum(a != b for a, b in zip(flags, new_flags, strict=True))


class DensityFallback:
    """Applies the rule after every step (`observe`, from the step's global per-layer L0) and
    reports it per log window (`metrics`). The decisions are the model's state
    (`SparseLlamaForCausalLM.ffn_dense_fallback`), saved in checkpoints with it; a fresh run starts
    with every layer dense (module docstring), a resumed one with the checkpoint's flags."""

    def __init__(
        self,
        model: SparseLlamaForCausalLM,
        max_density: float = DEFAULT_MAX_DENSITY,
        hysteresis: float = DEFAULT_HYSTERESIS,
    ) -> None:
        if model.ffn_plan.impl("train") == "dense":
            raise ValueError("the model's training FFN is dense: there is nothing to fall back from")
        self.model = model
        self.max_density = max_density
        self.hysteresis = hysteresis
        self.flips = 0  # switches since this process started
        self._window_flips = 0
        model.set_ffn_dense_fallback([True] * len(model.ffn_dense_fallback()))

    def observe(self, l0_per_layer: Sequence[float]) -> None:
        """Apply the rule to the last step's per-layer L0."""
        switched = apply_density_fallback(self.model, l0_per_layer, self.max_density, self.hysteresis)
        self.flips += switched
        self._window_flips += switched

    def metrics(self) -> dict[str, float]:
        """`ffn_fallback/layer_NN` (1 = dense now), `ffn_fallback/dense_layers`,
        `ffn_fallback/switches` (since the last call) and `ffn_fallback/flips` (since the process
        started); starts a new window."""
        flags = self.model.ffn_dense_fallback()
        out = {layer_metric("ffn_fallback", i, len(flags)): float(f) for i, f in enumerate(flags)}
        out["ffn_fallback/dense_layers"] = float(sum(flags))
        out["ffn_fallback/switches"] = float(self._window_flips)
        out["ffn_fallback/flips"] = float(self.flips)
        self._window_flips = 0
        return out
