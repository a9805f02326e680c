"""Where the training block op's GPU time goes beyond the sparse op's, kernel by kernel, on a
trained model's layers.

    python -m benchmarks.block_kernels --model runs/sparse_1b [--share 0.01] [--layers 0 3 12 17]
    python -m benchmarks.block_kernels --tiny      # CPU, seconds: the script end to end

The FFN op alone (`ffn_forward_train` on the layer's bf16 weights) is what `layer_ffn.py` and
`column_hybrid.py` time; a training step runs the block op (`ffn_block_train`: norm, FFN and residual
add under bf16 autocast over fp32 master weights, on the capacity path with the layer's capacities).
column_hybrid.py measured the block op, eager, at 91.9 ms GPU busy over a run's 18 layers where the
op alone took 52.3 (benchmarks/results/column_hybrid_1b_h200_run3.md): this script says which
kernels make the difference, eager or compiled. Per layer, each variant's forward+backward (with the L1 term) is timed as
`layer_ffn.timed` times it, its kernels' microseconds kept; variants:

    op            ffn_forward_train, bf16 weights (the FFN input as x)
    block         ffn_block_train, fp32 residual and master weights, host-read path (no capacities)
    block_cap     the same on the capacity path, as the trainer runs it (capacities warmed by one call)
    block_cap_hot the capacity path with the hot units at --share (model.ffn_hot_share)
    dense_block   the model's dense block (norm, FFN, residual; compiled on a GPU)

The block variants run eager unless `--compile` (each compiled as the trainer compiles a layer,
`model.compiling.compile_region`: the norm's and the casts' elementwise kernels are then fused; a
plain torch.compile would break the graph at the sparse op and run its autograd function eager;
the report counts the graph breaks and the graphs compiled). The block's input is the layer's FFN
input as the residual with a norm weight of ones, as column_hybrid.py's: the norm rescales each row, which leaves the pattern of active units as it was.
The capacity variants need the CUDA kernels; on the CPU (--tiny) they are left out.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.column_hybrid import block_builder, block_call, block_graph_room, dense_block, hot_units
from benchmarks.ffn import train_ours
from benchmarks.layer_ffn import timed
from benchmarks.row_density import model_inputs, model_parser, parse_model_args, training_impl
from sparse_llm.model.compiling import compiled_graphs
from sparse_llm.ops.ffn.training import TrainCapacities

VARIANTS = ("op", "block", "block_cap", "block_cap_hot", "dense_block")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--share", type=float, default=0.01, help="the hot units' share (model.ffn_hot_share)")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="the layers timed (default all)")
    p.add_argument("--sets", type=int, default=3, help="copies of a layer's weights the timed calls rotate")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--top", type=int, default=25, help="kernels listed one by one; the rest in one line")
    p.add_argument("--compile", action="store_true", help="compile the block variants (as the trainer does)")
    return parse_model_args(p, argv)


def time_layer(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    impl: str,
    args: argparse.Namespace,
    dense: Callable,
) -> dict[str, Any]:
    """Each variant's timing (`layer_ffn.timed`, with kernels on a GPU) on one layer whose active
    units are `active` ([M, H])."""
    kernels = x.is_cuda
    built = block_builder(args.compile)

    op_sets = [
        tuple(t.detach().clone().requires_grad_(True) for t in (x, *weights)) for _ in range(args.sets)
    ]
    block_inputs = (x.float(), torch.ones(x.shape[1], device=x.device), *(w.float() for w in weights))
    block_sets = [
        tuple(t.detach().clone().requires_grad_(True) for t in block_inputs) for _ in range(args.sets)
    ]
    hot = hot_units(active, args.share)
    row: dict[str, Any] = {"l0": active.sum(-1).float().mean().item(), "hot_units": int(hot.numel())}
    calls: dict[str, tuple[Callable, list]] = {
        "op": (train_ours(impl, args.heavy_threshold), op_sets),
        "block": (built(block_call(impl, None)), block_sets),
        "dense_block": (dense, block_sets),
    }
    if impl == "cuda":
        calls["block_cap"] = (built(block_call(impl, None, TrainCapacities.new())), block_sets)
        calls["block_cap_hot"] = (built(block_call(impl, hot, TrainCapacities.new())), block_sets)
    for name, (fn, sets) in calls.items():
        row[name] = timed(fn, sets, args, kernels=kernels)
    return row


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process so far."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def kernel_totals(rows: list[dict], variant: str) -> dict[str, float]:
    """A variant's microseconds by kernel, summed over the layers."""
    total: dict[str, float] = {}
    for r in rows:
        for label, us in r.get(variant, {}).get("kernel_us", {}).items():
            total[label] = total.get(label, 0.0) + us
    return total


