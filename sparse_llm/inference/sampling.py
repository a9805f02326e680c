"""Sampling parameters (validated before any compute) and next-token selection.

Selection runs on the device with no host synchronisation (no `.item()`, no data-dependent
shapes), so that a CUDA graph can capture it with the decode step (sparse_llm.inference.decode).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    temperature 0 is greedy decoding (argmax); > 0 samples from softmax(logits / temperature),
    restricted to the `top_k` most likely tokens (0: all) and to the nucleus: the smallest set
    of most likely tokens whose probability reaches `top_p` (1.0: all). `seed` makes sampling
    reproducible (None: a fresh draw from torch's global generator).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set the logits outside the top-k and outside the top-p nucleus to -inf (rows: [B, V]); by
    masked_fill, not `logits[mask] = -inf`, whose boolean index may become a nonzero() (a sync)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep a token while the mass of the tokens before it is below top_p: the smallest
        # prefix whose mass reaches top_p (the most likely token is always kept).
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Next token per row ([B]) from the last-position logits ([B, V])."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    probs = logits.softmax(-1)
    # torch.multinomial(probs, 1, generator=generator) draws one sample as exactly this race
    # (argmax of p / q with q ~ Exp(1), from the same generator: the same tokens, the same
    # generator state after), but first checks the probabilities with two host syncs.
    q = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return probs.div(q).argmax(-1)
