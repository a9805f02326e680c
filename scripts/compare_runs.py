"""Compare finished runs side by side: a table (val CE, sparsity, dead, tokens/s) and overlay plots.

    python scripts/compare_runs.py RUN_DIR [RUN_DIR ...] --out DIR --name NAME [--labels a,b,c]

Writes NAME.md, NAME.json and NAME_<metric>.png (sparsity/mean, dead/mean, val_loss, and on log
axes l0/mean and l1_coeff) into DIR.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from sparse_llm.analysis.plots import plot_runs_overlay
from sparse_llm.analysis.sweep import summarize_run, to_markdown
from sparse_llm.run_files import RUN_INFO_FILE

# (metric, log y axis): L0 and the controller's coefficient span decades.
OVERLAY_KEYS = (
    ("sparsity/mean", False),
    ("dead/mean", False),
    ("val_loss", False),
    ("l0/mean", True),
    ("l1_coeff", True),
)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--labels", help="comma-separated curve labels (default: run directory names)")
    args = parser.parse_args()
    labels = args.labels.split(",") if args.labels else [d.name for d in args.run_dirs]
    args.out.mkdir(parents=True, exist_ok=True)

    rows = [summarize_run(d, d.parent) for d in args.run_dirs]
    for row, label in zip(rows, labels, strict=True):
        row.run = label
    run_info = args.run_dirs[0] / RUN_INFO_FILE
    info = json.loads(run_info.read_text()) if run_info.is_file() else {}
    header = (
        f"Device: {info.get('device', '?')}; commit {info.get('commit', '?')}; date {info.get('date', '?')}."
    )
    markdown = f"# {args.name}\n\n{header}\n\n{to_markdown(rows)}\n"
    (args.out / f"{args.name}.md").write_text(markdown)
    (args.out / f"{args.name}.json").write_text(
        json.dumps({**info, "runs": [asdict(r) for r in rows]}, indent=1)
    )
    for key, log_y in OVERLAY_KEYS:
        png = args.out / f"{args.name}_{key.split('/')[0]}.png"
        plot_runs_overlay(args.run_dirs, png, labels, key, log_y=log_y)
    print(markdown)


if __name__ == "__main__":
    main()
