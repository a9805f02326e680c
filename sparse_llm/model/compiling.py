"""torch.compile for our models: one graph per call, sparse training FFN included.

The sparse training FFN op (`ops.ffn_forward_train`) returns its compact record of the active
units, whose length depends on the data. torch.compile only captures such an op when
`torch._dynamo.config.capture_dynamic_output_shape_ops` is set (or with fullgraph=True); by
default it breaks the graph at every FFN layer, and each break costs a few hundred microseconds
of host time during which the GPU waits (~12 ms per step on the 1b preset). `compile_model` sets
that flag for its own calls only, so it is not left on for the rest of the program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def compile_model(model: nn.Module, **compile_kwargs: Any) -> Callable[..., Any]:
    """torch.compile(model, **compile_kwargs), called with the sparse ops' data-dependent record
    sizes captured in the graph instead of breaking it."""
    compiled = torch.compile(model, **compile_kwargs)

    @functools.wraps(model.forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            return compiled(*args, **kwargs)

    return run
