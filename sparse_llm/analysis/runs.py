"""Reading finished (or running) run directories: `metrics.jsonl` and `config.yaml`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparse_llm.run_files import CONFIG_FILE, METRICS_FILE

# Downstream task metrics (sparse_llm.eval) are logged as downstream/<task>/<metric>; these of
# lm-eval's metrics are accuracies (in [0, 1]).
DOWNSTREAM_PREFIX = "downstream"
ACCURACY_METRICS = ("acc_norm", "acc", "exact_match")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The logged records of a run, ordered by step (the last record wins if a step repeats)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}")
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[int(record["step"])] = record
    return [by_step[step] for step in sorted(by_step)]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry `key`."""
    kept = [r for r in records if key in r]
    return [int(r["step"]) for r in kept], [float(r[key]) for r in kept]


def find_run_dirs(root: Path) -> list[Path]:
    """Directories below `root` (itself included) that hold both a metrics log and a config."""
    return sorted(p.parent for p in Path(root).rglob(METRICS_FILE) if (p.parent / CONFIG_FILE).is_file())
