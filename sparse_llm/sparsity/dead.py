"""Dead-unit tracking: per layer and unit, how many tokens have passed since it last fired.

The window (`sparsity.dead_window_tokens`, 0 meaning one global batch) is resolved to tokens
by the trainer.

Updated once per optimizer step with fire counts already summed over the step's micro-batches
and data-parallel ranks, so every rank holds the same counters. The resolution is one step:
a unit that fired anywhere in a step restarts at 0 after it.
"""

from __future__ import annotations

import torch

_STATE_KEY = "tokens_since_fired"


class DeadUnitTracker:
    def __init__(
        self, num_layers: int, num_units: int, window_tokens: int, device: torch.device | str
    ) -> None:
        if window_tokens <= 0:
            raise ValueError(f"window_tokens must be > 0, got {window_tokens}")
        self.window_tokens = window_tokens
        self.tokens_since_fired = torch.zeros(num_layers, num_units, dtype=torch.int64, device=device)

    def update(self, fire_counts: torch.Tensor, tokens: torch.Tensor | int) -> None:
        """One optimizer step: `fire_counts` [L, H] and `tokens` summed over micro-batches and ranks."""
        fired = fire_counts.to(self.tokens_since_fired.device) > 0
        self.tokens_since_fired.add_(tokens).masked_fill_(fired, 0)

    def dead_mask(self) -> torch.Tensor:
        """[L, H] bool: units that have not fired for at least `window_tokens` tokens."""
        return self.tokens_since_fired >= self.window_tokens

    def dead_fraction(self) -> torch.Tensor:
        """[L] float32: share of each layer's units that are dead."""
        return self.dead_mask().float().mean(-1)

    def reset(self, units: torch.Tensor) -> None:
        """Restart the counters of `units` ([L, H] bool), e.g. after they were re-initialised."""
        self.tokens_since_fired.masked_fill_(units.to(self.tokens_since_fired.device), 0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        # CPU copies: the trainer saves these with safetensors next to the model.
        return {_STATE_KEY: self.tokens_since_fired.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        counters = state[_STATE_KEY]
        if counters.shape != self.tokens_since_fired.shape:
            raise ValueError(
                f"dead-unit tracker state has shape {tuple(counters.shape)}, "
                f"expected {tuple(self.tokens_since_fired.shape)} (layers, intermediate size)"
            )
        self.tokens_since_fired.copy_(counters)
