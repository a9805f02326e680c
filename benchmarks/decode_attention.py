"""The attention of a static decode step: SDPA under the key mask (the step before ops.decode_attention)
against ops.decode_attention, which reads each row's columns by their bounds; both inside one CUDA
graph, at 1, 8 and 64 rows.

    python -m benchmarks.decode_attention [--rows 1 8 64] [--context 1024 2048] [--json F] [--md F]

Each graph runs `--layers` layers with distinct caches (more bytes than the L2 holds, as in a model)
of a 1b model's shape (32 heads of 64). Every row attends to `context` columns of a cache of
`context` columns (the decode step's cache-length bucket, all of it real): the bytes are the same
for both, so the ratio is the kernels'. GB/s counts the keys and values read.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks import common
from benchmarks.decode_ffn import graph_ms
from sparse_llm.model.kv_cache import decode_key_mask
from sparse_llm.ops.decode_attention import decode_attention, sdpa_one_query


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=8, help="distinct caches per graph replay")
    p.add_argument("--reps", type=int, default=50)
    return p.parse_args(argv)


def bench(rows: int, context: int, args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    shape = (rows, context, args.heads, args.head_dim)
    caches = [
        tuple(torch.randn(shape, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
        for _ in range(args.layers)
    ]
    q = torch.randn(rows, 1, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
    first = torch.zeros(rows, dtype=torch.long, device=device)
    last = torch.full((rows,), context - 1, dtype=torch.long, device=device)
    mask = decode_key_mask(first, last, context, torch.bfloat16)  # one a step, shared by its layers

    def sdpa() -> None:
        for k, v in caches:
            sdpa_one_query(q, k, v, mask)

    def ours() -> None:
        for k, v in caches:
            decode_attention(q, k, v, first, last)

    sdpa(), ours()  # compile and tune outside the graphs
    sdpa_us = graph_ms(sdpa, args.reps) * 1e3 / args.layers
    ours_us = graph_ms(ours, args.reps) * 1e3 / args.layers
    gb = 2 * rows * context * args.heads * args.head_dim * 2 / 1e9
    return {
        "rows": rows,
        "context": context,
        "sdpa_us_per_layer": sdpa_us,
        "ours_us_per_layer": ours_us,
        "speedup": sdpa_us / ours_us,
        "sdpa_gbs": gb / (sdpa_us * 1e-6),
        "ours_gbs": gb / (ours_us * 1e-6),
    }


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; {meta['heads']} heads of "
        f"{meta['head_dim']}, {meta['layers']} layers per graph; device copy {meta['copy_gbs']:,.0f} GB/s "
        "(read + write).",
        "",
        "| rows | context | SDPA + mask us/layer | ours us/layer | speedup | SDPA GB/s | ours GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rows']} | {r['context']} | {r['sdpa_us_per_layer']:.1f} | {r['ours_us_per_layer']:.1f} | "
            f"{r['speedup']:.2f}x | {r['sdpa_gbs']:,.0f} | {r['ours_gbs']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = common.require_cuda("benchmarks.decode_attention")
    meta = common.run_meta(
        device,
        heads=args.heads,
        head_dim=args.head_dim,
        layers=args.layers,
        copy_gbs=common.copy_bandwidth_gbs(device),
    )
    results = common.measure_cases(
        itertools.product(args.context, args.rows),
        lambda context, rows: bench(rows, context, args),
        lambda context, rows, row: f"rows {rows} context {context}: {row['speedup']:.2f}x",
    )
    common.write_report(markdown(meta, results), meta, results, args.json, args.md)


if __name__ == "__main__":
    main()
