"""A column hybrid of the FFN training op, prototyped on a trained model's layers: the units that
fire on many tokens of the step (hot units) as a dense FFN over their columns, on tensor cores; the
other units' entries through the sparse op. Is it faster than the op, layer by layer?

    python -m benchmarks.column_hybrid --model runs/sparse_1b [--shares 0.0025 0.005 0.01 0.02 0.04]
    python -m benchmarks.column_hybrid --tiny      # CPU, seconds: the script end to end

Why: the op's per-entry kernels (up/down, the row backward, the unit backward) read a weight row
(or an x and a grad_y row) per active entry and run at a few TFLOP/s of useful work, where a dense
GEMM column over all M tokens runs at cuBLAS's rate. For a unit firing on more than ~1% of the
tokens its column computed densely (gate, up, down and their backward over all M tokens) costs less
than its entries gathered one by one. A trained layer concentrates its entries on few units (a
layer at L0 6 has ~600 units active in a step of 5632), so a small dense block may take most of
its entries off the gather path.

Exact by construction, for any choice of hot units S: with a = relu(x Wg^T), the FFN's output
y = sum over units j of a_j u_j Wd[:, j] and its L1 sum |a_j u_j| split over units, so
y = FFN(units not in S) + FFN(units in S), and their gradients too. The prototype computes
FFN(not S) with `ops.ffn_forward_train` on Wg with S's rows zeroed (those units never fire: g = 0
is not active) and FFN(S) with the model's dense FFN (compiled on a GPU) on the panels Wg[S],
Wu[S], Wd[:, S], its down GEMM adding into the op's y. Separate leaves for the panels: their
gradients are S's rows of the full ones (the real design writes them in place; the prototype
leaves them apart, uncounted).

What the prototype overstates against a built hybrid: the op still runs its gate GEMM over all H
units (S's rows zero) and the dense part runs S's gate again; dx is summed from the two parts by an
add. So its times bound a built hybrid's from above.

Per layer and per share s in `--shares`: S = the units firing on at least s x M of the step's
tokens (as the trainer chooses them: to a multiple of 64, at most a quarter of H; the results of
88296fc and 86cc380 were taken without that cap); its size, the share of the step's active entries it takes, the heavy rows left to the op,
and the forward+backward (with the L1 term) timed as `layer_ffn.py` times it: dense (compiled), the
op alone, the hybrid. Then the error of the op and of the hybrid at the layer's fastest share against
a float32 dense reference (relative Frobenius norm of y, dx and the three weight gradients).

Beside the prototype, the built op as a training step runs it (`ffn_block_train(hot_units=S)`, the
trainer's `model.ffn_hot_share`; norm, FFN and residual add, bf16 autocast with fp32 master weights;
on a GPU compiled as the trainer compiles a layer, `model.compiling.compile_region`): the dense block,
the block op without hot units and with S at each share (JSON keys `*_block*`, headline
`speedup_block` and `speedup_block_hot`). Results before 2026-12-02 timed the block op eager.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from benchmarks import common
from benchmarks.ffn import dense_train, saved_bytes, train_ours
from benchmarks.layer_ffn import GRAD_L1, timed
from benchmarks.row_density import layer_rows, model_inputs, model_parser, parse_model_args, training_impl
from sparse_llm.model.compiling import compile_region
from sparse_llm.ops.ffn.block import ffn_block_train
from sparse_llm.ops.ffn.hot_units import HOT_UNITS_MULTIPLE, choose_hot_units
from sparse_llm.ops.precision import autocast_dtype
from sparse_llm.ops.rms_norm import rms_norm
from sparse_llm.training.hot_units import MAX_HOT_FRACTION

DEFAULT_SHARES = (0.0025, 0.005, 0.01, 0.02, 0.04, 0.08)  # of the step's tokens a hot unit fires on
GRADIENTS = ("y", "dx", "dwg", "dwu", "dwd")
BLOCK_EPS = 1e-5  # the norm's eps in the built block op's timing (the presets' rms_norm_eps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = model_parser(__doc__)
    p.add_argument("--shares", type=float, nargs="+", default=list(DEFAULT_SHARES))
    p.add_argument("--sets", type=int, default=3, help="copies of a layer's weights the timed calls rotate")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    args = parse_model_args(p, argv)
    if not all(0.0 < s <= 1.0 for s in args.shares):
        p.error(f"--shares are fractions of the step's tokens in (0, 1]; got {args.shares}")
    return args


def hot_units(active: torch.Tensor, share: float) -> torch.Tensor:
    """S for a layer from its active [M, H] mask, as the trainer chooses it (`choose_hot_units`, at
    most MAX_HOT_FRACTION of H)."""
    return choose_hot_units(
        active.sum(dim=0), active.shape[0], share, max_units=int(MAX_HOT_FRACTION * active.shape[1])
    )


def split_stats(active: torch.Tensor, hot: torch.Tensor, threshold: int) -> dict[str, float]:
    """What taking `hot` out of the sparse op leaves it: S's size, the share of the step's active
    entries S takes, and the rows still heavy (more than `threshold` active units outside S)."""
    entries = active.sum()
    hot_entries = active[:, hot].sum()
    cold_per_row = active.sum(dim=1) - active[:, hot].sum(dim=1)
    return {
        "hot_units": hot.numel(),
        "hot_entry_share": (hot_entries / entries.clamp(min=1)).item(),
        "heavy_rows_left": int((cold_per_row > threshold).sum()),
    }


def hybrid_leaves(
    x: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor], hot: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The hybrid's inputs: x, Wg with S's rows zeroed, Wu, Wd (the op's), and the panels Wg[S],
    Wu[S], Wd[:, S] (the dense part's), each a fresh leaf that wants its gradient."""
    wg, wu, wd = weights
    cold_wg = wg.index_fill(0, hot, 0)
    leaves = (x, cold_wg, wu, wd, wg[hot], wu[hot], wd[:, hot])
    return tuple(t.detach().clone().requires_grad_(True) for t in leaves)


