"""Does the sparse path change the loss? Every joined whole-run pair's final held-out loss ratio
(sparse over dense, from `benchmarks.whole_run --join`) beside every A/A ratio (the dense run
repeated with the same seed and data: the runs' own nondeterminism), with their mean and spread.

Two runs of one implementation end 0-1% apart (attention's backward is not deterministic), so one
A/B pair says little; many pairs against many A/A pairs do:

    python -m benchmarks.loss_pairs benchmarks/results/run_1b_h100.json benchmarks/results/run_1b_h200*.json \\
      --json loss_pairs_1b.json --md loss_pairs_1b.md --plot loss_pairs_1b.png

Each pair is listed once, as are A/A pairs that several files (or pairs) share. Files holding runs
of other presets or GPU counts may be mixed in: each row names its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import script_parser


@dataclass(frozen=True)
class LossPair:
    """One joined pair: where it is committed, what ran, and its loss ratios."""

    file: str
    device: str
    commit: str
    preset: str
    gpus: int
    seed: int | None
    dense_loss: float
    sparse_loss: float
    ratio: float  # sparse / dense
    aa_ratio: float | None  # the dense run again over the dense run, where the pair has one
    runs: tuple[str, str]  # the dense and sparse runs' dates: a pair in two files is counted once
    aa_runs: tuple[str, str] | None  # the two dense runs' dates, in order: an A/A pair counted once


def read_pairs(path: Path) -> list[LossPair]:
    """The pairs of one joined whole-run JSON (`whole_run --join`)."""
    data = json.loads(path.read_text())
    pairs = data["results"][0]["pairs"]
    metas = data["meta"]["pairs"]
    out = []
    for pair, meta in zip(pairs, metas, strict=True):
        dense, sparse = pair["dense"], pair["sparse"]
        aa = pair.get("aa")
        out.append(
            LossPair(
                file=path.name,
                device=meta["sparse"].get("device", "?"),
                commit=meta["sparse"].get("commit", "?"),
                preset=dense.get("preset", "?"),
                gpus=dense.get("gpus") or 1,
                seed=dense.get("seed"),
                dense_loss=dense["final_val_loss"],
                sparse_loss=sparse["final_val_loss"],
                ratio=sparse["final_val_loss"] / dense["final_val_loss"],
                aa_ratio=None if aa is None else aa["final_loss_ratio"],
                runs=(meta["dense"]["date"], meta["sparse"]["date"]),
                aa_runs=None
                if aa is None
                else tuple(sorted((meta["dense"]["date"], meta["dense_again"]["date"]))),
            )
        )
    return out


def spread(values: list[float]) -> dict[str, float | int | None]:
    """n, mean, sample standard deviation, the mean's standard error, lowest and highest."""
    n = len(values)
    stdev = statistics.stdev(values) if n > 1 else None
    return {
        "n": n,
        "mean": statistics.fmean(values) if values else None,
        "stdev": stdev,
        "stderr": None if stdev is None else stdev / n**0.5,
        "min": min(values, default=None),
        "max": max(values, default=None),
    }


def report(files: list[Path]) -> dict[str, Any]:
    """The pairs of `files` (each once), the A/B and A/A spreads, and what they say."""
    pairs: dict[tuple[str, str], LossPair] = {}
    for path in files:
        for pair in read_pairs(path):
            known = pairs.get(pair.runs)
            if known is None or (known.aa_runs is None and pair.aa_runs is not None):
                pairs[pair.runs] = pair
    aa: dict[tuple[str, str], float] = {}
    for pair in pairs.values():
        if pair.aa_runs is not None:  # two pairs may share their two dense runs, either way round
            aa.setdefault(pair.aa_runs, pair.aa_ratio)
    ab, aa_spread = spread([p.ratio for p in pairs.values()]), spread(list(aa.values()))
    return {
        "pairs": [asdict(p) for p in pairs.values()],
        "aa_ratios": list(aa.values()),
        "ab": ab,
        "aa": aa_spread,
        "verdict": verdict(ab, aa_spread),
    }


def verdict(ab: dict[str, Any], aa: dict[str, Any]) -> str:
    """One sentence: is the A/B mean off 1 by more than two standard errors, and is the A/B spread
    wider than the A/A one."""
    if ab["stderr"] is None:
        return "one pair: no spread to judge it by; run more pairs and an A/A pair"
    shifted = abs(ab["mean"] - 1) > 2 * ab["stderr"]
    mean = (
        f"the A/B mean {ab['mean']:.4f} is {'more' if shifted else 'less'} than two standard errors "
        f"({2 * ab['stderr']:.4f}) from 1: {'a shift' if shifted else 'no shift detected'}"
    )
    if aa["stdev"] is None:
        return mean + "; too few A/A pairs to compare the spreads"
    wider = ab["stdev"] > aa["stdev"]
    return (
        f"{mean}; the A/B pairs spread {ab['stdev']:.4f} (standard deviation) against the A/A pairs' "
        f"{aa['stdev']:.4f}: {'wider than' if wider else 'within'} the runs' own nondeterminism"
    )


def markdown(result: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str = ".4f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "# Final held-out loss, sparse over dense, against dense over dense (A/A)",
        "",
        "Each row a whole run pair (`benchmarks/whole_run.py`, the trainer from initialisation to L0 30);",
        "A/A: its dense run repeated with the same seed and data, where the pair has one.",
        "",
        "| file | device | commit | preset | GPUs | seed | dense loss | sparse loss | A/B ratio | A/A ratio |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["pairs"]:
        lines.append(
            f"| {p['file']} | {p['device']} | {p['commit']} | {p['preset']} | {p['gpus']} | "
            f"{fmt(p['seed'], 'd')} | {p['dense_loss']:.4f} | {p['sparse_loss']:.4f} | {p['ratio']:.4f} | "
            f"{fmt(p['aa_ratio'])} |"
        )
    lines += [
        "",
        "| | pairs | mean | standard deviation | standard error | lowest | highest |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, key in (("A/B (sparse / dense)", "ab"), ("A/A (dense / dense)", "aa")):
        s = result[key]
        lines.append(
            f"| {name} | {s['n']} | {fmt(s['mean'])} | {fmt(s['stdev'])} | {fmt(s['stderr'])} | "
            f"{fmt(s['min'])} | {fmt(s['max'])} |"
        )
    lines += ["", result["verdict"][0].upper() + result["verdict"][1:] + ".", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ab = [p["ratio"] for p in result["pairs"]]
    aa = result["aa_ratios"]
    fig, ax = plt.subplots(figsize=(7, 2.6))
    ax.scatter(ab, [1] * len(ab), label="A/B: sparse / dense", alpha=0.7)
    ax.scatter(aa, [0] * len(aa), label="A/A: dense / dense", alpha=0.7, marker="s")
    ax.axvline(1.0, color="grey", linewidth=0.8)
    ax.set_yticks([0, 1], ["A/A", "A/B"])
    ax.set_ylim(-0.7, 1.7)
    ax.set_xlabel("final held-out loss ratio")
    ax.set_title("Whole runs: the sparse path's loss against the runs' own spread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = script_parser(__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="joined whole-run JSONs (whole_run --join)")
    parser.add_argument("--plot", type=Path, default=None, help="write the ratios as a strip plot here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    missing = [str(p) for p in args.files if not p.is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)}")
    result = report(args.files)
    text = markdown(result)
    print(text)
    if args.json:
        args.json.write_text(
            json.dumps({"meta": {"files": [str(p) for p in args.files]}, "results": [result]}, indent=2)
        )
    if args.md:
        args.md.write_text(text)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
