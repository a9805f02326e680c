"""Summarise an L1 sweep: python scripts/summarize_sweep.py SWEEP_DIR [--out DIR].

Finds every run directory below SWEEP_DIR (metrics.jsonl + config.yaml), prints a Markdown
table (l1_coeff, final val CE, final sparsity, dead fraction, median tokens/s) and writes
sweep_summary.md, sweep_summary.json and sweep_val_ce_vs_sparsity.png into --out
(default: SWEEP_DIR).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparse_llm.analysis.sweep import SweepError, summarize_sweep, to_markdown, write_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path, help="folder holding the sweep's run directories")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write the summary (default: SWEEP_DIR)"
    )
    args = parser.parse_args(argv)
    try:
        rows = summarize_sweep(args.sweep_dir)
    except SweepError as err:
        print(f"summarize_sweep: {err}", file=sys.stderr)
        return 2
    print(to_markdown(rows), end="")
    for path in write_summary(rows, args.out or args.sweep_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
