"""Per-layer fallback of the sparse training FFN to dense when a layer is too dense to gain.

The sparse training path costs more per active unit than dense costs per unit, so above some
density (l0 / H) a layer trains faster dense. The rule, per layer, on the measured density:

    sparse -> dense   when density > max_density
    dense  -> sparse  when density < hysteresis * max_density   (no flapping around the edge)

Both paths compute the same function (exactly), so a switch changes speed, never the result;
each switch is logged and reported as a metric. `max_density` is a speed knob measured with
benchmarks/ffn.py --train (D=2048, H=5632, 16384 tokens): the CUDA training FFN beats
compiled dense up to ~56 active units per token on an H100 and ~84 on an H200 (interpolated
between the measured 30, 60 and 120; its gathers lean on L2, 50 MB on the H100 against 60), hence
the default of 1.0%, right on both (benchmarks/results/ffn_train_h100.md, ffn_train_h200.md).
Decisions use the global (all-rank) density, so every rank agrees.

The trainer applies it by itself whenever the model's training FFN is sparse (model.ffn_impl
reference, cuda, or auto where the kernels run), with max_density = model.ffn_dense_above.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from sparse_llm.config import ModelConfig
from sparse_llm.model import SparseLlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MAX_DENSITY = ModelConfig.ffn_dense_above  # 1.0%, ~56 of 5632 units (module docstring)
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
) -> dict[str, float]:
    """Apply the rule to every layer of `model` from its measured L0 (the model's training FFN must
    be sparse); log each switch. Returns metrics: `ffn_fallback/layer_NN` (1 = dense),
    `ffn_fallback/dense_layers` and `ffn_fallback/switches` (the switches made now)."""
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
    width = max(2, len(str(len(flags) - 1)))
    metrics: dict[str, float] = {}
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
        metrics[f"ffn_fallback/layer_{i:0{width}d}"] = float(dense)
    model.set_ffn_dense_fallback(new_flags)
    metrics["ffn_fallback/dense_layers"] = float(sum(new_flags))
    metrics["ffn_fallback/switches"] = float(sum(a != b for a, b in zip(flags, new_flags, strict=True)))
    return metrics


_L0_KEY = re.compile(r"^l0/layer_(\d+)$")


class DensityFallback:
    """Applies the rule whenever a step's metrics carry the per-layer L0 (the sparsity monitor's
    summary, global over ranks, every train.log_every steps), so every rank decides alike. The
    decisions are the model's state (`SparseLlamaForCausalLM.ffn_dense_fallback`), saved in
    checkpoints with it."""

    def __init__(
        self,
        model: SparseLlamaForCausalLM,
        max_density: float = DEFAULT_MAX_DENSITY,
        hysteresis: float = DEFAULT_HYSTERESIS,
    ) -> None:
        self.model = model
        self.max_density = max_density
        self.hysteresis = hysteresis

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """The fallback metrics after applying the rule to `metrics`' per-layer L0 (none without)."""
        found = {int(m.group(1)): v for k, v in metrics.items() if (m := _L0_KEY.match(k))}
        if not found:
            return {}
        l0 = [found[i] for i in sorted(found)]
        return apply_density_fallback(self.model, l0, self.max_density, self.hysteresis)
