"""The training backward's dense units, layer by layer on a trained model's activations: from which
share of a step's rows a unit's light entries should make it a dense unit (its weight-gradient rows
by GEMMs over all rows; `ops.ffn.training.DENSE_UNIT_ROW_SHARE`, docs/kernels.md part 7), measured.

    python -m benchmarks.dense_units --model runs/sparse_1b [--shares 0 0.00390625 0.0078125 0.015625 0.03125]
    python -m benchmarks.dense_units --tiny      # CPU, seconds: the statistics alone, no timing

The layers' FFN inputs come as in `layer_ffn.py` (one forward over held-out text, or `--inputs`).
Per layer and share s: the dense units (light entries on at least ceil(s M) rows; s = 0: none), how
many there are and the share of the light entries they hold; on a GPU also the op's training
forward+backward with the L1 term through the extension at that threshold (GPU busy ms and
event-timed ms, rotating `--sets` copies of the layer's weights as `layer_ffn.py` does). The totals:
each share's sum over the layers, and the sum with the fastest share in each layer.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.layer_ffn import GRAD_L1, rotating
from benchmarks.row_density import model_inputs, model_parser, parse_model_args
from sparse_llm.ops.ffn.training import DENSE_UNIT_ROW_SHARE, dense_unit_min_fires

DEFAULT_SHARES = (0.0, 1 / 256, 1 / 128, DENSE_UNIT_ROW_SHARE, 1 / 32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument(
        "--shares", type=float, nargs="+", default=list(DEFAULT_SHARES), help="row shares (0: none)"
    )
    p.add_argument("--sets", type=int, default=3, help="copies of a layer's weights the timed calls rotate")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    args = parse_model_args(p, argv)
    if any(not 0 <= s <= 1 for s in args.shares):
        p.error(f"--shares must be in [0, 1], got {args.shares}")
    return args


def min_fires(rows: int, share: float) -> int:
    """The extension's dense_min_fires for a row share: light entries on ceil(share x rows) rows, 0 for none."""
    return 0 if share == 0 else dense_unit_min_fires(rows, share)


def dense_unit_stats(active: torch.Tensor, heavy_threshold: int, fires: int) -> dict[str, float]:
    """For a layer's gate pattern `active` ([M, H] bool): the dense units at `fires` (0: none), their
    number and the share of the light rows' entries they hold."""
    light_rows = active.sum(-1) <= heavy_threshold
    light_fires = (active & light_rows[:, None]).sum(0)
    dense = light_fires >= fires if fires > 0 else torch.zeros_like(light_fires, dtype=torch.bool)
    entries = int(light_fires.sum())
    return {
        "dense_units": int(dense.sum()),
        "dense_entry_share": float(light_fires[dense].sum()) / entries if entries else 0.0,
    }


