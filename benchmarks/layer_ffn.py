"""The FFN training op layer by layer, on a trained model's own activations: what each layer's FFN
costs, dense against the sparse op, at the L0 and row density that layer has.

    python -m benchmarks.layer_ffn --model runs/sparse_1b [--rows 8 --seq-len 2048] [--json F] [--md F]
    python -m benchmarks.layer_ffn --tiny      # CPU, seconds: the reference op, the script end to end

One forward over held-out text (rows x seq-len tokens, the M of one training step) keeps each
layer's FFN input (the post-attention norm's output), or `--inputs DIR` reads those that
`row_density.py --save-inputs DIR` saved (bf16, the same tokens every time). Then, layer by layer,
on that input and the layer's weights: the training forward+backward with the L1 term as `benchmarks/ffn.py --train` times
it, dense (compiled on a GPU) against `ops.ffn_forward_train`, beside the layer's row density
(`row_density.py`: L0, heavy rows, past early). ffn.py's synthetic workload spreads the active units
over tokens one way; a trained layer spreads them its own way, and that sets what the training
step's FFNs cost and where the trainer's dense fallback (`model.ffn_dense_above`) should switch:
the totals give the sum over layers with every layer sparse, with the trainer's rule, and with
the faster of the two in each layer. Every timed call reads the next of `--sets` copies of the
layer's weights, as in a model with many layers (no call finds them in L2).

`--synthetic 30 60 120` adds `benchmarks/ffn.py`'s synthetic workload at those non-zeros a token,
at the model's sizes and token count, timed the same way: the real layers beside the synthetic
patterns in one report. The JSON's top level holds `busy_speedup` (on a GPU: the GPU busy time
summed over the model's layers, dense over ours in every layer) and `speedup` (the same with
event-timed calls), the figures of issue 50; `synthetic` holds the synthetic rows.

    python -m benchmarks.layer_ffn --model runs/sparse_1b --synthetic 30 60 120 --json ffn_layer_mix_h100.json

`--kernels` (GPU) also keeps ours' GPU time kernel by kernel in each layer (the JSON rows'
`kernel_us_ours`) and adds a table of each kernel's time summed over the layers and over the
layers of each L0 band: where the op's time goes on the layers a run produces.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import common
from benchmarks.ffn import dense_train, forward_backward, train_ours
from benchmarks.row_density import layer_rows, model_inputs, model_parser, parse_model_args, training_impl
from sparse_llm.model.ffn import recompute_in_chunks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--sets", type=int, default=3, help="copies of a layer's weights the timed calls rotate")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument(
        "--synthetic",
        type=float,
        nargs="*",
        default=[],
        help="also the synthetic workload at these non-zeros a token",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="also ours' GPU time kernel by kernel in each layer (GPU only): where the op's time goes",
    )
    return parse_model_args(p, argv)


def rotating(fn: Callable, sets: list[tuple[torch.Tensor, ...]]) -> Callable[[], Any]:
    """fn over sets[0], sets[1], ... in turn, one set a call."""
    turn = itertools.count()
    return lambda: fn(*sets[next(turn) % len(sets)])


GRAD_L1 = 2e-5  # the L1 coefficient the headline step uses


def timed(
    fn: Callable, sets: list[tuple[torch.Tensor, ...]], args: argparse.Namespace, kernels: bool = False
) -> dict[str, Any]:
    """One training call of fn over `sets` in turn (forward, backward with GRAD_L1): its median
    event-timed ms (`ms`) and, on a GPU, its GPU busy ms (`gpu_ms`) and, with `kernels`, each
    kernel's us (`kernel_us`)."""
    device = sets[0][0].device
    call = rotating(forward_backward(fn, torch.tensor(GRAD_L1, device=device)), sets)
    out: dict[str, Any] = {"ms": common.median_ms(call, device, args.warmup, args.reps)}
    if device.type == "cuda":
        spans = common.profiled_device_spans(call, calls=args.sets)
        out["gpu_ms"] = common.busy_ms(spans, calls=args.sets)
        if kernels:
            out["kernel_us"] = common.kernel_us(spans, calls=args.sets)
    return out


