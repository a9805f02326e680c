"""Small FFN cases for `compute-sanitizer --tool memcheck` (run by scripts/gpu_check.sh): the
inference forward (TwELL, or the decode FFN up to 64 rows), its in-place add into a residual, and the
training forward + backward; then the training op twice on the same inputs with a few hot units
(every row light, thousands of entries a unit), saying whether the two give the same bits. No options.

    compute-sanitizer --tool memcheck --error-exitcode 9 python -m benchmarks.sanitize_ffn
"""

from __future__ import annotations

import argparse

import torch

from benchmarks import common
from sparse_llm import ops

# M, D, H, nnz, threshold; up to 64 rows the inference ops take the decode FFN (one row: its one-launch
# kernel; two: the gate GEMV then up/down; five: cuBLAS's gate, the compaction, up/down); the last
# case is past masked_gate_min_rows (the masked gate and pack).
CASES = [
    (1, 2048, 5632, 30, 16),
    (2, 256, 704, 20, 16),
    (67, 256, 1000, 20, 16),
    (5, 24, 40, 3, 2),
    (130, 8192, 256, 5, 512),
    (65536, 64, 1000, 5, 16),
]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return common.script_parser(__doc__, report=False).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parse_args(argv)
    for m, d, h, nnz, threshold in CASES:
        w = common.make_workload(m, d, h, nnz, seed=m, device="cuda", calib_tokens=m)
        y = ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda", heavy_threshold=threshold)
        ref = ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="reference")
        torch.cuda.synchronize()
        print(
            f"inference M={m} D={d} H={h} threshold={threshold}: rel diff vs dense bf16 {rel_diff(y, ref):.2e}"
        )
        residual = torch.randn_like(w.x)
        expected = residual + y
        with torch.no_grad():
            ops.ffn_add_(residual, w.x, w.wg, w.wu, w.wd, impl="cuda", heavy_threshold=threshold)
        torch.cuda.synchronize()
        print(f"in-place add M={m}: equals residual + forward: {torch.equal(residual, expected)}")

        grads = {}
        for impl in ("cuda", "reference"):
            inputs = [t.detach().clone().requires_grad_(True) for t in (w.x, w.wg, w.wu, w.wd)]
            out = ops.ffn_forward_train(*inputs, impl=impl)
            (out.y.float().sum() + 0.5 * out.l1).backward()
            grads[impl] = [out.y, *(t.grad for t in inputs)]
        torch.cuda.synchronize()
        diffs = ", ".join(
            f"{rel_diff(a, b):.1e}" for a, b in zip(grads["cuda"], grads["reference"], strict=True)
        )
        print(f"training M={m} D={d} H={h}: rel diff vs reference (y, dx, dWg, dWu, dWd) {diffs}")
    hot_units_repeat()


def hot_units_repeat(m: int = 4096, d: int = 256, h: int = 704, live: int = 8) -> None:
    """The training op twice on one input where `live` units take every token (the others dead):
    the light rows' kernels and the long-units kernel, whose outputs must repeat bit for bit."""
    w = common.make_workload(m, d, h, 30, seed=1, device="cuda", calib_tokens=m)
    with torch.no_grad():
        w.wg[live:] = 0
    runs = []
    for _ in range(2):
        inputs = [t.detach().clone().requires_grad_(True) for t in (w.x, w.wg, w.wu, w.wd)]
        out = ops.ffn_forward_train(*inputs, impl="cuda")
        (out.y.float().sum() + 0.5 * out.l1).backward()
        runs.append([out.y, *(t.grad for t in inputs)])
    torch.cuda.synchronize()
    same = ", ".join(str(torch.equal(a, b)) for a, b in zip(*runs, strict=True))
    print(f"training repeat with {live} hot units M={m} D={d} H={h}: bitwise (y, dx, dWg, dWu, dWd) {same}")


if __name__ == "__main__":
    main()
