"""The block op with hot units on a GPU, part by part: what the contract tests of
tests/ops/ffn/test_block.py assert in one line, here as numbers for each case and hot-unit set.

    python tests/hot_units_diagnosis.py      # a Hopper GPU; ~15 s

For each case (pattern, size) and each of test_block's hot-unit sets, on the host-read and the
capacity paths: the error against float64 of y, L1, dx and dWg, ours / the dense bf16 block's; how
many rows' and units' counts differ from the dense block's; and, where units' counts differ, the
smallest |g| / (|x| |Wg|^T) over their tokens (a gate at the rounding level, where two GEMMs summing
in different orders may disagree on whether the unit fires).
"""

from __future__ import annotations

import torch
from ops.ffn import test_block as tb

from sparse_llm.ops.ffn.training import TrainCapacities

CASES = (  # (pattern, m, d, h, seed): the failures of the first GPU run of the hot-unit tests
    ("mixed_rows", 1003, 256, 1000, 5),
    ("mixed_rows", 2051, 2048, 5632, 2051 + 2048 + 5632),
    ("random", 2051, 2048, 5632, 2051 + 2048 + 5632),
)
SHOWN = ("out", "l1", "dx", "dWg")


def main() -> None:
    for pattern, m, d, h, seed in CASES:
        inputs = tb.gpu_block_inputs(pattern, m, d, h, seed=seed)
        r = torch.randn(inputs[0].shape, device="cuda", dtype=torch.float64)
        dense_bf16 = tb.outputs_and_grads(tb.dense, inputs, r, autocast_device="cuda")
        want = tb.outputs_and_grads(tb.dense, [t.double() for t in inputs], r)
        g, scale = tb.gate_levels(inputs)
        print(
            f"== {pattern} {m}x{d}x{h} seed {seed}: dense bf16 L1 error {tb.rel_err(dense_bf16[1], want[1]):.2e}"
        )
        for name, hot in tb.hot_sets(inputs, h).items():
            paths = (("host", tb.block("cuda", hot)), ("cap", tb.capacity_block(TrainCapacities.new(), hot)))
            for path, fn in paths:
                got = tb.outputs_and_grads(fn, inputs, r, autocast_device="cuda")
                errors = " ".join(
                    f"{n} {tb.rel_err(a, w):.1e}/{tb.rel_err(b, w):.1e}"
                    for n, a, b, w in zip(tb.NAMES, got, dense_bf16, want, strict=True)
                    if n in SHOWN
                )
                rows = int((got[2] != dense_bf16[2]).sum())
                units = (got[3] != dense_bf16[3]).nonzero().flatten()
                line = f"  {name:12s} |S| {hot.numel():5d} {path:4s} {errors} rows differing {rows} units differing {units.numel()}"
                if units.numel():
                    levels = (g[:, units[:5]] / scale[:, units[:5]].clamp_min(1e-30)).min(0).values
                    line += f"; min |g| / (|x| |Wg|^T) there {levels.tolist()}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
