"""Structured config schema and start-up validation.

Hydra composes the YAML files under `configs/`; `load_config` merges the result onto these
dataclasses (so an unknown key or a wrong type is rejected with the key's name) and then
checks the cross-field rules. Everything here runs before any model or data is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

# The FFN implementations (sparse_llm.ops.select says what each means and picks what runs).
FFN_IMPLS = ("auto", "dense", "reference", "cuda")
ATTN_IMPLS = ("sdpa", "flash")
DATA_SOURCES = ("embedded", "files", "hub")
PRECISIONS = ("auto", "bf16", "fp32")
WANDB_MODES = ("auto", "online", "offline", "disabled")


class ConfigError(ValueError):
    """A configuration problem, reported before any compute."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = 0  # 0: take the tokenizer's vocabulary size
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 0  # 0: same as num_attention_heads (multi-head attention)
    max_position_embeddings: int = 2048
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    ffn_impl: str = "dense"
    # ffn_impl=cuda: a layer whose measured density (L0 / H) exceeds this trains with the dense FFN
    # until it is sparse again (sparse_llm.training.ffn_fallback); from benchmark_ffn.py --train.
    ffn_dense_above: float = 0.01
    attn_impl: str = "sdpa"


@dataclass
class DataConfig:
    name: str = "embedded"
    source: str = "embedded"  # embedded (Python stdlib sources), files, hub
    paths: list[str] = field(default_factory=list)  # files: jsonl / parquet / txt paths or globs
    hub_id: str | None = None  # hub: dataset id, e.g. HuggingFaceFW/fineweb-edu
    hub_config: str | None = None  # hub: dataset config name, e.g. sample-10BT
    hub_split: str = "train"
    text_field: str = "text"
    tokenizer: str = "embedded"  # "embedded", a local directory, or a hub id
    val_fraction: float = 0.02  # share of documents held out for validation (by content hash)
    max_documents: int = 0  # > 0: read only the first N documents (rows) of the source
    # Training batches read ahead by a background thread (0: read in the loop); None: 2 on a GPU
    # (measured +3.7% tokens/s on the 1b preset, H200), 0 on CPU (there the thread takes cores
    # from the model's compute: ~5% slower on 2 cores).
    prefetch: int | None = None


@dataclass
class TrainConfig:
    seq_len: int = 256
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per forward pass on one rank
    max_steps: int = 300
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    precision: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    compile: bool = False
    activation_checkpointing: bool = False
    # RMSNorm outputs recomputed in the backward instead of saved: a [tokens, D] activation per norm
    # less (1b preset at 8 x 2048 tokens: 2.25 GiB dense, 1.13 GiB with ffn_impl=cuda, whose FFN
    # block never saves its norm's output) for 0.6-0.8% of the step time
    # (H100, benchmarks/results/train_1b_recompute_h100.md).
    recompute_norms: bool = False
    seed: int = 0
    device: str = "auto"  # auto, cpu, cuda
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    checkpoint_every: int = 0  # 0: only the final checkpoint
    keep_last: int = 2
    resume: str = "none"  # none, auto, or a checkpoint directory
    export: bool = True
    progress: bool = True


@dataclass
class ReinitConfig:
    enabled: bool = False
    every: int = 100  # steps between reinitialisations of dead units
    reset_up_down: bool = False  # also re-draw the up_proj rows and down_proj columns of dead units


@dataclass
class SparsityConfig:
    l1_coeff: float = 0.0
    l1_warmup_start: int = 0  # coefficient ramps linearly from 0 at this step ...
    l1_warmup_end: int = 0  # ... to l1_coeff at this step, constant after
    dead_window_tokens: int = 0  # a unit is dead after this many tokens without firing; 0: one global batch
    reinit: ReinitConfig = field(default_factory=ReinitConfig)
    plots: bool = True  # PNG plots of the sparsity curves in the run directory at the end


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto: online if an API key is configured, offline otherwise
    project: str = "sparse-llm"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggerConfig:
    name: str = "default"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class RunConfig:
    run_dir: str | None = None  # None: Hydra's output directory
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # User hooks: entries like {_target_: my_pkg.MyCallback, some_arg: 1} (see training/callbacks.py)
    callbacks: list[Any] = field(default_factory=list)


def load_config(raw: DictConfig | dict[str, Any], world_size: int = 1) -> RunConfig:
    """Merge a composed config onto the schema, validate it, and return typed objects."""
    schema = OmegaConf.structured(RunConfig)
    try:
        merged = OmegaConf.merge(schema, raw)
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).splitlines()[0]
        raise ConfigError(f"config key '{key}': {reason}") from None
    validate(cfg, world_size)
    return cfg


