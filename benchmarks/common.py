"""What the benchmark scripts share, and no library code needs: their command line, device and
report (parser, --json / --md, meta, the files), the synthetic FFN workload, the weights they time
(loaded, freshly initialised or made sparse by a short high-L1 training run), the median time of a
call, the kernel table (and GPU idle) of one profiled call, and where the memory peak of a recorded
call comes from.

Every script is a module, run from the repository root as `python -m benchmarks.<name> ...`.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# The model of the scripts' --tiny runs on a CPU (the rest of ModelConfig: its defaults).
TINY_MODEL = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2}


# ---- the command line, device and report of every script -----------------------------------------
def script_parser(doc: str | None, report: bool = True) -> argparse.ArgumentParser:
    """A script's parser, its module docstring as the help text; with `report`, --json and --md
    (where `write_report` writes the rows with the meta, and the Markdown)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if report:
        p.add_argument("--json", type=Path, default=None, help="write the meta and rows here as JSON")
        p.add_argument("--md", type=Path, default=None, help="write the Markdown report here")
    return p


def bench_device(cpu: bool = False) -> torch.device:
    """Where a script measures: the GPU where there is one, the CPU when `cpu` asks (a --tiny run)."""
    return torch.device("cuda" if torch.cuda.is_available() and not cpu else "cpu")


def require_cuda(what: str, kernels: bool = False) -> torch.device:
    """The GPU `what` measures on; exits with the reason where there is none or, with `kernels`,
    where the CUDA kernels cannot run."""
    from sparse_llm.ops import kernels_unavailable

    reason = kernels_unavailable("cuda") if kernels else None if torch.cuda.is_available() else "no CUDA GPU"
    if reason is not None:
        raise SystemExit(f"{what}: needs {'the CUDA kernels' if kernels else 'a CUDA GPU'} ({reason})")
    return torch.device("cuda")


def run_meta(device: torch.device | str, world_size: int = 1, **fields: Any) -> dict[str, Any]:
    """A report's meta: the device, commit, date and versions of this run over `world_size`
    processes (`training.run_info.collect_run_info`), then the script's `fields`."""
    from sparse_llm.training.run_info import collect_run_info

    return collect_run_info(torch.device(device), world_size) | fields


