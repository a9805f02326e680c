"""Structured config schema and start-up validation.

Hydra composes the YAML files under `configs/`; `load_config` merges the result onto these
dataclasses (so an unknown key or a wrong type is rejected with the key's name) and then
checks the cross-field rules. Everything here runs before any model or data is built.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

# The FFN implementations: the ops' own names (sparse_llm.ops.ffn.select.FFN_IMPLS, which says what
# each means and picks what runs), written out here so that the config, and a command line's config
# error, loads without torch (tests/test_config.py checks that the two agree).
FFN_IMPLS = ("auto", "dense", "reference", "cuda")
ATTN_IMPLS = ("sdpa", "flash")
# The FFN's gate activation: relu (the sparse recipe and kernels) or silu (SwiGLU, the dense baseline).
HIDDEN_ACTS = ("relu", "silu")
DATA_SOURCES = ("embedded", "files", "hub")
PRECISIONS = ("auto", "bf16", "fp32")
WANDB_MODES = ("auto", "online", "offline", "disabled")
DEVICES = ("auto", "cpu", "cuda")


# A sparsity target's two forms (SparsityConfig): at most one may be set.
TARGET_KEYS = ("sparsity.target_l0", "sparsity.target_sparsity")
# An unknown key's suggestions: names at least this similar (difflib's ratio), and within the margin
# of the best one.
SUGGEST_CUTOFF = 0.6
SUGGEST_MARGIN = 0.05


class ConfigError(ValueError):
    """A configuration problem, reported before any compute."""


def config_dirs() -> tuple[Path, Path]:
    """Where the Hydra configs may be, in order: the installed package's `configs/` (pyproject.toml
    maps the repository's top-level configs/ there), the checkout's (an editable install)."""
    return (
        Path(str(resources.files("sparse_llm") / "configs")),
        Path(__file__).resolve().parents[1] / "configs",
    )


def config_dir() -> Path:
    """The first of `config_dirs()` that holds config.yaml (the first one if none does)."""
    candidates = config_dirs()
    return next((d for d in candidates if (d / "config.yaml").is_file()), candidates[0])


CONFIG_DIR = config_dir()  # what sparse_llm.train composes, and the eval presets are read from


@dataclass(frozen=True)
class Rule:
    """What a field accepts: a number in a range (finite, the field's type, bounds inclusive or
    not), or one of `choices`. `optional`: None is accepted too."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    optional: bool = False

    def problem(self, value: Any, annotation: str) -> str | None:
        """Why `value` (of a field annotated `annotation`) breaks the rule, or None."""
        if value is None:
            return None if self.optional else "must be set"
        if self.choices is not None:
            return None if value in self.choices else f"{value!r} is not one of {', '.join(self.choices)}"
        wants_int = annotation.startswith("int")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (wants_int and not isinstance(value, int))
        ):
            return f"must be {'an integer' if wants_int else 'a number'}, got {value!r}"
        if not math.isfinite(value):
            return f"must be finite, got {value}"
        in_range = (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )
        if not in_range:
            return f"must be {self.describe()}, got {value}"
        return None

    def describe(self) -> str:
        parts = [
            f"{word} {bound:g}"
            for bound, word in ((self.ge, ">="), (self.gt, ">"), (self.le, "<="), (self.lt, "<"))
            if bound is not None
        ]
        return " and ".join(parts) or "any number"


def checked(default: Any, **rule: Any) -> Any:
    """A dataclass field with its Rule in the metadata: every numeric and choice field of the schema
    has one (tests/test_config.py enumerates the schema and fails on a numeric field without)."""
    return field(default=default, metadata={"rule": Rule(**rule)})


