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
    """`make(weights, dtype)` of some parameters, one tensor per dtype asked for, each kept until
    one of its weights changes. One per dtype: a model run both with and without autocast would
    otherwise swap the tensor, and free the address a captured graph reads."""

    def __init__(self, make: Make) -> None:
        self._make = make
        self._held: dict[torch.dtype, tuple[tuple, torch.Tensor]] = {}  # dtype: (weights' key, tensor)

    def get(self, weights: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        key = tuple((w.data_ptr(), w._version) for w in weights)
        entry = self._held.get(dtype)
        if entry is None or entry[0] != key:
            # Made outside inference mode: an inference tensor could not be refreshed in place
            # later outside it.
            with torch.inference_mode(False), torch.no_grad():
                made = self._make([w.detach() for w in weights], dtype)
                if entry is not None and (entry[1].shape, entry[1].device) == (made.shape, made.device):
                    made = entry[1].copy_(made)
            self._held[dtype] = (key, made)
        return self._held[dtype][1]

    def traced(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The tensor made before, in `dtype` on `device`, else None (the caller then computes
        without it). It is as current as the last `get`: callers refresh before they trace or
        replay (`model.prepare_inference`)."""
        entry = self._held.get(dtype)
        return entry[1] if entry is not None and entry[1].device == device else None
