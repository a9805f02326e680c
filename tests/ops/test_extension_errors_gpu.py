"""A failed check in the CUDA extension raises a Python exception, and the process lives on.

The extension is called directly (`sparse_llm.ops._extension.extension()`), past the Python fronts'
own checks: a bad argument raises ValueError, a failed launch RuntimeError (kernels/errors.h),
and the next valid call of the same entry point works. A failed check used to end the process
(a segmentation fault on the device machines), so the first check runs in a child process: if it
dies there, this module's tests fail instead of taking the test session down.
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from ffn_patterns import needs_hopper

from sparse_llm.ops._extension import extension

pytestmark = [pytest.mark.gpu, needs_hopper]

M, D, H = 16, 64, 128
BF16 = torch.bfloat16

_CHILD = textwrap.dedent(
    """
    import torch
    from sparse_llm.ops._extension import extension

    ext = extension()
    g = torch.randn(3, 5, device="cuda", dtype=torch.bfloat16)  # H = 5: not a multiple of 8
    try:
        ext.twell_pack(g, 64)
    except (ValueError, RuntimeError) as err:
        print("raised", type(err).__name__, err)
    else:
        raise SystemExit("twell_pack took H = 5")
    ext.twell_pack(torch.randn(3, 8, device="cuda", dtype=torch.bfloat16), 64)
    torch.cuda.synchronize()
    print("survived")
    """
)


@pytest.fixture(scope="module")
def ext():
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=900)
    if child.returncode != 0 or "survived" not in child.stdout:
        pytest.fail(
            f"a failed C++ check ended the process (exit status {child.returncode}):\n"
            f"{child.stdout[-2000:]}\n{child.stderr[-4000:]}"
        )
    return extension()


def _ffn_inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, wg, wu = (torch.randn(s, device="cuda", dtype=BF16, generator=gen) for s in [(M, D), (H, D), (H, D)])
    wd = torch.randn(D, H, device="cuda", dtype=BF16, generator=gen)
    return x, wg, wu, wd


def _kv_write(ext, layer, start, columns=None):
    """kv_cache_write_rope of 4 tokens at `start` (or kv_cache_write_rope_columns at `columns`) into
    layer `layer` of a 2-layer cache of 8."""
    layers, batch, max_len, heads, head_dim, tokens = 2, 1, 8, 2, 16, 4
    k_cache, v_cache = (
        torch.zeros(layers, batch, max_len, heads, head_dim, device="cuda", dtype=BF16) for _ in range(2)
    )
    k, v = (torch.randn(batch, tokens, heads, head_dim, device="cuda", dtype=BF16) for _ in range(2))
    cos, sin = (torch.randn(tokens, head_dim, device="cuda", dtype=BF16) for _ in range(2))
    if columns is None:
        ext.kv_cache_write_rope(k_cache, v_cache, layer, start, k, v, cos, sin)
    else:
        ext.kv_cache_write_rope_columns(k_cache, v_cache, layer, columns, k, v, cos, sin)


def _pack(ext, threshold=64):
    x, wg, wu, wd = _ffn_inputs()
    return x, wu, wd.t().contiguous(), ext.twell_pack(x @ wg.T, threshold)


def _backward_args(ext):
    x, wg, wu, wd = _ffn_inputs()
    out = ext.ffn_train_forward(x, wg, wu, wd, None, 64, 2)
    grad_y = torch.randn_like(x)
    grad_l1 = torch.ones((), device="cuda")
    nnz, cols, a_vals, u_vals, heavy_rows, heavy_cols, heavy_a, heavy_u, dense_units = out[2], *out[6:]
    return [
        grad_y,
        grad_l1,
        x,
        wg,
        wu,
        wd,
        nnz,
        cols,
        a_vals,
        u_vals,
        heavy_rows,
        heavy_cols,
        heavy_a,
        heavy_u,
        dense_units,
    ]


def _decode_args(d: int) -> list[torch.Tensor]:
    """(out, x, wg, wu, wd_t) of ffn_decode_add_ for 4 rows of dimension d."""
    x = torch.randn(4, d, device="cuda", dtype=BF16)
    wg, wu, wd_t = (torch.randn(H, d, device="cuda", dtype=BF16) for _ in range(3))
    return [torch.zeros_like(x), x, wg, wu, wd_t]


def _with(args, index, value):
    return [*args[:index], value, *args[index + 1 :]]


# (entry point, bad call, the error's message, a valid call of the same entry point)
CASES = {
    "twell_pack H not a multiple of 8": (
        lambda ext: ext.twell_pack(torch.randn(3, 5, device="cuda", dtype=BF16), 64),
        "H must be a multiple of 8",
        lambda ext: ext.twell_pack(torch.randn(3, 8, device="cuda", dtype=BF16), 64),
    ),
    "twell_pack wrong dtype": (
        lambda ext: ext.twell_pack(torch.randn(3, 8, device="cuda"), 64),
        "g must be BFloat16",
        lambda ext: ext.twell_pack(torch.randn(3, 8, device="cuda", dtype=BF16), 64),
    ),
    "twell_pack wrong device": (
        lambda ext: ext.twell_pack(torch.randn(3, 8, dtype=BF16), 64),
        "g must be a CUDA tensor",
        lambda ext: ext.twell_pack(torch.randn(3, 8, device="cuda", dtype=BF16), 64),
    ),
    "twell_pack_masked wrong mask": (
        lambda ext: ext.twell_pack_masked(
            torch.rand(3, 8, device="cuda", dtype=BF16),
            torch.zeros(3, 4, device="cuda", dtype=torch.int64),
            64,
        ),
        "mask must be a contiguous int32",
        lambda ext: ext.twell_pack_masked(
            torch.rand(3, 8, device="cuda", dtype=BF16),
            torch.full((3, 4), -1, device="cuda", dtype=torch.int32),
            64,
        ),
    ),
    "gate_relu_mask mismatched D": (
        lambda ext: ext.gate_relu_mask(*_ffn_inputs()[:1], torch.randn(H, D + 8, device="cuda", dtype=BF16)),
        r"wg must be \[H, D\]",
        lambda ext: ext.gate_relu_mask(*_ffn_inputs()[:2]),
    ),
    "ffn_forward heavy_threshold above 512": (
        lambda ext: ext.ffn_forward(*_ffn_inputs(), None, 513),
        r"heavy_threshold must be in \[0, 512\]",
        lambda ext: ext.ffn_forward(*_ffn_inputs(), None, 64),
    ),
    "ffn_forward negative heavy_threshold": (
        lambda ext: ext.ffn_forward(*_ffn_inputs(), None, -1),
        r"heavy_threshold must be in \[0, 512\]",
        lambda ext: ext.ffn_forward(*_ffn_inputs(), None, 0),
    ),
    "ffn_forward mismatched wu": (
        lambda ext: ext.ffn_forward(
            *_ffn_inputs()[:2], torch.randn(H, D // 2, device="cuda", dtype=BF16), _ffn_inputs()[3], None, 64
        ),
        "wg and wu must have the same shape",
        lambda ext: ext.ffn_forward(*_ffn_inputs(), None, 64),
    ),
    "ffn_add_ non-contiguous out": (
        lambda ext: ext.ffn_add_(torch.zeros(D, M, device="cuda", dtype=BF16).t(), *_ffn_inputs(), None, 64),
        "out must be contiguous",
        lambda ext: ext.ffn_add_(torch.zeros(M, D, device="cuda", dtype=BF16), *_ffn_inputs(), None, 64),
    ),
    "transpose 3-D": (
        lambda ext: ext.transpose(torch.randn(2, 8, 8, device="cuda", dtype=BF16)),
        "t must be 2-D",
        lambda ext: ext.transpose(torch.randn(8, 16, device="cuda", dtype=BF16)),
    ),
    "kv_cache_write_rope layer out of range": (
        lambda ext: _kv_write(ext, layer=5, start=0),
        "layer 5 out of range",
        lambda ext: _kv_write(ext, layer=1, start=4),
    ),
    "kv_cache_write_rope_columns int32 columns": (
        lambda ext: _kv_write(
            ext, layer=1, start=0, columns=torch.zeros(1, device="cuda", dtype=torch.int32)
        ),
        "columns must be a contiguous int64 vector",
        lambda ext: _kv_write(ext, layer=1, start=0, columns=torch.zeros(1, device="cuda", dtype=torch.long)),
    ),
    "kv_cache_write_rope_columns columns of the wrong length": (
        lambda ext: _kv_write(ext, layer=1, start=0, columns=torch.zeros(2, device="cuda", dtype=torch.long)),
        "columns must be a contiguous int64 vector of B = 1",
        lambda ext: _kv_write(ext, layer=1, start=0, columns=torch.zeros(1, device="cuda", dtype=torch.long)),
    ),
    "kv_cache_write_rope_columns columns on the CPU": (
        lambda ext: _kv_write(ext, layer=1, start=0, columns=torch.zeros(1, dtype=torch.long)),
        "start columns on k's device",
        lambda ext: _kv_write(ext, layer=1, start=0, columns=torch.zeros(1, device="cuda", dtype=torch.long)),
    ),
    "ffn_train_forward D not a multiple of 8": (
        lambda ext: ext.ffn_train_forward(
            *(torch.randn(s, device="cuda", dtype=BF16) for s in [(M, 60), (H, 60), (H, 60), (60, H)]),
            None,
            64,
            0,
        ),
        "D must be a multiple of 8",
        lambda ext: ext.ffn_train_forward(*_ffn_inputs(), None, 64, 0),
    ),
    "ffn_train_forward negative heavy_threshold": (
        lambda ext: ext.ffn_train_forward(*_ffn_inputs(), None, -1, 0),
        "heavy_threshold must be >= 0",
        lambda ext: ext.ffn_train_forward(*_ffn_inputs(), None, 64, 0),
    ),
    "ffn_train_forward negative dense_min_fires": (
        lambda ext: ext.ffn_train_forward(*_ffn_inputs(), None, 64, -1),
        "dense_min_fires must be >= 0",
        lambda ext: ext.ffn_train_forward(*_ffn_inputs(), None, 64, 2),
    ),
    "ffn_train_backward wrong grad_y": (
        lambda ext: ext.ffn_train_backward(
            *_with(_backward_args(ext), 0, torch.randn(M + 1, D, device="cuda", dtype=BF16))
        ),
        "grad_y must be shaped like x",
        lambda ext: ext.ffn_train_backward(*_backward_args(ext)),
    ),
    "cross_entropy_rows int32 labels": (
        lambda ext: ext.cross_entropy_rows(
            torch.randn(4, 32, device="cuda", dtype=BF16),
            torch.zeros(4, device="cuda", dtype=torch.int32),
            -100,
            None,
            False,
        ),
        "labels must be contiguous int64",
        lambda ext: ext.cross_entropy_rows(
            torch.randn(4, 32, device="cuda", dtype=BF16),
            torch.zeros(4, device="cuda", dtype=torch.int64),
            -100,
            None,
            False,
        ),
    ),
    "ffn_decode_add_ D too large": (
        lambda ext: ext.ffn_decode_add_(*_decode_args(4096)),
        "D must be a multiple of 8, at most 2048",
        lambda ext: ext.ffn_decode_add_(*_decode_args(64)),
    ),
    "ffn_decode_add_ wd_t of the wrong shape": (
        lambda ext: ext.ffn_decode_add_(
            *_with(_decode_args(64), 4, torch.zeros(H, 32, device="cuda", dtype=BF16))
        ),
        "wg, wu and wd_t must all be",
        lambda ext: ext.ffn_decode_add_(*_decode_args(64)),
    ),
    "ffn_decode_add_ too many splits": (
        lambda ext: ext.ffn_decode_add_(*_decode_args(64), 65),
        "splits must be in",
        lambda ext: ext.ffn_decode_add_(*_decode_args(64), 64),
    ),
    "ffn_decode_add_ out of the wrong size": (
        lambda ext: ext.ffn_decode_add_(
            *_with(_decode_args(64), 0, torch.zeros(3, 64, device="cuda", dtype=BF16))
        ),
        "out must be a contiguous bf16 CUDA tensor",
        lambda ext: ext.ffn_decode_add_(*_decode_args(64)),
    ),
    "activation_counts wrong dtype": (
        lambda ext: ext.activation_counts(torch.rand(4, 16, device="cuda")),
        "a must be BFloat16",
        lambda ext: ext.activation_counts(torch.rand(4, 16, device="cuda", dtype=BF16)),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_argument_raises_value_error_and_the_process_lives_on(ext, case):
    bad, match, good = CASES[case]
    with pytest.raises(ValueError, match=match):
        bad(ext)
    good(ext)
    torch.cuda.synchronize()


def test_failed_launch_raises_runtime_error(ext):
    """A launcher's refusal (twell_updown's light-row budget above 512: checked by the launcher
    alone) comes back as a RuntimeError naming the kernel; the device stays usable."""
    x, wu, wd_t, pack = _pack(ext)
    with pytest.raises(RuntimeError, match="twell_updown failed"):
        ext.twell_updown(x, wu, wd_t, *pack, 600)
    y = ext.twell_updown(x, wu, wd_t, *pack, 64)
    torch.cuda.synchronize()
    assert y.shape == x.shape


def test_many_failed_checks_in_a_row(ext):
    """Nothing leaks or breaks per failure: a thousand failed checks, then a valid call."""
    g = torch.randn(3, 5, device="cuda", dtype=BF16)
    for _ in range(1000):
        with pytest.raises(ValueError):
            ext.twell_pack(g, 64)
    values, *_ = ext.twell_pack(torch.randn(3, 8, device="cuda", dtype=BF16), 64)
    torch.cuda.synchronize()
    assert values.shape[0] == 3