@dataclass
class ModelConfig:
    name: str = "tiny"
    vocab_size: int = checked(0, ge=0)  # 0: take the tokenizer's vocabulary size
    hidden_size: int = checked(256, gt=0)
    intermediate_size: int = checked(704, gt=0)
    num_hidden_layers: int = checked(4, gt=0)
    num_attention_heads: int = checked(4, gt=0)
    num_key_value_heads: int = checked(0, ge=0)  # 0: same as num_attention_heads (multi-head attention)
    max_position_embeddings: int = checked(2048, gt=0)
    rope_theta: float = checked(100000.0, gt=0)
    rms_norm_eps: float = checked(1e-5, gt=0)
    tie_word_embeddings: bool = True
    initializer_range: float = checked(0.02, gt=0)
    hidden_act: str = checked("relu", choices=HIDDEN_ACTS)
    ffn_impl: str = checked("dense", choices=FFN_IMPLS)
    # A sparse training FFN: a layer whose last step's density (L0 / H) exceeds this trains with the
    # dense FFN (recomputed in the backward) until it is sparse again; a fresh run starts dense
    # (sparse_llm.training.ffn_fallback, which says where 3% comes from).
    ffn_dense_above: float = checked(0.03, gt=0, le=1)
    # A sparse training FFN: the units that fired on at least this share of a step's tokens run as a
    # dense FFN over their columns, the others through the sparse op (the same function, faster where
    # few units hold most entries; docs/kernels.md, design review part 5). None: off.
    ffn_hot_share: float | None = checked(None, gt=0, le=1, optional=True)
    attn_impl: str = checked("sdpa", choices=ATTN_IMPLS)


@dataclass
class DataConfig:
    name: str = "embedded"
    source: str = checked("embedded", choices=DATA_SOURCES)  # embedded (Python stdlib sources), files, hub
    paths: list[str] = field(default_factory=list)  # files: jsonl / parquet / txt paths or globs
    hub_id: str | None = None  # hub: dataset id, e.g. HuggingFaceFW/fineweb-edu
    hub_config: str | None = None  # hub: dataset config name, e.g. sample-10BT
    hub_split: str = "train"
    text_field: str = "text"
    tokenizer: str = "embedded"  # "embedded", a local directory, or a hub id
    val_fraction: float = checked(
        0.02, ge=0, lt=1
    )  # share of documents held out for validation (by content hash)
    max_documents: int = checked(0, ge=0)  # > 0: read only the first N documents (rows) of the source
    # Training batches read ahead by a background thread (0: read in the loop); None: 2 on a GPU
    # (measured +3.7% tokens/s on the 1b preset, H200), 0 on CPU (there the thread takes cores
    # from the model's compute: ~5% slower on 2 cores).
    prefetch: int | None = checked(None, ge=0, optional=True)


