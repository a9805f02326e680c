"""Entry point: `python -m sparse_llm.train key=value ...` (or the `sparse-llm-train` script).

Hydra composes `configs/config.yaml` with the overrides; the result is validated against the
schema before anything is built. The last line printed is `run_dir: <path>`.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sparse_llm.config import ConfigError, load_config, to_yaml
from sparse_llm.run_files import CONFIG_FILE


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


CONFIG_DIR = config_dir()


def run(raw: DictConfig, run_dir: Path) -> Path:
    """Validate, build and train; returns the run directory."""
    from sparse_llm.training.callbacks import build_callbacks
    from sparse_llm.training.run_info import write_run_info
    from sparse_llm.training.trainer import Trainer

    cfg = load_config(raw)
    callbacks = build_callbacks(cfg.callbacks)
    trainer = Trainer(cfg, run_dir, callbacks)
    if trainer.accelerator.is_main_process:
        # The trainer's config: resolved (vocab size) and validated, the config that runs.
        (run_dir / CONFIG_FILE).write_text(to_yaml(trainer.cfg))
        write_run_info(run_dir, trainer.device, trainer.world_size)
    trainer.fit()
    return run_dir


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_main(raw: DictConfig) -> None:
    # Inside a multirun every job gets its own output directory; a single run uses run_dir.
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    OmegaConf.set_struct(raw, False)
    raw.run_dir = str(run_dir)
    try:
        run(raw, run_dir)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print(f"run_dir: {run_dir}", flush=True)


def main() -> None:
    if not (CONFIG_DIR / "config.yaml").is_file():
        looked = " or ".join(str(d) for d in config_dirs())
        sys.exit(f"error: no Hydra configs (config.yaml) found in {looked}; the install is incomplete")
    _hydra_main()


if __name__ == "__main__":
    main()
