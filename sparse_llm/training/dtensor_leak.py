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
leaks. The key decides which schemas share a cached sharding decision: a key coarser than torch's
would hand one schema another's sharding. So the fix is applied only where the Python key equals
the installed helper's on a matrix of argument kinds (`key_matches_torch`), checked each time before
patching: torch 2.11 and 2.12 (2.10's helper ignores strategy arguments; it keeps its leak, with a
warning). tests/training/test_dtensor_leak.py checks the key on an FSDP2 step's schemas too.
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor._op_schema import OpSchema

logger = logging.getLogger(__name__)

FIRST_LEAKING, FIRST_FIXED = (2, 10), (2, 13)  # torch releases of the leaking helper


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    major, minor = (int(part) for part in version.split(".")[:2])
    return major, minor


def torch_leaks(version: str = torch.__version__) -> bool:
    """Whether this torch release has the leaking key helper."""
    return FIRST_LEAKING <= torch_release(version) < FIRST_FIXED


# From 2.12 on, torch keys an argument that is None (an absent optional tensor) wherever it sits, so
# that op(a, b, None) and op(a, None, b) differ (pytorch#178348); 2.11 keys it only past the
# op's static index.
KEYS_BARE_NONE = torch_release() >= (2, 12)


@functools.cache  # imported once, not at every schema built
def _tensor_like() -> tuple[type, ...]:
    from torch.distributed.tensor._op_schema import DTensorSpec, OpStrategy, TupleStrategy

    return DTensorSpec, OpStrategy, TupleStrategy


def _hashed_arg(arg: object, tensor_like: tuple[type, ...]) -> bool:
    """Whether an argument below the op's static index goes into the key: a tensor's spec or
    strategy, or a list of them (None allowed in it), and from 2.12 on a bare None."""
    if isinstance(arg, tensor_like) or (arg is None and KEYS_BARE_NONE):
        return True
    return isinstance(arg, list) and all(e is None or isinstance(e, tensor_like) for e in arg)


def comparison_key(schema: OpSchema) -> tuple[object, ...]:
    """The key torch's C++ helper gives an OpSchema: the operator, the arguments that decide its
    sharding (lists as tuples), and, where the op names some, those keyword arguments."""
    args = schema.args_schema
    if not isinstance(args, tuple):
        raise TypeError(f"an OpSchema's args_schema must be a tuple, got {type(args).__name__}")
    info = schema.schema_info
    static_argnum = info.static_argnum if info is not None else len(args)
    static_kwargkey = info.static_kwargkey if info is not None else None
    tensor_like = _tensor_like()
    hashed = tuple(
        tuple(arg) if isinstance(arg, list) else arg
        for i, arg in enumerate(args)
        if i >= static_argnum or _hashed_arg(arg, tensor_like)
    )
    if static_kwargkey is None:
        return (schema.op, hashed)
    return (schema.op, hashed, tuple(schema.kwargs_schema.get(key) for key in static_kwargkey))


def _set_comparison_key(schema: OpSchema) -> None:
    """OpSchema's post-init and key refresh, in Python: the key is all torch's helper sets."""
    schema._comparison_key = comparison_key(schema)


def key_matches_torch() -> bool:
    """Whether `comparison_key` equals torch's own helper's key on every ordered pair of the argument
    kinds a schema holds (None, a number, a spec, a tuple or list of specs, a list with None, a list
    of numbers, a strategy, a tuple strategy, a list of strategies, a nested list), under each kind of
    op information (none, a static index, static keyword arguments, pytree): 400 schemas, a few
    milliseconds at start-up. No process group is needed: the helper looks at the arguments' types
    only."""
    from torch._C import _DTensor_OpSchema_post_init as torch_post_init
    from torch.distributed.tensor._op_schema import (
        DTensorSpec,
        OpSchema,
        OpStrategy,
        RuntimeSchemaInfo,
        TupleStrategy,
    )

    spec, strategy = object.__new__(DTensorSpec), OpStrategy([])
    kinds = [
        None,
        1,
        spec,
        (spec,),
        [spec, None],
        [1],
        strategy,
        TupleStrategy([strategy]),
        [strategy],
        [[spec]],
    ]
    infos = [
        None,
        RuntimeSchemaInfo(1),
        RuntimeSchemaInfo(1, static_kwargkey=["k"]),
        RuntimeSchemaInfo(needs_pytree=True),
    ]
    for info, args in itertools.product(infos, itertools.product(kinds, repeat=2)):
        schema = object.__new__(OpSchema)  # its fields set by hand: no post-init of either kind
        schema.op, schema.args_schema, schema.kwargs_schema = torch.ops.aten.add.Tensor, args, {"k": 2}
        schema.schema_info = info
        torch_post_init(schema)
        if comparison_key(schema) != schema._comparison_key:
            return False
    return True


def fix_dtensor_op_schema_leak() -> bool:
    """On a leaking torch whose key `comparison_key` reproduces, make every OpSchema compute its key
    in Python from now on (the two entry points of torch's `_op_schema` module to the C++ helper
    rebound, for the whole process); whether it did."""
    if not torch_leaks():
        return False
    import torch.distributed.tensor._op_schema as op_schema

    if op_schema._DTensor_OpSchema_post_init is _set_comparison_key:
        return True
    if not key_matches_torch():
        logger.warning(
            "torch %s leaks a few Python objects per DTensor operator call (pytorch#181761) and its "
            "operator keys differ from this package's: left as is; torch 2.13 fixes the leak",
            torch.__version__,
        )
        return False
    op_schema._DTensor_OpSchema_post_init = _set_comparison_key
    op_schema._DTensor_OpSchema_recompute_comparison_key = _set_comparison_key
    logger.info(
        "torch %s: DTensor's operator keys computed in Python (the C++ helper leaks; pytorch#181761)",
        torch.__version__,
    )
    return True