@dataclass
class TrainConfig:
    seq_len: int = checked(256, gt=0)
    global_batch_size: int = checked(16, gt=0)  # sequences per optimizer step, over all ranks
    micro_batch_size: int = checked(8, gt=0)  # sequences per forward pass on one rank
    max_steps: int = checked(300, gt=0)
    lr: float = checked(2e-3, gt=0)
    min_lr_ratio: float = checked(0.1, ge=0, le=1)
    warmup_steps: int = checked(30, ge=0)
    weight_decay: float = checked(0.1, ge=0)
    beta1: float = checked(0.9, ge=0, lt=1)
    beta2: float = checked(0.95, ge=0, lt=1)
    eps: float = checked(1e-8, gt=0)
    grad_clip: float = checked(1.0, ge=0)
    precision: str = checked("auto", choices=PRECISIONS)  # auto: bf16 on GPU, fp32 on CPU
    compile: bool = False
    activation_checkpointing: bool = False
    # RMSNorm outputs recomputed in the backward instead of saved: a [tokens, D] activation per norm
    # less (1b preset at 8 x 2048 tokens: 2.25 GiB dense, 1.13 GiB with ffn_impl=cuda, whose FFN
    # block never saves its norm's output) for 0.6-0.8% of the step time
    # (H100, benchmarks/results/train_1b_recompute_h100.md).
    recompute_norms: bool = False
    # FSDP2 only: each decoder layer all-gathers the weights of the next this-many layers when its
    # forward starts (the previous ones in the backward), set once when the model is prepared;
    # 0 keeps FSDP2's own order (a layer's all-gather issued when the host reaches that layer). 1:
    # the kernels' 1b run +8-10% tokens/s on 2 x H100, dense unchanged (run_1b_2xh100_prefetch.md).
    fsdp_prefetch: int = checked(1, ge=0)
    # Python's garbage collector runs (its young generations) every this-many steps, on every rank
    # at once, instead of when each process decides (training/garbage.py); 0: Python's own schedule.
    gc_every: int = checked(50, ge=0)
    # Every step the same bits on the same weights and batch (PyTorch's deterministic algorithms:
    # attention by flash's ordered backward instead of cuDNN's), so that a resume is bitwise; slower.
    deterministic: bool = False
    seed: int = checked(0, ge=0)
    device: str = checked("auto", choices=DEVICES)
    log_every: int = checked(10, gt=0)
    eval_every: int = checked(100, ge=0)
    eval_batches: int = checked(4, gt=0)
    checkpoint_every: int = checked(0, ge=0)  # 0: only the final checkpoint
    keep_last: int = checked(2, ge=1)
    resume: str = "none"  # none, auto, or a checkpoint directory
    # A run directory that holds another run (checkpoints, metrics.jsonl, export/) is refused unless
    # this is set; then that run's files are moved to <run_dir>.replaced-<date>_<time>, not deleted.
    overwrite: bool = False
    export: bool = True
    progress: bool = True


@dataclass
class ReinitConfig:
    enabled: bool = False
    every: int = checked(100, gt=0)  # steps between reinitialisations of dead units
    reset_up_down: bool = False  # also re-draw the up_proj rows and down_proj columns of dead units


@dataclass
class L1ControllerConfig:
    """How the L1 coefficient follows `sparsity.target_l0` / `target_sparsity` (sparse_llm/sparsity/
    controller.py; the defaults are justified there)."""

    # Per step, with e = log((L0 + eps) / target_l0), eps = 1% of the target: the integral part
    # log(I) += gain x e, and lambda = I x exp(p_gain x e) (PI; p_gain 0: lambda = I).
    gain: float = checked(0.15, gt=0, le=1)
    p_gain: float = checked(1.0, ge=0, le=10)
    coeff_min: float = checked(1e-8, gt=0)  # the coefficient is clamped to [coeff_min, coeff_max]
    coeff_max: float = checked(1.0, gt=0)
    per_layer: bool = False  # one coefficient per layer, each driven by its own layer's L0
    # With sparsity.reinit: after a reinit that revived units, the integral holds still for this
    # share of the reinit period, while their burst of activity passes (the P term answers it).
    reinit_hold_fraction: float = checked(0.5, ge=0, lt=1)


@dataclass
class SparsityConfig:
    # With a target (target_l0 or target_sparsity), the controller's starting value; else lambda.
    l1_coeff: float = checked(0.0, ge=0)
    l1_warmup_start: int = checked(0, ge=0)  # coefficient ramps linearly from 0 at this step ...
    l1_warmup_end: int = checked(0, ge=0)  # ... to l1_coeff at this step, constant after
    dead_window_tokens: int = checked(
        0, ge=0
    )  # a unit is dead after this many tokens without firing; 0: one global batch
    reinit: ReinitConfig = field(default_factory=ReinitConfig)
    plots: bool = True  # PNG plots of the sparsity curves in the run directory at the end
    # A target instead of a fixed lambda: mean active units per token (the logs' `l0/mean`), or as
    # a sparsity, target_l0 = (1 - target_sparsity) x H. At most one; none: the fixed l1_coeff
    # schedule. The coefficient then adapts every step after l1_warmup_end (`controller`).
    target_l0: float | None = checked(None, gt=0, optional=True)
    target_sparsity: float | None = checked(None, gt=0, lt=1, optional=True)
    controller: L1ControllerConfig = field(default_factory=L1ControllerConfig)

    def resolved_target_l0(self, num_units: int) -> float | None:
        """The target in active units per token for FFNs of `num_units` (H), or None (no target)."""
        if self.target_sparsity is not None:
            return (1.0 - self.target_sparsity) * num_units
        return self.target_l0


