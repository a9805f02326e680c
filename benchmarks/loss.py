"""Benchmark the chunked output projection + cross-entropy (sparse_llm.model.loss), forward and backward
under torch.compile: each chunk's loss and logit gradient by the CUDA kernel (impl='cuda') or in
PyTorch (impl='reference', which Inductor fuses across chunks), against F.cross_entropy on the
whole logits. Medians of CUDA-event timings, the peak memory above the inputs, and the error of
the loss and both gradients against the unfused path. Prints Markdown, writes JSON and Markdown.

    python -m benchmarks.loss --json out.json --md out.md   # 1b preset sizes
    python -m benchmarks.loss --tiny                         # CPU, seconds: the script end to end
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from sparse_llm.model.loss import IGNORE_INDEX, default_chunk_tokens, linear_cross_entropy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step (8 x 2048 on the 1b preset)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk; default: the loss's own")
    p.add_argument("--impls", nargs="+", default=["unfused", "reference", "cuda"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="small sizes on CPU, the unfused and reference paths")
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.dim, args.vocab, args.chunk, args.reps, args.warmup = 96, 32, 211, 32, 3, 1
        args.impls = [i for i in args.impls if i != "cuda"]
    return args


def unfused_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=IGNORE_INDEX)


def loss_fn(impl: str, chunk: int) -> Callable[..., torch.Tensor]:
    if impl == "unfused":
        return unfused_loss
    return lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=chunk, impl=impl)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_case(
    impl: str, args: argparse.Namespace, device: torch.device, ref: dict[str, torch.Tensor] | None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Times one impl on fresh inputs (the same for every impl); its row and its outputs."""
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(args.tokens, args.dim, device=device, generator=gen).requires_grad_()
    weight = (
        torch.randn(args.vocab, args.dim, device=device, generator=gen) / args.dim**0.5
    ).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=gen)
    labels[::17] = IGNORE_INDEX
    fn = torch.compile(loss_fn(impl, args.chunk))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    last: dict[str, torch.Tensor] = {}

    def step() -> None:
        hidden.grad = weight.grad = None
        with autocast:
            loss = fn(hidden, weight, labels)
        loss.backward()
        last["loss"] = loss.detach()

    ms = common.median_ms(step, device, args.warmup, args.reps)
    peak_gib = float("nan")
    if device.type == "cuda":
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_gib = (torch.cuda.max_memory_allocated() - start) / 2**30
    row = {"impl": impl, "ms": ms, "peak_gib": peak_gib, "loss": last["loss"].item()}
    outputs = {"loss": last["loss"], "grad_hidden": hidden.grad, "grad_weight": weight.grad}
    if ref is not None:
        row.update({f"err_{name}": rel_err(outputs[name], ref[name]) for name in outputs})
    return row, outputs


def markdown(meta: dict, rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        f"# Output projection + cross-entropy, forward and backward, compiled: {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, {meta['tokens']} tokens, "
        f"D = {meta['dim']}, V = {meta['vocab']}, chunks of {meta['chunk']} tokens, bf16 autocast, median of "
        f"{meta['reps']} after {meta['warmup']} warm-up. Peak: memory above the inputs during one step. "
        f"Errors: relative Frobenius against `{first['impl']}`.",
        "",
        "| impl | ms | vs first | peak GiB | loss | err loss | err grad hidden | err grad weight |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        errs = " | ".join(
            f"{r[k]:.2e}" if k in r else "-" for k in ("err_loss", "err_grad_hidden", "err_grad_weight")
        )
        lines.append(
            f"| {r['impl']} | {r['ms']:.3f} | {first['ms'] / r['ms']:.2f}x | {r['peak_gib']:.2f} | {r['loss']:.5f} "
            f"| {errs} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny)
    args.chunk = args.chunk or default_chunk_tokens(args.vocab)
    meta = common.run_meta(
        device, **{k: getattr(args, k) for k in ("tokens", "dim", "vocab", "chunk", "warmup", "reps")}
    )
    rows, ref = [], None
    for impl in args.impls:
        row, outputs = run_case(impl, args, device, ref)
        ref = ref or outputs
        rows.append(row)
    common.write_report(markdown(meta, rows), meta, rows, args.json, args.md)
    return rows


if __name__ == "__main__":
    main()
