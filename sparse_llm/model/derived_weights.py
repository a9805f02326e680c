"""Tensors derived from parameters for inference: Wd^T for the sparse FFN kernels, which read a
unit's down projection as a row, and [Wq; Wk; Wv], so that q, k and v come from one GEMM.

A derived tensor is a cache, not state: never saved, made on first use and remade when a source
parameter changes (its address or version), in place where the shape allows, so that a CUDA graph
captured on it keeps a valid address. A graph replays what it captured: weights changed after the
capture reach it only through a new capture. A torch.compile trace reads only a tensor made before
it (`traced`): one made inside the trace would be remade on every replay of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Make = Callable[[Sequence[torch.Tensor], torch.dtype], torch.Tensor]


def transposed(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The one weight's transpose, contiguous."""
    (weight,) = weights
    return weight.to(dtype).t().contiguous()


def stacked_rows(weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weights' rows one after another: x @ result^T is every projection's output, side by side."""
    return torch.cat([w.to(dtype) for w in weights])


class DerivedWeight:
    """`make(weights, dtype)` of some parameters, kept until one of them changes."""

    def __init__(self, make: Make) -> None:
        self._make = make
        self.tensor: torch.Tensor | None = None
        self._key: tuple | None = None

    def get(self, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        key = (*((w.data_ptr(), w._version) for w in weights), dtype)
        if self._key != key:
            with torch.no_grad():
                made = self._make([w.detach() for w in weights], dtype)
            held = self.tensor
            if held is not None and (held.shape, held.dtype, held.device) == (
                made.shape,
                made.dtype,
                made.device,
            ):
                held.copy_(made)
            else:
                self.tensor = made
            self._key = key
        return self.tensor

    def traced(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor made before, in `dtype`, else None (the caller then computes without it)."""
        held = self.tensor
        return held if held is not None and held.dtype == dtype else None