@dataclass
class WandbConfig:
    mode: str = checked(
        "auto", choices=WANDB_MODES
    )  # auto: online if an API key is configured, offline otherwise
    project: str = "sparse-llm"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    quiet: bool = True  # wandb's own console output (banner, sync hints) off


@dataclass
class LoggerConfig:
    name: str = "default"
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class DownstreamEvalConfig:
    """Task accuracy through lm-evaluation-harness during training (DownstreamEvalCallback in
    training/callbacks.py; the same evaluation as `sparse-llm-eval`). Presets: configs/eval/."""

    # lm-eval task names or presets (configs/eval/<name>.yaml: paper, quick, offline); empty: off.
    tasks: list[str] = field(default_factory=list)
    # Steps between evaluations, a multiple of train.log_every (the results are logged with that
    # step's record); 0: only after the last step. The last step is always evaluated.
    every: int = checked(0, ge=0)
    limit: int | None = checked(None, gt=0, optional=True)  # examples per task (None: all)
    num_fewshot: int | None = checked(None, ge=0, optional=True)  # None: each task's own default
    batch_size: int = checked(32, gt=0)  # sequences per scoring forward


@dataclass
class EvalConfig:
    name: str = "none"
    downstream: DownstreamEvalConfig = field(default_factory=DownstreamEvalConfig)


@dataclass
class RunConfig:
    run_dir: str | None = None  # None: Hydra's output directory
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sparsity: SparsityConfig = field(default_factory=SparsityConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # User hooks: entries like {_target_: my_pkg.MyCallback, some_arg: 1} (see training/callbacks.py)
    callbacks: list[Any] = field(default_factory=list)


def schema_keys(cls: type = RunConfig, prefix: str = "") -> list[str]:
    """Every key of the schema, dotted, in schema order: each section and each of its fields."""
    keys = []
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if isinstance(f.default_factory, type) and is_dataclass(f.default_factory):
            keys += schema_keys(f.default_factory, f"{key}.")
    return keys


def unknown_key(key: str, extra: Sequence[str] = ()) -> ConfigError:
    """The error for `key`, which neither the schema nor `extra` (top-level names such as config
    groups) has: the closest valid keys (a typo in the name, else the name in another section),
    else the keys its section has."""
    known = list(dict.fromkeys([*schema_keys(), *extra]))
    section, _, name = key.rpartition(".")
    siblings = [k for k in known if k.rpartition(".")[0] == section]
    close = _closest(name, siblings) or _closest(name, known)
    if close:
        hint = f"did you mean {' or '.join(close)}?"
    else:
        names = ", ".join(k.rpartition(".")[2] for k in siblings)
        hint = f"the keys {f'of {section}' if section else 'at the top level'} are {names}"
    return ConfigError(f"config key '{key}' does not exist; {hint}")


def _closest(name: str, keys: Sequence[str]) -> list[str]:
    """The keys whose last part is most like `name`: the best, and any about as good."""
    scored = sorted(
        ((difflib.SequenceMatcher(None, name, k.rpartition(".")[2]).ratio(), k) for k in keys), reverse=True
    )
    if not scored or scored[0][0] < SUGGEST_CUTOFF:
        return []
    return [k for score, k in scored if score >= scored[0][0] - SUGGEST_MARGIN][:3]


@functools.cache
def _schema() -> DictConfig:
    """RunConfig as an OmegaConf schema, built once: building it is most of a load_config (~30 ms)."""
    return OmegaConf.structured(RunConfig)


def load_config(raw: DictConfig | dict[str, Any], world_size: int = 1) -> RunConfig:
    """Merge a composed config onto the schema, validate it, and return typed objects."""
    try:
        merged = OmegaConf.merge(_schema(), raw)  # a new config: the schema is copied, not changed
        cfg: RunConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except ConfigKeyError as err:
        raise unknown_key(str(err.full_key)) from None
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).splitlines()[0]
        raise ConfigError(f"config key '{key}': {reason}") from None
    validate(cfg, world_size)
    return cfg


