"""Load a trained model for inference: an HF export directory or a training checkpoint.

An export directory (written by `sparse_llm.model.hf_export.export_hf`) holds config.json,
model.safetensors and the tokenizer files. A training checkpoint is `<run_dir>/checkpoints/
step_*`; the model config comes from the run's `config.yaml` (two levels up) and the tokenizer
from its `data.tokenizer`. A run directory is also taken: its latest complete checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from sparse_llm.config import HIDDEN_ACTS, ModelConfig
from sparse_llm.data import load_tokenizer
from sparse_llm.model import FFNPlan, SparseLlamaForCausalLM
from sparse_llm.model.state import load_model_state
from sparse_llm.run_files import (
    CHECKPOINT_MANIFEST,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    STEP_DIR,
    latest_checkpoint,
)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DTYPES.update({"float16": torch.float16, "fp16": torch.float16})


@dataclass
class LoadedModel:
    model: SparseLlamaForCausalLM
    tokenizer: PreTrainedTokenizerFast
    source: str  # "export" or "checkpoint"
    path: Path
    eos_token_ids: tuple[int, ...]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for but no CUDA device is visible")
    return device


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA (what the TwELL kernels take), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def detect_source(path: Path) -> tuple[str, Path]:
    """("export" | "checkpoint", directory) for an export, a checkpoint or a run directory."""
    if not path.exists():
        raise FileNotFoundError(f"no such model directory: {path}")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; pass an export or checkpoint directory")
    if (path / "config.json").is_file():
        for name in ("model.safetensors",):
            if not (path / name).is_file():
                raise FileNotFoundError(f"export directory {path} has config.json but no {name}")
        return "export", path
    if STEP_DIR.match(path.name):
        if not (path / CHECKPOINT_MANIFEST).is_file():
            raise FileNotFoundError(f"{path} is not a complete checkpoint (no {CHECKPOINT_MANIFEST})")
        if not (path / "model.safetensors").is_file():
            raise FileNotFoundError(f"checkpoint {path} has no model.safetensors")
        return "checkpoint", path
    latest = latest_checkpoint(path / CHECKPOINTS_DIR)
    if latest is not None:
        return "checkpoint", latest
    raise FileNotFoundError(
        f"{path} is neither an export directory (config.json + model.safetensors), a checkpoint "
        f"directory (checkpoints/step_*) nor a run directory with a complete checkpoint"
    )


def model_config_from_hf(config: dict) -> ModelConfig:
    """Our ModelConfig from an exported config.json (LlamaForCausalLM, hidden_act relu or silu)."""
    if config.get("model_type") != "llama":
        raise ValueError(f"config.json: model_type {config.get('model_type')!r} is not llama")
    if config.get("hidden_act") not in HIDDEN_ACTS:
        raise ValueError(
            f"config.json: hidden_act {config.get('hidden_act')!r}; sparse-llm models use {' or '.join(HIDDEN_ACTS)}"
        )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError("config.json: attention or MLP biases are not supported")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"config.json: RoPE scaling {rope} is not supported (default RoPE only)")
    theta = config.get("rope_theta", rope.get("rope_theta", ModelConfig.rope_theta))
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != config["hidden_size"] // heads:
        raise ValueError(f"config.json: head_dim {head_dim} != hidden_size / num_attention_heads")
    return ModelConfig(
        name="export",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        max_position_embeddings=config.get("max_position_embeddings", ModelConfig.max_position_embeddings),
        rope_theta=float(theta),
        rms_norm_eps=config.get("rms_norm_eps", ModelConfig.rms_norm_eps),
        tie_word_embeddings=config.get("tie_word_embeddings", True),
        hidden_act=config["hidden_act"],
    )


def _run_config(checkpoint: Path) -> tuple[ModelConfig, str]:
    """Model config and tokenizer spec from `<run_dir>/config.yaml` (run_dir = checkpoint/../..)."""
    path = checkpoint.parent.parent / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no run config at {path}: a checkpoint is loaded with its run's config.yaml "
            f"(two levels above {checkpoint.name}); export the run or restore that file"
        )
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in (raw.get("model") or {}).items() if k in known}
    tokenizer = (raw.get("data") or {}).get("tokenizer", "embedded")
    return ModelConfig(**model), tokenizer


def load_model(
    path: str | Path,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    ffn: str | dict[str, str] = "dense",
) -> LoadedModel:
    """Read config, weights and tokenizer; the model is in eval mode on `device` in `dtype`, with
    the FFN plan resolved from `ffn` (one value of ops.ffn.select for every phase, or one per phase)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    source, directory = detect_source(Path(path).expanduser())
    if source == "export":
        config = json.loads((directory / "config.json").read_text())
        cfg = model_config_from_hf(config)
        tokenizer = load_tokenizer(str(directory.resolve()))
        eos = config.get("eos_token_id")
    else:
        cfg, tokenizer_spec = _run_config(directory)
        tokenizer = load_tokenizer(tokenizer_spec)
        eos = None
    state = load_file(directory / "model.safetensors")
    if cfg.vocab_size == 0:
        cfg = dataclasses.replace(cfg, vocab_size=state["model.embed_tokens.weight"].shape[0])
    cfg = dataclasses.replace(cfg, ffn_impl="dense", attn_impl="sdpa")
    plan = FFNPlan.resolve(ffn, cfg, device, dtype, where="ffn")
    with torch.device("meta"):
        model = SparseLlamaForCausalLM(cfg, plan)
    model.to_empty(device="cpu")
    # to_empty leaves buffers uninitialised; the RoPE tables are not in the checkpoint.
    model.model.rotary_emb.reset_tables()
    load_model_state(model, state)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # .to(dtype) also rounds the RoPE cos/sin tables to `dtype`: what the rotary would cast them to.
    model = model.to(device=device, dtype=dtype).eval()
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return LoadedModel(model, tokenizer, source, directory, eos_ids)
