"""Runs side by side: one table of tasks x runs with each run's sparsity and L0, and a bar plot.

Each run's downstream results are those of the step `results.locate` files it under (a run
directory: its latest checkpoint); its sparsity and L0 are the last ones its metrics.jsonl logged
at or before that step (none for an export outside a run). A task's headline metric is the first
of HEADLINE_METRICS it has (acc_norm before acc, as papers report the suite); the mean accuracy
averages the tasks whose headline is an accuracy (the paper's figure), for a run that has them all.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparse_llm.analysis.runs import ACCURACY_METRICS, read_metrics
from sparse_llm.eval.results import EvalTarget, format_value, read_result

HEADLINE_METRICS = (*ACCURACY_METRICS, "bits_per_byte", "word_perplexity")
MEAN_ROW = "mean accuracy"
COMPARE_NAME = "downstream_compare"  # <out>/downstream_compare.{md,json,png}


@dataclass
class RunColumn:
    label: str
    model: str
    step: int | None
    sparsity: float | None
    l0: float | None
    tasks: dict[str, dict[str, Any]]


def run_column(target: EvalTarget) -> RunColumn:
    record = read_result(target)
    sparsity = l0 = None
    if target.run_dir is not None:
        for entry in read_metrics(target.run_dir):
            if target.step is not None and entry["step"] > target.step:
                break
            sparsity = entry.get("sparsity/mean", sparsity)
            l0 = entry.get("l0/mean", l0)
    label = (target.run_dir or target.model).name
    return RunColumn(label, str(target.model), target.step, sparsity, l0, record["tasks"])


def headline(tasks: dict[str, dict[str, Any]], task: str) -> str | None:
    metrics = tasks.get(task, {}).get("metrics", {})
    return next((m for m in HEADLINE_METRICS if m in metrics), None)


@dataclass
class Comparison:
    runs: list[RunColumn]
    rows: list[tuple[str, str]]  # (task, its headline metric), in the order the runs list the tasks

    def value(self, run: RunColumn, task: str, metric: str) -> float | None:
        return run.tasks.get(task, {}).get("metrics", {}).get(metric)

    def mean_accuracy(self, run: RunColumn) -> float | None:
        values = [self.value(run, t, m) for t, m in self.rows if m in ACCURACY_METRICS]
        if not values or any(v is None for v in values):
            return None
        return statistics.fmean(values)


def compare(targets: list[EvalTarget]) -> Comparison:
    runs = [run_column(t) for t in targets]
    labels = [r.label for r in runs]
    for run in runs:  # two runs named alike (two exports, two checkpoints of one run): their paths
        if labels.count(run.label) > 1:
            run.label = run.model
    rows = []
    for task in dict.fromkeys(t for run in runs for t in run.tasks):
        metric = next(filter(None, (headline(run.tasks, task) for run in runs)), None)
        if metric is not None:
            rows.append((task, metric))
    return Comparison(runs, rows)


def to_markdown(comparison: Comparison) -> str:
    runs = comparison.runs
    lines = [
        "| task | metric | " + " | ".join(r.label for r in runs) + " |",
        "|---|---|" + "---:|" * len(runs),
    ]

    def row(name: str, metric: str, values: list[float | None], spec: str | None = None) -> None:
        cells = ["–" if v is None else format_value(v) if spec is None else spec.format(v) for v in values]
        lines.append(f"| {name} | {metric} | " + " | ".join(cells) + " |")

    for task, metric in comparison.rows:
        row(task, metric, [comparison.value(r, task, metric) for r in runs])
    if sum(m in ACCURACY_METRICS for _, m in comparison.rows) > 1:
        row(f"**{MEAN_ROW}**", "", [comparison.mean_accuracy(r) for r in runs])
    row("sparsity", "1 - L0/H", [r.sparsity for r in runs], "{:.2%}")
    row("L0", "active units/token", [r.l0 for r in runs], "{:.1f}")
    row("step", "", [r.step for r in runs], "{:d}")
    notes = []
    for task, _ in comparison.rows:  # a task scored on different examples is no like-for-like comparison
        counts = [str(r.tasks.get(task, {}).get("samples", "–")) for r in runs]
        if len(set(counts)) > 1:
            notes.append(
                f"{task}: the runs were scored on different numbers of examples ({' / '.join(counts)})"
            )
    return "\n".join(lines + (["", *notes] if notes else [])) + "\n"


def write_comparison(comparison: Comparison, out_dir: Path) -> list[Path]:
    """<out_dir>/downstream_compare.md, .json and .png (the bar plot)."""
    from sparse_llm.analysis.plots import plot_downstream_compare  # matplotlib only when writing

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{COMPARE_NAME}.md"
    md.write_text(to_markdown(comparison))
    js = out_dir / f"{COMPARE_NAME}.json"
    payload = {
        "rows": [list(r) for r in comparison.rows],
        "runs": [{**asdict(r), "mean_accuracy": comparison.mean_accuracy(r)} for r in comparison.runs],
    }
    js.write_text(json.dumps(payload, indent=2) + "\n")
    png = plot_downstream_compare(bar_panels(comparison), out_dir / f"{COMPARE_NAME}.png")
    return [md, js, png]


def bar_panels(comparison: Comparison) -> dict[str, tuple[list[str], dict[str, list[float | None]]]]:
    """The bar plot's panels: accuracies together (and their mean), every other metric on its own
    axis; each {title: (bar group names, {run legend: one value per group})}."""
    panels: dict[str, tuple[list[str], dict[str, list[float | None]]]] = {}
    for task, metric in comparison.rows:
        title = "accuracy" if metric in ACCURACY_METRICS else metric
        names, bars = panels.setdefault(title, ([], {_legend(r): [] for r in comparison.runs}))
        names.append(task if title == metric else f"{task}\n{metric}")
        for run in comparison.runs:
            bars[_legend(run)].append(comparison.value(run, task, metric))
    if "accuracy" in panels and len(panels["accuracy"][0]) > 1:
        names, bars = panels["accuracy"]
        names.append(MEAN_ROW)
        for run in comparison.runs:
            bars[_legend(run)].append(comparison.mean_accuracy(run))
    return panels


def _legend(run: RunColumn) -> str:
    if run.l0 is None:
        return run.label
    return f"{run.label} (L0 {run.l0:.1f}, {run.sparsity:.1%} sparse)"
