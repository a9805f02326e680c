"""Rotary position embedding (RoPE) as transformers' default Llama rope computes it: the tables of
cos and sin (their application, in the rotate_half convention: sparse_llm.ops.rotary)."""

from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The RoPE inverse frequencies (float32), as transformers' default rope computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def rope_tables(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ([positions, head_dim], float32) of the RoPE angles, as transformers computes them."""
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), rope_inv_freq(head_dim, theta))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE, laid out as in transformers (rotate_half convention).

    cos and sin of every position below `max_positions` are computed once, in float32: a forward
    looks them up. (Computed per forward, Inductor inlined cos and sin into every layer's rotary
    kernel: ~9% of a compiled 1B prefill.)
    """

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        cos, sin = rope_tables(head_dim, theta, max_positions)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def reset_tables(self) -> None:
        """Recompute the tables on their device (e.g. after `to_empty`, which leaves them unset)."""
        cos, sin = rope_tables(self.head_dim, self.theta, self.cos_table.shape[0])
        self.cos_table = cos.to(self.cos_table.device)
        self.sin_table = sin.to(self.sin_table.device)

    def forward(
        self, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """cos, sin shaped to broadcast over token-major q, k ([B, T, heads, head_dim]): [T, 1, head_dim],
        or [B, T, 1, head_dim] for per-row `position_ids` [B, T] (every position below
        max_position_embeddings)."""
        if position_ids is not None:
            cos, sin = self.cos_table[position_ids].unsqueeze(2), self.sin_table[position_ids].unsqueeze(2)
            return cos.to(dtype), sin.to(dtype)
        if seq_len > self.cos_table.shape[0]:
            raise ValueError(
                f"{seq_len} positions exceed max_position_embeddings ({self.cos_table.shape[0]})"
            )
        return self.cos_table[:seq_len, None].to(dtype), self.sin_table[:seq_len, None].to(dtype)
