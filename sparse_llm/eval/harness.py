"""The lm-evaluation-harness side of an evaluation: whether it is installed, which task names and
presets exist, one run of lm-eval's evaluator on a model, and its results as plain numbers.

lm-eval is an optional dependency (`pip install "sparse-llm[eval]"`): this module imports it only
inside its functions, so that `require_lm_eval` can say what is missing in one line. Presets are
the YAML files of the `eval` config group (configs/eval/<name>.yaml: their `downstream.tasks`), so
that `sparse-llm-eval --tasks paper` and the training run's `eval=paper` name the same tasks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from omegaconf import OmegaConf

from sparse_llm.config import CONFIG_DIR
from sparse_llm.eval.tasks import SHIPPED_TASKS, TASK_DIR

NO_PRESET = "none"  # the eval group's "off" entry, not a preset


class LMEvalMissing(ImportError):
    """lm-evaluation-harness is not installed."""


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise LMEvalMissing(
            "downstream evaluation needs lm-evaluation-harness: pip install 'sparse-llm[eval]'"
        )


@dataclass(frozen=True)
class Preset:
    name: str
    tasks: tuple[str, ...]
    limit: int | None
    num_fewshot: int | None


def presets() -> dict[str, Preset]:
    """The task presets: configs/eval/*.yaml but `none`."""
    found = {}
    for path in sorted((CONFIG_DIR / "eval").glob("*.yaml")):
        if path.stem == NO_PRESET:
            continue
        downstream = OmegaConf.load(path).downstream
        found[path.stem] = Preset(
            path.stem, tuple(downstream.tasks), downstream.get("limit"), downstream.get("num_fewshot")
        )
    return found


def expand_tasks(names: Sequence[str]) -> list[str]:
    """Task names with presets replaced by their tasks, each task once, in order."""
    known = presets()
    tasks: list[str] = []
    for name in names:
        for task in known[name].tasks if name in known else (name,):
            if task not in tasks:
                tasks.append(task)
    return tasks


def task_manager(tasks: Sequence[str]) -> Any:
    """An lm-eval TaskManager that knows `tasks`: the shipped tasks' directory, and lm-eval's own
    tasks unless every task is a shipped one (indexing those ~14K configs takes ~13 s of a core).
    When each of the other tasks is named in none of those configs, check_tasks' error comes at
    once instead: no index of them could know these (reading the files' bytes takes ~0.5 s)."""
    require_lm_eval()
    others = [task for task in tasks if task not in SHIPPED_TASKS]
    if others and not _written_in_lm_eval_configs(others):
        raise _unknown_tasks(others)
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=bool(others))


def _written_in_lm_eval_configs(names: Sequence[str]) -> bool:
    """Whether any YAML file of lm-eval's task directory holds the text of any of `names`: lm-eval's
    index takes its task, group and tag names from those files' `task`, `group` and `tag` keys."""
    spec = importlib.util.find_spec("lm_eval")  # its directory, without importing it
    roots = spec.submodule_search_locations if spec is not None else None
    if not roots:
        return False
    needles = [name.encode() for name in names]
    for path in (Path(roots[0]) / "tasks").rglob("*.yaml"):
        text = path.read_bytes()
        if any(needle in text for needle in needles):
            return True
    return False


def _unknown_tasks(unknown: Sequence[str]) -> ValueError:
    return ValueError(
        f"unknown lm-eval task(s) {', '.join(unknown)}; presets: {', '.join(presets())}; "
        f"shipped offline tasks: {', '.join(SHIPPED_TASKS)}"
    )


def check_tasks(tasks: Sequence[str], manager: Any) -> None:
    """A ValueError naming the tasks lm-eval does not know (before any model is loaded)."""
    if not tasks:
        raise ValueError("no tasks to evaluate")
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise _unknown_tasks(unknown)


def fetch_task_data(tasks: Sequence[str], manager: Any, verbose: bool = False) -> None:
    """Load the tasks once, before any model: their data is downloaded (hub tasks) or read, so
    that a machine without the hub fails here, in one line, and each evaluation reads the cache."""
    with lm_eval_logging(verbose):
        try:
            manager.load(list(tasks))
        except OSError as err:  # the hub unreachable, a dataset or file missing
            raise ValueError(f"cannot load the data of task(s) {', '.join(tasks)}: {err}") from err


@contextlib.contextmanager
def lm_eval_logging(verbose: bool) -> Iterator[None]:
    """lm-eval's loggers at WARNING, or at ERROR unless `verbose` (its per-task notes about
    defaults filled in are not the user's to act on); their level restored after."""
    logger = logging.getLogger("lm_eval")
    before = logger.level
    logger.setLevel(logging.WARNING if verbose else logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


@contextlib.contextmanager
def machine_not_described() -> Iterator[None]:
    """simple_evaluate ends by describing the machine in its output: torch's collect_env (~15
    subprocesses: pip list, conda, nvidia-smi, gcc, ...; ~1.5 s of a core per evaluation, and every
    in-loop evaluation of a training run) and the working directory's git hash. Nothing here reads
    them: both are skipped while the block runs."""
    import lm_eval.evaluator

    with (
        mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None),
        mock.patch.object(lm_eval.evaluator, "get_git_commit_hash", lambda: None),
    ):
        yield


@contextlib.contextmanager
def preserved_rng(device: torch.device) -> Iterator[None]:
    """Python's, NumPy's and torch's global random states (the CPU's and `device`'s) restored on
    exit: lm-eval seeds all three, and a training run that evaluates must draw what it would have."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def run_lm_eval(
    lm: Any,
    tasks: Sequence[str],
    manager: Any,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    log_samples: bool = False,
    verbose: bool = False,
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` of the LM instance `lm` on `tasks`: its output as it gives it
    (results per task; the per-request responses under "samples" with `log_samples`), without the
    machine's description (`machine_not_described`)."""
    from lm_eval import simple_evaluate

    with lm_eval_logging(verbose), machine_not_described():
        return simple_evaluate(
            model=lm,
            tasks=list(tasks),
            task_manager=manager,
            limit=limit,
            num_fewshot=num_fewshot,
            log_samples=log_samples,
        )


def task_results(output: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task: {"metrics": {name: value}, "stderr": {name: value or None}, "samples": count,
    "num_fewshot": shots}. lm-eval's keys are "<metric>,<filter>"; the filter is dropped where it
    is lm-eval's "none" and appended as "<metric>_<filter>" elsewhere."""
    results = {}
    for task, entry in output["results"].items():
        metrics, stderr = {}, {}
        for key, value in entry.items():
            if "," not in key:
                continue
            metric, filt = key.split(",", 1)
            is_stderr = metric.endswith("_stderr")
            metric = metric.removesuffix("_stderr")
            name = metric if filt == "none" else f"{metric}_{filt}"
            if is_stderr:
                stderr[name] = _number(value)
            elif _number(value) is not None:
                metrics[name] = float(value)
        results[task] = {
            "metrics": metrics,
            "stderr": {k: v for k, v in stderr.items() if k in metrics},
            "samples": output.get("n-samples", {}).get(task, {}).get("effective"),
            "num_fewshot": output.get("n-shot", {}).get(task),
        }
    return results


def evaluate(
    lm: Any,
    tasks: Sequence[str],
    manager: Any,
    *,
    limit: int | None = None,
    num_fewshot: int | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Run `tasks` on our model class `lm` (sparse_llm.eval.lm.SparseLM); the record the result
    files hold: per-task results, how the model ran, wall time. The global random state is left
    as it was (`preserved_rng`)."""
    import lm_eval

    weight = lm.model.lm_head.weight
    start = time.perf_counter()
    with preserved_rng(weight.device):
        output = run_lm_eval(lm, tasks, manager, limit=limit, num_fewshot=num_fewshot, verbose=verbose)
    return {
        "tasks": task_results(output),
        "seconds": time.perf_counter() - start,
        "device": str(weight.device),
        "dtype": str(weight.dtype).removeprefix("torch."),
        "ffn": lm.model.ffn_plan.describe(),
        "limit": limit,
        "lm_eval_version": lm_eval.__version__,
    }


def _number(value: Any) -> float | None:
    """lm-eval writes "N/A" where it has no standard error."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
