"""The FFN of a decode step, dense against the decode kernels (kernels/decode_ffn.cu), both inside
one CUDA graph: what the bytes allow at 1, 8 and 64 rows.

    python -m benchmarks.decode_ffn [--rows 1 8 64] [--nnz 15 30] [--layers 8] [--json F] [--md F]
    python -m benchmarks.decode_ffn --rows 1 8 --splits 1 2 4 8 16   # ours at each CTA split too

Each graph runs `--layers` FFNs with distinct weights (more bytes than the L2 holds, so every layer
reads its weights from memory as in a model), out += ffn(x) into one residual. Dense: the three
bf16 GEMMs (cuBLAS) and relu(g) * u. Ours: `ops.ffn_add_` with a cached Wd^T. GB/s counts the
bytes each must read: dense all three matrices; ours the gate plus the rows of Wu and Wd^T of the
units active in the batch (their union), at the non-zeros per token asked for.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.ffn import print_profile
from sparse_llm import ops
from sparse_llm.inference.decode import DecodeGraph


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--nnz", type=float, nargs="+", default=[15, 30])
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--H", type=int, default=5632)
    p.add_argument("--layers", type=int, default=8, help="distinct weight sets per graph replay")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--profile", action="store_true", help="per-kernel times of one eager call of each, per case"
    )
    p.add_argument(
        "--splits",
        type=int,
        nargs="*",
        default=[],
        help="also time ours with up/down as its own launch over these CTAs a row (the op's tuning knob; "
        "the main table: its default plan, one launch at 1 row)",
    )
    return p.parse_args(argv)


def graph_ms(step: Callable[[], None], reps: int) -> float:
    """Median ms of one replay of `step` captured in a CUDA graph (as a decode step is: DecodeGraph)."""
    device = torch.device("cuda")
    return common.median_ms(DecodeGraph(step, device, None, None), device, warmup=0, reps=reps)


def bench_rows(rows: int, nnz: float, args: argparse.Namespace) -> dict:
    d, h, layers = args.D, args.H, args.layers
    loads = [common.make_workload(rows, d, h, nnz, seed=i, device="cuda") for i in range(layers)]
    x = loads[0].x
    weights = [(w.wg, w.wu, w.wd, w.wd.t().contiguous()) for w in loads]
    out = torch.zeros_like(x)

    def dense() -> None:
        for wg, wu, wd, _ in weights:
            out.add_(F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), wd))

    def ours() -> None:
        for wg, wu, wd, wd_t in weights:
            ops.ffn_add_(out, x, wg, wu, wd, impl="cuda", wd_t=wd_t)

    if args.profile:
        for name, fn in (("dense", dense), ("ours", ours)):
            print(f"-- rows {rows}, nnz {nnz:g}: {name}")
            print_profile(fn)

    def ours_split(splits: int) -> Callable[[], None]:
        def run() -> None:
            for wg, wu, _, wd_t in weights:
                torch.ops.sparse_llm.ffn_decode_add_(out, x, wg, wu, wd_t, splits)

        return run

    dense_ms, ours_ms = graph_ms(dense, args.reps), graph_ms(ours, args.reps)
    by_splits = {s: 1e3 * graph_ms(ours_split(s), args.reps) / layers for s in args.splits}
    active = [int((torch.relu(x @ wg.T) > 0).any(0).sum()) for wg, *_ in weights]  # union per layer
    nnz_measured = statistics.fmean(
        float((torch.relu(x @ wg.T) > 0).sum(1).float().mean()) for wg, *_ in weights
    )
    dense_bytes = layers * 3 * h * d * 2
    ours_bytes = sum(h * d * 2 + 2 * a * d * 2 for a in active)
    return {
        "rows": rows,
        "nnz": nnz_measured,
        "union_units": statistics.fmean(active),
        "dense_us_per_layer": 1e3 * dense_ms / layers,
        "ours_us_per_layer": 1e3 * ours_ms / layers,
        "speedup": dense_ms / ours_ms,
        "dense_gbs": dense_bytes / dense_ms / 1e6,
        "ours_gbs": ours_bytes / ours_ms / 1e6,
        "ours_us_per_layer_by_splits": by_splits,
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; D={meta['D']}, H={meta['H']}, "
        f"{meta['layers']} layers per graph; device copy {meta['copy_gbs']:,.0f} GB/s (read + write).",
        "",
        "| rows | nnz/token | units active in the batch | dense us/layer | ours us/layer | speedup | dense GB/s | ours GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['nnz']:.1f} | {r['union_units']:.0f} | {r['dense_us_per_layer']:.1f} | "
            f"{r['ours_us_per_layer']:.1f} | {r['speedup']:.2f}x | {r['dense_gbs']:,.0f} | {r['ours_gbs']:,.0f} |"
        )
    swept = sorted({s for r in rows for s in r["ours_us_per_layer_by_splits"]})
    if swept:
        lines += [
            "",
            "Ours, us a layer, with up/down as its own launch over `--splits` CTAs a row (the table above: the default plan, "
            "the whole FFN in one launch at 1 row):",
            "",
            "| rows | nnz/token | " + " | ".join(f"splits {s}" for s in swept) + " |",
            "|---:|---:|" + "---:|" * len(swept),
        ]
        for r in rows:
            cells = [f"{r['ours_us_per_layer_by_splits'][s]:.1f}" for s in swept]
            lines.append(f"| {r['rows']} | {r['nnz']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = common.require_cuda("benchmarks.decode_ffn")
    meta = common.run_meta(
        device, D=args.D, H=args.H, layers=args.layers, copy_gbs=common.copy_bandwidth_gbs(device)
    )
    rows = common.measure_cases(
        itertools.product(args.rows, args.nnz),
        lambda m, nnz: bench_rows(m, nnz, args),
        lambda m, nnz, row: f"rows {m} nnz {nnz:g}: {row['speedup']:.2f}x",
    )
    common.write_report(markdown(meta, rows), meta, rows, args.json, args.md)


if __name__ == "__main__":
    main()
