"""Summarise a run's throughput into benchmark files (JSON + a Markdown table).

    python scripts/summarize_run.py RUN_DIR --name train_1b_dense --out benchmarks/results [--skip 2]

Medians are over the logged windows after the first `--skip` (compilation and warm-up); a step
logged twice (a resumed run) counts once, its last record (sparse_llm.analysis.runs.read_metrics).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from sparse_llm.analysis.runs import read_metrics
from sparse_llm.run_files import CONFIG_FILE, RUN_INFO_FILE


def summarize(run_dir: Path, skip: int) -> dict:
    windows = [r for r in read_metrics(run_dir) if "tokens_per_s" in r][skip:]
    if not windows:
        raise SystemExit(f"error: {run_dir} has no throughput records after skipping {skip}")
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    info_path = run_dir / RUN_INFO_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    t = cfg["train"]
    summary = {
        **info,
        "model": cfg["model"]["name"],
        "ffn_impl": cfg["model"]["ffn_impl"],
        "tokens_per_step": t["global_batch_size"] * t["seq_len"],
        "micro_batch": f"{t['micro_batch_size']} x {t['seq_len']}",
        "compile": t["compile"],
        "precision": t["precision"],
        "windows": len(windows),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in windows),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in windows),
        "final_loss": windows[-1]["loss"],
    }
    if all("mfu" in r for r in windows):
        summary["mfu_median"] = statistics.median(r["mfu"] for r in windows)
    if "sparsity/mean" in windows[-1]:
        summary["sparsity_final"] = windows[-1]["sparsity/mean"]
    return summary


def to_markdown(name: str, s: dict) -> str:
    mfu = f"{100 * s['mfu_median']:.1f}%" if "mfu_median" in s else "n/a"
    return "\n".join(
        [
            f"# {name}",
            "",
            f"Device: {s.get('device', '?')}; commit {s.get('commit', '?')}; date {s.get('date', '?')}; "
            f"torch {s.get('torch', '?')}.",
            "",
            "| model | FFN | micro-batch | compile | tokens/s (median) | MFU | peak memory |",
            "|---|---|---|---|---|---|---|",
            f"| {s['model']} | {s['ffn_impl']} | {s['micro_batch']} | {s['compile']} | "
            f"{s['tokens_per_s_median']:,.0f} | {mfu} | {s['peak_mem_gib']:.1f} GiB |",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--name", required=True, help="file stem of the outputs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--skip", type=int, default=2, help="throughput windows to drop (warm-up)")
    args = parser.parse_args()
    summary = summarize(args.run_dir, args.skip)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    markdown = to_markdown(args.name, summary)
    (args.out / f"{args.name}.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
