"""Atomic, data-only checkpoints with keep-last-k and `resume=auto` discovery.

A checkpoint is a directory `step_XXXXXXXX/` holding
  model.safetensors      model weights (a tied lm_head is stored once, as the embedding)
  optimizer.pt           optimizer state: tensors and plain Python values only
  tensors.safetensors    other tensor state: RNG states, the sparsity tracker
  trainer_state.json     step, token count, scheduler and data-loader states, written last
It is written into a hidden temporary directory and renamed into place, so a crash mid-write
leaves only a `.tmp-*` directory that discovery never picks. Loading never unpickles code:
safetensors for weights, `torch.load(weights_only=True)` for the optimizer.

A sharded model (FSDP2: DTensor parameters) is saved instead as `sharded/`, a
torch.distributed.checkpoint (DCP) directory of model and optimizer shards written by every rank
(`save_sharded_state`, collective) in place of model.safetensors and optimizer.pt. DCP reshards on
load, so it resumes on any number of processes; `consolidate_sharded` turns it into one full
model state dict offline, in a single process (for a Hugging Face export).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "trainer_state.json"
SHARDED_DIR = "sharded"


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable trainer state


def model_state_to_save(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with tensors that share storage (tied weights) stored once."""
    seen: dict[int, str] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen[key] = name
        state[name] = tensor.detach().contiguous().cpu()
    return state


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")


def is_sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are sharded DTensors (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def save_sharded_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this rank's shards of model and optimizer into `directory` (DCP). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load model and optimizer shards from a DCP `directory`, resharding as needed. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state on CPU, on rank 0; empty elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def consolidate_sharded(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a sharded checkpoint (`path`: step dir or its `sharded/`).

    Single process, no process group, no GPU: reads every shard from disk.
    """
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = path / SHARDED_DIR if (path / SHARDED_DIR).is_dir() else path
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(directory), str(target))
        full = torch.load(target, map_location="cpu", weights_only=True)
    return {name: tensor for name, tensor in full["model"].items()}


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def sharded_temporary(root: Path, step: int) -> Path:
    """The temporary directory of a sharded checkpoint: a name every rank can compute."""
    return root / f".tmp-{checkpoint_dir_name(step)}-sharded"


def save_checkpoint(root: Path, ckpt: Checkpoint, keep_last: int, tmp: Path | None = None) -> Path:
    """Write `ckpt` and rename it into place. `tmp`: an existing temporary directory that already
    holds the `sharded/` model and optimizer (then `ckpt.model` and `ckpt.optimizer` are empty)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir_name(ckpt.step)
    if tmp is None:
        tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        save_file(ckpt.model, tmp / "model.safetensors", metadata={"format": "pt"})
        torch.save(ckpt.optimizer, tmp / "optimizer.pt")
    save_file({k: v.contiguous().cpu() for k, v in ckpt.tensors.items()}, tmp / "tensors.safetensors")
    (tmp / MANIFEST).write_text(json.dumps({"step": ckpt.step, **ckpt.state}, indent=1))
    for path in tmp.rglob("*"):
        _fsync(path)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _prune(root, keep_last)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST})")
    state = json.loads((path / MANIFEST).read_text())
    sharded = (path / SHARDED_DIR).is_dir()  # model and optimizer: load_sharded_state
    return Checkpoint(
        step=int(state.pop("step")),
        model={} if sharded else load_file(path / "model.safetensors"),
        optimizer={}
        if sharded
        else torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
        tensors=load_file(path / "tensors.safetensors"),
        state=state,
    )


def remove_stale_temporaries(root: Path) -> None:
    """Delete leftovers of writes that crashed; they are never read."""
    if root.is_dir():
        for path in root.glob(".tmp-step_*"):
            shutil.rmtree(path, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    for path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
