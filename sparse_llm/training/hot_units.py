"""Each layer's hot units, chosen from the units' fire counts while a run trains
(`model.ffn_hot_share`; ops/ffn/hot_units.py says what they are and why).

Every `refresh_steps` optimizer steps, from the last step's fire counts (global over ranks, so every
rank chooses the same units): the units that fired on at least `share` of the step's tokens, rounded
up to a multiple of 64 by the next most firing ones, at most a quarter of H, for the layers that run
the sparse op (not those falling back to dense). Any choice computes the same function, so a
refresh changes speed, never the result. Counts move slowly once a run is sparse, and a refresh reads
each layer's count on the host (a sync), hence not every step. The choice is the model's state
(`SparseLlamaForCausalLM.ffn_hot_units`), saved in checkpoints with it: a resumed run computes its
steps with the units the interrupted run had.
"""

from __future__ import annotations

import torch

from sparse_llm.metric_keys import layer_metric
from sparse_llm.model import SparseLlamaForCausalLM
from sparse_llm.ops.ffn.hot_units import choose_hot_units

DEFAULT_REFRESH_STEPS = 50
# At most this share of H a layer: S's g and u over [tokens, |S|] are kept for the backward, so
# a layer that just left the dense fallback (L0 100-170, where thousands of units fire on 1% of the
# tokens) would otherwise keep nearly a dense FFN's activations. A quarter of H costs little speed:
# the prototype's best S was 320-1,792 units of 5632 (benchmarks/results/column_hybrid_1b_h200*.md).
MAX_HOT_FRACTION = 0.25


class HotUnits:
    """Chooses the hot units (`choose`, after the steps that are `due`) and reports their sizes
    (`metrics`)."""

    def __init__(
        self, model: SparseLlamaForCausalLM, share: float, refresh_steps: int = DEFAULT_REFRESH_STEPS
    ):
        if model.ffn_plan.impl("train") == "dense":
            raise ValueError("model.ffn_hot_share needs a sparse training FFN; this model's is dense")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"model.ffn_hot_share is a fraction of a step's tokens in (0, 1]; got {share}")
        if refresh_steps < 1:
            raise ValueError(f"refresh_steps must be >= 1; got {refresh_steps}")
        self.model = model
        self.share = share
        self.refresh_steps = refresh_steps

    def due(self, step: int) -> bool:
        """Whether the units are chosen again after optimizer step `step` (1-based)."""
        return step % self.refresh_steps == 0

    def choose(self, fire_counts: torch.Tensor, tokens: int) -> None:
        """Each sparse layer's units from a step's fire counts [L, H] over `tokens` tokens (at most
        MAX_HOT_FRACTION of H); none for a layer that falls back to dense now (it runs no sparse op,
        and its counts are the dense phase's: S would be most of H when it turns sparse)."""
        max_units = int(MAX_HOT_FRACTION * fire_counts.shape[1])
        self.model.set_ffn_hot_units(
            [
                None if dense else choose_hot_units(counts, tokens, self.share, max_units=max_units)
                for counts, dense in zip(fire_counts, self.model.ffn_dense_fallback(), strict=True)
            ]
        )

    def metrics(self) -> dict[str, float]:
        """`ffn_hot/layer_NN` (the layer's hot units) and `ffn_hot/units` (over the layers)."""
        sizes = [0 if hot is None else hot.shape[0] for hot in self.model.ffn_hot_units()]
        out = {layer_metric("ffn_hot", i, len(sizes)): float(n) for i, n in enumerate(sizes)}
        out["ffn_hot/units"] = float(sum(sizes))
        return out
