"""Entry point: `python -m sparse_llm.train key=value ...` (or the `sparse-llm-train` script).

Hydra composes `configs/config.yaml` with the overrides; the result is validated against the
schema before anything is built or written (the run directory is created only once the config,
the tokenizer and the data have passed). The log (this package's lines; other libraries' warnings
only) goes to stderr and to <run_dir>/train.log; the last line printed is `run_dir: <absolute path>`.

A failure the user can fix ends as one line on stderr and a stable exit code, never a traceback
(`--debug`, or HYDRA_FULL_ERROR=1, shows it before that line; the exit code stays):

    2  config       a bad key (with the closest valid names), preset, value, combination, or FFN
                    implementation that cannot run here; a run_dir that holds another run (its
                    checkpoints, metrics.jsonl or export/) while train.resume is none and
                    train.overwrite false
    3  data         data.paths that match no file, a file that is not the text it claims (binary,
                    not UTF-8, not parseable, no text field or column), no usable text, a missing
                    tokenizer
    4  checkpoint   train.resume names a checkpoint that does not verify or does not fit the run
                    (a model setting that differs from the checkpoint's, named with both values),
                    or resume=auto finds checkpoints of which none verifies
    5  diverged     the loss or the gradient norm became NaN or infinite (no checkpoint written)

    75 preempted    SIGTERM, SIGUSR1 or SIGINT: the run stopped after the step in flight and wrote
                    a checkpoint (one log line names it); train.resume=auto continues it. A second
                    signal ends the process at once, by that signal (sparse_llm/training/preemption.py)

Sweeps (`-m key=a,b`) and Hydra's own flags (--cfg, --help, ...) go through Hydra's launcher,
which makes each job's directory itself.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import TextIO

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from sparse_llm.config import (
    CONFIG_DIR,
    ConfigError,
    config_dirs,
    load_config,
    prefer_explicit_target,
    to_yaml,
    unknown_key,
)
from sparse_llm.data.errors import DataError
from sparse_llm.data.file_check import check_files
from sparse_llm.run_files import CONFIG_FILE, LOG_FILE
from sparse_llm.training.preemption import EXIT_PREEMPTED, TrainingPreempted

logger = logging.getLogger("sparse_llm.train")  # not __name__: that is "__main__" under python -m


def run(raw: DictConfig | dict, run_dir: Path, log_file: bool = False) -> Path:
    """Validate, build and train; returns the run directory. `log_file`: also log to
    <run_dir>/train.log once the run directory exists (Hydra's launcher does it for its jobs).
    Raises TrainingPreempted when a signal stopped the run (after its checkpoint)."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    from sparse_llm.training.callbacks import build_callbacks
    from sparse_llm.training.run_info import write_run_info
    from sparse_llm.training.trainer import Trainer

    cfg = load_config(raw)
    callbacks = build_callbacks(cfg.callbacks)
    trainer = Trainer(cfg, run_dir, callbacks)
    handler = _log_to_file(run_dir / LOG_FILE) if log_file else None
    try:
        if trainer.accelerator.is_main_process:
            logger.info("run directory: %s", absolute(run_dir))
            # The trainer's config: resolved (vocab size) and validated, the config that runs.
            (run_dir / CONFIG_FILE).write_text(to_yaml(trainer.cfg))
            write_run_info(run_dir, trainer.device, trainer.world_size, trainer.parallel_setup)
        with logging_redirect_tqdm():  # log lines above the progress bar, not through it
            trainer.fit()
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()
    return run_dir


def absolute(path: Path) -> Path:
    """`path` made absolute and normalised, symbolic links kept (what the user's shell names)."""
    return Path(os.path.abspath(path))


# The errors found before the trainer is needed (the config, the data files) and their exit codes,
# reported without importing it (seconds of imports on a command that fails at once).
_EARLY_ERRORS: dict[type[BaseException], int] = {ConfigError: 2, DataError: 3}


def _user_errors() -> dict[type[BaseException], int]:
    """The failures a user can fix, and their exit codes (see the module docstring). It imports the
    trainer."""
    from sparse_llm.training.checkpoint import CheckpointError
    from sparse_llm.training.trainer import TrainingDiverged

    return {**_EARLY_ERRORS, FileNotFoundError: 3, CheckpointError: 4, TrainingDiverged: 5}


def _report(err: BaseException, debug: bool = False) -> int:
    """Print `err` as one line on stderr (after its traceback with `debug`); its exit code."""
    if debug:
        traceback.print_exception(err)
    errors = _EARLY_ERRORS if isinstance(err, tuple(_EARLY_ERRORS)) else _user_errors()
    code = next(c for kind, c in errors.items() if isinstance(err, kind))
    message = " ".join(str(err).split()) or type(err).__name__
    print(f"error: {message}", file=sys.stderr)
    return code


def _debug() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1"  # what --debug sets (main)


_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _setup_logging() -> None:
    """The console log of a run: this package's INFO lines, only warnings from other libraries
    (configs/config.yaml sets the same for Hydra's jobs), warnings as log lines (stderr)."""
    logging.basicConfig(level=logging.WARNING, format=_LOG_FORMAT)
    logging.getLogger("sparse_llm").setLevel(logging.INFO)
    warnings.showwarning = _log_warning


def _log_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """warnings.showwarning as one log line, without the source line Python echoes after it."""
    logging.getLogger("py.warnings").warning("%s: %s", category.__name__, message)


def _log_to_file(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def _compose(overrides: list[str]) -> DictConfig:
    """Hydra's composition of the configs with `overrides`; its errors as one-line ConfigErrors."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            raw = compose("config", overrides=overrides)
    except MissingConfigException as err:  # model=7b: the group's presets, not Hydra's search path
        group, _, name = (err.missing_cfg_file or "").rpartition("/")
        if not group or err.options is None:
            raise ConfigError(str(err).split("Config search path")[0]) from err
        close = difflib.get_close_matches(name, err.options, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            f"config group '{group}' has no preset {name!r}; {hint}its presets are {', '.join(err.options)}"
        ) from err
    except (HydraException, OmegaConfBaseException) as err:
        # train.max_step=5: Hydra's "use +train.max_step=5" hint leads to the schema's refusal.
        cause = err.__cause__
        if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
            raise unknown_key(str(cause.full_key), _config_groups()) from err
        raise ConfigError(str(err)) from err
    prefer_explicit_target(raw, overrides)
    return raw


def _config_groups() -> list[str]:
    """The config groups of config.yaml's defaults list (model, data, ..., experiment)."""
    defaults = OmegaConf.load(CONFIG_DIR / "config.yaml").get("defaults", [])
    return [name for entry in defaults if isinstance(entry, DictConfig) for name in entry]


def single_run(overrides: list[str], debug: bool = False) -> int:
    """One run from command-line overrides; the process's exit code."""
    _setup_logging()
    try:
        raw = _compose(overrides)
        cfg = load_config(raw)  # validated before anything is written
        run_dir = Path(cfg.run_dir)
        if cfg.data.source == "files":
            check_files(cfg.data)  # the trainer checks them again: here, before its imports
        run(raw, run_dir, log_file=True)
    except TrainingPreempted:  # the trainer logged where its checkpoint is
        print(f"run_dir: {absolute(run_dir)}", flush=True)
        return EXIT_PREEMPTED
    except tuple(_EARLY_ERRORS) as err:  # before _user_errors, which imports the trainer
        return _report(err, debug)
    except tuple(_user_errors()) as err:
        return _report(err, debug)
    print(f"run_dir: {absolute(run_dir)}", flush=True)
    return 0


@hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base="1.3")
def _hydra_main(raw: DictConfig) -> None:
    # A multirun job (or a run with Hydra's own flags): Hydra made the job's directory.
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    warnings.showwarning = _log_warning
    OmegaConf.set_struct(raw, False)
    raw.run_dir = str(run_dir)
    prefer_explicit_target(raw, list(hydra_cfg.overrides.task))
    try:
        run(raw, run_dir)
    except TrainingPreempted:
        print(f"run_dir: {absolute(run_dir)}", flush=True)
        sys.exit(EXIT_PREEMPTED)
    except tuple(_user_errors()) as err:
        sys.exit(_report(err, _debug()))
    print(f"run_dir: {absolute(run_dir)}", flush=True)


def main() -> None:
    if not (CONFIG_DIR / "config.yaml").is_file():
        looked = " or ".join(str(d) for d in config_dirs())
        sys.exit(f"error: no Hydra configs (config.yaml) found in {looked}; the install is incomplete")
    args = sys.argv[1:]
    if "--debug" in args:
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's own errors in full too
    args = [a for a in args if a != "--debug"]
    if any(a.startswith("-") for a in args):  # -m/--multirun, --cfg, --help, ...: Hydra's CLI
        sys.argv = [sys.argv[0], *args]
        _hydra_main()
        return
    sys.exit(single_run(args, _debug()))


if __name__ == "__main__":
    main()