def measure_cases(
    cases: Iterable[tuple[Any, ...]], bench: Callable[..., dict], progress: Callable[..., str]
) -> list[dict]:
    """The rows of `bench(*case)` for every case, with a progress line each (`progress(*case, row)`)
    and the GPU's cached blocks freed between cases (each allocates its own inputs)."""
    rows = []
    for case in cases:
        rows.append(bench(*case))
        print(progress(*case, rows[-1]), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def call_times_ms(
    fn: Callable[[], Any],
    device: torch.device,
    warmup: int,
    reps: int,
    before: Callable[[], Any] | None = None,
) -> list[float]:
    """Milliseconds of each of `reps` calls of fn() after `warmup`: CUDA events on a GPU, the wall
    clock on CPU; `before` runs ahead of each timed call, outside its time (e.g. a barrier)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return times


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls after `warmup` (`call_times_ms`)."""
    return statistics.median(call_times_ms(fn, device, warmup, reps))


def copy_bandwidth_gbs(device: torch.device, size_bytes: int = 2**30) -> float | None:
    """The device's copy bandwidth in GB/s (bytes read + written) from a large device-to-device
    copy: what a bandwidth-bound decode step is measured against. None off CUDA."""
    if device.type != "cuda":
        return None
    src = torch.empty(size_bytes // 2, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup=3, reps=20)
    return 2 * size_bytes / (ms / 1000) / 1e9


def kernel_table(
    fn: Callable[[], Any], device: torch.device, row_limit: int = 30, trace_path: Path | None = None
) -> str:
    """Run fn() once under torch.profiler: its operators and kernels by self GPU time (CPU time on
    a CPU), the call's wall time and, on a GPU, where the GPU sat idle (gaps between kernels).
    Warm fn up (and compile it) before. trace_path: also write the Chrome trace there (a name
    ending in .gz is compressed)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall_ms = 1000 * (time.perf_counter() - start)
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=row_limit
    )
    idle = gpu_idle_table(prof.events()) if cuda else ""
    return f"{table}\nWall time of the profiled call: {wall_ms:.1f} ms\n{idle}"


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def _device_spans(events: Any) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the profiler's device events (kernels, memsets, copies)."""
    from torch.autograd import DeviceType

    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]


def busy_us(spans: list[tuple[float, float, str]]) -> float:
    """Microseconds in which at least one of `spans` (start, end, name) runs: overlaps count once."""
    busy, end = 0.0, float("-inf")
    for start, stop, _ in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profiled_device_spans(fn: Callable[[], Any], calls: int) -> list[tuple[float, float, str]]:
    """The device events (start us, end us, name) of `calls` calls of fn() under torch.profiler.
    Warm fn up first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return _device_spans(prof.events())


def gpu_busy_ms(fn: Callable[[], Any], calls: int) -> float:
    """Milliseconds a call of fn() keeps the GPU busy (device events of `calls` calls under
    torch.profiler, overlaps counted once), without the idle between its kernels that its event
    time includes. Warm fn up first."""
    return busy_ms(profiled_device_spans(fn, calls), calls)


def busy_ms(spans: list[tuple[float, float, str]], calls: int) -> float:
    """Milliseconds a call keeps the GPU busy, from `calls` calls' device events."""
    return busy_us(spans) / 1000 / calls


def kernel_label(name: str) -> str:
    """A kernel's short name for a table: the function's own name without its namespaces, template
    arguments and parameters (`void ns::(anonymous namespace)::csr_count_kernel<float>(...)` ->
    `csr_count_kernel`); ATen's generic kernels keep the functor that says what they do
    (`vectorized_elementwise_kernel[FillFunctor]`); names without a signature (cuBLAS's `nvjet_...`,
    `Memset (Device)`) stay whole."""
    if name.startswith(("Memcpy", "Memset")) or "(" not in name.replace("(anonymous namespace)", ""):
        return name
    plain = name.replace("(anonymous namespace)::", "").removeprefix("void ")
    label = plain.split("(", 1)[0].split("<", 1)[0].rsplit("::", 1)[-1]
    if "at::native::" in plain:
        functor = re.search(r"(\w+Functor|\w+Ops|\w+_kernel_cuda|\w+_kernel_impl)\b", plain)
        if functor:
            label += f"[{functor.group(1)}]"
    return label


def kernel_us(spans: Iterable[tuple[float, float, str]], calls: int) -> dict[str, float]:
    """Microseconds a call of each kernel (by `kernel_label`) over `calls` calls' device events,
    largest first. Kernels that overlap each count their own time."""
    per_label: dict[str, float] = {}
    for start, end, name in spans:
        label = kernel_label(name)
        per_label[label] = per_label.get(label, 0.0) + (end - start) / calls
    return dict(sorted(per_label.items(), key=lambda kv: -kv[1]))


def step_time_split(events: Any, steps: int = 1) -> dict[str, float]:
    """Milliseconds per step from the first to the last device event, split into the time some
    compute kernel runs, the time only communication (NCCL) runs, and the time nothing runs. Under
    FSDP2 the all-gathers and reduce-scatters overlap compute when issued early enough; what they
    do not overlap, and the idle, is what a second GPU costs each step."""
    spans = _device_spans(events)
    if not spans:
        return {}
    compute = [s for s in spans if "nccl" not in s[2].lower()]
    comm = [s for s in spans if "nccl" in s[2].lower()]
    span = max(end for _, end, _ in spans) - min(start for start, _, _ in spans)
    busy, compute_busy = busy_us(spans), busy_us(compute)
    return {
        "span_ms": span / 1000 / steps,
        "compute_ms": compute_busy / 1000 / steps,
        "communication_ms": busy_us(comm) / 1000 / steps,
        "communication_exposed_ms": (busy - compute_busy) / 1000 / steps,
        "idle_ms": (span - busy) / 1000 / steps,
    }


def gpu_idle_table(events: Any, min_gap_us: float = 2.0, rows: int = 15) -> str:
    """Where the GPU idles between the first and the last device event: the gaps (all streams
    merged) grouped by the kernels on either side, largest total first. A gap that follows a
    host read or a burst of small launches shows up here, not in the kernel table."""
    spans = sorted(_device_spans(events))
    if not spans:
        return ""
    gaps: dict[tuple[str, str], list[float]] = {}
    busy_end, last_name = spans[0][1], spans[0][2]
    total_idle = 0.0
    for start, end, name in spans[1:]:
        gap = start - busy_end
        if gap >= min_gap_us:
            total_idle += gap
            gaps.setdefault((last_name, name), []).append(gap)
        if end >= busy_end:
            busy_end, last_name = end, name
    span_ms = (busy_end - spans[0][0]) / 1000
    lines = [
        "",
        f"GPU idle between kernels: {total_idle / 1000:.2f} ms of {span_ms:.2f} ms "
        f"(gaps of at least {min_gap_us:g} us, all streams merged)",
        "",
        "| idle ms | gaps | mean us | after kernel | before kernel |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:rows]
    for (before, after), values in ranked:
        lines.append(
            f"| {sum(values) / 1000:.2f} | {len(values)} | {sum(values) / len(values):.1f} "
            f"| {_short(before)} | {_short(after)} |"
        )
    return "\n".join(lines) + "\n"


def device_kernel_table(events: Any, calls: int = 1, rows: int = 40) -> str:
    """GPU time of every kernel (and device memset or copy) over `calls` profiled calls, per call,
    largest first: the operator table of torch.profiler folds small kernels under their operators
    and cuts the list, so a few microseconds each, many times a call, go unseen there."""
    per_name: dict[str, list[float]] = {}
    for start, end, name in _device_spans(events):
        per_name.setdefault(name, []).append(end - start)
    if not per_name:
        return ""
    total = sum(sum(v) for v in per_name.values()) / calls
    lines = [
        "",
        f"GPU time per call: {total:.1f} us in {sum(len(v) for v in per_name.values()) / calls:g} launches",
        "",
        "| us per call | launches per call | kernel |",
        "|---|---|---|",
    ]
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    for name, spans in ranked[:rows]:
        lines.append(f"| {sum(spans) / calls:.1f} | {len(spans) / calls:g} | {_short(name, 90)} |")
    if len(ranked) > rows:
        rest = [t for _, spans in ranked[rows:] for t in spans]
        lines.append(
            f"| {sum(rest) / calls:.1f} | {len(rest) / calls:g} | (the remaining {len(ranked) - rows}) |"
        )
    return "\n".join(lines) + "\n"


def _frame_text(frame: dict[str, Any]) -> str:
    return f"{Path(frame['filename']).name}:{frame['line']} {frame['name']}"


def _allocation_site(frames: list[dict[str, Any]]) -> tuple[str, str]:
    """(the innermost frame outside torch's package: e.g. a line of Inductor's generated code,
    the innermost frame of this repository: the model or script line behind it)."""
    own = next((f for f in frames if "/site-packages/torch/" not in f["filename"]), None)
    repo = next((f for f in frames if "sparse_llm/" in f["filename"] or "benchmarks/" in f["filename"]), None)
    return (_frame_text(own) if own else "?", _frame_text(repo) if repo else "?")


def memory_peak_table(trace: list[dict[str, Any]], rows: int = 25) -> str:
    """From a trace of the CUDA caching allocator (`torch.cuda.memory._snapshot()["device_traces"]`
    of one device, recorded with `torch.cuda.memory._record_memory_history`): the peak of the
    memory allocated during the trace, above what was allocated when it started, and the blocks
    alive at that peak grouped by size and allocation site, largest total first."""
    total = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
        elif event["action"] == "free_requested":
            total -= event["size"]
    live: dict[int, dict[str, Any]] = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_requested":
            live.pop(event["addr"], None)
    groups: dict[tuple[int, str, str], int] = {}
    for event in live.values():
        key = (event["size"], *_allocation_site(event.get("frames", [])))
        groups[key] = groups.get(key, 0) + 1
    mib = 2**20
    lines = [
        f"Peak during the trace: {peak / mib:.0f} MiB above the memory allocated when it started, "
        f"at event {peak_index} of {len(trace)}; blocks alive then, by size and site:",
        "",
        "| total MiB | blocks | MiB each | allocated at | from |",
        "|---|---|---|---|---|",
    ]
    ranked = sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])[:rows]
    for (size, site, repo_site), count in ranked:
        lines.append(f"| {size * count / mib:.0f} | {count} | {size / mib:.1f} | {site} | {repo_site} |")
    return "\n".join(lines) + "\n"