def op_call(
    x: torch.Tensor, heavy_threshold: int, fires: int, grad_y: torch.Tensor, grad_l1: torch.Tensor
) -> Callable[..., Any]:
    """The extension's training forward, then its backward, at dense_min_fires `fires`: fn(wg, wu, wd)."""
    from sparse_llm.ops._extension import extension

    ext = extension()

    def call(wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> Any:
        out = ext.ffn_train_forward(x, wg, wu, wd, None, heavy_threshold, fires)
        return ext.ffn_train_backward(grad_y, grad_l1, x, wg, wu, wd, out[2], *out[6:])

    return call


def time_share(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], fires: int, args: argparse.Namespace
) -> dict[str, float]:
    """ms (event-timed) and gpu_ms (GPU busy) of one forward+backward call at `fires`."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    grad_y = torch.randn(x.shape, device=x.device, generator=gen).to(x.dtype)
    grad_l1 = torch.tensor(GRAD_L1, device=x.device)
    sets = [tuple(w.clone() for w in weights) for _ in range(args.sets)]
    call = rotating(op_call(x, args.heavy_threshold, fires, grad_y, grad_l1), sets)
    spans = common.profiled_device_spans(call, calls=args.sets)
    return {
        "ms": common.median_ms(call, x.device, args.warmup, args.reps),
        "gpu_ms": common.busy_ms(spans, calls=args.sets),
    }


def totals(rows: list[dict], shares: list[float]) -> dict[str, float]:
    """GPU busy ms summed over the layers at each share (key `gpu_ms_<share>`), and with the fastest
    share in each layer (`gpu_ms_best`)."""
    by_layer: dict[int, dict[float, float]] = {}
    for r in rows:
        by_layer.setdefault(r["layer"], {})[r["share"]] = r["gpu_ms"]
    sums = {f"gpu_ms_{s:g}": sum(layer[s] for layer in by_layer.values()) for s in shares}
    sums["gpu_ms_best"] = sum(min(layer.values()) for layer in by_layer.values())
    return sums


def markdown(meta: dict[str, Any], rows: list[dict], shares: list[float]) -> str:
    timed = "gpu_ms" in rows[0]
    head = (
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; model {meta['model']}; "
        f"{meta['tokens']} tokens; heavy threshold {meta['heavy_threshold']}. Per layer and row share s "
        "(dense units: light entries on at least ceil(s M) rows): the dense units, the share of the light "
        "entries they hold"
        + (
            ", and the op's forward+backward with the L1 term, GPU busy ms (event-timed ms).\n\n"
            if timed
            else " (no timing on the CPU).\n\n"
        )
    )
    cols = " | ".join(f"s = {s:g}" for s in shares)
    lines = [f"| layer | L0 | {cols} |", "|---:|---:|" + "---:|" * len(shares)]
    for layer in sorted({r["layer"] for r in rows}):
        cells = []
        for s in shares:
            r = next(r for r in rows if r["layer"] == layer and r["share"] == s)
            cell = f"{r['dense_units']} units, {100 * r['dense_entry_share']:.0f}%"
            if timed:
                cell += f": {r['gpu_ms']:.3f} ({r['ms']:.3f})"
            cells.append(cell)
        l0 = next(r["l0"] for r in rows if r["layer"] == layer)
        lines.append(f"| {layer} | {l0:.1f} | " + " | ".join(cells) + " |")
    text = head + "\n".join(lines) + "\n"
    if timed:
        sums = meta["totals"]
        text += "\nSum over layers, GPU busy ms: " + ", ".join(
            f"s = {s:g}: {sums[f'gpu_ms_{s:g}']:.2f}" for s in shares
        )
        text += f"; the fastest share in each layer: {sums['gpu_ms_best']:.2f}.\n"
    return text


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    model, inputs, text, name = model_inputs(args, device)
    rows = []
    for layer, (x, block) in enumerate(zip(inputs, model.model.layers, strict=True)):
        active = common.gate_active(x, block.mlp)
        weights = common.ffn_weights(block.mlp, x.dtype)
        l0 = active.sum(-1).float().mean().item()
        for share in args.shares:
            fires = min_fires(x.shape[0], share)
            row = {"layer": layer, "l0": l0, "share": share, "min_fires": fires}
            row |= dense_unit_stats(active, args.heavy_threshold, fires)
            if device.type == "cuda":
                row |= time_share(x, weights, fires, args)
            rows.append(row)
    meta = common.run_meta(
        device,
        model=name,
        tokens=inputs[0].shape[0],
        text=text,
        heavy_threshold=args.heavy_threshold,
        shares=args.shares,
        reps=args.reps,
        sets=args.sets,
    )
    headline = {}
    if device.type == "cuda":
        meta["totals"] = totals(rows, args.shares)
        headline = {"gpu_ms_by_share": meta["totals"]}
    common.write_report(markdown(meta, rows, args.shares), meta, rows, args.json, args.md, headline)
    return rows


if __name__ == "__main__":
    main()
