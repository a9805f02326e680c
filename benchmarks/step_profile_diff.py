"""Whole runs side by side, with their profiled steps kernel by kernel.

    python -m benchmarks.step_profile_diff \\
      --run auto whole_run_auto.json step_profile_rank0_steps_701_703.txt \\
      --run hot whole_run_auto_hot.json hot/step_profile_rank0_steps_701_703.txt \\
      --json diff.json --md diff.md

Each `--run` is a label, a whole run's JSON (`benchmarks.whole_run`) and the text report of a
`benchmarks.step_profile.StepProfile` callback in that run. The report puts the runs' figures in one
table (steady tokens/s, wall clock, peak memory, held-out loss and L0, hot units, graphs, and the
profiled step's wall, GPU compute and idle ms), then the kernels whose time differs most from the
first run's, ms a step each.

Runs from different leases differ by the machines' clocks as well as by the code (5-10% in tokens/s
here). The `reference kernels` row sums the kernels no FFN choice changes (attention's forward and
backward, the loss), so its ratio to the first run's says how much of a difference is the machine.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from benchmarks import common

# Kernels whose work the FFN's implementation does not change: the machine's speed, run to run.
REFERENCE_KERNELS = ("native_sdpa", "cudnn::fusion::", "cross_entropy_rows_kernel")
RUN_FIELDS = (
    ("steady_tokens_per_s", "steady tokens/s", "{:,.0f}"),
    ("wall_s_after_first_step", "wall after step 1, s", "{:.1f}"),
    ("peak_mem_gib", "peak GiB", "{:.2f}"),
    ("final_val_loss", "held-out loss", "{:.4f}"),
    ("heldout_l0", "held-out L0", "{:.1f}"),
    ("hot_units_at_end", "hot units at the end", "{:.0f}"),
    ("graphs", "graphs compiled", "{:.0f}"),
)
STEP_FIELDS = ("wall_ms", "compute_ms", "idle_ms")
_SPLIT_ROW = re.compile(r"^\| (\w+_ms) \| ([-\d.]+) \|$")
_KERNEL_ROW = re.compile(r"^\| ([\d.]+) \| ([\d.]+) \| (.+) \|$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument(
        "--run",
        nargs=3,
        action="append",
        required=True,
        metavar=("LABEL", "WHOLE_RUN_JSON", "STEP_PROFILE_TXT"),
        help="one run: its label, whole-run JSON and step-profile text report",
    )
    p.add_argument("--top", type=int, default=25, help="kernels listed, by their largest difference")
    return p.parse_args(argv)


def read_step_profile(path: Path) -> dict[str, Any]:
    """A StepProfile text report's per-step split (`*_ms` rows) and its kernel table (ms a step
    by kernel name, the remaining kernels under one name)."""
    split: dict[str, float] = {}
    kernels: dict[str, float] = {}
    in_kernels = False
    for line in path.read_text().splitlines():
        if line.startswith("| us per call |"):
            in_kernels = True
        elif in_kernels and (m := _KERNEL_ROW.match(line)):
            name = "(the remaining kernels)" if m.group(3).startswith("(the remaining") else m.group(3)
            kernels[name] = kernels.get(name, 0.0) + float(m.group(1)) / 1000
        elif not in_kernels and (m := _SPLIT_ROW.match(line)):
            split[m.group(1)] = float(m.group(2))
    if not kernels or "compute_ms" not in split:
        raise ValueError(f"{path} is not a step profile report (no split or kernel table)")
    return {"split": split, "kernel_ms": kernels}


def reference_ms(kernels: dict[str, float]) -> float:
    return sum(ms for name, ms in kernels.items() if any(part in name for part in REFERENCE_KERNELS))


def read_run(label: str, whole_run: Path, profile: Path) -> dict[str, Any]:
    report = json.loads(whole_run.read_text())
    result = report["results"][0]
    step = read_step_profile(profile)
    return {
        "label": label,
        "commit": report["meta"].get("commit"),
        "date": report["meta"].get("date"),
        "device": report["meta"].get("device"),
        **{key: result.get(key) for key, _, _ in RUN_FIELDS},
        **step["split"],
        "reference_kernels_ms": reference_ms(step["kernel_ms"]),
        "kernel_ms": step["kernel_ms"],
    }


def markdown(runs: list[dict[str, Any]], top: int) -> str:
    labels = [r["label"] for r in runs]
    head = "| | " + " | ".join(labels) + " |\n|---|" + "---:|" * len(runs)
    lines = [
        "Runs: "
        + "; ".join(f"{r['label']} {r['commit']} on {r['device']} ({r['date']})" for r in runs)
        + ".",
        "",
        head,
    ]

    def cell(value: Any, fmt: str) -> str:
        return "-" if value is None else fmt.format(value)

    for key, name, fmt in RUN_FIELDS:
        lines.append(f"| {name} | " + " | ".join(cell(r[key], fmt) for r in runs) + " |")
    for key in STEP_FIELDS:
        lines.append(
            f"| profiled step {key} | " + " | ".join(cell(r.get(key), "{:.2f}") for r in runs) + " |"
        )
    first = runs[0]["reference_kernels_ms"]
    lines.append(
        "| reference kernels ms (ratio to the first) | "
        + " | ".join(
            f"{r['reference_kernels_ms']:.2f} ({r['reference_kernels_ms'] / first:.3f})" for r in runs
        )
        + " |"
    )
    names = set().union(*(r["kernel_ms"] for r in runs))
    base = runs[0]["kernel_ms"]

    def spread(name: str) -> float:
        return max(abs(r["kernel_ms"].get(name, 0.0) - base.get(name, 0.0)) for r in runs)

    ranked = sorted(names, key=lambda n: -spread(n))[:top]
    lines += [
        "",
        f"Kernels, ms a profiled step, ranked by their largest difference from {labels[0]}'s "
        "(a kernel under a report's top 40 counts as 0 there, inside its remaining kernels):",
        "",
        "| kernel | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    for name in ranked:
        lines.append(f"| {name} | " + " | ".join(f"{r['kernel_ms'].get(name, 0.0):.2f}" for r in runs) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    runs = [read_run(label, Path(whole), Path(profile)) for label, whole, profile in args.run]
    headline = {
        "compute_ms": {r["label"]: r["compute_ms"] for r in runs},
        "steady_tokens_per_s": {r["label"]: r["steady_tokens_per_s"] for r in runs},
    }
    meta = {"runs": [{k: r[k] for k in ("label", "commit", "date", "device")} for r in runs]}
    common.write_report(markdown(runs, args.top), meta, runs, args.json, args.md, headline)
    return runs


if __name__ == "__main__":
    main()
