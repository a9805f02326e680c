"""Small TwELL FFN cases for `compute-sanitizer --tool memcheck` (run by scripts/gpu_check.sh)."""

import torch

from sparse_llm import ops
from sparse_llm.ops.workload import make_workload


def main() -> None:
    for m, d, h, nnz, threshold in [(67, 256, 1000, 20, 16), (5, 24, 40, 3, 2), (130, 8192, 256, 5, 512)]:
        w = make_workload(m, d, h, nnz, seed=m, device="cuda", calib_tokens=m)
        y = ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda", heavy_threshold=threshold)
        ref = ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="reference")
        torch.cuda.synchronize()
        err = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"sanitize case M={m} D={d} H={h} threshold={threshold}: rel diff vs dense bf16 {err:.2e}")


if __name__ == "__main__":
    main()
