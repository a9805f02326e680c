"""Inference benchmark: batched prefill and decode throughput, dense FFN vs the TwELL kernels.

The same weights run once per FFN implementation: prefill of B x L prompt tokens into a KV cache
(tokens/s; eager, and under torch.compile on a GPU or with --compile), then greedy decode of N
tokens per row (tokens/s, eager), with energy per token from NVML where available (pip install
nvidia-ml-py). The sparsity the kernels see is measured on the same
prompts. Writes inference_benchmark.json and .md (device, commit, date) into --out.

The decode sweep (--decode-sweep, on by default) times one decode step at every batch of
--decode-batches (1 8 64) and context of --decode-contexts (1024 2048: the cache holds that many
columns at the end of --decode-steps steps), per FFN implementation, graph-captured
(sparse_llm.inference.decode) and eager: tokens/s, and the GB/s achieved on the bytes a step must
read (attention and FFN weights, for a sparse FFN the gate plus the up and down rows of the units
active in the batch at the measured L0, the LM head, the embedding rows, the KV cache up to the
context) next to the device's measured copy bandwidth. A decode step that cannot be captured (the
kernels' FFN above its decode path's row limit) shows why instead of a graph timing. On CPU the graph rows run the same
static step uncaptured (`static`).

    # the done-when run on one H100/H200: make a 1B model >= 99% sparse, then benchmark it
    python -m benchmarks.inference --sparsify --preset 1b --out benchmarks/results/inference_1b
    # an existing model (export, checkpoint or run directory)
    python -m benchmarks.inference --model runs/my_run/export --batch 64 --prompt-len 2048
    # CPU, toy size (what the tests run); `cuda` is replaced by its reference there
    python -m benchmarks.inference --tiny --out /tmp/bench

--sparsify trains the preset for --sparsify-steps with a high L1 coefficient through the
project's Trainer (benchmarks.common.sparsify; run directory <out>/sparsify_run, checkpoint +
config.yaml), then loads that checkpoint. Each FFN implementation runs as a model of its own
plan sharing the loaded weights (`with_ffn_plan`). Prompts are held-out text of the embedded
corpus (or --random-tokens).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from sparse_llm.config import ModelConfig
from sparse_llm.inference import (
    FASTEST,
    SamplingParams,
    StaticDecoder,
    choose_ffn_plan,
    compile_prefill,
    load_model,
)
from sparse_llm.inference.calibrate import synchronize
from sparse_llm.inference.decode import why_not_graph
from sparse_llm.inference.generate import eager_decode_from
from sparse_llm.model import FFNPlan, KVCache, SparseLlamaForCausalLM

TINY = dict(
    batch=2,
    prompt_len=32,
    decode_tokens=4,
    reps=1,
    warmup=0,
    sparsify_steps=4,
    decode_batches=[1, 2],
    decode_contexts=[16, 48],
    decode_steps=4,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__, report=False)
    p.add_argument("--model", type=Path, help="export, checkpoint or run directory to benchmark")
    p.add_argument("--sparsify", action="store_true", help="first train --preset with a high L1 (Trainer)")
    p.add_argument("--tiny", action="store_true", help="toy sizes on CPU (implies --sparsify unless --model)")
    p.add_argument("--preset", default="1b", help="configs/model/<preset>.yaml for --sparsify")
    p.add_argument("--sparsify-steps", type=int, default=300)
    p.add_argument("--l1-coeff", type=float, default=1e-3)
    p.add_argument("--sparsify-lr", type=float, default=1e-3)
    p.add_argument("--sparsify-batch", type=int, default=16, help="sequences per step (micro-batch 8)")
    p.add_argument("--sparsify-seq-len", type=int, default=1024)
    p.add_argument("--set", action="append", default=[], help="extra run-config override key=value")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--impls", nargs="+", default=["dense", "cuda"], choices=["dense", "reference", "cuda"])
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the prefill under torch.compile (default: on a CUDA device)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile")
    p.add_argument(
        "--decode-sweep",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time decode steps per batch and context, graph-captured and eager (see above)",
    )
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--decode-contexts", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per repetition")
    p.add_argument(
        "--decode-modes",
        nargs="+",
        default=["graph", "eager"],
        choices=["graph", "graph-compiled", "static", "eager"],
    )
    p.add_argument(
        "--profile", action="store_true", help="write each impl's prefill kernel table to <out>/profile_*.txt"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--random-tokens", action="store_true", help="random prompts instead of held-out text")
    p.add_argument("--min-sparsity", type=float, default=0.99, help="warn below this measured sparsity")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/inference"))
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            if p.get_default(key) == getattr(args, key):
                setattr(args, key, value)
        if args.model is None:
            args.sparsify = True
        if args.preset == p.get_default("preset"):
            args.preset = "tiny"
        args.device = "cpu" if args.device == "auto" else args.device
    if args.compile is None:
        args.compile = args.device != "cpu" and torch.cuda.is_available()
    if args.model is None and not args.sparsify:
        p.error("give --model, --sparsify or --tiny")
    if args.model is not None and args.sparsify:
        p.error("--model and --sparsify exclude each other")
    for key in ("batch", "prompt_len", "decode_tokens", "reps", "sparsify_steps", "decode_steps"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1")
    if min(args.decode_batches) < 1 or min(args.decode_contexts) <= args.decode_steps:
        p.error("--decode-batches must be >= 1 and --decode-contexts > --decode-steps")
    return args


# ---------------------------------------------------------------------------------------------
def sparsify_run(args: argparse.Namespace) -> Path:
    """Train the preset briefly with a high L1 through the Trainer; returns the run directory."""
    gpu = torch.cuda.is_available() and args.device != "cpu"
    model = common.model_preset(args.preset)
    size = dict(seq_len=args.sparsify_seq_len, batch=args.sparsify_batch, lr=args.sparsify_lr)
    data = None
    if args.tiny:
        model.update(common.TINY_MODEL)
        size = dict(seq_len=32, batch=4, lr=1e-2)
        data = {"max_documents": 200}
    return common.sparsify(
        args.out / "sparsify_run",
        model,
        steps=args.sparsify_steps,
        l1_coeff=args.l1_coeff,
        l1_warmup_end=max(1, args.sparsify_steps // 5),
        micro_batch=min(8, size["batch"]),
        data=data,
        train={"compile": gpu, "device": "cuda" if gpu else "cpu", "progress": not args.tiny},
        overrides=args.set,
        **size,
    )


def with_ffn(model: SparseLlamaForCausalLM, impl: str) -> SparseLlamaForCausalLM:
    """`model` with `impl` as the FFN of every inference phase (training stays dense), sharing its
    weights."""
    weight = model.lm_head.weight
    plan = FFNPlan.resolve(
        dict.fromkeys(("eval", "prefill", "decode"), impl), model.config, weight.device, weight.dtype
    )
    return model.with_ffn_plan(plan)


# ---------------------------------------------------------------------------------------------
class Energy:
    """Board energy (J) between start() and stop() via NVML; None where it is not available."""

    def __init__(self, device: torch.device) -> None:
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            self.nvml, self.handle = pynvml, handle
        except Exception:  # not installed, no permission, or a GPU without an energy counter
            self.handle = None

    def read(self) -> float | None:
        if self.handle is None:
            return None
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0  # mJ -> J


@torch.no_grad()
def measure_sparsity(model, ids: torch.Tensor) -> dict[str, Any]:
    rows = ids[: min(8, ids.shape[0])]
    stats = model(rows, with_stats=True).ffn_stats
    nnz = stats.nnz_per_token.float()  # [L, M]
    hidden = model.config.intermediate_size
    per_layer = (1 - nnz.mean(1) / hidden).tolist()
    return {
        "mean": 1 - nnz.mean().item() / hidden,
        "per_layer": per_layer,
        "nnz_per_token_mean": nnz.mean().item(),
        "nnz_per_token_p99": torch.quantile(nnz.flatten()[:100_000], 0.99).item(),
        "tokens": rows.numel(),
    }


def _timed(device: torch.device, energy: Energy, fn, *args, **kwargs) -> tuple[Any, float, float | None]:
    """fn(*args, **kwargs), its seconds and joules (None without NVML), synchronized on both ends."""
    synchronize(device)
    e0, t0 = energy.read(), time.perf_counter()
    out = fn(*args, **kwargs)
    synchronize(device)
    e1, t1 = energy.read(), time.perf_counter()
    return out, t1 - t0, None if e0 is None else e1 - e0


@torch.no_grad()
def run_impl(model, ids: torch.Tensor, impl: str, args, energy: Energy, compiled) -> dict[str, Any]:
    """Prefill (eager, and through `compiled` when given) then greedy decode (the package's eager
    decode: `eager_decode_from`) with `model`, whose FFN plan runs `impl`."""
    device = ids.device
    batch, length = ids.shape
    dtype = model.lm_head.weight.dtype
    greedy = SamplingParams(max_new_tokens=args.decode_tokens)
    lengths = torch.full((batch,), length, device=device)
    times: dict[str, list[float]] = {"prefill": [], "prefill_compiled": [], "decode": []}
    joules: dict[str, list[float]] = {key: [] for key in times}
    tokens = logits_last = compiled_logits = None
    for rep in range(args.warmup + args.reps):
        measured: dict[str, tuple[float, float | None]] = {}
        if compiled is not None:  # first, so that only one KV cache is alive at a time
            cache = KVCache(model.config, batch, length + args.decode_tokens, device, dtype)
            out, *measured["prefill_compiled"] = _timed(
                device, energy, compiled, ids, cache=cache, last_logits_only=True
            )
            compiled_logits = out.logits[:, -1].float().cpu()
            del cache, out
        cache = KVCache(model.config, batch, length + args.decode_tokens, device, dtype)
        out, *measured["prefill"] = _timed(device, energy, model, ids, cache=cache, last_logits_only=True)
        generated, *measured["decode"] = _timed(
            device, energy, eager_decode_from, model, out.logits[:, -1], cache, greedy, lengths
        )
        if rep >= args.warmup:
            for key, (seconds, energy_j) in measured.items():
                times[key].append(seconds)
                if energy_j is not None:
                    joules[key].append(energy_j)
        tokens, logits_last = generated.cpu(), out.logits[:, -1].float().cpu()
        del cache, out
    counts = {
        "prefill": batch * length,
        "prefill_compiled": batch * length,
        "decode": batch * args.decode_tokens,
    }
    result: dict[str, Any] = {"impl": impl}
    for key, count in counts.items():
        if not times[key]:
            continue
        seconds = statistics.median(times[key])
        result[f"{key}_s"] = seconds
        result[f"{key}_tokens_per_s"] = count / seconds
        result[f"{key}_j_per_token"] = statistics.median(joules[key]) / count if joules[key] else None
    if compiled_logits is not None:
        result["compiled_vs_eager_max_logit_diff"] = (compiled_logits - logits_last).abs().max().item()
    result["peak_mem_gib"] = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    )
    return result | {"_tokens": tokens, "_logits": logits_last}


# ---------------------------------------------------------------------------------------------
# Decode sweep: graph-captured against eager decode, per batch and context.
def compare_with_dense(row: dict[str, Any], dense: dict[str, Any]) -> None:
    """Greedy-token agreement and the largest last-logit difference of `row` against dense's run
    on the same prompts (both from run_impl's `_tokens` and `_logits`), into `row`."""
    row["tokens_match_dense"] = (row["_tokens"] == dense["_tokens"]).float().mean().item()
    row["max_logit_diff_vs_dense"] = (row["_logits"] - dense["_logits"]).abs().max().item()


def active_rows(hidden: int, l0: float, batch: int) -> float:
    """Expected units active in at least one of `batch` tokens at `l0` active units per token,
    assuming units fire independently: the up and down rows a sparse FFN must read for a step."""
    return hidden * (1 - (1 - min(l0, hidden) / hidden) ** batch)


def decode_step_bytes(
    cfg: ModelConfig, impl: str, batch: int, context: int, elem_bytes: int, l0_per_layer: list[float]
) -> dict[str, float]:
    """Bytes one decode step must read: attention weights (q, k, v, o), FFN weights (dense: all
    three; sparse: the gate plus the up and down rows of the units active in the batch), the LM
    head, the embedding rows and the KV cache up to `context` columns. Norm weights (a few KB) left
    out."""
    d, h, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    kv_dim = (cfg.num_key_value_heads or cfg.num_attention_heads) * (d // cfg.num_attention_heads)
    if impl == "dense":
        ffn = layers * 3 * d * h
    else:
        ffn = sum(d * h + 2 * d * active_rows(h, l0, batch) for l0 in l0_per_layer)
    elements = {
        "attention": layers * (2 * d * d + 2 * d * kv_dim),
        "ffn": ffn,
        "lm_head": cfg.vocab_size * d,
        "embedding": batch * d,
        "kv_cache": 2 * layers * batch * context * kv_dim,
    }
    out = {key: value * elem_bytes for key, value in elements.items()}
    return out | {"total": sum(out.values())}


@torch.no_grad()
def time_decode_step(model, ids: torch.Tensor, mode: str, steps: int, warmup: int, reps: int) -> float:
    """Median seconds of one greedy decode step of every row after a prefill of `ids` ([B, W]), by
    the package's decode loops: `eager` (one forward over the filled columns per step:
    `eager_decode_from`) or the static step of sparse_llm.inference.decode (`DecodeSlot.decode`),
    CUDA-graph-captured (`graph`), compiled by Inductor and then captured (`graph-compiled`) or
    neither (`static`). The cache ends at W + steps columns; every repetition decodes the same
    `steps` columns again."""
    device, (batch, width) = ids.device, ids.shape
    why = why_not_graph(model, batch) if mode.startswith("graph") else None
    if why:  # a StaticDecoder would run it uncaptured: not what "graph" is timed as
        raise ValueError(f"cannot time a graph-captured decode step: {why}")
    greedy = SamplingParams(max_new_tokens=steps + 1)  # `steps` forwards after the first token
    lengths = torch.full((batch,), width, device=device)
    if mode == "eager":
        cache = KVCache(model.config, batch, width + steps, device, model.lm_head.weight.dtype)
        logits = model(ids, cache=cache, last_logits_only=True).logits[:, -1]

        def run() -> None:
            cache.length = width
            eager_decode_from(model, logits, cache, greedy, lengths)

    else:
        decoder = StaticDecoder(model, capture=mode.startswith("graph"), compile=mode == "graph-compiled")
        slot = decoder.slot(batch, width + steps, 0)
        slot.step_for(greedy)  # captures before the prefill
        first = model(ids, cache=slot.state.prefill_cache(), last_logits_only=True).logits[:, -1].argmax(-1)
        no_eos = torch.empty(0, dtype=torch.long, device=device)

        def run() -> None:
            slot.decode(first, lengths, width, greedy, no_eos)

    return common.median_ms(run, device, warmup, reps) / 1000 / steps


def decode_sweep(model, impls: list[str], tokenizer, sparsity: dict[str, Any], args) -> dict[str, Any]:
    """Decode step timings for every FFN implementation, batch, context and mode, with tokens/s,
    the bytes a step must read and the GB/s achieved (see decode_step_bytes)."""
    device = model.lm_head.weight.device
    cfg = model.config
    modes = list(
        dict.fromkeys(
            "static" if m.startswith("graph") and device.type != "cuda" else m for m in args.decode_modes
        )
    )
    bandwidth = common.copy_bandwidth_gbs(device)
    l0_per_layer = [(1 - s) * cfg.intermediate_size for s in sparsity["per_layer"]]
    elem_bytes = model.lm_head.weight.element_size()
    rows = []
    for impl in impls:
        impl_model = with_ffn(model, impl)
        for batch in args.decode_batches:
            for context in args.decode_contexts:
                ids, _ = common.token_batch(
                    tokenizer,
                    cfg.vocab_size,
                    batch,
                    context - args.decode_steps,
                    random_tokens=args.random_tokens,
                )
                nbytes = decode_step_bytes(cfg, impl, batch, context, elem_bytes, l0_per_layer)
                for mode in modes:
                    row: dict[str, Any] = {"impl": impl, "batch": batch, "context": context, "mode": mode}
                    why = why_not_graph(impl_model, batch) if mode.startswith("graph") else None
                    if why:  # e.g. a decode FFN that syncs with the host: say so instead of a timing
                        rows.append(row | {"error": why})
                        print(f"decode {impl} b={batch} ctx={context} graph: {why}", file=sys.stderr)
                        continue
                    seconds = time_decode_step(
                        impl_model, ids.to(device), mode, args.decode_steps, args.warmup, args.reps
                    )
                    gbs = nbytes["total"] / seconds / 1e9
                    row |= {
                        "step_ms": 1000 * seconds,
                        "tokens_per_s": batch / seconds,
                        "bytes_per_step": nbytes,
                        "gb_per_s": gbs,
                        "of_copy_bandwidth": gbs / bandwidth if bandwidth else None,
                    }
                    rows.append(row)
                    print(
                        f"decode {impl} b={batch} ctx={context} {mode}: {row['step_ms']:.3f} ms/step, "
                        f"{row['tokens_per_s']:,.0f} tok/s, {gbs:,.0f} GB/s",
                        file=sys.stderr,
                    )
        del impl_model
    eager = {
        (r["impl"], r["batch"], r["context"]): r for r in rows if r["mode"] == "eager" and "step_ms" in r
    }
    for r in rows:
        base = eager.get((r["impl"], r["batch"], r["context"]))
        if base is not None and "step_ms" in r:
            r["vs_eager"] = base["step_ms"] / r["step_ms"]
    return {"copy_bandwidth_gbs": bandwidth, "steps": args.decode_steps, "modes": modes, "rows": rows}


def decode_sweep_markdown(sweep: dict[str, Any]) -> list[str]:
    bandwidth = sweep["copy_bandwidth_gbs"]
    copy = f"{bandwidth:,.0f} GB/s" if bandwidth else "n/a (not a CUDA device)"
    lines = [
        "",
        f"## Decode steps (median of {sweep['steps']} steps a repetition)",
        "",
        f"Copy bandwidth of the device (a large device-to-device copy, read + write): {copy}. GB/s counts "
        "the bytes a step must read: attention and FFN weights (sparse FFN: the gate plus the up and down "
        "rows of the units active in the batch at the measured L0, units assumed independent), the LM "
        "head, the embedding rows and the KV cache up to the context; the graph step reads the whole "
        "cache bucket.",
        "",
        "| FFN | batch | context | decode | ms/step | tokens/s | GB/s | of copy bandwidth | vs eager |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sweep["rows"]:
        head = f"| {r['impl']} | {r['batch']} | {r['context']} | {r['mode']} "
        if "error" in r:
            lines.append(head + f"| n/a: {r['error']} | | | | |")
            continue
        share = f"{r['of_copy_bandwidth']:.0%}" if r["of_copy_bandwidth"] is not None else "n/a"
        vs = f"{r['vs_eager']:.2f}x" if "vs_eager" in r else "n/a"
        lines.append(
            head
            + f"| {r['step_ms']:.3f} | {r['tokens_per_s']:,.0f} | {r['gb_per_s']:,.0f} | {share} | {vs} |"
        )
    return lines


@torch.no_grad()
def profile_prefill(model, ids: torch.Tensor, forward, path: Path) -> None:
    """One prefill through `forward` (`model` or its compiled form) under torch.profiler: its
    kernels by GPU time."""
    cache = KVCache(model.config, *ids.shape[:1], ids.shape[1] + 1, ids.device, model.lm_head.weight.dtype)
    forward(ids, cache=cache, last_logits_only=True)  # warm (and compiled) before the trace
    cache.length = 0
    path.write_text(common.kernel_table(lambda: forward(ids, cache=cache, last_logits_only=True), ids.device))


def markdown(report: dict[str, Any]) -> str:
    s = report["sparsity"]
    lines = [
        f"# Inference benchmark: {report['device']}",
        "",
        f"commit `{report['commit']}`, {report['date']}, torch {report['torch']}, model {report['model']} "
        f"({report['parameters'] / 1e6:.1f}M parameters, {report['dtype']}); prefill {report['batch']} x "
        f"{report['prompt_len']} tokens, decode {report['decode_tokens']} tokens per row; median of "
        f"{report['reps']} after {report['warmup']} warm-up.",
        "",
        f"FFN sparsity on the prompts: {s['mean']:.3%} (mean non-zeros per token {s['nnz_per_token_mean']:.1f}, "
        f"p99 {s['nnz_per_token_p99']:.0f}, of {report['intermediate_size']}).",
        "",
        "| FFN | prefill tokens/s, eager | vs dense | prefill tokens/s, compiled | vs dense "
        "| decode tokens/s | vs dense | prefill J/token (compiled) | decode J/token "
        "| greedy tokens = dense | max abs logit diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, f: "n/a" if v is None else format(v, f)
    for r in report["results"]:
        compiled = "prefill_compiled_tokens_per_s" in r
        lines.append(
            f"| {r['impl']} | {r['prefill_tokens_per_s']:,.0f} | {r['prefill_vs_dense']:.2f}x "
            f"| {fmt(r.get('prefill_compiled_tokens_per_s'), ',.0f')} "
            f"| {fmt(r.get('prefill_compiled_vs_dense'), '.2f')}{'x' if compiled else ''} "
            f"| {r['decode_tokens_per_s']:,.0f} | {r['decode_vs_dense']:.2f}x "
            f"| {fmt(r.get('prefill_compiled_j_per_token', r['prefill_j_per_token']), '.3e')} "
            f"| {fmt(r['decode_j_per_token'], '.3e')} "
            f"| {r['tokens_match_dense']:.1%} | {r['max_logit_diff_vs_dense']:.2e} |"
        )
    fastest = report["fastest"]
    lines += ["", f"`{FASTEST}` chooses: prefill {fastest['prefill']}, decode {fastest['decode']}."]
    if report.get("decode_sweep"):
        lines += decode_sweep_markdown(report["decode_sweep"])
    for note in report["notes"]:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    source = args.model
    if args.sparsify:
        source = sparsify_run(args)
        notes.append(
            f"Weights: {args.sparsify_steps} steps of the `{args.preset}` preset with L1 {args.l1_coeff} "
            f"(benchmarks.common.sparsify, through the Trainer), run directory {source}."
        )
    try:
        loaded = load_model(source, args.device, args.dtype)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = loaded.model
    device = model.lm_head.weight.device
    impls = list(dict.fromkeys(args.impls))
    sparse_impl, reason = common.sparse_path(
        "prefill", model.config, model.lm_head.weight.device, model.lm_head.weight.dtype
    )
    if args.decode_sweep and max(args.decode_contexts) > model.config.max_position_embeddings:
        print("error: --decode-contexts exceed max_position_embeddings", file=sys.stderr)
        return 2
    if "cuda" in impls and sparse_impl != "cuda":
        impls = [("reference" if i == "cuda" else i) for i in impls]
        impls = list(dict.fromkeys(impls))
        notes.append(f"`cuda` ran as `reference` (the PyTorch path of the sparse front): {reason}.")
    if "dense" not in impls:
        impls.insert(0, "dense")
    if args.prompt_len + args.decode_tokens > model.config.max_position_embeddings:
        print("error: --prompt-len + --decode-tokens exceed max_position_embeddings", file=sys.stderr)
        return 2
    ids, _ = common.token_batch(
        loaded.tokenizer,
        model.config.vocab_size,
        args.batch,
        args.prompt_len,
        random_tokens=args.random_tokens,
    )
    ids = ids.to(device)
    sparsity = measure_sparsity(model, ids)
    if sparsity["mean"] < args.min_sparsity:
        notes.append(
            f"Warning: measured sparsity {sparsity['mean']:.2%} is below --min-sparsity {args.min_sparsity:.0%}."
        )
    fastest, measurement = choose_ffn_plan(
        model,
        FASTEST,
        FASTEST,
        calibration_batch=min(args.batch, 8),
        calibration_len=min(args.prompt_len, 512),
    )
    energy = Energy(device)
    if energy.handle is None:
        notes.append("Energy: NVML not available here (pip install nvidia-ml-py on an NVIDIA GPU).")
    if args.compile:
        notes.append(
            f"Compiled prefill: torch.compile(model, backend={args.compile_backend!r}), one compilation "
            "per FFN implementation in the warm-up; decode runs eager."
        )
    results = []
    for impl in impls:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        impl_model = with_ffn(model, impl)
        compiled = compile_prefill(impl_model, backend=args.compile_backend) if args.compile else None
        results.append(run_impl(impl_model, ids, impl, args, energy, compiled))
        r = results[-1]
        compiled_note = (
            f", compiled {r['prefill_compiled_tokens_per_s']:,.0f} tok/s" if "prefill_compiled_s" in r else ""
        )
        print(
            f"{impl}: prefill {r['prefill_tokens_per_s']:,.0f} tok/s{compiled_note}, "
            f"decode {r['decode_tokens_per_s']:,.0f} tok/s",
            file=sys.stderr,
        )
        if args.profile:
            forward = impl_model if compiled is None else compiled
            profile_prefill(impl_model, ids, forward, args.out / f"profile_prefill_{impl}.txt")
        del impl_model, compiled
    dense = results[0]
    for r in results:
        for phase in ("prefill", "prefill_compiled", "decode"):
            if f"{phase}_s" in r:
                r[f"{phase}_vs_dense"] = r[f"{phase}_tokens_per_s"] / dense[f"{phase}_tokens_per_s"]
        compare_with_dense(r, dense)
    for r in results:
        del r["_tokens"], r["_logits"]
    sweep = None
    if args.decode_sweep:
        sweep = decode_sweep(model, impls, loaded.tokenizer, sparsity, args)
        if device.type != "cuda" and "graph" in args.decode_modes:
            notes.append(
                "Decode sweep: CUDA graphs need a GPU; the `static` rows run the graphs' step uncaptured."
            )
    report = common.run_meta(device) | {
        "model": str(loaded.path),
        "parameters": model.num_parameters(),
        "hidden_size": model.config.hidden_size,
        "intermediate_size": model.config.intermediate_size,
        "num_layers": model.config.num_hidden_layers,
        "dtype": str(model.lm_head.weight.dtype).removeprefix("torch."),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.decode_tokens,
        "reps": args.reps,
        "warmup": args.warmup,
        "prompts": "random tokens" if args.random_tokens else "held-out embedded text",
        "sparsity": sparsity,
        "meets_min_sparsity": sparsity["mean"] >= args.min_sparsity,
        "fastest": {"prefill": fastest.prefill.impl, "decode": fastest.decode.impl},
        "fastest_measurement": measurement and dataclasses.asdict(measurement),
        "results": results,
        "decode_sweep": sweep,
        "notes": notes,
    }
    (args.out / "inference_benchmark.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "inference_benchmark.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