def hot_dense(y_cold: torch.Tensor, x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor):
    """The dense FFN over the hot units' panels, its output added to the op's by the down GEMM:
    (y_cold + y_hot, l1_hot)."""
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    return torch.addmm(y_cold, h, wd.T), h.float().abs().sum(-1).mean()


def hot_only(dense_part: Callable) -> Callable:
    """(x, Wg[S], Wu[S], Wd[:, S]) -> (y, l1): the hybrid's dense part alone, added to zeros."""

    def call(x, hot_wg, hot_wu, hot_wd):
        return dense_part(x.new_zeros(x.shape[0], hot_wd.shape[0]), x, hot_wg, hot_wu, hot_wd)

    return call


def recomputed(dense_part: Callable) -> Callable:
    """dense_part made again in the backward (keeping its inputs only)."""

    def call(*inputs: torch.Tensor):
        return checkpoint(dense_part, *inputs, use_reentrant=False)

    return call


def hybrid_call(ours: Callable, dense_part: Callable) -> Callable:
    """(x, Wg with S zeroed, Wu, Wd, Wg[S], Wu[S], Wd[:, S]) -> (y, l1): the op over the units
    outside S plus the dense FFN over S."""

    def call(x, cold_wg, wu, wd, hot_wg, hot_wu, hot_wd):
        y_cold, l1_cold = ours(x, cold_wg, wu, wd)
        y, l1_hot = dense_part(y_cold, x, hot_wg, hot_wu, hot_wd)
        return y, l1_cold + l1_hot

    return call