def write_report(
    text: str,
    meta: dict[str, Any],
    rows: list[dict],
    json_path: Path | None,
    md_path: Path | None,
    headline: dict[str, Any] | None = None,
) -> None:
    """Print the Markdown `text`; write {**headline, "meta", "results"} as JSON (`headline`: the
    figures a reader looks up first, at the top level) and the text as Markdown where asked."""
    print(text)
    if json_path:
        report = {**(headline or {}), "meta": meta, "results": rows}
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    if md_path:
        md_path.write_text(text)


# ---- the synthetic sparse-FFN workload (docs/design.md section 5), of every FFN benchmark ------------
# x rows ~ N(0, s_t^2) with a per-token scale s_t ~ LogNormal(0, 0.3); input feature 0 is held at
# 1.0 and gate column 0 holds minus a per-unit threshold, (base + 0.5 * N(0, 1)) standard
# deviations of that unit's pre-activation; 30% of the units never fire. `base` is found by
# bisection so that the mean number of non-zeros of relu(g) per token hits a target.

_SCALE_SIGMA = 0.3  # sigma of the per-token LogNormal scale
_SPREAD = 0.5  # per-unit threshold spread, in standard deviations
_DEAD_FRACTION = 0.3
_DEAD_THRESHOLD = 50.0  # standard deviations: such a unit never fires


