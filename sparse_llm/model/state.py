"""The model's weights as a state dict to save, and loading one back (tied weights stored once)."""

from __future__ import annotations

import json
import math
import os
import struct
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


# Bytes per element of safetensors' dtypes.
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors a safetensors file holds, read from its header alone, after
    checking that the header parses and that the tensors' byte ranges, by their dtypes and shapes,
    tile the data exactly to the end of the file (what a truncated or overwritten file fails).
    Raises ValueError saying what is wrong."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"has {size} bytes, too few for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > min(SAFETENSORS_MAX_HEADER, size - 8):
            raise ValueError(f"names a {length}-byte header in a file of {size} bytes (truncated?)")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"has an unreadable header ({err})") from None
    if not isinstance(header, dict):
        raise ValueError("has a header that is not a JSON object")
    header.pop("__metadata__", None)
    shapes, ranges = {}, []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            expected = SAFETENSORS_DTYPE_BYTES[dtype] * math.prod(shape)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"has an unreadable header entry for {name}") from None
        if end - begin != expected:
            raise ValueError(
                f"has {end - begin} bytes for {name}, whose {dtype} {list(shape)} needs {expected}"
            )
        shapes[name] = shape
        ranges.append((begin, end))
    position = 0
    for begin, end in sorted(ranges):
        if begin != position:
            raise ValueError("has tensors whose byte ranges overlap or leave gaps")
        position = end
    if 8 + length + position != size:
        raise ValueError(f"has {size} bytes where its header describes {8 + length + position} (truncated?)")
    return shapes


class StateMismatch(RuntimeError):
    """A state dict whose tensor names or shapes are not the model's."""


def state_mismatch(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], optional: set[str] = frozenset()
) -> str | None:
    """What keeps a state of tensors `found` ({name: shape}) from loading into a model whose state
    is `expected`, in one line (a few names of each kind, and how many there are); None when it
    fits. `optional` names may be absent (a tied lm_head, stored once as the embedding)."""
    missing = [k for k in expected if k not in found and k not in optional]
    unexpected = [k for k in found if k not in expected]
    shapes = [
        f"{k} {list(found[k])} (the model's: {list(expected[k])})"
        for k in expected
        if k in found and tuple(found[k]) != tuple(expected[k])
    ]
    problems = [
        f"{len(names)} {kind}: {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
        for kind, names in (("of another shape", shapes), ("missing", missing), ("unexpected", unexpected))
        if names
    ]
    return "; ".join(problems) or None


def model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def tied_names(model: nn.Module) -> set[str]:
    """The state-dict names a saved state may leave out: the tied lm_head."""
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into `model`; a tied lm_head may be absent. Any other mismatch of names or
    shapes is a StateMismatch naming the tensors, raised before anything is copied."""
    problem = state_mismatch(
        model_shapes(model), {k: tuple(v.shape) for k, v in state.items()}, tied_names(model)
    )
    if problem is not None:
        raise StateMismatch(f"the weights do not match the model: {problem}")
    model.load_state_dict(state, strict=False)