def resolve_config(cfg: RunConfig, tokenizer_vocab: int, world_size: int = 1) -> RunConfig:
    """The config with its derived values filled in (model.vocab_size = 0 takes the tokenizer's
    vocabulary), validated as a whole; a new object, `cfg` is left as it was."""
    model = cfg.model
    if model.vocab_size == 0:
        model = replace(model, vocab_size=tokenizer_vocab)
    elif model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"config key 'model.vocab_size': {model.vocab_size} is smaller than "
            f"the tokenizer's vocabulary ({tokenizer_vocab})"
        )
    resolved = replace(cfg, model=model)
    validate(resolved, world_size)
    return resolved


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"config key '{key}': {value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"config key '{key}': must be > 0, got {value}")


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Cross-field checks; each failure names the offending key."""
    m, d, t, s = cfg.model, cfg.data, cfg.train, cfg.sparsity
    _choice("model.ffn_impl", m.ffn_impl, FFN_IMPLS)
    _choice("model.attn_impl", m.attn_impl, ATTN_IMPLS)
    _choice("data.source", d.source, DATA_SOURCES)
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.device", t.device, ("auto", "cpu", "cuda"))
    _choice("logger.wandb.mode", cfg.logger.wandb.mode, WANDB_MODES)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _positive(f"model.{key}", getattr(m, key))
    if d.prefetch is not None and d.prefetch < 0:
        raise ConfigError(f"config key 'data.prefetch': must be >= 0, got {d.prefetch}")
    if not 0 < m.ffn_dense_above <= 1:
        raise ConfigError(f"config key 'model.ffn_dense_above': must be in (0, 1], got {m.ffn_dense_above}")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"config key 'model.num_attention_heads': {m.num_attention_heads} heads do not divide "
            f"model.hidden_size={m.hidden_size}"
        )
    if (m.hidden_size // m.num_attention_heads) % 2:
        raise ConfigError("config key 'model.num_attention_heads': head dimension must be even for RoPE")
    kv_heads = m.num_key_value_heads or m.num_attention_heads
    if m.num_attention_heads % kv_heads:
        raise ConfigError(
            f"config key 'model.num_key_value_heads': {kv_heads} does not divide "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    for key in ("seq_len", "global_batch_size", "micro_batch_size", "max_steps", "lr", "log_every"):
        _positive(f"train.{key}", getattr(t, key))
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"config key 'train.seq_len': {t.seq_len} exceeds "
            f"model.max_position_embeddings={m.max_position_embeddings}"
        )
    per_step = t.micro_batch_size * world_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"config key 'train.global_batch_size': {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size x world size = {t.micro_batch_size} x {world_size}"
        )
    if t.keep_last < 1:
        raise ConfigError("config key 'train.keep_last': must keep at least 1 checkpoint")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"config key 'data.val_fraction': must be in [0, 1), got {d.val_fraction}")
    if d.source == "files":
        if not d.paths:
            raise ConfigError("config key 'data.paths': data.source=files needs at least one path")
        for pattern in d.paths:
            if not _glob_matches(pattern):
                raise ConfigError(f"config key 'data.paths': no file matches {pattern!r}")
    if d.source == "hub" and not d.hub_id:
        raise ConfigError("config key 'data.hub_id': data.source=hub needs a dataset id")
    if not d.tokenizer:
        raise ConfigError("config key 'data.tokenizer': a tokenizer is required")
    if _looks_like_path(d.tokenizer) and not Path(d.tokenizer).expanduser().exists():
        raise ConfigError(f"config key 'data.tokenizer': no tokenizer at {d.tokenizer!r}")
    if s.l1_coeff < 0:
        raise ConfigError(f"config key 'sparsity.l1_coeff': must be >= 0, got {s.l1_coeff}")
    if s.dead_window_tokens < 0:
        raise ConfigError("config key 'sparsity.dead_window_tokens': must be >= 0")
    if s.reinit.enabled and s.reinit.every <= 0:
        raise ConfigError("config key 'sparsity.reinit.every': must be > 0 when reinit is enabled")
    if s.l1_warmup_end < s.l1_warmup_start:
        raise ConfigError("config key 'sparsity.l1_warmup_end': must be >= sparsity.l1_warmup_start")
    if t.resume not in ("none", "auto") and not Path(t.resume).expanduser().is_dir():
        raise ConfigError(f"config key 'train.resume': no checkpoint directory at {t.resume!r}")


def _looks_like_path(name: str) -> bool:
    """Hub ids look like 'org/name'; local tokenizers are given as paths."""
    return name != "embedded" and (name.startswith((".", "/", "~")) or Path(name).expanduser().exists())


def _glob_matches(pattern: str) -> bool:
    path = Path(pattern).expanduser()
    if path.exists():
        return True
    anchor = Path(path.anchor) if path.is_absolute() else Path(".")
    relative = str(path.relative_to(path.anchor)) if path.is_absolute() else str(path)
    return any(anchor.glob(relative))


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
