"""Summary table of an L1-coefficient sweep: one row per run directory below a sweep folder."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import OmegaConf

from sparse_llm.analysis.runs import CONFIG_FILE, METRICS_FILE, find_run_dirs, read_metrics, series

TOKENS_PER_S_KEY = "tokens_per_s"


class SweepError(ValueError):
    """The sweep folder holds no usable runs."""


@dataclass
class RunSummary:
    run: str  # path relative to the sweep folder
    l1_coeff: float | None
    val_ce: float | None  # val_loss of the last eval
    sparsity: float | None  # sparsity/mean of the last log
    sparsity_tail: float | None  # mean sparsity/mean over the last 10% of the logged steps
    l0: float | None  # l0/mean (active units per token) of the last log
    dead: float | None  # dead/mean of the last log
    tokens_per_s: float | None  # median over the logged steps


TAIL_FRACTION = 0.1  # what a sparsity target is judged on: the end of the run, not one log line


def summarize_sweep(sweep_dir: Path) -> list[RunSummary]:
    """One summary per run directory below `sweep_dir`, ordered by L1 coefficient."""
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise SweepError(f"{sweep_dir} is not a directory")
    run_dirs = find_run_dirs(sweep_dir)
    if not run_dirs:
        raise SweepError(f"no run directories (with both {METRICS_FILE} and {CONFIG_FILE}) below {sweep_dir}")
    rows = [summarize_run(run_dir, sweep_dir) for run_dir in run_dirs]
    return sorted(rows, key=lambda r: (r.l1_coeff is None, r.l1_coeff or 0.0, r.run))


def summarize_run(run_dir: Path, sweep_dir: Path) -> RunSummary:
    records = read_metrics(run_dir)
    coeff = OmegaConf.select(OmegaConf.load(run_dir / CONFIG_FILE), "sparsity.l1_coeff")
    throughput = series(records, TOKENS_PER_S_KEY)[1]
    return RunSummary(
        run=str(run_dir.relative_to(sweep_dir)),
        l1_coeff=None if coeff is None else float(coeff),
        val_ce=_last(records, "val_loss"),
        sparsity=_last(records, "sparsity/mean"),
        sparsity_tail=_tail_mean(records, "sparsity/mean"),
        l0=_last(records, "l0/mean"),
        dead=_last(records, "dead/mean"),
        tokens_per_s=statistics.median(throughput) if throughput else None,
    )


def to_markdown(rows: list[RunSummary]) -> str:
    lines = [
        "| run | l1_coeff | val CE | sparsity | sparsity, last 10% | L0 | dead | tokens/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = (
            r.run,
            _fmt(r.l1_coeff, "{:g}"),
            _fmt(r.val_ce, "{:.4f}"),
            _fmt(r.sparsity, "{:.4f}"),
            _fmt(r.sparsity_tail, "{:.4f}"),
            _fmt(r.l0, "{:.1f}"),
            _fmt(r.dead, "{:.4f}"),
            _fmt(r.tokens_per_s, "{:,.0f}"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(rows: list[RunSummary], out_dir: Path) -> list[Path]:
    """Write sweep_summary.md, sweep_summary.json and sweep_val_ce_vs_sparsity.png into `out_dir`."""
    from sparse_llm.analysis.plots import plot_val_ce_vs_sparsity  # matplotlib only when writing

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "sweep_summary.md"
    md.write_text(to_markdown(rows))
    js = out_dir / "sweep_summary.json"
    js.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    points = [
        (f"λ={_fmt(r.l1_coeff, '{:g}')}", r.sparsity, r.val_ce)
        for r in rows
        if r.sparsity is not None and r.val_ce is not None
    ]
    png = plot_val_ce_vs_sparsity(points, out_dir / "sweep_val_ce_vs_sparsity.png")
    return [md, js, png]


def _last(records: list[dict], key: str) -> float | None:
    values = series(records, key)[1]
    return values[-1] if values else None


def _tail_mean(records: list[dict], key: str) -> float | None:
    steps, values = series(records, key)
    if not values:
        return None
    start = steps[-1] - TAIL_FRACTION * steps[-1]
    tail = [v for s, v in zip(steps, values, strict=True) if s >= start]
    return statistics.fmean(tail)


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else spec.format(value)
