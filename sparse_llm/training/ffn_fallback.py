"""Per-layer fallback of the sparse training FFN to dense when a layer is too dense to gain.

The sparse training path costs more per active unit than dense costs per unit, so above some
density (l0 / H) a layer trains faster dense. The rule, per layer, on the measured density:

    sparse -> dense   when density > max_density
    dense  -> sparse  when density < hysteresis * max_density   (no flapping around the edge)

Both paths compute the same function (exactly), so a switch changes speed, never the result;
each switch is logged and reported as a metric. `max_density` is a speed knob measured with
scripts/benchmark_ffn.py --train (D=2048, H=5632, 16384 tokens): the CUDA training FFN beats
compiled dense up to ~56 active units per token on an H100 and ~84 on an H200 (interpolated
between the measured 30, 60 and 120; its gathers lean on L2, 50 MB on the H100 against 60), hence
the default of 1.0%, right on both (benchmarks/results/ffn_train_h100.md, ffn_train_h200.md).
Decisions use the global (all-rank) density, so every rank agrees.

The trainer adds the callback by itself for model.ffn_impl=cuda, with
max_density = model.ffn_dense_above.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from torch import nn

from sparse_llm.config import ModelConfig
from sparse_llm.training.callbacks import Callback

logger = logging.getLogger(__name__)

DEFAULT_MAX_DENSITY = ModelConfig.ffn_dense_above  # 1.0%, ~56 of 5632 units (module docstring)
DEFAULT_HYSTERESIS = 0.8


def wants_dense(density: float, is_dense: bool, max_density: float, hysteresis: float) -> bool:
    """The rule: should a layer at `density` (l0 / H) that is now dense (`is_dense`) run dense?"""
    if is_dense:
        return density >= hysteresis * max_density
    return density > max_density


def sparse_mlps(model: nn.Module) -> list[nn.Module]:
    """The FFN modules of `model` (in layer order) that run a sparse implementation."""
    return [layer.mlp for layer in model.model.layers if layer.mlp.ffn_impl != "dense"]


def apply_density_fallback(
    model: nn.Module,
    l0_per_layer: Sequence[float],
    max_density: float = DEFAULT_MAX_DENSITY,
    hysteresis: float = DEFAULT_HYSTERESIS,
) -> dict[str, float]:
    """Apply the rule to every layer of `model` from its measured L0; log each switch.

    Returns metrics: `ffn_fallback/dense_layers` and `ffn_fallback/layer_NN` (1 = dense) for the
    layers with a sparse ffn_impl; `ffn_fallback/switches` counts the switches made now."""
    if not 0 < max_density <= 1 or not 0 <= hysteresis <= 1:
        raise ValueError(
            f"need 0 < max_density <= 1 and 0 <= hysteresis <= 1, got {max_density}, {hysteresis}"
        )
    layers = model.model.layers
    if len(l0_per_layer) != len(layers):
        raise ValueError(f"got L0 for {len(l0_per_layer)} layers, the model has {len(layers)}")
    width = max(2, len(str(len(layers) - 1)))
    metrics: dict[str, float] = {}
    switches = 0
    for i, (layer, l0) in enumerate(zip(layers, l0_per_layer, strict=True)):
        mlp = layer.mlp
        if mlp.ffn_impl == "dense":
            continue
        density = float(l0) / mlp.gate_proj.weight.shape[0]
        dense = wants_dense(density, mlp.train_dense_fallback, max_density, hysteresis)
        if dense != mlp.train_dense_fallback:
            switches += 1
            logger.info(
                "layer %d: density %.4f %s; training FFN switches %s",
                i,
                density,
                f"> {max_density:g}" if dense else f"< {hysteresis * max_density:g}",
                f"from {mlp.ffn_impl} to dense" if dense else f"back from dense to {mlp.ffn_impl}",
            )
            mlp.train_dense_fallback = dense
        metrics[f"ffn_fallback/layer_{i:0{width}d}"] = float(dense)
    metrics["ffn_fallback/dense_layers"] = float(sum(m.train_dense_fallback for m in sparse_mlps(model)))
    metrics["ffn_fallback/switches"] = float(switches)
    return metrics


_L0_KEY = re.compile(r"^l0/layer_(\d+)$")


class DensityFallbackCallback(Callback):
    """Applies the rule whenever the step's metrics carry the per-layer L0 (the sparsity monitor's
    summary, global over ranks, every train.log_every steps); adds the fallback metrics."""

    def __init__(
        self, max_density: float = DEFAULT_MAX_DENSITY, hysteresis: float = DEFAULT_HYSTERESIS
    ) -> None:
        self.max_density = max_density
        self.hysteresis = hysteresis

    def on_step_end(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        found = {int(m.group(1)): v for k, v in metrics.items() if (m := _L0_KEY.match(k))}
        if not found or not sparse_mlps(trainer.model):
            return
        l0 = [found[i] for i in sorted(found)]
        metrics.update(apply_density_fallback(trainer.model, l0, self.max_density, self.hysteresis))
