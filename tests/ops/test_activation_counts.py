"""The FFN statistics op (ops.activation_counts): positive entries per row and per column, by the
CUDA kernel (bf16 on Hopper) or PyTorch, equal to `(a > 0).sum(...)` on every pattern."""

from __future__ import annotations

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.ops.activation_counts import (
    KERNEL_MAX_COLUMNS,
    activation_counts,
    activation_counts_reference,
    runs_on_kernel,
)


def patterned(m: int, h: int, pattern: str, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, h, generator=gen, device=device)
    if pattern == "all_negative":
        a = -a.abs() - 1e-3
    elif pattern == "all_positive":
        a = a.abs() + 1e-3
    elif pattern == "sparse":  # ~0.5% positive, one column and one row always positive
        a = torch.where(torch.rand(m, h, generator=gen, device=device) < 0.005, a.abs() + 1e-3, -1.0)
        a[:, h // 2] = 1.0
        a[m // 2] = 1.0
    elif pattern == "specials":  # NaN, -0.0, +0.0, inf and the smallest bf16 subnormal
        values = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf"), 9.2e-41], device=device)
        a = values[torch.randint(0, len(values), (m, h), generator=gen, device=device)]
    return a.bfloat16()


def check(a: torch.Tensor) -> None:
    rows, cols = activation_counts(a)
    want_rows, want_cols = activation_counts_reference(a)
    assert rows.dtype == cols.dtype == torch.int64
    assert torch.equal(rows, want_rows) and torch.equal(cols, want_cols)


@pytest.mark.parametrize("pattern", ["random", "all_negative", "all_positive", "sparse", "specials"])
def test_cpu_op_counts_the_positive_entries(pattern: str) -> None:
    """On CPU the op is the reference itself: checked against counts written out in Python (NaN,
    -0.0 and 0.0 inactive; +inf and the smallest subnormal active)."""
    a = patterned(37, 24, pattern, "cpu")
    assert not runs_on_kernel(a)
    positive = [[x > 0 for x in row] for row in a.float().tolist()]
    rows, cols = activation_counts(a)
    assert rows.tolist() == [sum(row) for row in positive]
    assert cols.tolist() == [sum(col) for col in zip(*positive, strict=True)]


def test_fake_gives_the_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        rows, cols = activation_counts(torch.empty(5, 16, dtype=torch.bfloat16))
    assert rows.shape == (5,) and cols.shape == (16,) and rows.dtype == cols.dtype == torch.int64


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pattern", ["random", "all_negative", "all_positive", "sparse", "specials"])
@pytest.mark.parametrize(
    ("m", "h"), [(1, 8), (7, 24), (1003, 5632), (20011, 2112), (64, KERNEL_MAX_COLUMNS), (0, 64)]
)
def test_cuda_kernel_equals_the_comparison(pattern: str, m: int, h: int) -> None:
    """20011 rows: more than the grid's 1024 CTAs x 8 warps, so warps take several rows."""
    a = patterned(max(m, 1), h, pattern, "cuda", seed=m + h)[:m]
    assert runs_on_kernel(a)
    check(a)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", ["columns_not_multiple_of_8", "too_wide", "float32", "not_contiguous"])
def test_cuda_inputs_the_kernel_does_not_take_use_pytorch(case: str) -> None:
    a = {
        "columns_not_multiple_of_8": patterned(33, 20, "random", "cuda"),
        "too_wide": patterned(9, KERNEL_MAX_COLUMNS + 8, "random", "cuda"),
        "float32": patterned(33, 64, "random", "cuda").float(),
        "not_contiguous": patterned(64, 33, "random", "cuda").t(),
    }[case]
    assert not runs_on_kernel(a)
    check(a)
