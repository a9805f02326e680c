"""Load a trained model for inference: an HF export directory or a training checkpoint.

An export directory (written by `sparse_llm.model.hf_export.export_hf`) holds config.json,
model.safetensors and the tokenizer files. A training checkpoint is `<run_dir>/checkpoints/
step_*`; the model config comes from its manifest (the config it was written with) or, for an
older checkpoint, from the run's `config.yaml` (two levels up), and the tokenizer from its
`data.tokenizer`. A run directory is also taken: its latest complete checkpoint.

Before a tensor is read, `inspect_model` checks what it can: a checkpoint's model.safetensors
against the size and SHA-256 its manifest records, an export's against its own header (the
tensors' byte ranges must fill the file exactly), every config file parses, and the weights'
names and shapes are those of the configured model. Any failure is a `DamagedModel` (a
ValueError) naming the file and the problem in one line; the CLIs exit with code 4 for it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerFast

from sparse_llm.config import HIDDEN_ACTS, ModelConfig
from sparse_llm.data import load_tokenizer
from sparse_llm.model import FFNPlan, SparseLlamaForCausalLM
from sparse_llm.model.state import (
    load_model_state,
    model_shapes,
    safetensors_shapes,
    state_mismatch,
    tied_names,
)
from sparse_llm.run_files import (
    CHECKPOINT_MANIFEST,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    STEP_DIR,
    file_problem,
    latest_checkpoint,
    list_checkpoints,
    recorded_files,
)

WEIGHTS_FILE = "model.safetensors"
CONFIG_KEY = "config"  # a checkpoint manifest's record of its run's config (training.checkpoint)


class DamagedModel(ValueError):
    """A model directory whose files are damaged or do not fit together: a truncated or altered
    weights file, a config that does not parse, weights of another model."""


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
    missing = [
        key
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
        if key not in config
    ]
    if missing:
        raise DamagedModel(f"config.json has no {', '.join(missing)}")
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


def _model_config(section: Any, where: Path) -> ModelConfig:
    """ModelConfig from a run config's `model` section (keys this version does not know dropped)."""
    if not isinstance(section, dict):
        raise DamagedModel(f"{where} has no model section")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in section.items() if k in known})
    except TypeError as err:
        raise DamagedModel(f"{where}: its model section does not read ({err})") from None


