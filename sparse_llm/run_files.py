"""Where a run directory keeps what: the names the trainer writes and the readers look for.

<run_dir>/config.yaml                        the resolved config that ran
<run_dir>/run_info.json                      device, commit, versions, how the model was spread
                                             (the run's last start: a resume rewrites it)
<run_dir>/metrics.jsonl                      one JSON record per logged step
<run_dir>/nnz_hist.json                      per-token non-zero histograms (the plots read it)
<run_dir>/checkpoints/step_XXXXXXXX/         complete checkpoints (trainer_state.json last)
<run_dir>/export/                            the Hugging Face export
<run_dir>/eval/<step>.json, <step>.md        downstream task results (sparse-llm-eval, eval.downstream)

A run directory belongs to one run: `previous_run` says what an earlier run left in it (its
checkpoints, metrics or export), which a new run refuses to replace unless asked to
(`train.overwrite`), and then `move_aside` moves it next to the directory instead of deleting it.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.json"
METRICS_FILE = "metrics.jsonl"
NNZ_HIST_FILE = "nnz_hist.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
EVAL_DIR = "eval"
STEP_DIR = re.compile(r"^step_(\d+)$")
CHECKPOINT_MANIFEST = "trainer_state.json"  # written last: a checkpoint without it is incomplete
FILES_KEY = "files"  # in the manifest: {relative path: {"size": bytes, "sha256": hex}}
LOG_FILE = "train.log"
# Hydra's record of a job's composition: written by its launcher for the job that runs, so it stays.
HYDRA_DIR = ".hydra"
REPLACED_SUFFIX = ".replaced-"  # <run_dir>.replaced-<date>_<time>: a run that train.overwrite moved aside


def checkpoint_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root` (a run's checkpoints/ directory), oldest first."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = STEP_DIR.match(path.name)
        if match and (path / CHECKPOINT_MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(root: Path) -> Path | None:
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def recorded_files(checkpoint: Path) -> dict[str, dict[str, Any]]:
    """The sizes and SHA-256 sums a checkpoint's manifest records for its files (empty for a
    checkpoint written before they were recorded). Raises ValueError for an unreadable manifest."""
    try:
        manifest = json.loads((checkpoint / CHECKPOINT_MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{CHECKPOINT_MANIFEST} is unreadable ({err})") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{CHECKPOINT_MANIFEST} is not a JSON object")
    return manifest.get(FILES_KEY, {})


def file_problem(checkpoint: Path, name: str, expected: dict[str, Any]) -> str | None:
    """What is wrong with the checkpoint's file `name` against its recorded size and SHA-256."""
    file = checkpoint / name
    if not file.is_file():
        return f"{name} is missing"
    size = file.stat().st_size
    if size != expected["size"]:
        return f"{name} has {size} bytes, {expected['size']} were written"
    if sha256_file(file) != expected["sha256"]:
        return f"{name} does not match its recorded SHA-256"
    return None


def previous_run(run_dir: Path) -> str | None:
    """What a run left in `run_dir` that a new run would overwrite (its checkpoints, metrics.jsonl,
    export/), in words; None when there is none (a missing or empty directory, or only the files
    of a run that stopped before its first logged step)."""
    found = []
    steps = sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).glob("step_*") if STEP_DIR.match(p.name))
    if steps:
        found.append(f"{len(steps)} checkpoint{'s' if len(steps) > 1 else ''} (up to {steps[-1]})")
    metrics = run_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        records = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())
        found.append(f"{METRICS_FILE} ({records} record{'s' if records != 1 else ''})")
    if (run_dir / EXPORT_DIR).exists():
        found.append(f"{EXPORT_DIR}/")
    return ", ".join(found) or None


def move_aside(run_dir: Path) -> Path:
    """Move everything in `run_dir` into a new sibling `<run_dir>.replaced-<date>_<time>` (the
    directory itself stays, for the run that replaces it); returns the new directory. Hydra's
    `.hydra/` is copied instead of moved: its launcher has already written the new job's."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    target = run_dir.with_name(f"{run_dir.name}{REPLACED_SUFFIX}{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}{REPLACED_SUFFIX}{stamp}_{n}")
    target.mkdir(parents=True)
    for path in sorted(run_dir.iterdir()):
        if path.name == HYDRA_DIR and path.is_dir():
            shutil.copytree(path, target / path.name, symlinks=True)
        else:
            path.rename(target / path.name)
    return target
