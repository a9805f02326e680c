"""Atomic, data-only checkpoints with keep-last-k and `resume=auto` discovery.

A checkpoint is a directory `step_XXXXXXXX/` holding
  model.safetensors      model weights (a tied lm_head is stored once, as the embedding)
  optimizer.pt           optimizer state: tensors and plain Python values only
  tensors.safetensors    other tensor state: RNG states, the sparsity tracker
  trainer_state.json     step, token count, scheduler and data-loader states, the run's resolved
                         config (`config`: what a resume checks its model against), written last
It is written into a hidden temporary directory and renamed into place, so a crash mid-write
leaves only a `.tmp-*` directory that discovery never picks. The manifest records the size and
SHA-256 of every other file; `verify_checkpoint` checks them, so a checkpoint damaged after it was
written (a truncated copy, a full disk, bit rot) is detected before it is loaded, and
`resume=auto` falls back to the newest checkpoint that verifies. Loading never unpickles code:
safetensors for weights, `torch.load(weights_only=True)` for the optimizer.

A sharded model (FSDP2: DTensor parameters) is saved instead as `sharded/`, a
torch.distributed.checkpoint (DCP) directory of model and optimizer shards written by every rank
(`save_sharded_state`, collective) in place of model.safetensors and optimizer.pt. DCP reshards on
load, so it resumes under FSDP2 on any number of processes, or in one process without FSDP2;
`consolidate_sharded` turns it into one full
model state dict offline, in a single process (for a Hugging Face export).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from sparse_llm.model.state import load_model_state, model_state_to_save, write_safetensors
from sparse_llm.run_files import CHECKPOINT_MANIFEST as MANIFEST
from sparse_llm.run_files import (
    CONFIG_FILE,
    FILES_KEY,
    checkpoint_dir_name,
    file_problem,
    list_checkpoints,
    recorded_files,
    sha256_file,
)

logger = logging.getLogger(__name__)

SHARDED_DIR = "sharded"
CONFIG_KEY = "config"  # in the manifest: the resolved config of the run that wrote it


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from: incomplete, damaged, or of another kind of run."""


