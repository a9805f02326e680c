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
from pathlib import Path

import torch

from benchmarks.common import write_report
from benchmarks.decode_ffn import graph_ms
from benchmarks.inference import copy_bandwidth_gbs
from sparse_llm.model.kv_cache import decode_key_mask
from sparse_llm.ops.decode_attention import decode_attention, sdpa_one_query
from sparse_llm.training.run_info import collect_run_info


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=8, help="distinct caches per graph replay")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    return p.parse_args()


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


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py needs a CUDA GPU")
    meta = {
        **collect_run_info(torch.device("cuda"), world_size=1),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "layers": args.layers,
        "copy_gbs": copy_bandwidth_gbs(torch.device("cuda")),
    }
    results = []
    for context in args.context:
        for rows in args.rows:
            results.append(bench(rows, context, args))
            print(f"rows {rows} context {context}: {results[-1]['speedup']:.2f}x", flush=True)
            torch.cuda.empty_cache()
    write_report(markdown(meta, results), meta, results, args.json, args.md)


if __name__ == "__main__":
    main()
