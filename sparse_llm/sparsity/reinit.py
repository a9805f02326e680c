"""Targeted re-initialisation of dead FFN units (docs/design.md section 2).

A dead unit's gate row gets a fresh draw from the model's init distribution, and the AdamW
moments of exactly the re-drawn rows/columns are zeroed, so stale moments do not push the new
weights straight back. Everything else, parameters and optimizer state, stays bit-for-bit.

Under FSDP2 the weights and their moments are DTensors sharded along dim 0: every process draws
the full rows, as a single process would, and writes the part of them its shard holds.
"""

from __future__ import annotations

import torch
from torch import nn

from sparse_llm.model import SparseLlamaForCausalLM


@torch.no_grad()
def reinit_dead_units(
    model: SparseLlamaForCausalLM,
    optimizer: torch.optim.Optimizer,
    dead: torch.Tensor,
    std: float,
    reset_up_down: bool,
    generator: torch.Generator,
) -> int:
    """Re-draw the gate rows (and optionally up rows / down columns) of `dead` [L, H] units.

    Draws come from `generator` in a fixed order (layer by layer: gate, up, down), so ranks
    holding identically seeded generators and the same mask stay identical replicas (or, with
    FSDP2, shards of the weights a single process would have).
    Returns the number of units revived.
    """
    layers = model.model.layers
    hidden = layers[0].mlp.gate_proj.weight.shape[0]
    if dead.shape != (len(layers), hidden):
        raise ValueError(f"dead mask has shape {tuple(dead.shape)}, expected ({len(layers)}, {hidden})")
    dead = dead.cpu()
    revived = 0
    for layer, mask in zip(layers, dead, strict=True):
        units = mask.nonzero().squeeze(1)
        if units.numel() == 0:
            continue
        revived += units.numel()
        mlp = layer.mlp
        _redraw(mlp.gate_proj, units, 0, optimizer, std, generator)
        if reset_up_down:
            _redraw(mlp.up_proj, units, 0, optimizer, std, generator)
            _redraw(mlp.down_proj, units, 1, optimizer, std, generator)
    return revived


def _redraw(
    linear: nn.Linear,
    units: torch.Tensor,
    dim: int,
    optimizer: torch.optim.Optimizer,
    std: float,
    generator: torch.Generator,
) -> None:
    """Fresh normal(0, std) values for slices `units` along `dim` of the weight; zero their moments."""
    weight = linear.weight
    shape = list(weight.shape)
    shape[dim] = units.numel()
    # Drawn whole in float32 on the generator's device, then cast: the same values whatever the
    # parameter's dtype, device or sharding, which keeps the draws identical across ranks and
    # precisions (and the generators of all ranks in step).
    values = torch.randn(shape, generator=generator, device=generator.device, dtype=torch.float32) * std
    local, index, part = _local_units(weight, dim, units)
    local.index_copy_(dim, index, values[part].to(local.device, local.dtype))
    # Per-element state (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad) has the parameter's
    # shape (and sharding); scalars like `step` do not and stay. No state yet (before the first
    # step): nothing to do.
    for value in optimizer.state.get(weight, {}).values():
        if torch.is_tensor(value) and value.shape == weight.shape:
            local, index, _ = _local_units(value, dim, units)
            local.index_fill_(dim, index, 0)


def _local_units(
    tensor: torch.Tensor, dim: int, units: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[slice | torch.Tensor, ...]]:
    """Where this process writes the slices `units` along `dim` of `tensor`.

    Returns the part of `tensor` it holds (all of it, unless `tensor` is a sharded DTensor), the
    local indices along `dim` of the units in that part, and the index that picks the matching
    values out of a tensor shaped like `tensor` but with one slice per unit along `dim`.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        local = tensor.to_local()  # a view of this process's shard: writes land in the parameter
    else:
        shape, offset, local = tuple(tensor.shape), (0,) * tensor.dim(), tensor
    held = (units >= offset[dim]) & (units < offset[dim] + shape[dim])
    part: list[slice | torch.Tensor] = [slice(o, o + n) for o, n in zip(offset, shape, strict=True)]
    part[dim] = held.nonzero().squeeze(1)
    return local, (units[held] - offset[dim]).to(local.device), tuple(part)
