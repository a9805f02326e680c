"""Where a run directory keeps what: the names the trainer writes and the readers look for.

<run_dir>/config.yaml                        the resolved config that ran
<run_dir>/metrics.jsonl                      one JSON record per logged step
<run_dir>/nnz_hist.json                      per-token non-zero histograms (the plots read it)
<run_dir>/checkpoints/step_XXXXXXXX/         complete checkpoints (trainer_state.json last)
<run_dir>/export/                            the Hugging Face export
<run_dir>/eval/<step>.json, <step>.md        downstream task results (sparse-llm-eval, eval.downstream)
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
NNZ_HIST_FILE = "nnz_hist.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
EVAL_DIR = "eval"
STEP_DIR = re.compile(r"^step_(\d+)$")
CHECKPOINT_MANIFEST = "trainer_state.json"  # written last: a checkpoint without it is incomplete


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
