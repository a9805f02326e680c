"""A short, quiet training run, for benchmarks that need weights at realistic sparsity."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from sparse_llm.config import load_config, to_yaml
from sparse_llm.training.trainer import Trainer


def short_training_run(
    run_dir: Path,
    model: dict[str, Any],
    train: dict[str, Any],
    sparsity: dict[str, Any],
    data: dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> Trainer:
    """Train with the given config groups on top of quiet defaults (no periodic evaluation or
    checkpoints, no export, no plots, wandb off); `overrides` are dotlist entries applied last.
    Writes `config.yaml` into `run_dir` as the command line does; returns the finished trainer."""
    raw = {
        "run_dir": str(run_dir),
        "model": model,
        "data": data or {},
        "train": {
            "eval_every": 0,
            "eval_batches": 1,
            "checkpoint_every": 0,
            "keep_last": 1,
            "export": False,
            "progress": False,
            **train,
        },
        "sparsity": {"plots": False, **sparsity},
        "logger": {"wandb": {"mode": "disabled"}},
    }
    cfg = load_config(OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides))))
    trainer = Trainer(cfg, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    trainer.fit()
    return trainer
