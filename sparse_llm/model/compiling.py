"""torch.compile for training: each decoder layer on its own, and the output head.

Why regional. A layer's training FFN may change path during a run (the per-layer dense fallback,
`FFNBlock.dense_fallback`, set from the measured density). Compiled as one graph, the whole model
guards on every layer's flag, so each flip recompiled all of it (about a minute on the 1b preset)
and dynamo's recompile limit would end compilation for the run. Compiled layer by layer, all
layers share one compiled graph per variant (dynamo treats the layer as an input of the code it
compiled, and guards only on what the code reads: the flag, the phase, whether statistics are
asked for): over a run the compiles are bounded by the variants, not by the flips, and compiling
the 1b preset costs one layer's compile, not eighteen. The layers' forward is compiled rather than
their `__call__`, so hooks of data-parallel wrappers (FSDP2's gathers) stay outside the graph.

The sparse training FFN op (`ops.ffn_block_train`) returns its compact record of the active units,
whose length depends on the data. torch.compile only captures such an op when
`torch._dynamo.config.capture_dynamic_output_shape_ops` is set; by default it breaks the graph at
every FFN layer, and each break costs host time during which the GPU waits. Each compiled region
sets that flag for its own calls only, so it is not left on for the rest of the program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every variant, every region)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def compile_model(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """Compile, in place, the decoder layers' forward and the output head of the
    `SparseLlamaForCausalLM` inside `model` (the model itself, or a data-parallel wrapper around it),
    with `compile_kwargs` for torch.compile, each with the sparse ops' data-dependent record sizes
    captured in its graph instead of breaking it. Returns `model`, whose calls now run them."""
    from sparse_llm.model.llama import SparseLlamaForCausalLM

    cores = [m for m in model.modules() if isinstance(m, SparseLlamaForCausalLM)]
    if len(cores) != 1:
        raise ValueError(
            f"compile_model needs a module holding one SparseLlamaForCausalLM, found {len(cores)}"
        )
    core = cores[0]
    for layer in core.model.layers:
        layer.forward = compile_region(layer.forward, **compile_kwargs)
    core.output = compile_region(core.output, **compile_kwargs)
    return model


def compile_region(fn: Callable[..., Any], **compile_kwargs: Any) -> Callable[..., Any]:
    """`fn` compiled as the trainer compiles a layer: torch.compile with `compile_kwargs`, its calls
    run with the sparse ops' data-dependent sizes captured (a plain torch.compile of a function that
    calls `ops.ffn_block_train` breaks the graph there and runs the op's autograd function eager)."""
    compiled = torch.compile(fn, **compile_kwargs)
    # One patch object for every call: each new one adds a ContextVar to the thread's context for
    # good, so a patch made per call grew the context (and what the garbage collector walks) by
    # one entry a layer a forward, through the whole run.
    dynamic_output_shapes = torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with dynamic_output_shapes:
            return compiled(*args, **kwargs)

    return run
