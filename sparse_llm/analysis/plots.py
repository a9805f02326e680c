"""PNG plots of a run's sparsity curves, and comparisons across runs.

Uses matplotlib's object API with the Agg canvas (no pyplot): no global backend switch and no
figure registry, so it is safe to call from the trainer at the end of a run.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from sparse_llm.analysis.runs import ACCURACY_METRICS, DOWNSTREAM_PREFIX, read_metrics, series
from sparse_llm.run_files import NNZ_HIST_FILE

SPARSITY_PNG = "sparsity_per_layer.png"
DEAD_PNG = "dead_per_layer.png"
NNZ_HIST_PNG = "nnz_hist_per_layer.png"
L0_BY_LAYER_PNG = "l0_by_layer.png"
DOWNSTREAM_PNG = "downstream.png"
SETTLED_SHARE = 0.1  # the last share of a run's logged steps a layer's settled L0 is averaged over
# Axis labels in words for the metrics.jsonl keys plots compare (other keys are shown as they are).
METRIC_LABELS = {
    "sparsity/mean": "sparsity (1 - L0 / H), mean of layers",
    "dead/mean": "dead fraction of units, mean of layers",
    "l0/mean": "L0 (active units per token), mean of layers",
    "l1_coeff": "L1 coefficient (lambda)",
    "val_loss": "validation loss (CE)",
    "loss": "training loss (CE + L1 term)",
    "ce": "training CE",
}


def plot_run(run_dir: Path) -> list[Path]:
    """Write the per-layer sparsity, dead-fraction, settled-L0 and non-zero-distribution plots of a run.

    Reads `<run_dir>/metrics.jsonl` (and `nnz_hist.json` if the monitor saved one); returns
    the PNGs written, skipping any plot whose data the run does not have.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    written = [
        path
        for path in (
            _plot_layers(records, "sparsity", "sparsity (1 - L0 / H)", run_dir / SPARSITY_PNG),
            _plot_layers(records, "dead", "dead fraction of units", run_dir / DEAD_PNG),
            _plot_l0_by_layer(records, run_dir / L0_BY_LAYER_PNG),
            _plot_downstream(records, run_dir / DOWNSTREAM_PNG),
        )
        if path is not None
    ]
    if (run_dir / NNZ_HIST_FILE).is_file():
        written.append(_plot_nnz_hist(run_dir / NNZ_HIST_FILE, run_dir / NNZ_HIST_PNG))
    return written


def plot_runs_overlay(
    run_dirs: Sequence[Path],
    out_path: Path,
    labels: Sequence[str] | None = None,
    key: str = "sparsity/mean",
    log_y: bool = False,
) -> Path:
    """One curve of `key` per run (e.g. L1 on vs L1 = 0 for the README); labels default to run names.
    `log_y` for quantities that span decades (L0, the L1 coefficient); runs without the key, or
    with it at 0 throughout on a log axis, are left out."""
    labels = list(labels) if labels is not None else [Path(d).name for d in run_dirs]
    if len(labels) != len(run_dirs):
        raise ValueError(f"{len(labels)} labels for {len(run_dirs)} runs")
    fig, ax = _figure()
    for run_dir, label in zip(run_dirs, labels, strict=True):
        steps, values = series(read_metrics(Path(run_dir)), key)
        if not values or (log_y and max(values) <= 0):
            continue
        ax.plot(steps, values, label=label)
    if log_y:
        ax.set_yscale("log")
    label = METRIC_LABELS.get(key, key)
    ax.set(xlabel="step", ylabel=label, title=f"{label}, by run")
    ax.legend()
    return _save(fig, out_path)


def plot_val_ce_vs_sparsity(points: Sequence[tuple[str, float, float]], out_path: Path) -> Path:
    """Scatter of (label, sparsity, val CE) points, each annotated with its label."""
    fig, ax = _figure()
    for label, sparsity, val_ce in points:
        ax.scatter([sparsity], [val_ce], color="tab:blue")
        ax.annotate(label, (sparsity, val_ce), textcoords="offset points", xytext=(4, 4), fontsize=8)
    if not points:
        ax.text(0.5, 0.5, "no run has both val_loss and sparsity", ha="center", transform=ax.transAxes)
    ax.set(
        xlabel=f"{METRIC_LABELS['sparsity/mean']}, last logged step",
        ylabel=f"{METRIC_LABELS['val_loss']}, last evaluation",
        title="validation loss against sparsity",
    )
    return _save(fig, out_path)


def plot_downstream_compare(
    panels: dict[str, tuple[list[str], dict[str, list[float | None]]]], out_path: Path
) -> Path:
    """Grouped bars, a panel per {title: (group names, {run: one value per group})}: runs side by
    side in every group (a missing value leaves its bar out)."""
    fig = Figure(figsize=(max(6.0, 4.0 * len(panels) + 2.0), 5), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, (names, bars)) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        width = 0.8 / max(1, len(bars))
        for j, (label, values) in enumerate(bars.items()):
            points = [(k + j * width, v) for k, v in enumerate(values) if v is not None]
            ax.bar([x for x, _ in points], [v for _, v in points], width, label=label)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))], names, fontsize=8)
        ax.set(title=title, ylabel=title)
        ax.legend(fontsize=7)
    return _save(fig, out_path)


