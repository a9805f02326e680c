"""The benchmark scripts' shared helpers (benchmarks/common.py): the median time, the GPU idle
table, the kernel tables and labels, the memory peak table."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from benchmarks.common import (
    busy_us,
    device_kernel_table,
    gpu_idle_table,
    kernel_label,
    kernel_table,
    kernel_us,
    median_ms,
    memory_peak_table,
    step_time_split,
)


def _event(name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_gpu_idle_table_sums_gaps_by_neighbouring_kernels():
    events = [
        _event("gemm", 0, 100),
        _event("side_stream", 10, 50),  # overlaps the gemm: no gap
        _event("pack", 130, 140),  # 30 us after the gemm
        _event("host_op", 135, 400, DeviceType.CPU),  # CPU events are not GPU time
        _event("gemm", 141, 200),  # 1 us: under the threshold
        _event("pack", 250, 260),  # 50 us after the second gemm
    ]
    table = gpu_idle_table(events)
    assert "GPU idle between kernels: 0.08 ms of 0.26 ms" in table
    assert "| 0.08 | 2 | 40.0 | gemm | pack |" in table


def test_busy_us_counts_overlapping_spans_once():
    spans = [(0, 100, "gemm"), (10, 50, "side"), (130, 140, "pack"), (135, 160, "copy"), (200, 200, "empty")]
    assert busy_us(spans) == 100 + 30
    assert busy_us([]) == 0


def test_step_time_split_separates_compute_exposed_communication_and_idle():
    events = [
        _event("gemm", 0, 100),
        _event("ncclDevKernel_AllGather", 50, 130),  # 50-100 hidden by the gemm, 100-130 exposed
        _event("pack", 150, 200),  # 20 us idle before it
        _event("ncclDevKernel_ReduceScatter", 210, 240),  # 10 us idle, then 30 exposed
        _event("host_op", 0, 500, DeviceType.CPU),  # not GPU time
    ]
    split = step_time_split(events, steps=2)
    assert split == {
        "span_ms": 0.24 / 2,
        "compute_ms": 0.15 / 2,
        "communication_ms": 0.11 / 2,
        "communication_exposed_ms": 0.06 / 2,
        "idle_ms": 0.03 / 2,
    }
    assert step_time_split([_event("host_op", 0, 10, DeviceType.CPU)]) == {}


def test_gpu_idle_table_without_device_events_is_empty():
    assert gpu_idle_table([_event("host_op", 0, 10, DeviceType.CPU)]) == ""


def test_kernel_label_keeps_a_kernels_own_name():
    assert kernel_label(
        "void ns::(anonymous namespace)::csr_units_kernel<__nv_bfloat16>(float const*, long)"
    ) == ("csr_units_kernel")
    assert kernel_label("ns::(anonymous namespace)::csr_count_kernel(int const*, long)") == "csr_count_kernel"
    assert (
        kernel_label("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN")
        == "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN"
    )
    fill = "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul> >(int)"
    assert kernel_label(fill) == "vectorized_elementwise_kernel[FillFunctor]"
    assert kernel_label("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD (Device -> Device)"
    assert kernel_label("Memset (Device)") == "Memset (Device)"


def test_kernel_us_sums_each_kernel_per_call_largest_first():
    spans = [
        (0, 100, "void ns::a_kernel<float>(int)"),
        (100, 130, "ns::b_kernel(int)"),
        (130, 230, "void ns::a_kernel<__nv_bfloat16>(int)"),  # another instance: the same kernel
        (230, 290, "ns::b_kernel(int)"),
    ]
    assert kernel_us(spans, calls=2) == {"a_kernel": 100.0, "b_kernel": 45.0}
    assert list(kernel_us(spans, calls=2)) == ["a_kernel", "b_kernel"]


def test_device_kernel_table_lists_every_kernel_per_call():
    events = [
        _event("gemm", 0, 100),
        _event("pack", 100, 104),
        _event("pack", 104, 108),
        _event("host_op", 0, 500, DeviceType.CPU),  # not GPU time
        _event("gemm", 200, 300),
        _event("pack", 300, 304),
        _event("pack", 304, 308),
        _event("fill", 310, 312),
    ]
    table = device_kernel_table(events, calls=2, rows=2)
    assert "GPU time per call: 109.0 us in 3.5 launches" in table
    assert table.index("| 100.0 | 1 | gemm |") < table.index("| 8.0 | 2 | pack |")
    assert "| 1.0 | 0.5 | (the remaining 1) |" in table
    assert device_kernel_table([_event("host_op", 0, 10, DeviceType.CPU)]) == ""


def test_kernel_table_on_cpu_writes_the_trace(tmp_path):
    trace = tmp_path / "trace.json"
    table = kernel_table(lambda: torch.ones(8) @ torch.ones(8), torch.device("cpu"), trace_path=trace)
    assert "Wall time of the profiled call" in table and "GPU idle" not in table
    assert trace.read_text().lstrip().startswith("{")


def test_memory_peak_table_lists_the_blocks_alive_at_the_peak():
    model = {"filename": "/repo/sparse_llm/model.py", "line": 7, "name": "forward"}
    generated = {"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 42, "name": "call"}
    torch_frame = {"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"}
    mib = 2**20

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size * mib, "frames": frames}

    def free(addr, size):
        return {"action": "free_requested", "addr": addr, "size": size * mib}

    trace = [
        alloc(1, 64, [torch_frame, generated, model]),
        alloc(2, 64, [torch_frame, generated, model]),
        alloc(3, 10, [model]),
        free(3, 10),
        alloc(4, 300, [torch_frame, model]),  # the peak: 64 + 64 + 300
        free(4, 300),
        alloc(5, 100, [model]),
    ]
    table = memory_peak_table(trace)
    assert "Peak during the trace: 428 MiB" in table
    assert "| 300 | 1 | 300.0 | model.py:7 forward | model.py:7 forward |" in table
    assert "| 128 | 2 | 64.0 | cab.py:42 call | model.py:7 forward |" in table
    assert "100.0" not in table and "10.0" not in table  # allocated after the peak / freed before


def test_median_ms_calls_warmup_plus_reps_times_and_returns_the_median() -> None:
    calls = []

    def fn() -> None:
        calls.append(None)
        time.sleep(0.001 if len(calls) % 2 else 0.02)  # the odd calls 1 ms, the even ones 20 ms

    ms = median_ms(fn, torch.device("cpu"), warmup=2, reps=5)
    assert len(calls) == 7
    assert 1 <= ms < 20  # timed calls 3 to 7: 1, 20, 1, 20, 1 ms
