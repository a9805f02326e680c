"""A workaround for a host-memory leak of DTensor (FSDP2) in torch 2.10-2.12.

Every DTensor operator call that builds a Python `OpSchema` has its hash key computed by a C++
helper that, in those releases, keeps one reference too many to the key's tuple of arguments
(pytorch/pytorch#181761, fixed in 2.13 by #181792). The tuple and what it holds are never freed. In
torch 2.11 every call of the fused AdamW, of the foreach ops (`clip_grad_norm_`) and of `stack`
builds one, and the fused AdamW's per-parameter `step` counters are plain tensors that DTensor wraps
in a new spec at each call: the 1b model under FSDP2 kept +838 Python objects a step on an H100
(164 specs of five objects each, one per parameter, and 18 tuples;
benchmarks/results/object_growth_dense_fsdp2_1gpu_h100.md), so a long run's host memory grows and so
does each full garbage collection.

`fix_dtensor_op_schema_leak` makes OpSchema compute the same key in Python, where no reference
leaks. The key decides which schemas share a cached sharding decision, so it must equal torch's
own: tests/training/test_dtensor_leak.py checks it against the C++ helper on the schemas an FSDP2
step builds.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Releases whose C++ helper leaks: from the first with the helper to the first with the fix.
LEAKING = ((2, 10), (2, 13))


def torch_leaks(version: str = torch.__version__) -> bool:
    """Whether this torch release has the leaking key helper."""
    major, minor = (int(part) for part in version.split(".")[:2])
    return LEAKING[0] <= (major, minor) < LEAKING[1]


def _hashed_arg(arg: Any, tensor_like: tuple[type, ...]) -> bool:
    """Whether an argument below the op's static index goes into the key: a tensor's spec or
    strategy, or a list of them (None allowed in it)."""
    if isinstance(arg, tensor_like):
        return True
    return isinstance(arg, list) and all(e is None or isinstance(e, tensor_like) for e in arg)


def comparison_key(schema: Any) -> tuple:
    """The key torch's C++ helper gives an OpSchema: the operator, the arguments that decide its
    sharding (lists as tuples), and, where the op names some, those keyword arguments."""
    from torch.distributed.tensor._op_schema import DTensorSpec, OpStrategy, TupleStrategy

    args = schema.args_schema
    if not isinstance(args, tuple):
        raise TypeError(f"an OpSchema's args_schema must be a tuple, got {type(args).__name__}")
    info = schema.schema_info
    static_argnum = info.static_argnum if info is not None else len(args)
    static_kwargkey = info.static_kwargkey if info is not None else None
    tensor_like = (DTensorSpec, OpStrategy, TupleStrategy)
    hashed = tuple(
        tuple(arg) if isinstance(arg, list) else arg
        for i, arg in enumerate(args)
        if i >= static_argnum or _hashed_arg(arg, tensor_like)
    )
    if static_kwargkey is None:
        return (schema.op, hashed)
    return (schema.op, hashed, tuple(schema.kwargs_schema.get(key) for key in static_kwargkey))


def _set_comparison_key(schema: Any) -> None:
    schema._comparison_key = comparison_key(schema)


def fix_dtensor_op_schema_leak() -> bool:
    """On a leaking torch, make every OpSchema compute its key in Python from now on (the module's
    two entry points to the C++ helper rebound, for the whole process); whether it did."""
    if not torch_leaks():
        return False
    import torch.distributed.tensor._op_schema as op_schema

    if op_schema._DTensor_OpSchema_post_init is _set_comparison_key:
        return True
    op_schema._DTensor_OpSchema_post_init = _set_comparison_key
    op_schema._DTensor_OpSchema_recompute_comparison_key = _set_comparison_key
    logger.info(
        "torch %s: DTensor's operator keys computed in Python (the C++ helper leaks; pytorch#181761)",
        torch.__version__,
    )
    return True
