"""Benchmark one inference FFN layer: dense eager, dense torch.compile and the TwELL kernels.

The workload is docs/design.md section 5 (benchmarks/common.py). Each timed call reads one of
several input sets in turn (x and all three weights), so no call finds its weights in L2 from
the call before, as in a model with many layers. Prints a Markdown table, writes JSON and Markdown.

    python -m benchmarks.ffn --nnz 15 30 60 120 --M 16384 65536 --json out.json --md out.md
    python -m benchmarks.ffn --train ...   # forward+backward with L1 and saved bytes, vs dense
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Sequence

import torch

from benchmarks import common
from sparse_llm import ops
from sparse_llm.ops._extension import extension


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--nnz", type=float, nargs="+", default=[15, 30, 60, 120], help="mean non-zeros per token")
    p.add_argument("--M", type=int, nargs="+", default=[16384, 65536], help="tokens")
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--H", type=int, default=5632)
    p.add_argument(
        "--heavy-threshold",
        type=int,
        nargs="+",
        default=[ops.DEFAULT_HEAVY_THRESHOLD],
        help="heavy-row thresholds to time; the first is the one in the main table",
    )
    p.add_argument("--sets", type=int, default=3, help="input sets rotated through the timed calls")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="print a per-kernel profile of ours per case")
    p.add_argument(
        "--train",
        action="store_true",
        help="time forward+backward (with L1) of ffn_forward_train vs dense, and saved-activation bytes",
    )
    p.add_argument(
        "--gate-algos",
        action="store_true",
        help="only time the gate GEMM: plain cuBLAS vs each of cuBLASLt's ReLU-mask algorithms (by rank)",
    )
    p.add_argument(
        "--train-impl", default="cuda", choices=["cuda", "reference"], help="ffn_forward_train impl (--train)"
    )
    return p.parse_args(argv)


def median_ms(fn: Callable, sets: Sequence[tuple], warmup: int, reps: int) -> float:
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)
    ]
    for i, (start, end) in enumerate(events):
        args = sets[i % len(sets)]
        start.record()
        fn(*args)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def print_profile(fn: Callable, iters: int = 5) -> None:
    """Per-kernel CUDA time of `iters` calls (torch.profiler) and where the GPU idles between
    kernels, to see where a forward (or step) spends its time."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(common.device_kernel_table(prof.events(), calls=iters))
    print(common.gpu_idle_table(prof.events()))