def _run_config(checkpoint: Path) -> tuple[ModelConfig, str]:
    """Model config and tokenizer spec of a checkpoint: those its manifest records, else those of
    `<run_dir>/config.yaml` (run_dir = checkpoint/../..)."""
    manifest = checkpoint / CHECKPOINT_MANIFEST
    recorded = _read_json(manifest).get(CONFIG_KEY)
    if isinstance(recorded, dict):
        return _model_config(recorded.get("model"), manifest), (recorded.get("data") or {}).get(
            "tokenizer", "embedded"
        )
    path = checkpoint.parent.parent / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"no run config at {path}: a checkpoint is loaded with its run's config.yaml "
            f"(two levels above {checkpoint.name}); export the run or restore that file"
        )
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as err:  # YAML's and OmegaConf's errors alike: the file does not read
        raise DamagedModel(f"{path} does not read as YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict):
        raise DamagedModel(f"{path} is not a mapping of settings")
    tokenizer = (raw.get("data") or {}).get("tokenizer", "embedded")
    return _model_config(raw.get("model"), path), tokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DamagedModel(f"{path} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise DamagedModel(f"{path} is not a JSON object")
    return value


@dataclass
class ModelFiles:
    """A model directory, read and checked up to (not including) its tensors."""

    source: str  # "export" or "checkpoint"
    directory: Path
    config: ModelConfig  # vocab_size from the weights where the config leaves it 0
    tokenizer: str  # load_tokenizer's spec: the export directory, or the run's data.tokenizer
    eos: Any  # config.json's eos_token_id (an export), else None: the tokenizer's

    @property
    def weights(self) -> Path:
        return self.directory / WEIGHTS_FILE


def inspect_model(path: str | Path) -> ModelFiles:
    """Find the model at `path` (an export, a checkpoint, a run directory) and check everything
    but its tensors' values (see the module docstring). Raises FileNotFoundError or
    NotADirectoryError for a path that holds no model, DamagedModel for one whose files are
    damaged or disagree, ValueError for a model this package does not run."""
    given = Path(path).expanduser()
    source, directory = detect_source(given)
    try:
        return _inspect(source, directory)
    except DamagedModel as err:
        older = (
            [p for p in list_checkpoints(directory.parent) if p != directory] if directory != given else []
        )
        if not older:
            raise
        raise DamagedModel(f"{err} (the run's previous checkpoint: {older[-1]})") from None


def _inspect(source: str, directory: Path) -> ModelFiles:
    weights = directory / WEIGHTS_FILE
    if source == "export":
        hf_config = _read_json(directory / "config.json")
        try:
            cfg = model_config_from_hf(hf_config)
        except DamagedModel as err:
            raise DamagedModel(f"{directory / 'config.json'}: {err}") from None
        tokenizer, eos = str(directory.resolve()), hf_config.get("eos_token_id")
    else:
        try:
            recorded = recorded_files(directory).get(WEIGHTS_FILE)
        except ValueError as err:
            raise DamagedModel(f"{directory}: {err}") from None
        if recorded is not None:  # a checkpoint written before sizes and sums were recorded: none
            problem = file_problem(directory, WEIGHTS_FILE, recorded)
            if problem is not None:
                raise DamagedModel(f"{directory}: {problem}")
        cfg, tokenizer = _run_config(directory)
        eos = None
    try:
        shapes = safetensors_shapes(weights)
    except ValueError as err:
        raise DamagedModel(f"{weights} {err}") from None
    if cfg.vocab_size == 0 and "model.embed_tokens.weight" in shapes:
        cfg = dataclasses.replace(cfg, vocab_size=shapes["model.embed_tokens.weight"][0])
    cfg = dataclasses.replace(cfg, ffn_impl="dense", attn_impl="sdpa")
    what = "config.json" if source == "export" else "run config"
    try:
        with torch.device("meta"):
            model = SparseLlamaForCausalLM(cfg, FFNPlan.dense())
    except (TypeError, ValueError, RuntimeError, ZeroDivisionError) as err:
        raise DamagedModel(f"{directory}: the model its {what} describes cannot be built ({err})") from None
    problem = state_mismatch(model_shapes(model), shapes, tied_names(model))
    if problem is not None:
        raise DamagedModel(f"{weights} does not hold the model its {what} describes: {problem}")
    return ModelFiles(source, directory, cfg, tokenizer, eos)


def load_model(
    path: str | Path,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "auto",
    ffn: str | dict[str, str] = "dense",
) -> LoadedModel:
    """Read config, weights and tokenizer; the model is in eval mode on `device` in `dtype`, with
    the FFN plan resolved from `ffn` (one value of ops.ffn.select for every phase, or one per phase).
    The files are checked first (`inspect_model`): a damaged model is a DamagedModel."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    files = inspect_model(path)
    cfg, directory = files.config, files.directory
    try:
        tokenizer = load_tokenizer(files.tokenizer)
    except Exception as err:
        if files.source != "export":
            raise  # the run's data.tokenizer: load_tokenizer's own errors
        reason = " ".join(str(err).split()) or type(err).__name__
        raise DamagedModel(f"{directory}: its tokenizer files do not load ({reason})") from None
    try:
        state = load_file(files.weights)
    except Exception as err:  # changed since inspect_model read it: safetensors' own error, in a line
        raise DamagedModel(f"{files.weights} does not load ({' '.join(str(err).split())})") from None
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
    eos = files.eos if files.eos is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return LoadedModel(model, tokenizer, files.source, directory, eos_ids)