@dataclass
class Checkpoint:
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)  # JSON-serialisable trainer state


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
    with warnings.catch_warnings():  # one process without a process group: loading whole is meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
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
        write_safetensors(ckpt.model, tmp / "model.safetensors")
        torch.save(ckpt.optimizer, tmp / "optimizer.pt")
    write_safetensors({k: v.contiguous().cpu() for k, v in ckpt.tensors.items()}, tmp / "tensors.safetensors")
    manifest = {"step": ckpt.step, **ckpt.state, FILES_KEY: _file_digests(tmp)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in tmp.rglob("*"):
        _fsync(path)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    _prune(root, keep_last)
    return final


def _file_digests(directory: Path) -> dict[str, dict[str, Any]]:
    return {
        str(path.relative_to(directory)): {"size": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path` (one line), or None when every file it records
    has its recorded size and SHA-256. Checkpoints written before files were recorded are only
    checked for their manifest."""
    if not (path / MANIFEST).is_file():
        return f"no {MANIFEST} (an incomplete write)"
    try:
        recorded = recorded_files(path)
    except ValueError as err:
        return str(err)
    for name, expected in recorded.items():
        problem = file_problem(path, name, expected)
        if problem is not None:
            return problem
    return None


def checkpoint_to_resume(root: Path, requested: str) -> Path | None:
    """The checkpoint `train.resume` names: `auto` is the newest under `root` that verifies (each
    newer one that does not is skipped with a warning naming it and why; None when there is none);
    an explicit directory must verify, else CheckpointError."""
    if requested != "auto":
        path = Path(requested)
        problem = verify_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"cannot resume from {path}: {problem}")
        return path
    for path in reversed(list_checkpoints(root)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        logger.warning("resume=auto: skipping %s: %s", path, problem)
    return None


def recorded_config(path: Path) -> dict[str, Any] | None:
    """The resolved config the checkpoint at `path` was written with: the manifest's, or for a
    checkpoint written before the manifest held it, its run's config.yaml (two levels up) if that
    reads; None when neither does."""
    try:
        config = json.loads((path / MANIFEST).read_text()).get(CONFIG_KEY)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if config is not None:
        return config
    run_config = path.parent.parent / CONFIG_FILE
    if not run_config.is_file():
        return None
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(run_config), resolve=True)  # type: ignore[return-value]
    except Exception:  # an unreadable config.yaml: the weights' own check remains
        return None


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MANIFEST})")
    state = json.loads((path / MANIFEST).read_text())
    state.pop(FILES_KEY, None)
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


# --------------------------------------------------------------------------------------------
# A training run's whole state: what the trainer hands over to save and to restore.


@dataclass
class TrainingState:
    """Everything that changes a run's behaviour, as the trainer holds it. A checkpoint holds all
    of it, so a resumed run continues exactly as the uninterrupted one would."""

    model: nn.Module  # the plain (unwrapped) model; its per-layer FFN dense fallback included
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: Any  # the training batch stream: state_dict() / load_state_dict()
    sparsity: Any  # the SparsityMonitor: state_dict() / load_state_dict() of tensors
    reinit_generator: torch.Generator
    device: torch.device
    sharded: bool  # FSDP2: model and optimizer go to `sharded/` (DCP), written by every rank
    # The L1Controller of a run with a sparsity target (None without): JSON state_dict().
    l1_controller: Any = None
    # The last step's scalars, which act after the next step (training/step_scalars.py).
    step_readings: Any = None
    # The run's resolved config as plain values (config.to_plain), recorded in every checkpoint.
    config: dict[str, Any] | None = None


def save_training_state(
    root: Path,
    parts: TrainingState,
    step: int,
    tokens_seen: int,
    world_size: int,
    keep_last: int,
    accelerator: Any,
) -> Path:
    """Checkpoint `parts` at `step` under `root` (collective: every rank calls it; rank 0 writes
    all but the shards). Returns the checkpoint directory."""
    from accelerate.utils import gather_object

    data_state = parts.data.state_dict()
    if world_size > 1 and any(s != data_state for s in gather_object([data_state])):
        raise RuntimeError("data-parallel ranks disagree on the data position; not checkpointing")
    path = root / checkpoint_dir_name(step)
    tmp = None
    if parts.sharded:
        # Every rank writes its shards into a temporary directory all of them can name.
        tmp = sharded_temporary(root, step)
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        save_sharded_state(tmp / SHARDED_DIR, parts.model, parts.optimizer)
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        tensors = {
            "rng/torch_cpu": torch.get_rng_state(),
            "rng/reinit": parts.reinit_generator.get_state(),
        }
        if parts.device.type == "cuda":
            tensors["rng/torch_cuda"] = torch.cuda.get_rng_state(parts.device)
        tensors.update({f"sparsity/{k}": v for k, v in parts.sparsity.state_dict().items()})
        state = {
            "tokens_seen": tokens_seen,
            "world_size": world_size,
            "scheduler": parts.scheduler.state_dict(),
            "data": data_state,  # the global stream's position: the same on every rank
            "ffn_dense_fallback": parts.model.ffn_dense_fallback(),
            "ffn_hot_units": [None if hot is None else hot.tolist() for hot in parts.model.ffn_hot_units()],
        }
        if parts.l1_controller is not None:
            state["l1_controller"] = parts.l1_controller.state_dict()
        if parts.step_readings is not None:
            state["step_readings"] = parts.step_readings.state_dict()
        if parts.config is not None:
            state[CONFIG_KEY] = parts.config
        if parts.sharded:
            checkpoint = Checkpoint(step, {}, {}, tensors, state)
        else:
            checkpoint = Checkpoint(
                step, model_state_to_save(parts.model), parts.optimizer.state_dict(), tensors, state
            )
        path = save_checkpoint(root, checkpoint, keep_last, tmp=tmp)
    accelerator.wait_for_everyone()
    return path


def restore_training_state(path: Path, parts: TrainingState) -> Checkpoint:
    """Load the checkpoint at `path` into `parts` (collective under FSDP2); returns it for the
    trainer's own counters (step, tokens_seen, the world size it was written by)."""
    saved_sharded = (path / SHARDED_DIR).is_dir()
    if parts.sharded and not saved_sharded:
        raise CheckpointError(
            f"{path} is not sharded and this run is (FSDP2): a one-process or DDP checkpoint resumes "
            "without FSDP2"
        )
    ckpt = load_checkpoint(path)
    # Weights or optimizer state of another shape (a checkpoint that recorded no config to check
    # against first) are a checkpoint error, in one line.
    try:
        if saved_sharded:  # DCP reshards: into FSDP2 shards of any count, or whole into one process
            load_sharded_state(path / SHARDED_DIR, parts.model, parts.optimizer)
        else:
            load_model_state(parts.model, ckpt.model)
            parts.optimizer.load_state_dict(ckpt.optimizer)
    except (RuntimeError, ValueError, KeyError) as err:
        reason = " ".join(str(err).split())
        raise CheckpointError(f"cannot resume from {path}: it does not fit the model: {reason}") from err
    parts.scheduler.load_state_dict(ckpt.state["scheduler"])
    parts.data.load_state_dict(ckpt.state["data"])
    # Checkpoints from before the fallback was saved: every layer starts sparse, as they did.
    fallback = ckpt.state.get("ffn_dense_fallback")
    if fallback is not None:
        parts.model.set_ffn_dense_fallback(fallback)
    # Checkpoints from before hot units were saved, or of runs without them: none.
    parts.model.set_ffn_hot_units(
        ckpt.state.get("ffn_hot_units") or [None] * len(parts.model.ffn_hot_units())
    )
    torch.set_rng_state(ckpt.tensors["rng/torch_cpu"])
    parts.reinit_generator.set_state(ckpt.tensors["rng/reinit"])
    if parts.device.type == "cuda" and "rng/torch_cuda" in ckpt.tensors:
        torch.cuda.set_rng_state(ckpt.tensors["rng/torch_cuda"], parts.device)
    # A checkpoint without controller state (written with the fixed schedule): lambda starts
    # again from l1_coeff. Controller state with no target in this run: the fixed schedule.
    controller = ckpt.state.get("l1_controller")
    if parts.l1_controller is not None and controller is not None:
        parts.l1_controller.load_state_dict(controller)
    # Checkpoints from before the scalars were read late: nothing acts after the first step.
    if parts.step_readings is not None:
        parts.step_readings.load_state_dict(ckpt.state.get("step_readings"))
    prefix = "sparsity/"
    parts.sparsity.load_state_dict(
        {k[len(prefix) :]: v for k, v in ckpt.tensors.items() if k.startswith(prefix)}
    )
    return ckpt
