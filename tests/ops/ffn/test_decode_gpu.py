"""GPU tests of the decode FFN (kernels/decode_ffn.cu): the path of `ops.ffn_forward` / `ffn_add_`
for up to DECODE_MAX_ROWS rows. The exactness contract on every pattern, a result that depends on
the inputs only, and a CUDA graph replayed on new inputs giving the eager result."""

import pytest
import torch
from ffn_patterns import ABS_FLOOR, PATTERNS, ffn64, gpu_pattern, needs_hopper, rel_err

from benchmarks.common import make_workload
from sparse_llm import ops
from sparse_llm.ops._extension import extension
from sparse_llm.ops.ffn.inference import DECODE_MAX_DIM, DECODE_MAX_ROWS

pytestmark = [pytest.mark.gpu, needs_hopper]


def _assert_exact(out, x, wg, wu, wd):
    ref = ffn64(x, wg, wu, wd)
    dense = ops.ffn_forward(x, wg, wu, wd, impl="reference")
    assert torch.isfinite(out).all()
    if ref.norm() == 0:
        assert out.abs().max().item() == 0
        return
    err, err_dense = rel_err(out, ref), rel_err(dense, ref)
    assert err <= 2 * err_dense + ABS_FLOOR, f"error {err:.3e} vs dense bf16 {err_dense:.3e}"


# 1 row takes the whole FFN in one launch, 2 the gate GEMV then up/down, more cuBLAS's gate, the
# compaction and up/down.
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(
    ("m", "d", "h"), [(1, 2048, 5632), (2, 256, 704), (3, 256, 696), (64, 2048, 5632), (5, 8, 40)]
)
def test_patterns_are_exact(pattern, m, d, h):
    """`all_active` is the record's worst case: every unit of every segment listed."""
    x, wg, wu, wd = gpu_pattern(pattern, m, d, h, seed=m * 7 + d + h)
    _assert_exact(ops.ffn_forward(x, wg, wu, wd, impl="cuda"), x, wg, wu, wd)