def prefer_explicit_target(raw: DictConfig, overrides: Sequence[str]) -> None:
    """A sparsity target given on the command line replaces the other form of target that a preset
    set: `sparsity=target sparsity.target_l0=30` holds 30 active units per token instead of the
    preset's target_sparsity. Both forms on the command line are left for `validate` to refuse."""
    given = {o.lstrip("+").split("=", 1)[0] for o in overrides}
    for key, other in (TARGET_KEYS, TARGET_KEYS[::-1]):
        if key in given and other not in given and OmegaConf.select(raw, key) is not None:
            OmegaConf.update(raw, other, None)


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


def check_fields(obj: Any, prefix: str = "") -> None:
    """Every field's own Rule (type, finiteness, range, choices), walking nested configs; the
    first failure is a ConfigError naming the key."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            check_fields(value, f"{key}.")
            continue
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        problem = rule.problem(value, str(f.type))
        if problem is not None:
            raise ConfigError(f"config key '{key}': {problem}")


def validate(cfg: RunConfig, world_size: int = 1) -> None:
    """Each field's rule, then the cross-field checks; each failure names the offending key."""
    check_fields(cfg)
    m, d, t, s = cfg.model, cfg.data, cfg.train, cfg.sparsity
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
    if d.source == "hub" and not d.hub_id:
        raise ConfigError("config key 'data.hub_id': data.source=hub needs a dataset id")
    if not d.tokenizer:
        raise ConfigError("config key 'data.tokenizer': a tokenizer is required")
    if _looks_like_path(d.tokenizer) and not Path(d.tokenizer).expanduser().exists():
        raise ConfigError(f"config key 'data.tokenizer': no tokenizer at {d.tokenizer!r}")
    if s.l1_warmup_end < s.l1_warmup_start:
        raise ConfigError("config key 'sparsity.l1_warmup_end': must be >= sparsity.l1_warmup_start")
    _validate_sparsity_target(s, m.intermediate_size)
    _validate_downstream(cfg.eval.downstream, t, world_size)
    if t.resume not in ("none", "auto") and not Path(t.resume).expanduser().is_dir():
        raise ConfigError(f"config key 'train.resume': no checkpoint directory at {t.resume!r}")
    if t.overwrite and cfg.run_dir is not None and resumes_within(cfg):
        raise ConfigError(
            f"config key 'train.overwrite': it moves the run in {cfg.run_dir} aside, and train.resume="
            f"{t.resume} names one of its checkpoints; set one of them"
        )


def resumes_within(cfg: RunConfig) -> bool:
    """Whether train.resume names a checkpoint inside the run directory (not auto, not none)."""
    if cfg.train.resume in ("none", "auto") or cfg.run_dir is None:
        return False
    resume = Path(cfg.train.resume).expanduser().resolve()
    return resume.is_relative_to(Path(cfg.run_dir).expanduser().resolve())


