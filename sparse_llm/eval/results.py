"""Where downstream results go and how they read: `eval/<step>.json` and `.md` in the run directory.

A model path (run directory, checkpoint or export) maps to an `EvalTarget`: the directory its
results go to (`<run_dir>/eval`, or `<export>/eval` for an export outside any run) and the step
they are filed under (the checkpoint's step; for a run's export, the run's last logged step; a
lone export is filed as `export`). Evaluations of more tasks at the same step merge into one
file. A record is what `harness.evaluate` returns plus where the model came from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparse_llm.analysis.runs import DOWNSTREAM_PREFIX
from sparse_llm.inference.loading import detect_source
from sparse_llm.run_files import CONFIG_FILE, EVAL_DIR, EXPORT_DIR, METRICS_FILE, STEP_DIR


@dataclass(frozen=True)
class EvalTarget:
    model: Path  # what is loaded (an export or checkpoint directory; a training run's own model)
    source: str  # "export", "checkpoint" or "training"
    run_dir: Path | None  # the run it belongs to, if any
    step: int | None

    @property
    def out_dir(self) -> Path:
        return (self.run_dir or self.model) / EVAL_DIR

    @property
    def label(self) -> str:
        return "export" if self.step is None else str(self.step)

    def describe(self) -> dict[str, Any]:
        return {
            "model": str(self.model),
            "source": self.source,
            "run_dir": None if self.run_dir is None else str(self.run_dir),
            "step": self.step,
        }


def locate(path: str | Path) -> EvalTarget:
    """The target of a run directory (its latest complete checkpoint), a checkpoint or an export."""
    source, directory = detect_source(Path(path).expanduser())
    if source == "checkpoint":
        step = int(STEP_DIR.match(directory.name).group(1))
        return EvalTarget(directory, source, directory.parent.parent, step)
    parent = directory.parent
    if directory.name == EXPORT_DIR and (parent / CONFIG_FILE).is_file():
        return EvalTarget(directory, source, parent, last_logged_step(parent))
    return EvalTarget(directory, source, None, None)


def last_logged_step(run_dir: Path) -> int | None:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]
    return max(steps, default=None)


def write_result(target: EvalTarget, record: dict[str, Any]) -> tuple[Path, Path]:
    """Merge `record` into `<out_dir>/<label>.json` (its tasks replace those of the same name)
    and rewrite `<label>.md`; returns both paths."""
    target.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = target.out_dir / f"{target.label}.json"
    previous = json.loads(json_path.read_text()) if json_path.is_file() else {}
    merged = {
        **previous,
        **record,
        **target.describe(),
        "tasks": {**previous.get("tasks", {}), **record["tasks"]},
    }
    json_path.write_text(json.dumps(merged, indent=2) + "\n")
    md_path = json_path.with_suffix(".md")
    md_path.write_text(to_markdown(merged))
    return json_path, md_path


def read_result(target: EvalTarget) -> dict[str, Any]:
    path = target.out_dir / f"{target.label}.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"no downstream results for {target.model} at {target.label} ({path}); evaluate it first: "
            f"sparse-llm-eval {target.model} --tasks <tasks>"
        )
    return json.loads(path.read_text())


def log_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The record's metrics as metrics.jsonl / wandb keys: downstream/<task>/<metric>, and the
    evaluation's wall time as downstream/seconds."""
    metrics = {
        f"{DOWNSTREAM_PREFIX}/{task}/{metric}": value
        for task, result in record["tasks"].items()
        for metric, value in result["metrics"].items()
    }
    return {**metrics, f"{DOWNSTREAM_PREFIX}/seconds": record["seconds"]}


def to_markdown(record: dict[str, Any]) -> str:
    """A table of every task's metrics (value, standard error, examples) and how the model ran."""
    step = "" if record.get("step") is None else f", step {record['step']}"
    lines = [
        f"Downstream evaluation of {record['model']}{step}",
        "",
        "| task | metric | value | stderr | examples | shots |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for task, result in sorted(record["tasks"].items()):
        for metric, value in result["metrics"].items():
            err = result["stderr"].get(metric)
            cells = (
                task,
                metric,
                format_value(value),
                "–" if err is None else format_value(err),
                str(result.get("samples", "–")),
                str(result.get("num_fewshot", "–")),
            )
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{record['device']}, {record['dtype']}, lm-eval {record['lm_eval_version']}, "
        f"{record['seconds']:.1f} s; FFN: {record['ffn']}",
    ]
    return "\n".join(lines) + "\n"


def format_value(value: float) -> str:
    """Four decimals; four significant digits for a large value (a word perplexity)."""
    return f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