def gradients(fn: Callable, inputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """y and the gradients of <1, y> + GRAD_L1 * l1 for x and the full weights (a hybrid's panels'
    gradients put back at their units' rows), float32."""
    y, l1 = fn(*inputs)
    torch.autograd.backward(
        (y, l1), (torch.ones_like(y), torch.tensor(GRAD_L1, device=y.device, dtype=l1.dtype))
    )
    out = {"y": y.detach().float(), "dx": inputs[0].grad.float()}
    out |= {name: t.grad.float() for name, t in zip(("dwg", "dwu", "dwd"), inputs[1:4], strict=True)}
    return out


def hybrid_gradients(
    fn: Callable, inputs: tuple[torch.Tensor, ...], hot: torch.Tensor
) -> dict[str, torch.Tensor]:
    out = gradients(fn, inputs)
    out["dwg"][hot] = inputs[4].grad.float()
    out["dwu"][hot] = inputs[5].grad.float()
    out["dwd"][:, hot] = inputs[6].grad.float()
    return out


def relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    return {
        name: ((got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)).item()
        for name in GRADIENTS
    }


def time_layer(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    args: argparse.Namespace,
    fns: dict[str, Callable],
) -> dict[str, Any]:
    """One layer: dense, the op, and the hybrid at each share, timed; errors at the fastest share."""
    key = "gpu_ms" if x.is_cuda else "ms"
    full_sets = [
        tuple(t.detach().clone().requires_grad_(True) for t in (x, *weights)) for _ in range(args.sets)
    ]
    row: dict[str, Any] = {f"{k}_dense": v for k, v in timed(fns["dense"], full_sets, args).items()}
    row |= {f"{k}_ours": v for k, v in timed(fns["ours"], full_sets, args).items()}
    del full_sets
    row["shares"] = []
    for share in args.shares:
        hot = hot_units(active, share)
        sets = [hybrid_leaves(x, weights, hot) for _ in range(args.sets)]
        cell = {
            "share": share,
            **split_stats(active, hot, args.heavy_threshold),
            **timed(fns["hybrid"], sets, args),
        }
        # The dense part alone (x and the panels; its output added to zeros): the rest is the op's.
        cell |= {f"{k}_hot": v for k, v in timed(fns["hot"], [(t[0], *t[4:]) for t in sets], args).items()}
        row["shares"].append(cell)
        del sets
    best = min(row["shares"], key=lambda s: s[key])
    row["best_share"] = best["share"]
    row[f"{key}_hybrid"] = best[key]
    # At the best share: the dense part recomputed in the backward (it then keeps x and the panels,
    # not its three [M, |S|] activations), and what autograd keeps for the backward, each way.
    hot = hot_units(active, best["share"])
    sets = [hybrid_leaves(x, weights, hot) for _ in range(args.sets)]
    row[f"{key}_hybrid_recomputed"] = timed(fns["hybrid_recomputed"], sets, args)[key]
    row["saved_mb"] = {
        name: saved_bytes(fns[name], inputs) / 1e6
        for name, inputs in (("ours", sets[0][:4]), ("hybrid", sets[0]), ("hybrid_recomputed", sets[0]))
    }
    del sets
    row |= time_blocks(x, weights, active, args, fns)

    reference = gradients(dense_train, tuple(t.detach().float().requires_grad_(True) for t in (x, *weights)))
    ours_grads = gradients(fns["ours"], tuple(t.detach().clone().requires_grad_(True) for t in (x, *weights)))
    row["err_ours"] = relative_errors(ours_grads, reference)
    del ours_grads
    dense_grads = gradients(
        fns["dense"], tuple(t.detach().clone().requires_grad_(True) for t in (x, *weights))
    )
    row["err_dense"] = relative_errors(dense_grads, reference)
    del dense_grads
    hot = hot_units(active, best["share"])
    row["err_hybrid"] = relative_errors(
        hybrid_gradients(fns["hybrid"], hybrid_leaves(x, weights, hot), hot), reference
    )
    return row


def block_call(impl: str, hot: torch.Tensor | None, capacities: torch.Tensor | None = None) -> Callable:
    """(x, norm weight, Wg, Wu, Wd) -> (y, l1, nnz_per_token, fire_counts): the trainer's block op
    (`ffn_block_train`: norm, FFN, residual add) with hot units S, under bf16 autocast on a GPU (fp32
    residual and master weights, as a step has them); with `capacities` (TrainCapacities) on the
    capacity path. The statistics are returned because a step reads them: compiled, a block whose
    caller dropped them would not compute them."""

    def call(x, norm_weight, wg, wu, wd):
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
            out = ffn_block_train(
                x, norm_weight, BLOCK_EPS, wg, wu, wd, impl, capacities=capacities, hot_units=hot
            )
        return out.y, out.l1, out.nnz_per_token, out.fire_counts

    return call


def block_builder(compiled: bool) -> Callable[[Callable], Callable]:
    """How the benchmarks build a `block_call`: compiled as the trainer compiles a layer
    (`compile_region`; a plain torch.compile breaks the graph at the sparse op), or as it is."""
    return compile_region if compiled else (lambda fn: fn)


def block_graph_room():
    """Room for the built blocks' graphs: every layer's and share's `block_call` shares one code
    object and S's length differs between them, so at dynamo's default limit of 8 some would fall
    back to eager."""
    return torch._dynamo.config.patch(recompile_limit=64)


def dense_block(x, norm_weight, wg, wu, wd):
    """The dense block as the model runs it: x + FFN(rms_norm(x)), under bf16 autocast on a GPU."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
        y, l1 = dense_train(rms_norm(x, norm_weight, BLOCK_EPS, autocast_dtype(x)), wg, wu, wd)
    return x + y, l1


def time_blocks(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    active: torch.Tensor,
    args: argparse.Namespace,
    fns: dict[str, Callable],
) -> dict[str, Any]:
    """The built op: the block dense, without hot units, and with them at each share (`*_block*`).
    Its input is the layer's FFN input as the residual and a norm weight of ones: the norm rescales
    each row, which leaves the pattern of active units as it was (g scales with the row)."""
    key = "gpu_ms" if x.is_cuda else "ms"
    inputs = (x.float(), torch.ones(x.shape[1], device=x.device), *(w.float() for w in weights))
    sets = [tuple(t.detach().clone().requires_grad_(True) for t in inputs) for _ in range(args.sets)]
    built = fns["built_block"]
    out = {
        f"{key}_dense_block": timed(fns["dense_block"], sets, args)[key],
        f"{key}_block": timed(built(block_call(fns["impl"], None)), sets, args)[key],
    }
    out["block_shares"] = {
        share: timed(built(block_call(fns["impl"], hot_units(active, share))), sets, args)[key]
        for share in args.shares
    }
    out["best_block_share"] = min(out["block_shares"], key=out["block_shares"].get)
    out[f"{key}_block_hot"] = out["block_shares"][out["best_block_share"]]
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    key = "gpu_ms" if "gpu_ms_ours" in rows[0] else "ms"
    what = "GPU busy ms" if key == "gpu_ms" else "event-timed ms"
    shares = [s["share"] for s in rows[0]["shares"]]
    lines = [
        f"Device: {meta['device']}; commit {meta['commit']}; date {meta['date']}; model {meta['model']}; "
        f"{meta['tokens']} tokens ({meta['text']}); the op: ffn_forward_train impl={meta['impl']}, heavy threshold "
        f"{meta['heavy_threshold']}; dense: {meta['dense']}; forward+backward with the L1 term; {what} "
        f"(median of {meta['reps']} calls over {meta['sets']} weight copies for event times).",
        "",
        "Hot units S = those firing on at least the share of the step's tokens (then the next most firing, "
        f"to a multiple of {HOT_UNITS_MULTIPLE}); each cell: |S|, the share of active entries S takes, the hybrid's "
        f"{what} (its dense part's alone).",
        "",
        "| layer | L0 | dense | op | "
        + " | ".join(f"share {s:g}" for s in shares)
        + " | hybrid best | op / best | best, dense part recomputed | saved MB: op / hybrid / recomputed |",
        "|---:|---:|---:|---:|" + "---|" * len(shares) + "---:|---:|---:|---|",
    ]
    for r in rows:
        cells = " | ".join(
            f"{s['hot_units']}, {s['hot_entry_share']:.0%}: {s[key]:.3f} ({s[f'{key}_hot']:.3f})"
            for s in r["shares"]
        )
        lines.append(
            f"| {r['layer']} | {r['l0']:.1f} | {r[f'{key}_dense']:.3f} | {r[f'{key}_ours']:.3f} | {cells} | "
            f"{r[f'{key}_hybrid']:.3f} ({r['best_share']:g}) | {r[f'{key}_ours'] / r[f'{key}_hybrid']:.2f}x | "
            f"{r[f'{key}_hybrid_recomputed']:.3f} | "
            + " / ".join(f"{r['saved_mb'][n]:.0f}" for n in ("ours", "hybrid", "hybrid_recomputed"))
            + " |"
        )
    sums = meta["totals"]
    lines += [
        "",
        f"Sum over layers, {what}: dense {sums['dense']:.2f}, the op {sums['ours']:.2f} "
        f"(dense / op {sums['dense'] / sums['ours']:.2f}x), the hybrid at each layer's best share {sums['hybrid']:.2f} "
        f"(dense / hybrid {sums['dense'] / sums['hybrid']:.2f}x); with its dense part recomputed in the backward "
        f"{sums['hybrid_recomputed']:.2f} ({sums['dense'] / sums['hybrid_recomputed']:.2f}x).",
        "",
        "The built op as a training step runs it (`ffn_block_train`: norm, FFN and residual add; bf16 autocast "
        f"with fp32 master weights on a GPU; {meta['block']}), without hot units and with S at each share, {what}:",
        "",
        "| layer | dense block | block | "
        + " | ".join(f"share {s:g}" for s in shares)
        + " | best | block / best |",
        "|---:|---:|---:|" + "---:|" * len(shares) + "---:|---:|",
        *(
            f"| {r['layer']} | {r[f'{key}_dense_block']:.3f} | {r[f'{key}_block']:.3f} | "
            + " | ".join(f"{r['block_shares'][s]:.3f}" for s in shares)
            + f" | {r[f'{key}_block_hot']:.3f} ({r['best_block_share']:g}) | "
            f"{r[f'{key}_block'] / r[f'{key}_block_hot']:.2f}x |"
            for r in rows
        ),
        "",
        f"Sum over layers, {what}: dense block {sums['dense_block']:.2f}, the block op {sums['block']:.2f} "
        f"(dense / block {sums['dense_block'] / sums['block']:.2f}x), with hot units at each layer's best share "
        f"{sums['block_hot']:.2f} ({sums['dense_block'] / sums['block_hot']:.2f}x).",
        "",
        "Relative error against a float32 dense reference (Frobenius), the bf16 dense FFN / the op / the hybrid "
        "at its best share:",
        "",
        "| layer | " + " | ".join(GRADIENTS) + " |",
        "|---:|" + "---|" * len(GRADIENTS),
    ]
    for r in rows:
        lines.append(
            f"| {r['layer']} | "
            + " | ".join(
                f"{r['err_dense'][g]:.1e} / {r['err_ours'][g]:.1e} / {r['err_hybrid'][g]:.1e}"
                for g in GRADIENTS
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    model, inputs, text, name = model_inputs(args, device)
    impl = training_impl(model, device)
    ours = train_ours(impl, args.heavy_threshold)
    compiled = device.type == "cuda"
    # One graph for every |S| (dynamic): a graph per layer and share would compile ~100 times.
    dense_part = torch.compile(hot_dense, dynamic=True) if compiled else hot_dense
    fns = {
        "impl": impl,
        "built_block": block_builder(compiled),
        "dense_block": torch.compile(dense_block, dynamic=False) if compiled else dense_block,
        "dense": torch.compile(dense_train, dynamic=False) if compiled else dense_train,
        "ours": ours,
        "hybrid": hybrid_call(ours, dense_part),
        "hot": hot_only(dense_part),
        "hybrid_recomputed": hybrid_call(ours, recomputed(dense_part)),
    }
    mlps = [layer.mlp for layer in model.model.layers]
    rows = []
    with block_graph_room():
        for x, mlp in zip(inputs, mlps, strict=True):
            active = common.gate_active(x, mlp)
            row = layer_rows(active.sum(-1, keepdim=False)[None].cpu(), args.heavy_threshold)[0]
            row["layer"] = len(rows)
            row.update(time_layer(x, common.ffn_weights(mlp, x.dtype), active, args, fns))
            rows.append(row)
            del active
    key = "gpu_ms" if device.type == "cuda" else "ms"
    meta = common.run_meta(
        device,
        model=name,
        tokens=inputs[0].shape[0],
        text=text,
        impl=impl,
        dense="compiled" if compiled else "eager",
        block="compiled" if compiled else "eager",
        heavy_threshold=args.heavy_threshold,
        reps=args.reps,
        sets=args.sets,
        shares=args.shares,
    )
    parts = ("dense", "ours", "hybrid", "hybrid_recomputed", "dense_block", "block", "block_hot")
    meta["totals"] = {part: sum(r[f"{key}_{part}"] for r in rows) for part in parts}
    headline = {
        "timing": key,
        "speedup_ours": meta["totals"]["dense"] / meta["totals"]["ours"],
        "speedup_hybrid": meta["totals"]["dense"] / meta["totals"]["hybrid"],
        "speedup_hybrid_recomputed": meta["totals"]["dense"] / meta["totals"]["hybrid_recomputed"],
        # The built op, as the trainer runs it: dense block over the block op, without and with S.
        "speedup_block": meta["totals"]["dense_block"] / meta["totals"]["block"],
        "speedup_block_hot": meta["totals"]["dense_block"] / meta["totals"]["block_hot"],
    }
    common.write_report(markdown(meta, rows), meta, rows, args.json, args.md, headline)
    return rows


if __name__ == "__main__":
    main()