@dataclass
class FFNWorkload:
    x: torch.Tensor  # [M, D]
    wg: torch.Tensor  # [H, D]
    wu: torch.Tensor  # [H, D]
    wd: torch.Tensor  # [D, H]
    base: float  # the bisected threshold base, in standard deviations


def make_inputs(m: int, d: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """Token rows with the per-token LogNormal scale and feature 0 held at 1.0 (float32)."""
    scale = torch.exp(_SCALE_SIGMA * torch.randn(m, 1, generator=generator, device=device))
    x = torch.randn(m, d, generator=generator, device=device) * scale
    x[:, 0] = 1.0
    return x


def _mean_nnz(pre: torch.Tensor, thresholds: torch.Tensor) -> float:
    return (pre > thresholds).sum(dim=1, dtype=torch.float64).mean().item()


def make_workload(
    m: int,
    d: int,
    h: int,
    nnz_target: float,
    *,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    calib_tokens: int = 4096,
) -> FFNWorkload:
    """Build (x, Wg, Wu, Wd) whose relu(x Wg^T) has about `nnz_target` non-zeros per token."""
    gen = torch.Generator(device=device).manual_seed(seed)
    wg = torch.randn(h, d, generator=gen, device=device) / d**0.5
    wu = torch.randn(h, d, generator=gen, device=device) / d**0.5
    wd = torch.randn(d, h, generator=gen, device=device) / h**0.5
    # Std of each unit's pre-activation over tokens without the threshold feature:
    # ||w_j|| * sqrt(E[s^2]), E[s^2] = exp(2 sigma^2) for s ~ LogNormal(0, sigma).
    sigma = wg[:, 1:].norm(dim=1) * torch.exp(torch.tensor(_SCALE_SIGMA**2, device=device))
    offset = _SPREAD * torch.randn(h, generator=gen, device=device)
    dead = torch.rand(h, generator=gen, device=device) < _DEAD_FRACTION
    offset[dead] = _DEAD_THRESHOLD

    x = make_inputs(m, d, gen, device)
    calib = x[: min(m, calib_tokens)]
    pre = calib[:, 1:] @ wg[:, 1:].T  # pre-activations without the threshold feature
    lo, hi = -10.0, 20.0  # mean nnz decreases as base grows
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        if _mean_nnz(pre, (mid + offset) * sigma) > nnz_target:
            lo = mid
        else:
            hi = mid
    base = 0.5 * (lo + hi)
    wg[:, 0] = -(base + offset) * sigma
    return FFNWorkload(x.to(dtype), wg.to(dtype), wu.to(dtype), wd.to(dtype), base)


# ---- the weights a script times: loaded, freshly initialised, or made sparse -----------------------
def load_weights(path: Path) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """The model config, fp32 weights (CPU) and tokenizer of an export, checkpoint or run directory."""
    from sparse_llm.inference.loading import load_model

    loaded = load_model(path, "cpu", torch.float32)
    return loaded.model.config, loaded.model.state_dict(), loaded.tokenizer


def fresh_weights(fields: dict[str, Any], seed: int) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """(config, fp32 CPU weights, tokenizer) of a model of `fields` (ModelConfig fields) initialised
    as the trainer does, seeded; the tokenizer is the trainer's default data's (the embedded one),
    whose vocabulary the model takes unless `fields` sets one."""
    from sparse_llm.config import ModelConfig
    from sparse_llm.data import load_tokenizer
    from sparse_llm.model import build_model

    tokenizer = load_tokenizer("embedded")
    cfg = ModelConfig(**{**fields, "vocab_size": fields.get("vocab_size") or len(tokenizer)})
    torch.manual_seed(seed)
    return cfg, build_model(cfg).state_dict(), tokenizer


def model_preset(name: str) -> dict[str, Any]:
    """configs/model/<name>.yaml as a dict of ModelConfig fields."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "model" / f"{name}.yaml"))


def sparsify(
    run_dir: Path,
    model: dict[str, Any],
    *,
    steps: int,
    l1_coeff: float,
    lr: float,
    seq_len: int,
    batch: int,
    micro_batch: int | None = None,
    l1_warmup_end: int = 0,
    data: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    overrides: Sequence[str] = (),
) -> Path:
    """Make sparse weights: train `model` (ModelConfig fields, e.g. `model_preset("1b")`, on the dense
    FFN) for `steps` steps of `batch` sequences at L1 coefficient `l1_coeff`, through
    `sparse_llm.train.run` (what `python -m sparse_llm.train` runs), quietly: no periodic evaluation
    or checkpoint, no export, no plots, wandb off. `train` adds train.* keys, `overrides` are dotlist
    entries applied last (e.g. "model.num_hidden_layers=2"). Returns `run_dir`, which then holds the
    final checkpoint with config.yaml and metrics.jsonl: `sparse_llm.inference.load_model(run_dir)`
    reads the weights. What the run held on the GPU is freed before returning."""
    from omegaconf import OmegaConf

    from sparse_llm.train import run

    raw = {
        "run_dir": str(run_dir),
        "model": {**model, "ffn_impl": "dense"},
        "data": data or {},
        "train": {
            "seq_len": seq_len,
            "global_batch_size": batch,
            "micro_batch_size": micro_batch or batch,
            "max_steps": steps,
            "lr": lr,
            "warmup_steps": max(1, steps // 10),
            "log_every": max(1, steps // 10),
            "eval_every": 0,
            "eval_batches": 1,
            "checkpoint_every": 0,
            "keep_last": 1,
            "export": False,
            "progress": False,
            **(train or {}),
        },
        "sparsity": {"l1_coeff": l1_coeff, "l1_warmup_end": l1_warmup_end, "plots": False},
        "logger": {"wandb": {"mode": "disabled"}},
    }
    run_dir = Path(run_dir)
    run(OmegaConf.merge(OmegaConf.create(raw), OmegaConf.from_dotlist(list(overrides))), run_dir)
    free_memory()  # the trainer is gone; its compiled graphs (train.compile) still reference the weights
    return run_dir


def sparse_path(
    phase: str, cfg: Any, device: torch.device | str, dtype: torch.dtype
) -> tuple[str, str | None]:
    """The sparse FFN a benchmark times in `phase` for a model config `cfg` on `device` in `dtype`:
    the CUDA kernels where `ops.ffn.select` says they can run, else their PyTorch reference (the same
    sparse arithmetic, so every script runs anywhere); and why not the kernels (None when they run).
    The one place the benchmarks decide this."""
    from sparse_llm.ops.ffn.select import select_ffn

    selection = select_ffn(
        "auto",
        phase,
        device=device,
        dtype=dtype,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        activation=cfg.hidden_act,
    )
    return ("cuda", None) if selection.impl == "cuda" else ("reference", selection.reason)


def token_batch(
    tokenizer: Any, vocab_size: int, batch: int, length: int, *, random_tokens: bool = False, seed: int = 0
) -> tuple[torch.Tensor, str]:
    """[batch, length] token ids: held-out text of the embedded corpus, or random ids (seeded) when
    asked or without a tokenizer; and which of the two they are."""
    if tokenizer is not None and not random_tokens:
        from sparse_llm.data import heldout_text_ids

        return heldout_text_ids(tokenizer, batch, length), "held-out text"
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=gen), "random tokens"


def runs_dense(l0: float, hidden: int, max_density: float) -> bool:
    """Whether the trainer's dense fallback runs a sparse layer at this L0 dense
    (`training.ffn_fallback.wants_dense` on L0 / H against `model.ffn_dense_above`)."""
    from sparse_llm.training.ffn_fallback import DEFAULT_HYSTERESIS, wants_dense

    return wants_dense(l0 / hidden, False, max_density, DEFAULT_HYSTERESIS)


def layers_over_dense_above(l0_per_layer: Sequence[float], hidden: int, max_density: float) -> int:
    """How many of these layers the trainer's dense fallback would run dense, from sparse."""
    return sum(runs_dense(l0, hidden, max_density) for l0 in l0_per_layer)


@torch.no_grad()
def ffn_inputs(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's FFN input (its post-attention norm's output) for every token of ids, [M, D],
    one row of ids at a time. With statistics asked for, every layer calls its FFN module on that
    input, whichever implementation it runs."""
    captured: list[list[torch.Tensor]] = [[] for _ in model.model.layers]
    hooks = [
        layer.mlp.register_forward_pre_hook(
            lambda _, inputs, kept=kept: kept.append(inputs[0].flatten(0, -2))
        )
        for layer, kept in zip(model.model.layers, captured, strict=True)
    ]
    try:
        for row in ids.split(1):
            model(row, with_stats=True)
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(rows) for rows in captured]


def ffn_weights(mlp: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's FFN weights (gate [H, D], up [H, D], down [D, H]) as detached `dtype` tensors."""
    return tuple(
        w.detach().to(dtype).contiguous()
        for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    )


def gate_active(x: torch.Tensor, mlp: Any) -> torch.Tensor:
    """[M, H] bool: which of the layer's units fire (gate > 0) on each token of its FFN input x."""
    return x @ mlp.gate_proj.weight.to(x.dtype).T > 0


@torch.no_grad()
def active_units_per_token(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """[layers, rows x seq-len] active FFN units of every token of ids ([rows, seq-len]), one row at
    a time (the memory of one row's forward)."""
    per_row = [model(row, with_stats=True).ffn_stats.nnz_per_token for row in ids.split(1)]
    return torch.cat(per_row, dim=1)


def free_memory() -> None:
    """Drop the compiled graphs (they hold the last variant's model) and cached GPU blocks, so that
    each variant starts from the same allocator state."""
    torch._dynamo.reset()
    if torch.cuda.is_available():
        # Blocks held by reference cycles reach the cache only once collected. (Not on a CPU-only
        # machine, where there is no cache: a collection of a large process's heap takes ~0.3 s.)
        gc.collect()
        torch.cuda.empty_cache()
