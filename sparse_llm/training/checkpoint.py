"""Atomic, data-only checkpoints with keep-last-k and `resume=auto` discovery.

A checkpoint is a directory `step_XXXXXXXX/` holding
  model.safetensors      model weights (a tied lm_head is stored once, as the embedding)
  optimizer.pt           optimizer state: tensors and plain Python values only
  tensors.safetensors    other tensor state: RNG states, the sparsity tracker
  trainer_state.json     step, token count, scheduler and data-loader states, written last
It is written into a hidden temporary directory and renamed into place, so a crash mid-write
leaves only a `.tmp-*` directory that discovery never picks. Loading never unpickles code:
safetensors for weights, `torch.load(weights_only=True)` for the optimizer.
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


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(root: Path, ckpt: Checkpoint, keep_last: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir_name(ckpt.step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    save_file(ckpt.model, tmp / "model.safetensors", metadata={"format": "pt"})
    torch.save(ckpt.optimizer, tmp / "optimizer.pt")
    save_file({k: v.contiguous().cpu() for k, v in ckpt.tensors.items()}, tmp / "tensors.safetensors")
    (tmp / MANIFEST).write_text(json.dumps({"step": ckpt.step, **ckpt.state}, indent=1))
    for path in tmp.iterdir():
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
    return Checkpoint(
        step=int(state.pop("step")),
        model=load_file(path / "model.safetensors"),
        optimizer=torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
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
