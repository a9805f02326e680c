"""A tiny run config shared by the tests that train (a few seconds on a laptop CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sparse_llm.config import RunConfig, load_config, to_yaml

TINY_MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
TINY_TRAIN = dict(
    seq_len=32,
    global_batch_size=4,
    micro_batch_size=2,
    max_steps=6,
    lr=3e-3,
    warmup_steps=2,
    log_every=1,
    eval_every=0,
    eval_batches=2,
    checkpoint_every=0,
    export=False,
    progress=False,
)


def tiny_run_config(
    run_dir: Path,
    *,
    sparsity: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    max_documents: int = 300,
    prefetch: int | None = 0,
    **train: Any,
) -> RunConfig:
    """The tiny model on the embedded data, wandb off; `model` overrides TINY_MODEL keys, `train`
    TINY_TRAIN keys."""
    return load_config(
        {
            "run_dir": str(run_dir),
            "model": {**TINY_MODEL, **(model or {})},
            "data": dict(max_documents=max_documents, prefetch=prefetch),
            "train": {**TINY_TRAIN, **train},
            "sparsity": {"l1_coeff": 1e-3, "plots": False, **(sparsity or {})},
            "logger": {"wandb": {"mode": "disabled"}},
        }
    )


# The same tiny run as command-line overrides, for tests of the `sparse_llm.train` command (2 steps);
# no end-of-run plots, as in tiny_run_config (matplotlib's import and figures: ~3.5 s a run).
TINY_CLI_OVERRIDES = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "train.seq_len=16",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "train.max_steps=2",
    "train.eval_batches=1",
    "train.progress=false",
    "data.max_documents=100",
    "logger=none",
    "sparsity.plots=false",
]


def train_default_model(run_dir: Path, steps: int = 4, **sparsity: Any) -> Path:
    """`steps` steps of the default model (configs/model/tiny.yaml) on the embedded data, with short
    sequences; the run directory then holds its checkpoint, config.yaml, metrics.jsonl and export."""
    from omegaconf import OmegaConf

    from sparse_llm.config import CONFIG_DIR
    from sparse_llm.training.trainer import Trainer

    model = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "model" / "tiny.yaml"))
    cfg = tiny_run_config(
        run_dir,
        model=model,
        sparsity=sparsity or None,
        max_steps=steps,
        seq_len=64,
        global_batch_size=4,
        micro_batch_size=4,
        lr=3e-3,
        export=True,
    )
    trainer = Trainer(cfg, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(trainer.cfg))  # as sparse_llm.train writes it
    trainer.fit()
    return run_dir