def _plot_downstream(records: list[dict[str, Any]], out_path: Path) -> Path | None:
    """Task metrics (downstream/<task>/<metric>) over training tokens: the accuracies in one panel,
    bits per byte (the perplexity tasks' figure that does not depend on the tokenizer) in another."""
    panels: dict[str, list[str]] = {}
    for key in dict.fromkeys(k for r in records for k in r):
        parts = key.split("/")
        if len(parts) != 3 or parts[0] != DOWNSTREAM_PREFIX:
            continue
        if parts[2] in ACCURACY_METRICS:
            panels.setdefault("accuracy", []).append(key)
        elif parts[2] == "bits_per_byte":
            panels.setdefault("bits per byte", []).append(key)
    if not panels:
        return None
    fig = Figure(figsize=(6.0 * len(panels), 5), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, keys) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for key in keys:
            kept = [r for r in records if key in r and "tokens_seen" in r]
            label = key.removeprefix(f"{DOWNSTREAM_PREFIX}/")
            ax.plot([r["tokens_seen"] for r in kept], [r[key] for r in kept], marker="o", label=label)
        ax.set(xlabel="tokens", ylabel=title, title=f"downstream {title}")
        ax.legend(fontsize=7)
    return _save(fig, out_path)


def _layer_keys(records: list[dict[str, Any]], name: str) -> list[str]:
    """The run's `<name>/layer_NN` metric keys, in layer order."""
    pattern = re.compile(rf"^{name}/layer_(\d+)$")
    return sorted({k for r in records for k in r if pattern.match(k)}, key=lambda k: int(k.rsplit("_", 1)[1]))


def _plot_layers(records: list[dict[str, Any]], name: str, ylabel: str, out_path: Path) -> Path | None:
    layer_keys = _layer_keys(records, name)
    if not layer_keys:
        return None
    fig, ax = _figure()
    colors = _layer_colors(len(layer_keys))
    for key, color in zip(layer_keys, colors, strict=True):
        ax.plot(*series(records, key), color=color, linewidth=1, label=key.split("/")[1])
    ax.plot(*series(records, f"{name}/mean"), color="black", linewidth=2.5, label="mean")
    ax.set(xlabel="step", ylabel=ylabel, title=f"{name} per layer")
    ax.legend(fontsize=7, ncol=max(1, len(layer_keys) // 12))
    return _save(fig, out_path)


def settled_layer_l0(records: list[dict[str, Any]]) -> tuple[list[float], int]:
    """(each layer's L0 averaged over the last SETTLED_SHARE of the steps that log it, at least one;
    that number of steps). Empty when the run logged no per-layer L0."""
    settled, last = [], 0
    for key in _layer_keys(records, "l0"):
        values = series(records, key)[1]
        last = max(1, round(SETTLED_SHARE * len(values)))
        settled.append(sum(values[-last:]) / last)
    return settled, last


def _plot_l0_by_layer(records: list[dict[str, Any]], out_path: Path) -> Path | None:
    """A bar a layer: its settled L0 (a log axis where the layers span a decade). A run's mean L0
    can hide layers ten times denser or sparser than it (the 1b preset held at a mean of 30 by one
    L1 coefficient spans 5-112), and a layer's L0 sets what its FFN costs."""
    settled, last = settled_layer_l0(records)
    if not settled:
        return None
    fig, ax = _figure()
    ax.bar(range(len(settled)), settled, color=_layer_colors(len(settled)))
    mean = sum(settled) / len(settled)
    ax.axhline(mean, color="black", linewidth=1.5, label=f"mean of layers: {mean:.1f}")
    if min(settled) > 0 and max(settled) >= 10 * min(settled):  # a log axis only where it spans a decade
        ax.set_yscale("log")
    ax.set_xticks(range(len(settled)))
    ax.set(
        xlabel="layer",
        ylabel="L0 (active units per token)",
        title=f"L0 by layer, mean of the last {last} logged step{'s' if last > 1 else ''}",
    )
    ax.legend()
    return _save(fig, out_path)


def _plot_nnz_hist(hist_path: Path, out_path: Path) -> Path:
    return _save(nnz_hist_figure(json.loads(hist_path.read_text())), out_path)


def nnz_hist_figure(data: dict[str, Any]) -> Figure:
    """Each layer's share of tokens by their number of active units (`nnz_hist.json`'s data).
    An empty bin is a gap in its layer's line (NaN), not bridged by it, and every non-empty bin
    has a marker, so a bin alone between empty ones shows too."""
    counts: list[list[int]] = data["counts"]
    fig, ax = _figure()
    for layer, (row, color) in enumerate(zip(counts, _layer_colors(len(counts)), strict=True)):
        total = sum(row)
        # Log y: the tail (a few tokens with hundreds of units) is what the kernels must handle.
        shares = [c / total if c else math.nan for c in row]
        ax.plot(
            range(len(row)),
            shares,
            color=color,
            linewidth=1,
            marker=".",
            markersize=3,
            label=f"layer {layer}",
        )
    ax.set_yscale("log")
    ax.set(
        xlabel=f"active units per token (of {data['num_units']})",
        ylabel="share of tokens",
        title=f"non-zeros per token, last log window ({data['tokens']} tokens)",
    )
    ax.legend(fontsize=7, ncol=max(1, len(counts) // 12))
    return fig


def _figure() -> tuple[Figure, Any]:
    fig = Figure(figsize=(8, 5), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _layer_colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    return [cmap(i / max(1, n - 1)) for i in range(n)]


def _save(fig: Figure, out_path: Path) -> Path:
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=120)
    return out_path
