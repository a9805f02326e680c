"""acc += a @ b in place, in acc's dtype, which may be wider than a's and b's: the chunked loss
(sparse_llm.model.loss) sums its float32 weight gradient over chunks of bf16 products with it.

On CUDA the product of bf16 (or fp16) a and b goes into acc by the GEMM itself (addmm with a
float32 output): no partial product is rounded to bf16 or kept beside acc. It is a custom op,
mutating acc, so that torch.compile keeps each chunk's accumulation in place and in order. Written
as `acc = acc + a @ b`, Inductor fused the chunks' additions into one kernel after the last GEMM
and kept every chunk's partial product alive until then.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("sparse_llm::matmul_accumulate_", mutates_args=("acc",))
def matmul_accumulate_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b; acc: [M, N], a: [M, K], b: [K, N], a and b of one dtype, acc's or narrower."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:  # CPU has no GEMM with a wider output: multiply the operands in acc's dtype (exactly)
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


@matmul_accumulate_.register_fake
def _(acc, a, b):
    return None