@pytest.mark.parametrize("m", [1, 8, 64])
@pytest.mark.parametrize("nnz", [15, 30, 120])
def test_standard_shapes_are_exact(m, nnz):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh inputs every run
    w = make_workload(m, 2048, 5632, nnz, seed=seed, device="cuda")
    _assert_exact(ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda"), w.x, w.wg, w.wu, w.wd)


@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("splits", [1, 3, 64])
def test_every_split_of_up_down_is_exact(m, splits):
    """The tuning knob moves work between CTAs only: each count gives an exact result, the same on
    every call."""
    w = make_workload(m, 2048, 5632, 30, seed=m + splits, device="cuda")
    out = torch.zeros_like(w.x)
    torch.ops.sparse_llm.ffn_decode_add_(out, w.x, w.wg, w.wu, w.wd.t().contiguous(), splits)
    _assert_exact(out, w.x, w.wg, w.wu, w.wd)
    again = torch.zeros_like(w.x)
    torch.ops.sparse_llm.ffn_decode_add_(again, w.x, w.wg, w.wu, w.wd.t().contiguous(), splits)
    assert torch.equal(again, out)


@pytest.mark.parametrize("pattern", ["all_active", "random", "one_hot"])
@pytest.mark.parametrize(
    ("d", "h"),
    # One launch with few finishers (H 104: 4 segments; H 32: 1, a slice of 256 values), and shapes
    # whose slices would pass 32 vectors a lane, which take the split path instead.
    [(200, 104), (256, 32), (8, 40), (1024, 64), (2048, 40), (264, 32)],
)
def test_one_row_at_small_and_odd_shapes_is_exact(pattern, d, h):
    x, wg, wu, wd = gpu_pattern(pattern, 1, d, h, seed=d + h)
    _assert_exact(ops.ffn_forward(x, wg, wu, wd, impl="cuda"), x, wg, wu, wd)


@pytest.mark.parametrize("pattern", ["all_active", "random"])
def test_a_hidden_too_wide_for_one_launch_takes_the_split_path_exactly(pattern):
    """Past kDecodeOneLaunchMaxSegments segments (H > 32768) one row falls back to gate + up/down."""
    x, wg, wu, wd = gpu_pattern(pattern, 1, 8, 33_000, seed=11)
    _assert_exact(ops.ffn_forward(x, wg, wu, wd, impl="cuda"), x, wg, wu, wd)


def test_one_launch_and_split_paths_agree():
    """The default plan at one row (one launch) and up/down as its own launch differ only in the
    order of the down projection's fp32 sum."""
    w = make_workload(1, 2048, 5632, 120, seed=1, device="cuda")
    wd_t = w.wd.t().contiguous()
    one, split = torch.zeros_like(w.x), torch.zeros_like(w.x)
    torch.ops.sparse_llm.ffn_decode_add_(one, w.x, w.wg, w.wu, wd_t, 0)
    torch.ops.sparse_llm.ffn_decode_add_(split, w.x, w.wg, w.wu, wd_t, 16)
    torch.testing.assert_close(one, split, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_add_is_out_plus_forward_and_depends_on_the_inputs_only(m):
    w = make_workload(m, 2048, 5632, 30, seed=m, device="cuda")
    out = torch.randn(m, 1, 2048, device="cuda").bfloat16()  # a decode step's residual stream
    expected = out + ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda").view(m, 1, 2048)
    wd_t = w.wd.t().contiguous()
    for _ in range(3):
        again = out.clone()
        ops.ffn_add_(again, w.x.view(m, 1, 2048), w.wg, w.wu, w.wd, impl="cuda", wd_t=wd_t)
        assert torch.equal(again, expected)


@pytest.mark.parametrize(
    "m", [1, 8]
)  # one row: the one-launch kernel, its arrival counter zeroed in the graph
def test_a_captured_graph_replays_new_inputs_exactly(m):
    w = make_workload(m, 2048, 5632, 30, seed=3, device="cuda")
    wd_t = w.wd.t().contiguous()
    x = torch.zeros_like(w.x)
    out = torch.zeros_like(w.x)

    def step():
        out.zero_()
        ops.ffn_add_(out, x, w.wg, w.wu, w.wd, impl="cuda", wd_t=wd_t)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (11, 12):
        fresh = make_workload(m, 2048, 5632, 30, seed=seed, device="cuda").x
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        eager = ops.ffn_forward(fresh, w.wg, w.wu, w.wd, impl="cuda", wd_t=wd_t)
        assert torch.equal(out, eager)


def test_no_host_sync():
    w = make_workload(4, 2048, 5632, 30, seed=5, device="cuda")
    out = torch.zeros_like(w.x)
    wd_t = w.wd.t().contiguous()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.ffn_add_(out, w.x, w.wg, w.wu, w.wd, impl="cuda", wd_t=wd_t)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _kernels_launched(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize(("m", "splits", "one_launch"), [(1, 0, True), (1, 16, False), (2, 0, False)])
def test_one_row_is_one_kernel_of_ours(m, splits, one_launch):
    """The default plan at one row is decode_ffn_kernel alone (with the arrival counter's fill);
    an explicit split, or a second row, runs the gate and up/down as their own launches."""
    w = make_workload(m, 2048, 5632, 30, seed=9, device="cuda")
    wd_t, out = w.wd.t().contiguous(), torch.zeros_like(w.x)
    names = _kernels_launched(
        lambda: torch.ops.sparse_llm.ffn_decode_add_(out, w.x, w.wg, w.wu, wd_t, splits)
    )
    ours = [n for n in names if "sparse_llm" in n]
    if one_launch:
        assert len(ours) == 1 and "decode_ffn_kernel" in ours[0], names
    else:
        assert not any("decode_ffn_kernel" in n for n in ours) and any("decode_updown" in n for n in ours), (
            names
        )


def test_decode_rows_bound_matches_the_kernel_choice():
    """Past DECODE_MAX_ROWS the TwELL path runs; both agree within the contract."""
    w = make_workload(DECODE_MAX_ROWS + 1, 2048, 5632, 30, seed=9, device="cuda")
    _assert_exact(ops.ffn_forward(w.x, w.wg, w.wu, w.wd, impl="cuda"), w.x, w.wg, w.wu, w.wd)


def test_the_python_bound_is_the_kernels():
    assert extension().decode_max_dim == DECODE_MAX_DIM


def test_opcheck():
    x, wg, wu, wd = gpu_pattern("random", 4, 64, 128, seed=1)
    out = torch.randn(4, 64, device="cuda").bfloat16()
    torch.library.opcheck(torch.ops.sparse_llm.ffn_decode_add_, (out, x, wg, wu, wd.t().contiguous()))
