"""Where a run's wall clock went, step by step: each logged step's seconds (from the trainer's
metrics.jsonl, `elapsed_s`) beside what changed in it (layers on the dense fallback, records that
overflowed their capacity, graphs compiled), with the steps slower than `--slow` times the median
named and their excess summed by cause.

Log every step to see single steps (a logging step reads its scalars on the host, so every step
pays that):

    python -m benchmarks.whole_run --impl auto --steps 60 --steady-steps 20 \\
      --override train.log_every=1 --out-dir out --run-dir /tmp/early
    python -m benchmarks.step_times /tmp/early/metrics.jsonl --md early.md --json early.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import pairwise
from pathlib import Path
from typing import Any

from benchmarks.common import script_parser

COLUMNS = (  # (metrics key, column title)
    ("l0/mean", "L0"),
    ("ffn_fallback/dense_layers", "dense layers"),
    ("ffn/capacity_overflows", "overflows so far"),
    ("compile/graphs", "graphs"),
)


def step_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per logged step: its seconds since the previous logged step (per step where the log
    skips some) and the COLUMNS' values."""
    timed = [r for r in records if "elapsed_s" in r]
    rows, before = [], (0, 0.0)
    for record in timed:
        steps = record["step"] - before[0]
        rows.append(
            {
                "step": record["step"],
                "seconds": (record["elapsed_s"] - before[1]) / steps,
                **{key: record.get(key) for key, _ in COLUMNS},
            }
        )
        before = (record["step"], record["elapsed_s"])
    return rows


def cause(row: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """What changed in a slow step: a graph compiled, a record rebuilt, or neither."""
    if previous is None:
        return "first step (first compile)"
    if (row["compile/graphs"] or 0) > (previous["compile/graphs"] or 0):
        return "graph compiled"
    if (row["ffn/capacity_overflows"] or 0) > (previous["ffn/capacity_overflows"] or 0):
        return "record overflowed (rebuilt)"
    return "other"


def report(rows: list[dict[str, Any]], slow: float) -> dict[str, Any]:
    """The median step (first excluded), the slow steps with their causes, and their excess by cause."""
    median = statistics.median(r["seconds"] for r in rows[1:]) if len(rows) > 1 else rows[0]["seconds"]
    causes = [cause(rows[0], None)] + [cause(row, previous) for previous, row in pairwise(rows)]
    slow_steps, excess = [], {}
    for i, (row, why) in enumerate(zip(rows, causes, strict=True)):
        if i == 0 or row["seconds"] > slow * median:
            slow_steps.append({**row, "cause": why})
            excess[why] = excess.get(why, 0.0) + row["seconds"] - median
    # Every step whose records overflowed, slow or not (those that also compiled aside): what the
    # rebuilds cost in all.
    overflowed = [
        row["seconds"] - median
        for row, why in zip(rows, causes, strict=True)
        if why == "record overflowed (rebuilt)"
    ]
    return {
        "median_step_s": median,
        "slow_steps": slow_steps,
        "excess_s_by_cause": excess,
        "overflow_steps": len(overflowed),
        "overflow_steps_excess_s": sum(overflowed),
        "rows": rows,
    }


def markdown(result: dict[str, Any], source: str, slow: float) -> str:
    def fmt(value: Any) -> str:
        return "-" if value is None else f"{value:.1f}" if isinstance(value, float) else str(value)

    titles = " | ".join(title for _, title in COLUMNS)
    lines = [
        f"# Step by step: {source}",
        "",
        f"Median step {result['median_step_s']:.3f} s (the first excluded). Steps over {slow}x the median, "
        "and their seconds over it by cause:",
        "",
        "| cause | seconds over the median |",
        "|---|---:|",
        *(f"| {why} | {s:.2f} |" for why, s in result["excess_s_by_cause"].items()),
        "",
        f"Every step whose records overflowed and compiled nothing ({result['overflow_steps']}, slow or not): "
        f"{result['overflow_steps_excess_s']:.2f} s over the median in all.",
        "",
        f"| step | seconds | {titles} | |",
        "|---:|---:|" + "---:|" * len(COLUMNS) + "---|",
    ]
    slow_at = {s["step"]: s["cause"] for s in result["slow_steps"]}
    for row in result["rows"]:
        values = " | ".join(fmt(row[key]) for key, _ in COLUMNS)
        lines.append(f"| {row['step']} | {row['seconds']:.3f} | {values} | {slow_at.get(row['step'], '')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("--slow", type=float, default=1.5, help="a slow step: over this times the median")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not args.metrics.is_file():
        raise SystemExit(f"no such file: {args.metrics}")
    rows = step_rows([json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()])
    if not rows:
        raise SystemExit(f"{args.metrics} has no timed step (no elapsed_s)")
    result = report(rows, args.slow)
    text = markdown(result, args.metrics.name, args.slow)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps({"meta": {"metrics": str(args.metrics)}, "results": [result]}, indent=2)
        )
    if args.md:
        args.md.write_text(text)
    return result


if __name__ == "__main__":
    main()
