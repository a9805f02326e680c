"""The model's weights as a state dict to save, and loading one back (tied weights stored once)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


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


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, with the file given the mode the process's umask gives any other
    file (save_file creates it 0600, unreadable to the rest of a team that shares the run)."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    Path(path).chmod(0o666 & ~umask)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into `model`; a tied lm_head may be absent. Raises on any other mismatch."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
