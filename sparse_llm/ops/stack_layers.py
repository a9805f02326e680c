"""`stack_layers`: torch.stack of per-layer tensors as one opaque op, for the model's statistics.

Why an op: under torch.compile, Inductor lowers `torch.stack` of the layers' statistics into one
small copy kernel per layer and input, launched right after that layer's FFN. On the sparse
training path the FFN op ends with a host read, after which the GPU runs each launch as the host
makes it; three stack copies a layer there were three waits of the GPU on the host (about 50 us a
layer on the 1b preset's profile). As an opaque op the stack is one launch per statistic, after
the last layer. Differentiable (the L1 penalty flows back through the stacked l1 values).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("sparse_llm::stack_layers", mutates_args=())
def stack_layers(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(tensors) (all of one shape, dtype and device) along a new first dimension."""
    return torch.stack(tensors)


@stack_layers.register_fake
def _(tensors):
    first = tensors[0]
    return first.new_empty((len(tensors), *first.shape))


def _setup_context(ctx, inputs, output) -> None:
    (tensors,) = inputs
    ctx.differentiable = [t.requires_grad for t in tensors]


def _backward(ctx, grad: torch.Tensor):
    return ([g if wanted else None for g, wanted in zip(grad.unbind(0), ctx.differentiable, strict=True)],)


stack_layers.register_autograd(_backward, setup_context=_setup_context)
