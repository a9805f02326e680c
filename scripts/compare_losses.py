"""Compare the per-step losses of runs against a reference run, step by step.

    python scripts/compare_losses.py REF OTHER [OTHER ...] [--labels ref,a,b] [--keys ce,loss]
        [--min-step N] [--json out.json]

REF and OTHER are run directories (their metrics.jsonl, read by sparse_llm.analysis.runs.read_metrics:
the last record of a step wins, as after a resume) or metrics.jsonl files. Only steps that every
run logged (and, with --min-step, steps >= N) are compared. Prints a per-step table and, for each
OTHER, the largest absolute and relative difference of each key; `--json` writes the same numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from sparse_llm.analysis.runs import read_metrics
from sparse_llm.run_files import METRICS_FILE

DEFAULT_KEYS = ("loss", "ce", "l1", "val_loss")


def metrics_by_step(path: Path) -> dict[int, dict[str, Any]]:
    """step -> record of a run directory or of its metrics.jsonl file."""
    if path.is_file() and path.name == METRICS_FILE:
        path = path.parent
    elif not path.is_dir():
        raise SystemExit(f"error: {path} is neither a run directory nor a {METRICS_FILE} file")
    try:
        return {int(r["step"]): r for r in read_metrics(path)}
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def compare(
    reference: dict[int, dict], others: dict[str, dict[int, dict]], keys: list[str], min_step: int = 0
) -> dict:
    common = set(reference).intersection(*(set(o) for o in others.values()))
    steps = sorted(step for step in common if step >= min_step)
    result: dict[str, Any] = {"steps": steps, "keys": keys, "runs": {}}
    for label, other in others.items():
        per_key = {}
        for key in keys:
            pairs = [
                (step, _number(reference[step].get(key)), _number(other[step].get(key))) for step in steps
            ]
            pairs = [(s, a, b) for s, a, b in pairs if a is not None and b is not None]
            if not pairs:
                continue
            diffs = [abs(b - a) for _, a, b in pairs]
            worst = max(range(len(pairs)), key=diffs.__getitem__)
            per_key[key] = {
                "steps_compared": len(pairs),
                "max_abs_diff": diffs[worst],
                "max_rel_diff": max(
                    d / max(abs(a), 1e-12) for d, (_, a, _) in zip(diffs, pairs, strict=True)
                ),
                "mean_abs_diff": sum(diffs) / len(diffs),
                "worst_step": pairs[worst][0],
                "bitwise_equal_steps": sum(a == b for _, a, b in pairs),
            }
        result["runs"][label] = per_key
    return result


def table(
    reference: dict[int, dict], others: dict[str, dict[int, dict]], steps: list[int], key: str, ref_label: str
) -> str:
    labels = list(others)
    lines = [" | ".join(["step", ref_label, *labels, *(f"{label} - {ref_label}" for label in labels)])]
    for step in steps:
        a = _number(reference[step].get(key))
        if a is None:
            continue
        values = [_number(others[label][step].get(key)) for label in labels]
        cells = [f"{v:.6f}" if v is not None else "-" for v in values]
        deltas = [f"{v - a:+.2e}" if v is not None else "-" for v in values]
        lines.append(" | ".join([str(step), f"{a:.6f}", *cells, *deltas]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, nargs="+", help="reference first")
    parser.add_argument("--labels", help="comma-separated labels (default: directory or file names)")
    parser.add_argument("--keys", default=",".join(DEFAULT_KEYS))
    parser.add_argument("--min-step", type=int, default=0, help="compare steps >= this only")
    parser.add_argument("--json", type=Path, help="write the comparison here")
    args = parser.parse_args()
    if len(args.runs) < 2:
        parser.error("give a reference run and at least one other")
    labels = args.labels.split(",") if args.labels else [p.name if p.is_dir() else p.stem for p in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(labels)} labels for {len(args.runs)} runs")
    keys = [k for k in args.keys.split(",") if k]
    metrics = [metrics_by_step(p) for p in args.runs]
    reference, others = metrics[0], dict(zip(labels[1:], metrics[1:], strict=True))
    result = compare(reference, others, keys, args.min_step)
    if not result["steps"]:
        raise SystemExit("error: the runs have no logged step in common")
    result["reference"] = labels[0]
    result["paths"] = dict(zip(labels, map(str, args.runs), strict=True))
    print(table(reference, others, result["steps"], keys[0], labels[0]))
    for label, per_key in result["runs"].items():
        for key, s in per_key.items():
            print(
                f"{label} vs {labels[0]} {key}: max |diff| {s['max_abs_diff']:.3e} (step {s['worst_step']}), "
                f"max rel {s['max_rel_diff']:.3e}, {s['bitwise_equal_steps']}/{s['steps_compared']} steps equal"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
