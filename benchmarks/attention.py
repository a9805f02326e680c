"""Benchmark PyTorch SDPA's backends on the model's attention shapes: is the backend PyTorch picks
for `attn_impl=sdpa` (the `default` row) the fastest one on this GPU and torch version?

Causal bf16 attention, median of CUDA-event timings: the training shape (forward + backward) and
the prefill shape (forward) of the 1b preset by default. Prints Markdown, writes JSON and Markdown.

    python -m benchmarks.attention --json attn.json --md attn.md
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import common

BACKENDS = {
    "default": None,  # PyTorch's own choice: what attn_impl=sdpa runs
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--train-shape", type=int, nargs=2, default=[8, 2048], metavar=("BATCH", "SEQ"))
    p.add_argument("--prefill-shape", type=int, nargs=2, default=[64, 1920], metavar=("BATCH", "SEQ"))
    p.add_argument("--reps", type=int, default=20)
    return p.parse_args(argv)


def measure(backend, batch: int, seq: int, args: argparse.Namespace, backward: bool) -> float | str:
    """Median ms of one call (forward, or forward + backward), or why the backend refused."""
    shape = (batch, args.heads, seq, args.head_dim)
    q, k, v = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=backward) for _ in range(3)
    )
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def call() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if backward:
            torch.autograd.grad(out, (q, k, v), grad)

    try:
        if backend is None:
            return common.median_ms(call, torch.device("cuda"), warmup=3, reps=args.reps)
        with sdpa_kernel(backend):
            return common.median_ms(call, torch.device("cuda"), warmup=3, reps=args.reps)
    except RuntimeError as err:
        return f"unavailable ({str(err).strip().splitlines()[0][:80]})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.require_cuda("benchmarks.attention")
    cases = [("train fwd+bwd", *args.train_shape, True), ("prefill fwd", *args.prefill_shape, False)]
    rows = []
    for name, batch, seq, backward in cases:
        # Causal: half of the 4 * B * heads * T^2 * head_dim forward FLOPs; backward 2.5x forward.
        flops = 2 * batch * args.heads * seq * seq * args.head_dim * (3.5 if backward else 1.0)
        for label, backend in BACKENDS.items():
            ms = measure(backend, batch, seq, args, backward)
            row = {"case": name, "batch": batch, "seq": seq, "backend": label}
            row |= {"ms": ms, "tflops": flops / ms / 1e9} if isinstance(ms, float) else {"error": ms}
            rows.append(row)
            print(row, file=sys.stderr)
    meta = common.run_meta("cuda", heads=args.heads, head_dim=args.head_dim)
    lines = [
        f"# SDPA backends, causal bf16: {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}; {args.heads} heads x "
        f"{args.head_dim}; median of {args.reps} CUDA-event timings.",
        "",
        "| case | batch x seq | backend | ms | TFLOP/s | vs default |",
        "|---|---|---|---:|---:|---:|",
    ]
    for row in rows:
        base = next(r for r in rows if r["case"] == row["case"] and r["backend"] == "default")
        if "ms" in row:
            ratio = f"{base['ms'] / row['ms']:.2f}x" if "ms" in base else "n/a"
            figures = f"{row['ms']:.3f} | {row['tflops']:.0f} | {ratio}"
        else:
            figures = f"{row['error']} | | "
        lines.append(f"| {row['case']} | {row['batch']} x {row['seq']} | {row['backend']} | {figures} |")
    common.write_report("\n".join(lines) + "\n", meta, rows, args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
