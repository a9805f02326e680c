"""Shared by the GPU kernel tests: named sparsity patterns of g = x Wg^T on random bf16 inputs
(docs/design.md section 3), the relative error the exactness contract is stated in, and the Hopper skip."""

from __future__ import annotations

import pytest
import torch

from sparse_llm.ops.ffn.twell import SLOTS

# The CUDA kernels are built for sm_90 (Hopper) only.
needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the CUDA kernels need a Hopper GPU",
)


# The exactness contract's floors on the relative error. Where fewer than SMALL_SUPPORT terms are
# summed, each error is one or two bf16 roundings and the ratio of two of them is noise, so the
# floor is two bf16 unit roundoffs (2 x 2^-9: one rounding of an intermediate, one of the output).
# A gradient at one active unit is a chain of up to six roundings in the dense bf16 block as in
# ours (dWg's: the normalised input, the output gradient's cast, dh, u, dg = dh u, the GEMM's
# output), so a draw of either lands anywhere up to six roundoffs while the other may land near
# none. Measured on one token, D = H = 8, one active unit: dWg 9.0e-3 (ours) against 2.6e-3 (dense
# bf16), and on another draw 1.05e-2 (5.4 roundoffs) against 1.45e-3 (H100, 80c0960): a floor of
# three failed.
ABS_FLOOR = 1e-5
SMALL_SUPPORT, SMALL_SUPPORT_FLOOR = 64, 2.0**-8
SMALL_SUPPORT_GRAD_FLOOR = 6 * 2.0**-9


def ffn64(x, wg, wu, wd) -> torch.Tensor:
    """The FFN in float64: the reference every error is measured against."""
    x, wg, wu, wd = (t.double() for t in (x, wg, wu, wd))
    return (torch.relu(x @ wg.T) * (x @ wu.T)) @ wd.T


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of out against a float64 reference."""
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def gpu_weights(d: int, h: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wg = torch.randn(h, d, generator=gen, device="cuda") / d**0.5
    wu = torch.randn(h, d, generator=gen, device="cuda") / d**0.5
    wd = torch.randn(d, h, generator=gen, device="cuda") / h**0.5
    return wg.bfloat16(), wu.bfloat16(), wd.bfloat16()


# x is drawn from a stream of its own. Drawn with the weights' seed, x's row r was Wg's row r scaled
# (the same random numbers first), so unit r's gate on row r sat ~sqrt(D) above its bias (45 at
# D = 2048, against the -50 of `empty`): there two units fired at 2051 x 2048 x 5632 (H200,
# 2026-12-02), gates just over 0 after a cancellation of ~50, with the two active units as all the
# norm weight's gradient.
X_SEED_OFFSET = 1 << 32


def gpu_pattern(name: str, m: int, d: int, h: int, seed: int):
    """(x, wg, wu, wd) whose gate g = x Wg^T has the named pattern; x[:, 0] = 1 drives it via Wg[:, 0]."""
    gen = torch.Generator(device="cuda").manual_seed(seed + X_SEED_OFFSET)
    wg, wu, wd = gpu_weights(d, h, seed)
    x = torch.randn(m, d, generator=gen, device="cuda")
    x[:, 0] = 1.0
    bias = torch.full((h,), -50.0, device="cuda")  # nothing fires
    if name == "all_active":
        bias.fill_(50.0)
    elif name == "one_hot":
        bias[h // 3] = 50.0
    elif name == "random":
        bias = 0.5 * torch.randn(h, generator=gen, device="cuda")
    elif name == "tile_budget":  # exactly SLOTS, then SLOTS + 1, units of tile 0 fire
        bias[: min(SLOTS, h)] = 50.0
    elif name == "tile_overflow":
        bias[: min(SLOTS + 1, h)] = 50.0
    wg[:, 0] = bias.bfloat16()
    if name == "mixed_rows":  # empty rows, fully dense rows and sparse rows in one batch
        wg[:, 0] = -2.0
        x[0::3] = 0.0  # g = 0: empty rows
        x[1::3, 0] = -100.0  # g = +200 - ...: every unit fires
    return x.bfloat16(), wg, wu, wd


PATTERNS = ["empty", "all_active", "one_hot", "random", "tile_budget", "tile_overflow", "mixed_rows"]