def markdown(meta: dict, rows: list[dict], top: int) -> str:
    key = "gpu_ms" if "gpu_ms" in rows[0]["op"] else "ms"
    what = "GPU busy ms" if key == "gpu_ms" else "event-timed ms"
    variants = [v for v in VARIANTS if v in rows[0]]
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; model {meta['model']}; "
        f"{meta['tokens']} tokens ({meta['text']}); impl {meta['impl']}; hot-unit share {meta['share']:g}; "
        f"forward+backward with the L1 term, {what}; the block variants {meta['block_mode']}, dense_block "
        f"{meta['dense_mode']}; {meta['graph_breaks']} graph breaks, {meta['graphs']} graphs compiled.",
        "",
        "| layer | L0 | hot units | " + " | ".join(variants) + " |",
        "|---:|---:|---:|" + "---:|" * len(variants),
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['l0']:.1f} | {r['hot_units']} | "
            + " | ".join(f"{r[v][key]:.3f}" for v in variants)
            + " |"
        )
    sums = meta["totals"]
    lines += ["| sum | | | " + " | ".join(f"**{sums[v]:.2f}**" for v in variants) + " |"]
    totals = {v: kernel_totals(rows, v) for v in variants}
    if not totals["op"]:
        return "\n".join(lines) + "\n"
    # Ranked by what the block on the capacity path (the trainer's) adds to the op, else the block.
    block = "block_cap" if "block_cap" in variants else "block"
    labels = sorted(
        set().union(*totals.values()),
        key=lambda k: (
            -(abs(totals[block].get(k, 0.0) - totals["op"].get(k, 0.0)) + 1e-3 * totals[block].get(k, 0.0))
        ),
    )
    groups = [[k] for k in labels[:top]] + ([labels[top:]] if len(labels) > top else [])
    lines += [
        "",
        f"Kernel by kernel, ms summed over the layers, ranked by what `{block}` adds to (or saves on) `op`:",
        "",
        "| kernel | " + " | ".join(variants) + f" | {block} - op |",
        "|---|" + "---:|" * (len(variants) + 1),
    ]
    for group in groups:
        name = group[0] if len(group) == 1 else f"(the other {len(group)})"
        ms = {v: sum(totals[v].get(k, 0.0) for k in group) / 1000 for v in variants}
        lines.append(
            f"| {name} | "
            + " | ".join(f"{ms[v]:.2f}" for v in variants)
            + f" | {ms[block] - ms['op']:+.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    model, inputs, text, name = model_inputs(args, device)
    impl = training_impl(model, device)
    dense = torch.compile(dense_block, dynamic=False) if device.type == "cuda" else dense_block
    breaks_before, graphs_before = graph_breaks(), compiled_graphs()
    layers = args.layers if args.layers is not None else list(range(len(inputs)))
    rows = []
    with block_graph_room():
        for layer in layers:
            x, mlp = inputs[layer], model.model.layers[layer].mlp
            active = common.gate_active(x, mlp)
            row = {
                "layer": layer,
                **time_layer(x, common.ffn_weights(mlp, x.dtype), active, impl, args, dense),
            }
            rows.append(row)
    key = "gpu_ms" if device.type == "cuda" else "ms"
    meta = common.run_meta(
        device,
        model=name,
        tokens=inputs[0].shape[0],
        text=text,
        impl=impl,
        share=args.share,
        block_mode="compiled" if args.compile else "eager",
        dense_mode="compiled" if device.type == "cuda" else "eager",
        graph_breaks=graph_breaks() - breaks_before,
        graphs=compiled_graphs() - graphs_before,
    )
    meta["totals"] = {v: sum(r[v][key] for r in rows) for v in VARIANTS if v in rows[0]}
    headline = {
        "timing": key,
        "block_over_op": meta["totals"]["block"] / meta["totals"]["op"],
        **(
            {
                "block_cap_over_op": meta["totals"]["block_cap"] / meta["totals"]["op"],
                "block_cap_hot_over_op": meta["totals"]["block_cap_hot"] / meta["totals"]["op"],
            }
            if "block_cap" in meta["totals"]
            else {}
        ),
    }
    common.write_report(markdown(meta, rows, args.top), meta, rows, args.json, args.md, headline)
    return rows


if __name__ == "__main__":
    main()
