"""How steady a whole run's throughput was: its logging windows of the steady phase, side by side.

    python -m benchmarks.run_windows benchmarks/results/run_1b_2xh100.json ... --md out.md

Reads whole-run summaries (`benchmarks/whole_run.py`'s per-run JSON) or their comparisons (`--join`
JSON, each pair's dense and sparse run) and reports, per run, over the windows of its last
`--steady-steps` steps: the median window's tokens/s, the slowest window against that median, how
many windows fell more than `--dip` below it, and the seconds the trainer's scheduled garbage
collection took (`gc_s`, where the run logged it). A pause on one rank of a multi-GPU run (a garbage
collection, a slow batch) shows as such a dip on every rank.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import common


def runs_in(path: Path) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(the run's summary, its file's meta) for every run a summary or comparison JSON holds."""
    data = json.loads(path.read_text())
    found = []
    for result in data["results"]:
        if "pairs" in result:  # a comparison: each pair's runs, each with its own meta
            for pair, metas in zip(result["pairs"], data["meta"]["pairs"], strict=True):
                found += [(pair[side], metas[side]) for side in ("dense", "sparse")]
        else:
            found.append((result, data["meta"]))
    return found


def window_stats(run: dict[str, Any], steady_steps: int, dip: float) -> dict[str, Any]:
    series = run["series"]
    last = series[-1]["step"]
    windows = [r for r in series if r["step"] > last - steady_steps]
    rates = [r["tokens_per_s"] for r in windows]
    median = statistics.median(rates)
    gc_seconds = [r["gc_s"] for r in windows if r.get("gc_s") is not None]
    return {
        "windows": len(windows),
        "median_tokens_per_s": median,
        "slowest_over_median": min(rates) / median,
        "dips": sum(rate < (1 - dip) * median for rate in rates),
        "gc_s": sum(gc_seconds) if gc_seconds else None,
    }


def markdown(rows: list[dict[str, Any]], steady_steps: int, dip: float) -> str:
    lines = [
        "# Throughput window by window, the steady phase of whole runs\n",
        f"The last {steady_steps} steps of each run, in its logging windows (20 steps each); a dip: a window "
        f"more than {dip:.0%} below the run's median window. gc s: the trainer's scheduled garbage "
        "collections in those windows (blank: the run left collection to Python).\n",
        "| file | impl | GPUs | commit | windows | median tokens/s | slowest / median | dips | gc s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gc_s = "" if r["gc_s"] is None else f"{r['gc_s']:.2f}"
        lines.append(
            f"| {r['file']} | {r['impl']} | {r['gpus']} | `{r['commit']}` | {r['windows']} | "
            f"{r['median_tokens_per_s']:.0f} | {r['slowest_over_median']:.3f} | {r['dips']} | {gc_s} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None):
    p = common.script_parser(__doc__)
    p.add_argument("files", nargs="+", type=Path, help="whole-run summaries or comparisons (JSON)")
    p.add_argument("--steady-steps", type=int, default=400, help="the steady phase: each run's last N steps")
    p.add_argument("--dip", type=float, default=0.07, help="a window this fraction below the median")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    rows = []
    for path in args.files:
        for run, meta in runs_in(path):
            stats = window_stats(run, args.steady_steps, args.dip)
            rows.append(
                {
                    "file": path.name,
                    "impl": run["impl"],
                    "gpus": run.get("gpus") or 1,
                    "commit": meta["commit"],
                }
                | stats
            )
    meta = {"inputs": [str(f) for f in args.files], "steady_steps": args.steady_steps, "dip": args.dip}
    common.write_report(markdown(rows, args.steady_steps, args.dip), meta, rows, args.json, args.md)
    return rows


if __name__ == "__main__":
    main()