def _validate_sparsity_target(s: SparsityConfig, num_units: int) -> None:
    c = s.controller
    if c.coeff_min > c.coeff_max:
        raise ConfigError(
            f"config key 'sparsity.controller.coeff_min': {c.coeff_min:g} is above "
            f"sparsity.controller.coeff_max={c.coeff_max:g}"
        )
    if s.target_l0 is not None and s.target_sparsity is not None:
        raise ConfigError(
            "config key 'sparsity.target_sparsity': set sparsity.target_l0 or sparsity.target_sparsity, not both"
        )
    target = s.resolved_target_l0(num_units)
    if target is None:
        return
    key = "sparsity.target_l0" if s.target_l0 is not None else "sparsity.target_sparsity"
    if not 0 < target < num_units:
        raise ConfigError(
            f"config key '{key}': a target of {target:g} active units per token is outside "
            f"(0, model.intermediate_size={num_units})"
        )
    if not c.coeff_min <= s.l1_coeff <= c.coeff_max:
        raise ConfigError(
            f"config key 'sparsity.l1_coeff': with {key} set it is the controller's starting value and "
            f"must be in [sparsity.controller.coeff_min, coeff_max] = [{c.coeff_min:g}, {c.coeff_max:g}], "
            f"got {s.l1_coeff:g}"
        )


def _validate_downstream(d: DownstreamEvalConfig, t: TrainConfig, world_size: int) -> None:
    if not d.tasks:
        return
    if d.every > 0 and d.every % t.log_every:
        raise ConfigError(
            f"config key 'eval.downstream.every': {d.every} is not a multiple of train.log_every="
            f"{t.log_every} (the task metrics are logged with that step's record)"
        )
    if world_size > 1:
        # Scoring on one rank while the others wait in a collective would run into their timeout.
        raise ConfigError(
            "config key 'eval.downstream.tasks': in-loop downstream evaluation runs in a single "
            "process; evaluate a multi-GPU run's checkpoints with sparse-llm-eval instead"
        )
    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "config key 'eval.downstream.tasks': downstream evaluation needs lm-evaluation-harness: "
            "pip install 'sparse-llm[eval]'"
        )


def _looks_like_path(name: str) -> bool:
    """Hub ids look like 'org/name'; local tokenizers are given as paths."""
    return name != "embedded" and (name.startswith((".", "/", "~")) or Path(name).expanduser().exists())


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain JSON-serialisable values (what a checkpoint records)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


# The model settings a checkpoint's weights are made for: a resume with another value of any of
# them is refused. The other settings may change on resume (each change is logged).
ARCHITECTURE_KEYS = tuple(
    f"model.{name}"
    for name in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "tie_word_embeddings",
        "hidden_act",
    )
)
# Keys that name this run's own start, not a setting to compare with the checkpoint's.
NOT_COMPARED_ON_RESUME = ("run_dir", "train.resume", "train.overwrite")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: leaf value} (lists are leaves)."""
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}."))
    return out


@dataclass(frozen=True)
class SettingChange:
    key: str
    recorded: Any  # the checkpoint's value
    configured: Any  # this run's

    def describe(self) -> str:
        return f"{self.key} {self.recorded!r} -> {self.configured!r}"


def compare_with_checkpoint(
    recorded: dict[str, Any], configured: RunConfig
) -> tuple[list[SettingChange], list[SettingChange]]:
    """(architecture changes, other changes) from a checkpoint's recorded config (`to_plain` of
    the resolved config it was written with) to the configured one. Keys that only one of them
    has (a config from another version of the schema) are not compared."""
    theirs, ours = flatten(recorded), flatten(to_plain(configured))
    for side in (theirs, ours):  # 0 key-value heads: as many as attention heads
        if side.get("model.num_key_value_heads") == 0:
            side["model.num_key_value_heads"] = side.get("model.num_attention_heads")
    changes = [
        SettingChange(key, theirs[key], value)
        for key, value in ours.items()
        if key in theirs and key not in NOT_COMPARED_ON_RESUME and theirs[key] != value
    ]
    architecture = [c for c in changes if c.key in ARCHITECTURE_KEYS]
    return architecture, [c for c in changes if c.key not in ARCHITECTURE_KEYS]