def time_layer(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    args: argparse.Namespace,
    dense: Callable,
    ours: Callable,
) -> dict[str, float]:
    """Milliseconds of one training call of an FFN with `weights` (Wg, Wu, Wd), dense (also
    recomputed in the backward, as a layer that falls back runs it) and ours, on its input x: the
    event-timed call from an idle GPU (`ms_*`) and, on a GPU, the time its kernels keep the GPU
    busy (`gpu_ms_*`; the difference is host-bound idle, which a model's step partly hides)."""
    x = x.detach().requires_grad_(True)
    sets = [(x, *(w.clone().requires_grad_(True) for w in weights)) for _ in range(args.sets)]
    times = {}

    # What the trainer runs in a layer that falls back: dense, recomputed in the backward one chunk
    # of tokens at a time (the model's recompute_in_chunks and chunk size).
    def recomputed(x: torch.Tensor, *ffn_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ys, l1s = recompute_in_chunks(dense, x, *ffn_weights)
        y = torch.cat(ys)
        return y, sum(l1 * part.shape[0] for l1, part in zip(l1s, ys, strict=True)) / y.shape[0]

    for name, fn in (("dense", dense), ("dense_recomputed", recomputed), ("ours", ours)):
        times |= {
            f"{k}_{name}": v
            for k, v in timed(fn, sets, args, kernels=name == "ours" and args.kernels).items()
        }
    return times


def totals(rows: list[dict], hidden: int, max_density: float, prefix: str = "ms") -> dict[str, float]:
    """Sums over layers of the `prefix` times ("ms": event-timed, "gpu_ms": GPU busy): all dense,
    all ours, the trainer's rule (dense recomputed where its fallback runs a layer of `hidden`
    units at that L0 dense, ours elsewhere), and the faster of those two in each layer."""
    dense, recomputed, ours = f"{prefix}_dense", f"{prefix}_dense_recomputed", f"{prefix}_ours"
    return {
        dense: sum(r[dense] for r in rows),
        ours: sum(r[ours] for r in rows),
        f"{prefix}_trainer_rule": sum(
            r[recomputed] if common.runs_dense(r["l0"], hidden, max_density) else r[ours] for r in rows
        ),
        f"{prefix}_best_per_layer": sum(min(r[recomputed], r[ours]) for r in rows),
    }


L0_BANDS = ((0.0, 20.0), (20.0, 50.0), (50.0, float("inf")))


def kernel_markdown(rows: list[dict], top: int = 20) -> str:
    """Where ours' GPU time goes: each kernel's milliseconds summed over the layers, and over the
    layers in each L0 band (the sparse middle layers and the denser ones pay for different
    kernels); the `top` largest, the rest in one line. Empty without per-kernel times."""
    if "kernel_us_ours" not in rows[0]:
        return ""
    bands = [[r for r in rows if low <= r["l0"] < high] for low, high in L0_BANDS]
    total: dict[str, float] = {}
    for r in rows:
        for label, us in r["kernel_us_ours"].items():
            total[label] = total.get(label, 0.0) + us
    busy = sum(r["gpu_ms_ours"] for r in rows)

    def band_ms(band: list[dict], labels: list[str]) -> str:
        return f"{sum(r['kernel_us_ours'].get(label, 0.0) for r in band for label in labels) / 1000:.2f}"

    heads = " | ".join(
        f"L0 {low:g}+ ({len(b)} layers), ms"
        if high == float("inf")
        else f"L0 {low:g}-{high:g} ({len(b)} layers), ms"
        for (low, high), b in zip(L0_BANDS, bands, strict=True)
    )
    lines = [
        "",
        f"Ours kernel by kernel, summed over the layers (GPU busy {busy:.2f} ms; kernels that overlap "
        "each count their own time):",
        "",
        f"| kernel | all layers, ms | share of busy | {heads} |",
        "|---|---:|---:|" + "---:|" * len(L0_BANDS),
    ]
    ranked = sorted(total, key=lambda label: -total[label])
    groups = [[label] for label in ranked[:top]] + ([ranked[top:]] if len(ranked) > top else [])
    for labels in groups:
        name = labels[0] if len(labels) == 1 else f"(the other {len(labels)})"
        ms = sum(total[label] for label in labels) / 1000
        lines.append(
            f"| {name} | {ms:.2f} | {ms / busy:.1%} | " + " | ".join(band_ms(b, labels) for b in bands) + " |"
        )
    return "\n".join(lines) + "\n"


def markdown(meta: dict, rows: list[dict], sums: dict[str, float]) -> str:
    gpu = "gpu_ms_ours" in rows[0]
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; model {meta['model']}; "
        f"{meta['tokens']} tokens ({meta['text']}); ours: ffn_forward_train impl={meta['impl']}, heavy "
        f"threshold {meta['heavy_threshold']}; dense: {meta['dense']}; forward+backward with the L1 term, "
        f"median of {meta['reps']} calls over {meta['sets']} weight copies"
        + ("; GPU busy: the kernels' time in a call, without the idle between them." if gpu else "."),
        "",
        "| layer | L0 | heavy rows | past early | dense ms | dense recomputed ms | ours ms | dense / ours "
        "| recomputed / ours |" + (" dense GPU busy ms | ours GPU busy ms |" if gpu else ""),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['l0']:.1f} | {r['heavy_rows']} | {r['past_early']} | {r['ms_dense']:.3f} "
            f"| {r['ms_dense_recomputed']:.3f} | {r['ms_ours']:.3f} | {r['ms_dense'] / r['ms_ours']:.2f}x "
            f"| {r['ms_dense_recomputed'] / r['ms_ours']:.2f}x |"
            + (f" {r['gpu_ms_dense']:.3f} | {r['gpu_ms_ours']:.3f} |" if gpu else "")
        )
    lines.append("")
    for prefix, what in (("ms", "event-timed"), ("gpu_ms", "GPU busy")):
        if f"{prefix}_ours" in sums:
            lines.append(
                f"Sum over layers, {what} ms: dense {sums[f'{prefix}_dense']:.2f}; ours in every layer "
                f"{sums[f'{prefix}_ours']:.2f} (dense / ours {sums[f'{prefix}_dense'] / sums[f'{prefix}_ours']:.2f}x); the trainer's rule (dense recomputed over "
                f"{meta['dense_above_units']:g} units, model.ffn_dense_above) {sums[f'{prefix}_trainer_rule']:.2f}; "
                f"the faster of those in each layer {sums[f'{prefix}_best_per_layer']:.2f}."
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    if args.kernels and device.type != "cuda":
        raise SystemExit("--kernels times ours kernel by kernel on a GPU; this run is on the CPU")
    model, inputs, text, name = model_inputs(args, device)
    mlps = [layer.mlp for layer in model.model.layers]
    nnz = torch.stack([common.gate_active(x, mlp).sum(-1) for x, mlp in zip(inputs, mlps, strict=True)])
    rows = layer_rows(nnz.cpu(), args.heavy_threshold)
    impl = training_impl(model, device)
    dense = torch.compile(dense_train, dynamic=False) if device.type == "cuda" else dense_train
    ours = train_ours(impl, args.heavy_threshold)
    for row, x, mlp in zip(rows, inputs, mlps, strict=True):
        row.update(time_layer(x, common.ffn_weights(mlp, x.dtype), args, dense, ours))
    synthetic = [synthetic_row(nnz, inputs[0], model.config, args, dense, ours) for nnz in args.synthetic]
    cfg = model.config
    meta = common.run_meta(
        device,
        model=name,
        tokens=nnz.shape[1],
        text=text,
        impl=impl,
        dense="compiled" if device.type == "cuda" else "eager",
        heavy_threshold=args.heavy_threshold,
        dense_above_units=cfg.ffn_dense_above * cfg.intermediate_size,
        reps=args.reps,
        sets=args.sets,
    )
    sums = totals(rows, cfg.intermediate_size, cfg.ffn_dense_above)
    if device.type == "cuda":
        sums |= totals(rows, cfg.intermediate_size, cfg.ffn_dense_above, prefix="gpu_ms")
    meta["totals"] = sums
    headline = {"speedup": sums["ms_dense"] / sums["ms_ours"]}
    if "gpu_ms_ours" in sums:
        headline["busy_speedup"] = sums["gpu_ms_dense"] / sums["gpu_ms_ours"]
    text = markdown(meta, rows, sums) + kernel_markdown(rows) + synthetic_markdown(synthetic)
    common.write_report(text, meta, rows, args.json, args.md, headline | {"synthetic": synthetic})
    return rows


def synthetic_row(
    nnz: float, like: torch.Tensor, cfg: Any, args: argparse.Namespace, dense: Callable, ours: Callable
) -> dict[str, float]:
    """`benchmarks/ffn.py`'s workload at `nnz` non-zeros a token, at the model's sizes and `like`'s
    token count and dtype, timed as a layer is; with the L0 it has."""
    w = common.make_workload(
        like.shape[0], cfg.hidden_size, cfg.intermediate_size, nnz, device=like.device, dtype=like.dtype
    )
    l0 = (w.x @ w.wg.T > 0).sum(-1).float().mean().item()
    return {"nnz": nnz, "l0": l0, **time_layer(w.x, (w.wg, w.wu, w.wd), args, dense, ours)}


def synthetic_markdown(rows: list[dict]) -> str:
    if not rows:
        return ""
    gpu = "gpu_ms_ours" in rows[0]
    lines = [
        "",
        "The synthetic workload (`benchmarks/ffn.py`) at the model's sizes and token count:",
        "",
        "| non-zeros a token | L0 | dense ms | ours ms | dense / ours |"
        + (" dense GPU busy ms | ours GPU busy ms | busy dense / ours |" if gpu else ""),
        "|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if gpu else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['nnz']:g} | {r['l0']:.1f} | {r['ms_dense']:.3f} | {r['ms_ours']:.3f} | "
            f"{r['ms_dense'] / r['ms_ours']:.2f}x |"
            + (
                f" {r['gpu_ms_dense']:.3f} | {r['gpu_ms_ours']:.3f} | {r['gpu_ms_dense'] / r['gpu_ms_ours']:.2f}x |"
                if gpu
                else ""
            )
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