def rel_err64(out: torch.Tensor, x, wg, wu, wd) -> float:
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    ref = (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T
    return ((out.double() - ref).norm() / ref.norm()).item()


def bench_one(m: int, nnz: float, args: argparse.Namespace, dense_compiled: Callable) -> dict:
    ext = extension()
    sets = []
    for k in range(args.sets):
        w = common.make_workload(m, args.D, args.H, nnz, seed=args.seed + 1000 * k, device="cuda")
        sets.append((w.x, w.wg, w.wu, w.wd, w.wd.t().contiguous()))
    dense = [s[:4] for s in sets]
    row: dict = {"M": m, "nnz_target": nnz}

    x, wg, wu, wd = dense[0]
    threshold = args.heavy_threshold[0]
    g = x @ wg.T
    packed = ops.twell_pack(g, threshold, impl="cuda")
    row_nnz = packed.row_nnz.double()
    row["nnz_measured"] = row_nnz.mean().item()
    row["nnz_p50"] = row_nnz.median().item()
    row["nnz_p99"] = row_nnz.quantile(0.99).item()
    row["nnz_max"] = row_nnz.max().item()
    row["heavy_rows"] = packed.heavy.double().mean().item()
    row["heavy_nnz_share"] = (row_nnz[packed.heavy].sum() / row_nnz.sum()).item()

    row["err_dense_bf16"] = rel_err64(ops.ffn_forward_reference(x, wg, wu, wd), x, wg, wu, wd)
    row["err_ours"] = rel_err64(
        ops.ffn_forward(x, wg, wu, wd, impl="cuda", heavy_threshold=threshold), x, wg, wu, wd
    )
    del g, packed

    # The whole variant list is timed twice in a row and each keeps its better median: the first
    # variant timed otherwise pays for warm-up effects (allocator growth, clocks) the others skip.
    variants: dict[str, tuple[Callable, Sequence[tuple]]] = {
        "ms_dense_eager": (ops.ffn_forward_reference, dense),
        "ms_dense_compiled": (dense_compiled, dense),
        "ms_ours_cached_wdT": (
            lambda x, wg, wu, wd, wd_t: ops.ffn_forward(
                x, wg, wu, wd, impl="cuda", heavy_threshold=threshold, wd_t=wd_t
            ),
            sets,
        ),
    }
    for t in args.heavy_threshold:
        variants[f"ours@{t}"] = (
            lambda x, wg, wu, wd, t=t: ops.ffn_forward(x, wg, wu, wd, impl="cuda", heavy_threshold=t),
            dense,
        )
    passes: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, (fn, inputs) in variants.items():
            passes[name].append(median_ms(fn, inputs, args.warmup, args.reps))
    row["timing_passes"] = passes
    for name in ("ms_dense_eager", "ms_dense_compiled", "ms_ours_cached_wdT"):
        row[name] = min(passes[name])
    row["ms_ours"] = {t: min(passes[f"ours@{t}"]) for t in args.heavy_threshold}
    # Parts of our forward, each timed alone on the same rotating inputs: the gate GEMM with its
    # ReLU bit mask and the masked pack (what ours runs), next to plain cuBLAS and the dense pack.
    row["ms_gate_gemm"] = median_ms(lambda x, wg, *_: x @ wg.T, sets, args.warmup, args.reps)
    row["ms_gate_mask"] = median_ms(lambda x, wg, *_: ext.gate_relu_mask(x, wg), sets, args.warmup, args.reps)
    gates = [(s[0] @ s[1].T,) for s in sets]
    masked = [ext.gate_relu_mask(s[0], s[1]) for s in sets]
    if any(gate is None for gate in masked):
        raise SystemExit("cuBLASLt offers no ReLU-mask gate GEMM here: ours runs at::mm + the dense pack")
    row["ms_pack"] = median_ms(lambda g: ext.twell_pack(g, threshold), gates, args.warmup, args.reps)
    row["ms_pack_masked"] = median_ms(
        lambda a, mask: ext.twell_pack_masked(a, mask, threshold), masked, args.warmup, args.reps
    )
    packs = [(*s, *ext.twell_pack(gk[0], threshold)) for s, gk in zip(sets, gates, strict=True)]
    row["ms_sparse_updown"] = median_ms(
        lambda x, wg, wu, wd, wd_t, values, cols, counts, row_nnz, heavy: ext.twell_updown(
            x, wu, wd_t, values, cols, counts, row_nnz, heavy, threshold
        ),
        packs,
        args.warmup,
        args.reps,
    )
    row["ms_transpose_wd"] = median_ms(
        lambda x, wg, wu, wd, wd_t: ext.transpose(wd), sets, args.warmup, args.reps
    )
    # What the parts leave: the heavy rows' dense path, the host read of their count, glue.
    row["masked_gate"] = m >= ext.masked_gate_min_rows
    gate_and_pack = (
        row["ms_gate_mask"] + row["ms_pack_masked"]
        if row["masked_gate"]
        else row["ms_gate_gemm"] + row["ms_pack"]
    )
    row["ms_rest"] = row["ms_ours_cached_wdT"] - gate_and_pack - row["ms_sparse_updown"]
    if args.profile:
        print_profile(lambda: ops.ffn_forward(*dense[0], impl="cuda", heavy_threshold=threshold))
    ours = row["ms_ours"][threshold]
    row["speedup_vs_eager"] = row["ms_dense_eager"] / ours
    row["speedup_vs_compiled"] = row["ms_dense_compiled"] / ours
    return row


def markdown(meta: dict, rows: list[dict], thresholds: list[int]) -> str:
    t0 = thresholds[0]
    lines = [
        f"# FFN inference forward: {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, D={meta['D']}, H={meta['H']}, "
        f"median of {meta['reps']} CUDA-event timings over {meta['sets']} rotating input sets (better of two passes), "
        f"heavy-row threshold {t0}.",
        "",
        "| M | nnz/token (target / measured / p99) | heavy rows | dense eager ms | dense compiled ms "
        "| ours ms | ours, cached Wd^T ms | vs eager | vs compiled | err ours | err dense bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['M']} | {r['nnz_target']:g} / {r['nnz_measured']:.1f} / {r['nnz_p99']:.0f} "
            f"| {100 * r['heavy_rows']:.1f}% | {r['ms_dense_eager']:.3f} | {r['ms_dense_compiled']:.3f} "
            f"| {r['ms_ours'][t0]:.3f} | {r['ms_ours_cached_wdT']:.3f} | {r['speedup_vs_eager']:.2f}x "
            f"| {r['speedup_vs_compiled']:.2f}x | {r['err_ours']:.2e} | {r['err_dense_bf16']:.2e} |"
        )
    lines += [
        "",
        "Parts of ours, each timed alone (ms): the gate GEMM with the ReLU bit mask (cuBLASLt) plus the "
        "masked pack, which ours runs from M = masked_gate_min_rows on, and plain cuBLAS plus the dense "
        "pack, which it runs below; sparse up/down covers the light rows only; rest = ours (cached Wd^T) "
        "minus the gate and pack it runs and the up/down.",
        "",
        "| M | nnz | gate GEMM + mask | plain gate GEMM | masked pack | dense pack | sparse up/down | Wd^T "
        "| rest: heavy rows, sync, glue |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['M']} | {r['nnz_target']:g} | {r['ms_gate_mask']:.3f} | {r['ms_gate_gemm']:.3f} "
            f"| {r['ms_pack_masked']:.3f} | {r['ms_pack']:.3f} | {r['ms_sparse_updown']:.3f} "
            f"| {r['ms_transpose_wd']:.3f} | {r['ms_rest']:.3f} |"
        )
    if len(thresholds) > 1:
        lines += ["", "Ours (ms) by heavy-row threshold:", ""]
        lines.append("| M | nnz | " + " | ".join(str(t) for t in thresholds) + " |")
        lines.append("|---|---|" + "---|" * len(thresholds))
        for r in rows:
            cells = " | ".join(f"{r['ms_ours'][t]:.3f}" for t in thresholds)
            lines.append(f"| {r['M']} | {r['nnz_target']:g} | {cells} |")
    return "\n".join(lines) + "\n"


def dense_train(x, wg, wu, wd):
    """The model's dense FFN with its statistics: (y, l1)."""
    h = torch.relu(x @ wg.T) * (x @ wu.T)
    return h @ wd.T, h.float().abs().sum(-1).mean()


def saved_bytes(fn: Callable, inputs: Sequence[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for fn's backward, leaf inputs (x, weights) excluded."""
    leaves = {t.untyped_storage().data_ptr() for t in inputs}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in leaves:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(saved.values())


def forward_backward(fn: Callable, grad_l1: torch.Tensor) -> Callable:
    """fn(x, wg, wu, wd, ...) -> (y, l1, ...) as one training call: the forward, the backward of
    <1, y> + grad_l1 * l1, the gradients dropped; further outputs (statistics a step reads, which
    a compiled fn would otherwise not compute) are dropped too. `grad_l1` is made once, on fn's device: a tensor
    built from a Python float inside the timed call is a pageable host-to-device copy, which waits
    for the GPU to drain, and the backward's launches then start from an idle GPU."""

    def run(*inputs: torch.Tensor) -> None:
        y, l1, *_ = fn(*inputs)
        torch.autograd.backward((y, l1), (torch.ones_like(y), grad_l1.to(l1.dtype)))
        for t in inputs:
            t.grad = None

    return run


def train_ours(impl: str, threshold: int) -> Callable:
    """ffn_forward_train as (y, l1)."""

    def ours(x, wg, wu, wd):
        out = ops.ffn_forward_train(x, wg, wu, wd, impl=impl, heavy_threshold=threshold)
        return out.y, out.l1

    return ours


def bench_train_one(
    m: int, nnz: float, args: argparse.Namespace, dense_compiled: Callable, ours_compiled: Callable
) -> dict:
    sets = []
    for k in range(args.sets):
        w = common.make_workload(m, args.D, args.H, nnz, seed=args.seed + 1000 * k, device="cuda")
        sets.append(tuple(t.requires_grad_(True) for t in (w.x, w.wg, w.wu, w.wd)))

    ours = train_ours(args.train_impl, args.heavy_threshold[0])
    grad_l1 = torch.tensor(2e-5, device="cuda")

    def fwd_bwd(fn):
        return forward_backward(fn, grad_l1)

    row: dict = {"M": m, "nnz_target": nnz}
    with torch.no_grad():
        row["nnz_measured"] = (sets[0][0] @ sets[0][1].T > 0).sum(-1).double().mean().item()
    # Saved activations: what autograd keeps besides x and the weights (x counted separately).
    row["saved_mb_dense"] = saved_bytes(dense_train, sets[0]) / 1e6
    row["saved_mb_ours"] = saved_bytes(ours, sets[0]) / 1e6
    row["x_mb"] = sets[0][0].numel() * sets[0][0].element_size() / 1e6
    variants = {
        "ms_dense_eager": fwd_bwd(dense_train),
        "ms_dense_compiled": fwd_bwd(dense_compiled),
        "ms_ours": fwd_bwd(ours),
        # Compiled as the model runs it: the custom ops' Python wrappers and autograd's bookkeeping
        # leave the call, the host read of the record sizes stays.
        "ms_ours_compiled": fwd_bwd(ours_compiled),
        "ms_dense_compiled_fwd": dense_compiled,  # forward alone (recording for backward)
        "ms_ours_fwd": ours,
        **{f"ours@{t}": fwd_bwd(train_ours(args.train_impl, t)) for t in args.heavy_threshold[1:]},
    }
    passes: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(2):
        for name, fn in variants.items():
            passes[name].append(median_ms(fn, sets, args.warmup, args.reps))
    for name in variants:
        row[name] = min(passes[name])
    row["ms_ours_by_threshold"] = {
        t: row["ms_ours"] if i == 0 else row[f"ours@{t}"] for i, t in enumerate(args.heavy_threshold)
    }
    with torch.no_grad():
        row_nnz = (sets[0][0] @ sets[0][1].T > 0).sum(-1)
    heavy = row_nnz > args.heavy_threshold[0]
    row["heavy_rows"] = heavy.double().mean().item()
    row["heavy_nnz_share"] = (row_nnz[heavy].sum() / row_nnz.sum().clamp_min(1)).item()
    row["speedup_vs_eager"] = row["ms_dense_eager"] / row["ms_ours"]
    row["speedup_vs_compiled"] = row["ms_dense_compiled"] / row["ms_ours"]
    row["speedup_compiled_vs_compiled"] = row["ms_dense_compiled"] / row["ms_ours_compiled"]
    if args.profile:
        print_profile(lambda: fwd_bwd(ours)(*sets[0]))
    return row


def markdown_train(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# FFN training forward+backward (with L1): {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, D={meta['D']}, H={meta['H']}, "
        f"ffn_forward_train impl={meta['train_impl']}, heavy-row threshold {meta['heavy_threshold'][0]}, "
        f"median of {meta['reps']} CUDA-event timings over "
        f"{meta['sets']} rotating input sets (better of two passes). Saved MB: autograd's saved tensors "
        "other than x and the weights (x itself is x MB, kept by both).",
        "",
        "| M | nnz/token (target / measured) | dense eager ms | dense compiled ms | ours ms | vs eager "
        "| vs compiled | ours compiled ms | compiled vs compiled | fwd ms dense compiled / ours "
        "| saved MB dense | saved MB ours | x MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['M']} | {r['nnz_target']:g} / {r['nnz_measured']:.1f} | {r['ms_dense_eager']:.3f} "
            f"| {r['ms_dense_compiled']:.3f} | {r['ms_ours']:.3f} | {r['speedup_vs_eager']:.2f}x "
            f"| {r['speedup_vs_compiled']:.2f}x | {r['ms_ours_compiled']:.3f} "
            f"| {r['speedup_compiled_vs_compiled']:.2f}x | {r['ms_dense_compiled_fwd']:.3f} / {r['ms_ours_fwd']:.3f} "
            f"| {r['saved_mb_dense']:.1f} | {r['saved_mb_ours']:.1f} "
            f"| {r['x_mb']:.1f} |"
        )
    thresholds = meta["heavy_threshold"]
    if len(thresholds) > 1:
        lines += [
            "",
            "Ours (ms) by heavy-row threshold:",
            "",
            "| M | nnz/token | " + " | ".join(str(t) for t in thresholds) + " |",
            "|---|---|" + "---|" * len(thresholds),
        ]
        for r in rows:
            cells = " | ".join(f"{r['ms_ours_by_threshold'][t]:.3f}" for t in thresholds)
            lines.append(f"| {r['M']} | {r['nnz_target']:g} | {cells} |")
    return "\n".join(lines) + "\n"


def run_cases(args: argparse.Namespace, bench, render, describe, extra_meta: dict) -> None:
    """Time every (M, nnz) case with `bench`, print a progress line (`describe`) and the table
    (`render`), and write JSON / Markdown where asked."""
    meta = common.run_meta("cuda", D=args.D, H=args.H, reps=args.reps, sets=args.sets, **extra_meta)
    rows = common.measure_cases(
        itertools.product(args.M, args.nnz), bench, lambda m, nnz, row: f"M={m} nnz={nnz:g}: {describe(row)}"
    )
    common.write_report(render(meta, rows), meta, rows, args.json, args.md)


def main_train(args: argparse.Namespace) -> None:
    common.require_cuda("benchmarks.ffn --train", kernels=args.train_impl == "cuda")
    dense_compiled = torch.compile(dense_train, dynamic=False)
    ours_compiled = torch.compile(train_ours(args.train_impl, args.heavy_threshold[0]), dynamic=False)
    run_cases(
        args,
        lambda m, nnz: bench_train_one(m, nnz, args, dense_compiled, ours_compiled),
        markdown_train,
        lambda r: (
            f"dense {r['ms_dense_compiled']:.3f} ours {r['ms_ours']:.3f} "
            f"(compiled {r['ms_ours_compiled']:.3f}) ms, "
            f"saved {r['saved_mb_ours']:.1f} MB (dense {r['saved_mb_dense']:.1f})"
        ),
        {"train_impl": args.train_impl, "heavy_threshold": args.heavy_threshold},
    )


def main_gate_algos(args: argparse.Namespace) -> None:
    """Which of cuBLASLt's ranked ReLU-mask algorithms is fastest, against the plain GEMM."""
    common.require_cuda("benchmarks.ffn --gate-algos", kernels=True)
    ext = extension()
    for m in args.M:
        sets = [
            common.make_workload(m, args.D, args.H, 30, seed=args.seed + k, device="cuda")
            for k in range(args.sets)
        ]
        inputs = [(w.x, w.wg) for w in sets]
        cells = [f"plain {median_ms(lambda x, wg: x @ wg.T, inputs, args.warmup, args.reps):.3f}"]
        for rank in range(8):
            if ext.gate_relu_mask(*inputs[0], rank) is None:
                break
            ms = median_ms(lambda x, wg, r=rank: ext.gate_relu_mask(x, wg, r), inputs, args.warmup, args.reps)
            cells.append(f"mask#{rank} {ms:.3f}")
        print(f"gate GEMM M={m} D={args.D} H={args.H} (ms): " + ", ".join(cells), flush=True)
        del sets, inputs
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.gate_algos:
        main_gate_algos(args)
        return
    if args.train:
        main_train(args)
        return
    common.require_cuda("benchmarks.ffn", kernels=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True  # torch's default, stated
    dense_compiled = torch.compile(ops.ffn_forward_reference, dynamic=False)
    run_cases(
        args,
        lambda m, nnz: bench_one(m, nnz, args, dense_compiled),
        lambda meta, rows: markdown(meta, rows, args.heavy_threshold),
        lambda r: (
            f"eager {r['ms_dense_eager']:.3f} compiled {r['ms_dense_compiled']:.3f} ours {r['ms_ours']} ms, "
            f"err {r['err_ours']:.2e} (dense {r['err_dense_bf16']:.2e})"
        ),
        {"heavy_thresholds": args.heavy_threshold},
    )


if __name__ == "__main__":
    main()
