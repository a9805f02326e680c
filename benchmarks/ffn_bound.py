"""Lower bound on an exact hybrid sparse FFN on the synthetic workload, against measured dense.

The design of the CUDA kernels: the gate GEMM is dense (the sign of every g is needed), rows with
more than T active units take dense GEMMs on the gathered rows, the others gather one weight row
per active unit. This script charges each part at a fixed rate, with no launch, sync, pack or
scheduling cost, every part at its rate at once, and picks the best T per case:

    gate GEMM       2 M D H flops
    heavy row       k GEMM rows over the units that fire in any heavy row: k * 2 D H_fired flops
                    (k = 2 for the forward; 7 forward + backward: up, down, dh, dx twice, dWg,
                    dWu, dWd, with g from the gate GEMM above)
    light non-zero  gathered bytes. Forward: a row of Wu and of Wd (2 * 2D bytes), divided by the
                    reuse factor (a unit shared by rows of one block is read once). Forward +
                    backward: also Wd, Wg and Wu rows again (3 * 2D / reuse) and the rows of x and
                    grad_y for the weight gradients (2 * 2D, no reuse), at their own rate: those
                    activations (134 MB at M = 16384) do not fit L2 as the weights (69 MB) nearly do

The defaults are optimistic for an H100 or H200: 800 TFLOP/s is above what cuBLAS reaches on the
gate GEMM (~750), 7 TB/s above the measured L2 gather rate of the sparse up/down (~5), and 1.4 is
the measured reuse within 64-row blocks. Time over the bound is what any kernel of this design
can still win; dense time over the bound is the largest speed-up it can reach. `--measured-rates`
sets the rates our kernels reach on an H100 instead (measured with the 5194881 kernels; docs/kernels.md).

    python -m benchmarks.ffn_bound --measured benchmarks/results/ffn_inference_h100.json \
        --measured-train benchmarks/results/ffn_train_h100.json --md bound.md
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks import common

FORWARD_GEMM_ROWS = 2
TRAIN_GEMM_ROWS = 7
BF16_BYTES = 2


@dataclass
class Rates:
    gemm_flops: float  # per second
    gather_bytes: float  # weight rows, per second
    reuse: float  # weight-row reads saved by sharing within a block of rows
    activation_gather_bytes: float | None = None  # rows of x and grad_y, per second; None: gather_bytes

    @property
    def activation_rate(self) -> float:
        """Bytes per second for the rows of x and grad_y."""
        return self.activation_gather_bytes or self.gather_bytes


# What our kernels reach on an H100 at 30 non-zeros, M = 16384 (5194881): cuBLAS's gate GEMM 378
# GFLOP in 0.488 ms; the light up/down and the per-row backward gather weight rows at 5.0-6.2 TB/s; the
# per-unit kernels gather x and grad_y rows at ~4.7 TB/s; no reuse across rows.
MEASURED_H100 = Rates(gemm_flops=775e12, gather_bytes=5.5e12, reuse=1.0, activation_gather_bytes=4.7e12)


@dataclass
class Bound:
    ms: float
    threshold: int  # rows with more active units than this take the GEMMs
    heavy_rows: float  # share of rows
    fired_units: float  # share of units the heavy GEMMs cover


def activity_profile(
    m: int, d: int, h: int, nnz: float, seed: int, chunk: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """(active units per row [M], for each unit the largest such count among the rows it fires in
    [H], 0 if it never fires), for the synthetic workload of benchmarks/ffn.py, in float32."""
    w = common.make_workload(m, d, h, nnz, seed=seed, dtype=torch.float32)
    row_counts = torch.empty(m, dtype=torch.long)
    unit_max_row = torch.zeros(h, dtype=torch.long)
    for start in range(0, m, chunk):
        active = (w.x[start : start + chunk] @ w.wg.T) > 0
        counts = active.sum(1)
        row_counts[start : start + chunk] = counts
        unit_max_row = torch.maximum(unit_max_row, (active * counts[:, None]).amax(0))
    return row_counts, unit_max_row


def best_bound(
    row_counts: torch.Tensor, unit_max_row: torch.Tensor, d: int, rates: Rates, train: bool
) -> Bound:
    """The smallest modelled time over every threshold (module docstring)."""
    m, h = row_counts.numel(), unit_max_row.numel()
    gemm_rows = TRAIN_GEMM_ROWS if train else FORWARD_GEMM_ROWS
    weight_rows = 5 if train else 2
    activation_rows = 2 if train else 0
    light_s_per_nnz = (
        weight_rows / rates.reuse * d * BF16_BYTES / rates.gather_bytes
        + activation_rows * d * BF16_BYTES / rates.activation_rate
    )
    gate_s = 2 * m * d * h / rates.gemm_flops
    best: Bound | None = None
    for threshold in range(int(row_counts.max()) + 1):
        heavy = row_counts > threshold
        fired = int((unit_max_row > threshold).sum())
        heavy_s = int(heavy.sum()) * gemm_rows * 2 * d * fired / rates.gemm_flops
        light_s = int(row_counts[~heavy].sum()) * light_s_per_nnz
        ms = (gate_s + heavy_s + light_s) * 1e3
        if best is None or ms < best.ms:
            best = Bound(ms, threshold, float(heavy.float().mean()), fired / h)
    assert best is not None
    return best


def measured_cases(path: Path | None) -> dict[tuple[int, float], dict]:
    """benchmarks/ffn.py results keyed by (M, target non-zeros)."""
    if path is None:
        return {}
    if not path.is_file():
        raise SystemExit(f"no such results file: {path}")
    return {(r["M"], float(r["nnz_target"])): r for r in json.loads(path.read_text())["results"]}


def ours_ms(result: dict, train: bool) -> float:
    """Our measured time: the training total, or the better inference variant (with or without
    the cached Wd^T)."""
    if train:
        return result["ms_ours"]
    return min(min(result["ms_ours"].values()), result["ms_ours_cached_wdT"])


def row(m: int, nnz: float, bound: Bound, result: dict | None, train: bool) -> dict:
    out = {"M": m, "nnz": nnz, "pass": "forward+backward" if train else "forward", **asdict(bound)}
    if result is not None:
        dense, ours = result["ms_dense_compiled"], ours_ms(result, train)
        out |= {
            "ms_dense_compiled": dense,
            "ms_ours": ours,
            "max_speedup": dense / bound.ms,
            "ours_speedup": dense / ours,
            "ours_over_bound": ours / bound.ms,
        }
    return out


def markdown(rows: list[dict], rates: Rates, meta: str) -> str:
    lines = [
        "# Lower bound of the exact hybrid sparse FFN (benchmarks/ffn_bound.py)",
        "",
        f"{meta}. Rates: GEMMs {rates.gemm_flops / 1e12:.0f} TFLOP/s, weight-row gathers "
        f"{rates.gather_bytes / 1e12:.1f} TB/s, x and grad_y rows {rates.activation_rate / 1e12:.1f} TB/s, weight-row "
        f"reuse {rates.reuse:g}; no launch, sync or pack cost. Dense and ours: measured (benchmarks/ffn.py).",
        "",
        "| pass | M | nnz | bound ms | best threshold | heavy rows | units in heavy GEMMs "
        "| dense compiled ms | ours ms | ours / bound | ours vs dense | largest possible vs dense |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        measured = (
            f"{r['ms_dense_compiled']:.3f} | {r['ms_ours']:.3f} | {r['ours_over_bound']:.2f}x | "
            f"{r['ours_speedup']:.2f}x | {r['max_speedup']:.2f}x"
            if "ms_dense_compiled" in r
            else "- | - | - | - | -"
        )
        lines.append(
            f"| {r['pass']} | {r['M']} | {r['nnz']:g} | {r['ms']:.3f} | {r['threshold']} | "
            f"{r['heavy_rows']:.1%} | {r['fired_units']:.0%} | {measured} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--M", type=int, nargs="+", default=[16384], help="tokens")
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--H", type=int, default=5632)
    p.add_argument("--nnz", type=float, nargs="+", default=[15, 30, 60, 120], help="mean non-zeros per token")
    p.add_argument("--seed", type=int, default=0, help="workload seed (benchmarks/ffn.py's first input set)")
    p.add_argument("--gemm-tflops", type=float, default=800.0)
    p.add_argument("--gather-tbps", type=float, default=7.0)
    p.add_argument("--reuse", type=float, default=1.4)
    p.add_argument(
        "--activation-gather-tbps",
        type=float,
        default=None,
        help="x and grad_y rows (default: --gather-tbps)",
    )
    p.add_argument(
        "--measured-rates", action="store_true", help="the rates our kernels reach on an H100 (overrides)"
    )
    p.add_argument("--measured", type=Path, default=None, help="benchmarks/ffn.py JSON (inference)")
    p.add_argument("--measured-train", type=Path, default=None, help="benchmarks/ffn.py --train JSON")
    p.add_argument("--tiny", action="store_true", help="a small workload: checks the script end to end")
    args = p.parse_args(argv)
    if args.tiny:
        args.M, args.D, args.H, args.nnz = [512], 64, 256, [4, 16]
    given = [args.gemm_tflops, args.gather_tbps, args.reuse, args.activation_gather_tbps]
    if min(v for v in given if v is not None) <= 0:
        p.error("--gemm-tflops, --gather-tbps, --activation-gather-tbps and --reuse must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    measured = {False: measured_cases(args.measured), True: measured_cases(args.measured_train)}
    activation = None if args.activation_gather_tbps is None else args.activation_gather_tbps * 1e12
    rates = (
        MEASURED_H100
        if args.measured_rates
        else Rates(args.gemm_tflops * 1e12, args.gather_tbps * 1e12, args.reuse, activation)
    )

    rows = []
    for m in args.M:
        for nnz in args.nnz:
            row_counts, unit_max_row = activity_profile(m, args.D, args.H, nnz, args.seed)
            for train in (False, True):
                bound = best_bound(row_counts, unit_max_row, args.D, rates, train)
                rows.append(row(m, nnz, bound, measured[train].get((m, float(nnz))), train))
                print(
                    f"M={m} nnz={nnz:g} {rows[-1]['pass']}: bound {bound.ms:.3f} ms at threshold "
                    f"{bound.threshold} ({bound.heavy_rows:.1%} heavy rows)",
                    flush=True,
                )
    sources = ", ".join(str(s) for s in (args.measured, args.measured_train) if s is not None)
    meta = f"D={args.D}, H={args.H}" + (f", measured: {sources}" if sources else "")
    table = markdown(rows, rates, meta)
    print(table)
    if args.json:
        args.json.write_text(
            json.dumps({"rates": asdict(rates), "meta": meta, "results": rows}, indent=2) + "\n"
        )
    if args.md:
        args.md.write_text(table)


if __name__ == "__main__":
    main()
