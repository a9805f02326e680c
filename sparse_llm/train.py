"""Entry point: `python -m sparse_llm.train key=value ...` (or the `sparse-llm-train` script).

Hydra composes `configs/config.yaml` with the overrides; the result is validated against the
schema before anything is built or written (the run directory is created only once the config,
the tokenizer and the data have passed). The last line printed is `run_dir: <path>`.

A failure the user can fix ends as one line on stderr and a stable exit code, never a traceback
(`--debug`, or HYDRA_FULL_ERROR=1, shows it):

    2  config       a bad key, value, combination, or FFN implementation that cannot run here
    3  data         no usable text, unreadable or unsupported files, a missing tokenizer
    4  checkpoint   train.resume names a checkpoint that does not verify or does not fit the run
    5  diverged     the loss or the gradient norm became NaN or infinite (no checkpoint written)

Sweeps (`-m key=a,b`) and Hydra's own flags (--cfg, --help, ...) go through Hydra's launcher,
which makes each job's directory itself.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sparse_llm.config import CONFIG_DIR, ConfigError, config_dirs, load_config, to_yaml
from sparse_llm.run_files import CONFIG_FILE

LOG_FILE = "train.log"


def run(raw: DictConfig | dict, run_dir: Path, log_file: bool = False) -> Path:
    """Validate, build and train; returns the run directory. `log_file`: also log to
    <run_dir>/train.log once the run directory exists (Hydra's launcher does it for its jobs)."""
    from sparse_llm.training.callbacks import build_callbacks
    from sparse_llm.training.run_info import write_run_info
    from sparse_llm.training.trainer import Trainer

    cfg = load_config(raw)
    callbacks = build_callbacks(cfg.callbacks)
    trainer = Trainer(cfg, run_dir, callbacks)
    if log_file:
        _log_to_file(run_dir / LOG_FILE)
    if trainer.accelerator.is_main_process:
        # The trainer's config: resolved (vocab size) and validated, the config that runs.
        (run_dir / CONFIG_FILE).write_text(to_yaml(trainer.cfg))
        write_run_info(run_dir, trainer.device, trainer.world_size)
    trainer.fit()
    return run_dir


def _user_errors() -> dict[type[BaseException], int]:
    """The failures a user can fix, and their exit codes (see the module docstring)."""
    from sparse_llm.data import DataError
    from sparse_llm.training.checkpoint import CheckpointError
    from sparse_llm.training.trainer import TrainingDiverged

    return {ConfigError: 2, DataError: 3, FileNotFoundError: 3, CheckpointError: 4, TrainingDiverged: 5}


def _report(err: BaseException) -> int:
    """Print `err` as one line on stderr; its exit code."""
    code = next(c for kind, c in _user_errors().items() if isinstance(err, kind))
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {message}", file=sys.stderr)
    return code


_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _log_to_file(path: Path) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logging.getLogger().addHandler(handler)


def single_run(overrides: list[str], debug: bool = False) -> int:
    """One run from command-line overrides; the process's exit code."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)  # stderr, as Hydra's job logging
    user_errors = tuple(_user_errors())
    try:
        try:
            with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
                raw = compose("config", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(" ".join(str(err).split())) from err
        run_dir = Path(load_config(raw).run_dir)  # validated before anything is written
        run(raw, run_dir, log_file=True)
    except user_errors as err:
        if debug:
            raise
        return _report(err)
    print(f"run_dir: {run_dir}", flush=True)
    return 0


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_main(raw: DictConfig) -> None:
    # A multirun job (or a run with Hydra's own flags): Hydra made the job's directory.
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    OmegaConf.set_struct(raw, False)
    raw.run_dir = str(run_dir)
    try:
        run(raw, run_dir)
    except tuple(_user_errors()) as err:
        sys.exit(_report(err))
    print(f"run_dir: {run_dir}", flush=True)


def main() -> None:
    if not (CONFIG_DIR / "config.yaml").is_file():
        looked = " or ".join(str(d) for d in config_dirs())
        sys.exit(f"error: no Hydra configs (config.yaml) found in {looked}; the install is incomplete")
    args = sys.argv[1:]
    debug = "--debug" in args or os.environ.get("HYDRA_FULL_ERROR") == "1"
    args = [a for a in args if a != "--debug"]
    if any(a.startswith("-") for a in args):  # -m/--multirun, --cfg, --help, ...: Hydra's CLI
        sys.argv = [sys.argv[0], *args]
        _hydra_main()
        return
    sys.exit(single_run(args, debug))


if __name__ == "__main__":
    main()
