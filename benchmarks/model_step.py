"""Benchmark a whole-model training step: dense FFN vs the sparse training FFN (ffn_impl=cuda).

The step timed is the trainer's own (`Trainer.train_step`: the forward of the step's batch from the
trainer's data stream with the L1 term and the statistics, backward, clipping, AdamW, the scheduler
and the per-layer FFN fallback), on fixed weights: of --model, of a sparsify run (--sparsify-steps N:
the Trainer at a high L1 first, benchmarks.common.sparsify), or freshly initialised. Every
implementation is timed on the same weights and batches, side by side in one run: median step time,
tokens/s, peak memory, the measured L0/sparsity and the loss. `cuda` runs the kernels' PyTorch
reference where they cannot run (sparse_llm.ops.ffn.select says why; the table shows which ran). The
whole run, from initialisation, is benchmarks/whole_run.py. Prints Markdown, writes JSON and Markdown.

    python -m benchmarks.model_step --preset 1b --sparsify-steps 300 --json out.json --md out.md
    python -m benchmarks.model_step --tiny      # CPU, seconds: the script end to end
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks import common
from sparse_llm.config import ModelConfig, RunConfig, load_config
from sparse_llm.model.state import load_model_state


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--preset", default="1b", help="configs/model/<preset>.yaml")
    p.add_argument(
        "--model", type=Path, default=None, help="export, checkpoint or run directory to time instead"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script end to end")
    p.add_argument(
        "--impls",
        nargs="+",
        default=["dense", "cuda"],
        choices=["dense", "reference", "cuda", "auto"],
        help="model.ffn_impl values to time",
    )
    p.add_argument(
        "--micro-batch", type=int, nargs="+", default=[8], help="sequences per step; several: each is timed"
    )
    p.add_argument(
        "--recompute-norms",
        nargs="+",
        choices=["on", "off"],
        default=["off"],
        help="train.recompute_norms: RMSNorm outputs recomputed in the backward; both: each is timed",
    )
    p.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="micro-batches per optimizer step (train=paper's 512 x 2048 tokens: 64 of 8); tokens/s "
        "counts them all, and the optimizer's share of the step is reported",
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sparsify-steps", type=int, default=0, help="Trainer steps at high L1 first")
    p.add_argument("--sparsify-l1", type=float, default=3e-3, help="L1 coefficient of the sparsify run")
    p.add_argument("--sparsify-lr", type=float, default=1e-3)
    p.add_argument(
        "--sparsify-dir",
        type=Path,
        default=None,
        help="keep the sparsify run (checkpoint and config) here, for --model in a later run; "
        "default: a temporary directory",
    )
    p.add_argument("--l1", type=float, default=2e-5, help="L1 coefficient in the timed steps")
    p.add_argument("--compile", action="store_true", help="torch.compile the model for the timed steps")
    p.add_argument(
        "--no-fallback",
        action="store_true",
        help="sparse impls: every layer runs the sparse FFN after the first step (model.ffn_dense_above "
        "1.0); by default the trainer's rule runs layers over model.ffn_dense_above dense",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write each impl's step kernel table, GPU idle and Chrome trace here",
    )
    p.add_argument(
        "--memory-snapshot",
        type=Path,
        default=None,
        help="write each impl's allocator trace of one step (memory_step_{impl}_norms_{on,off}.pickle, "
        "for pytorch.org/memory_viz) and the blocks alive at its peak (memory_peak_*.txt) here",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        args.micro_batch, args.seq_len = [2], 32
    return args


def model_dict(args: argparse.Namespace) -> dict:
    return dict(common.TINY_MODEL) if args.tiny else common.model_preset(args.preset)


def weights(args: argparse.Namespace, device: str) -> tuple[ModelConfig, dict, object]:
    """(model config, weights, tokenizer or None): of --model, of a sparsify run
    (--sparsify-steps), or freshly initialised."""
    if args.model is not None:
        return common.load_weights(args.model)
    model = model_dict(args)
    if args.sparsify_steps > 0:

        def sparse_weights(run_dir: Path) -> tuple[ModelConfig, dict, object]:
            common.sparsify(
                run_dir,
                model,
                data={"max_documents": 300} if args.tiny else None,
                train={"device": device},
                steps=args.sparsify_steps,
                l1_coeff=args.sparsify_l1,
                lr=args.sparsify_lr,
                seq_len=args.seq_len,
                batch=args.micro_batch[0],
            )
            return common.load_weights(run_dir)

        if args.sparsify_dir is not None:
            return sparse_weights(args.sparsify_dir)
        with tempfile.TemporaryDirectory() as tmp:
            return sparse_weights(Path(tmp) / "sparsify")
    return common.fresh_weights(model, args.seed)


def step_config(
    ffn: str,
    recompute_norms: str,
    mcfg: ModelConfig,
    shape: tuple[int, int],
    args: argparse.Namespace,
    device: str,
) -> RunConfig:
    """The trainer's config for timing its step on `mcfg`'s weights: `shape` = (sequences, tokens
    per sequence + 1) a step, one micro-batch, the L1 term at a fixed `--l1`, a small constant lr
    (the weights stay where they are), data from the embedded corpus, nothing written but the
    run directory's config. `--no-fallback`: no layer runs dense after the first step."""
    model = {**asdict(mcfg), "ffn_impl": ffn}
    if args.no_fallback:
        model["ffn_dense_above"] = 1.0
    raw = {
        "model": model,
        "data": {"max_documents": 300} if device == "cpu" else {},
        "train": {
            "device": device,
            "seq_len": shape[1] - 1,
            "global_batch_size": shape[0] * args.accumulate,
            "micro_batch_size": shape[0],
            "max_steps": args.warmup + args.steps + 8,
            "lr": 1e-5,
            "min_lr_ratio": 1.0,
            "warmup_steps": 0,
            "compile": args.compile,
            "recompute_norms": recompute_norms == "on",
            "eval_batches": 1,
            "checkpoint_every": 0,
            "export": False,
            "progress": False,
            "seed": args.seed,
        },
        "sparsity": {"l1_coeff": args.l1, "l1_warmup_end": 0, "plots": False},
        "logger": {"wandb": {"mode": "disabled"}},
    }
    return load_config(raw)


def trainer_batches(
    mcfg: ModelConfig, shape: tuple[int, int], args: argparse.Namespace, device: str, count: int
) -> list[torch.Tensor]:
    """The first `count` batches the trainer's step reads with `step_config`: for a yardstick step
    (benchmarks/lean_llama.py) to see the same tokens as ours."""
    from sparse_llm.data import TokenStream, load_tokenizer

    cfg = step_config("dense", "off", mcfg, shape, args, device)
    stream = TokenStream(cfg.data, load_tokenizer(cfg.data.tokenizer), cfg.train.seq_len, "train")
    return [stream.next_batch(cfg.train.micro_batch_size) for _ in range(count)]


def untimed_steps(warmup: int) -> int:
    """Steps before the memory probe and the timed ones: the first runs every layer dense (a fresh
    run's start), its L0 sets each layer's path after the second (a step's scalars act one step
    late), then `warmup` more compile what the timed steps run. A yardstick step
    (benchmarks/lean_llama.py) takes as many."""
    return warmup + 2


def time_impl(
    impl: str,
    recompute_norms: str,
    mcfg: ModelConfig,
    state: dict,
    ids: torch.Tensor,
    args: argparse.Namespace,
    device: str,
) -> dict:
    """The trainer's own step (`Trainer.train_step`: forward with the L1 term and statistics,
    backward, clipping, AdamW, the FFN fallback) on `state`'s weights, `ids.shape` sequences a step
    from the trainer's data stream: median wall clock, peak memory, losses and L0."""
    from sparse_llm.training.trainer import Trainer

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the autocast dtype of the step
    ffn, why_not_kernels = (
        common.sparse_path("train", mcfg, device, dtype) if impl == "cuda" else (impl, None)
    )
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(
            step_config(ffn, recompute_norms, mcfg, tuple(ids.shape), args, device), Path(run_dir)
        )
        try:
            return time_trainer_step(
                trainer, impl, why_not_kernels, recompute_norms, ids, state, args, device
            )
        finally:
            trainer.close()


def time_trainer_step(
    trainer: Any,
    impl: str,
    why_not_kernels: str | None,
    recompute_norms: str,
    ids: torch.Tensor,
    state: dict,
    args: argparse.Namespace,
    device: str,
) -> dict:
    model = trainer.model
    load_model_state(model, state)
    record: dict = {"impl": impl, "micro_batch": ids.shape[0], "recompute_norms": recompute_norms}
    if impl != "dense":  # which training FFN the layers run, and why not the kernels
        plan = trainer.model.ffn_plan.train  # what the trainer resolved `ffn` to
        record["train_ffn"] = plan.impl
        record["kernels_unavailable"] = why_not_kernels or (plan.reason if plan.impl != "cuda" else None)
    forward_end: list[int] = []
    # What the forward leaves for the backward: memory at the end of the model's forward.
    hook = model.register_forward_hook(
        lambda *_: forward_end.append(torch.cuda.memory_allocated()) if device == "cuda" else None
    )
    step = trainer.train_step
    optimizer_timer = OptimizerTimer(trainer.optimizer, device)
    try:
        for _ in range(untimed_steps(args.warmup)):
            step()
        record["dense_fallback_layers"] = sum(model.ffn_dense_fallback())
        first_variant = ids.shape[0] == args.micro_batch[0] and recompute_norms == args.recompute_norms[0]
        if args.profile is not None and first_variant:
            args.profile.mkdir(parents=True, exist_ok=True)
            trace = args.profile / f"trace_step_{impl}.json.gz"
            table = common.kernel_table(step, torch.device(device), row_limit=40, trace_path=trace)
            (args.profile / f"profile_step_{impl}.txt").write_text(table)
        if args.memory_snapshot is not None and device == "cuda" and ids.shape[0] == args.micro_batch[0]:
            write_memory_snapshot(step, args.memory_snapshot, f"{impl}_norms_{recompute_norms}")
        if device == "cuda":
            # Where the peak comes from: weights + optimizer state at the step's start (gradients are
            # freed), and what the forward holds for the backward (activations, the loss's gradients).
            torch.cuda.synchronize()
            start = torch.cuda.memory_allocated()
            forward_end.clear()
            step()
            record["start_mem_gib"] = start / 2**30
            record["forward_held_gib"] = (forward_end[-1] - start) / 2**30
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, losses = [], []
        for _ in range(args.steps):
            begin = time.perf_counter()
            step()
            losses.append(trainer.step_metrics()["ce"])  # a host sync, as on a logging step
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
    finally:
        hook.remove()
        optimizer_timer.remove()
    hist = trainer.sparsity.last_step_histogram()
    tokens = (ids.numel() - ids.shape[0]) * args.accumulate  # inputs: each row drops its last id
    record["accumulate"] = args.accumulate
    record["ms_step"] = 1000 * statistics.median(times)
    # AdamW of the timed steps (the last len(times) optimizer steps), as a share of the step.
    record["optimizer_ms"] = statistics.median(optimizer_timer.ms()[-len(times) :])
    record["optimizer_share"] = record["optimizer_ms"] / record["ms_step"]
    record["tokens_per_s"] = tokens / statistics.median(times)
    record["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    record["loss_first"], record["loss_last"] = losses[0], losses[-1]
    record["l0_per_layer"] = trainer.sparsity.last_step_l0()
    record["l0_mean"] = sum(record["l0_per_layer"]) / len(record["l0_per_layer"])
    record["sparsity"] = 1.0 - record["l0_mean"] / model.config.intermediate_size
    record["dense_above_units"] = model.config.ffn_dense_above * model.config.intermediate_size
    record["layers_over_dense_above"] = common.layers_over_dense_above(
        record["l0_per_layer"], model.config.intermediate_size, model.config.ffn_dense_above
    )
    # What the sparse path keeps of the residual stream for the FFN's backward (ops.ffn.block):
    # the tokens with an active unit.
    record["active_token_fraction"] = 1.0 - (hist[:, 0].sum() / hist.sum()).item()
    return record


class OptimizerTimer:
    """The time of each `optimizer.step()` (AdamW), by CUDA events around it (the host clock on a
    CPU), through the optimizer's step hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: str) -> None:
        self.on_gpu = device == "cuda"
        self.spans: list[tuple[Any, Any]] = []
        self._begin: Any = None
        self.handles = [
            optimizer.register_step_pre_hook(lambda *_: self._mark(begin=True)),
            optimizer.register_step_post_hook(lambda *_: self._mark(begin=False)),
        ]

    def _mark(self, begin: bool) -> None:
        if self.on_gpu:
            now: Any = torch.cuda.Event(enable_timing=True)
            now.record()
        else:
            now = time.perf_counter()
        if begin:
            self._begin = now
        else:
            self.spans.append((self._begin, now))

    def ms(self) -> list[float]:
        if self.on_gpu:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in self.spans]
        return [1000 * (b - a) for a, b in self.spans]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def write_memory_snapshot(step: Callable[[], object], out_dir: Path, impl: str) -> None:
    """Record the caching allocator through one step: the trace as a pickle, and the table of the
    blocks alive at the step's peak."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    with open(out_dir / f"memory_step_{impl}.pickle", "wb") as f:
        pickle.dump(snapshot, f)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    (out_dir / f"memory_peak_{impl}.txt").write_text(common.memory_peak_table(trace))


def markdown(meta: dict, rows: list[dict]) -> str:
    micro_batches = sorted({r["micro_batch"] for r in rows})
    lines = [
        f"# Training step, whole model: {meta['device']}",
        "",
        f"preset `{meta['preset']}`, commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, "
        f"{' and '.join(str(b) for b in micro_batches)} x {meta['seq_len']} tokens per micro-batch, "
        f"{meta.get('accumulate', 1)} micro-batch(es) per optimizer step, median of "
        f"{meta['steps']} steps after {meta['warmup']} warm-up, compile={meta['compile']}, "
        + (
            f"weights `{meta['model']}`"
            if meta["model"]
            else f"sparsify steps {meta['sparsify_steps']} (L1 {meta['sparsify_l1']:g})"
        )
        + f", timed on {meta['tokens']}. Ratios are against the first FFN at the same micro-batch and norm setting.",
        "",
        "| micro-batch | recompute norms | ffn_impl | ms/step | tokens/s | vs first | peak GiB | vs first "
        "| at step start GiB | held by forward GiB | L0 | L0 of a layer | sparsity | tokens with an active unit "
        "| AdamW ms (share) | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = next(
            b
            for b in rows
            if b["micro_batch"] == r["micro_batch"] and b.get("recompute_norms") == r.get("recompute_norms")
        )
        mem_ratio = r["peak_mem_gib"] / base["peak_mem_gib"] if base["peak_mem_gib"] > 0 else float("nan")
        lines.append(
            f"| {r['micro_batch']} | {r.get('recompute_norms', 'off')} | {r['impl']}{' (' + ran_label(r) + ')' if 'train_ffn' in r else ''} "
            f"| {r['ms_step']:.1f} | {r['tokens_per_s']:.0f} | {base['ms_step'] / r['ms_step']:.2f}x "
            f"| {r['peak_mem_gib']:.2f} | {mem_ratio:.2f}x | {r.get('start_mem_gib', float('nan')):.2f} "
            f"| {r.get('forward_held_gib', float('nan')):.2f} | {r['l0_mean']:.1f} | {layer_l0_range(r)} "
            f"| {100 * r['sparsity']:.2f}% "
            f"| {100 * r['active_token_fraction']:.1f}% "
            f"| {r['optimizer_ms']:.1f} ({100 * r['optimizer_share']:.1f}%) | {r['loss_last']:.4f} |"
        )
    return "\n".join(lines + pairings_markdown(rows)) + "\n"


def ran_label(record: dict) -> str:
    """The training FFN a time_impl record ran, with the layers that fell back to dense if any."""
    ran = record.get("train_ffn", "dense")
    layers = record.get("dense_fallback_layers")
    return f"{ran}, {layers} layers dense" if layers else ran


def layer_l0_range(record: dict) -> str:
    """The smallest and largest L0 of a layer in a time_impl record, as "min - max"."""
    per_layer = record.get("l0_per_layer")
    return f"{min(per_layer):.1f} - {max(per_layer):.1f}" if per_layer else "-"


def pairings_markdown(rows: list[dict]) -> list[str]:
    """With several norm settings timed: every sparse variant against every dense one at its
    micro-batch (e.g. the sparse path recomputing its norms against dense at its fastest setting),
    which the main table's same-setting ratios leave out. Empty otherwise."""
    if len({r["recompute_norms"] for r in rows}) < 2:
        return []
    lines = [
        "",
        "Every sparse variant against every dense one (speed: dense ms / its ms; memory: its peak / dense's):",
        "",
        "| micro-batch | ffn_impl | its norms recomputed | dense norms recomputed | speed | peak memory |",
        "|---|---|---|---|---|---|",
    ]
    dense = [d for d in rows if d["impl"] == "dense"]
    for r in (r for r in rows if r["impl"] != "dense"):
        for d in (d for d in dense if d["micro_batch"] == r["micro_batch"]):
            # Peak memory is only measured on a GPU (NaN on the CPU).
            mem = f"{r['peak_mem_gib'] / d['peak_mem_gib']:.3f}x" if d["peak_mem_gib"] > 0 else "-"
            lines.append(
                f"| {r['micro_batch']} | {r['impl']} | {r['recompute_norms']} | {d['recompute_norms']} "
                f"| {d['ms_step'] / r['ms_step']:.3f}x | {mem} |"
            )
    return lines


def model_step_args(
    *,
    steps: int,
    warmup: int,
    compile: bool,
    l1: float,
    micro_batch: int,
    seed: int = 0,
    no_fallback: bool = False,
) -> argparse.Namespace:
    """What benchmarks/model_step.time_impl reads from its command line: one micro-batch, norms
    saved (its default), no profile or memory snapshot."""
    return argparse.Namespace(
        seed=seed,
        compile=compile,
        no_fallback=no_fallback,
        warmup=warmup,
        steps=steps,
        l1=l1,
        micro_batch=[micro_batch],
        accumulate=1,
        recompute_norms=["off"],
        profile=None,
        memory_snapshot=None,
    )


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = common.bench_device(cpu=args.tiny).type
    mcfg, state, _ = weights(args, device)
    # The shape of each variant's step; the step reads its batches from the trainer's data stream.
    batches = {b: torch.empty(b, args.seq_len + 1, dtype=torch.long) for b in args.micro_batch}
    tokens = "the trainer's data stream (its training split)"
    meta = {
        **common.run_meta(device),
        "preset": "tiny" if args.tiny else args.preset,
        "model": str(args.model) if args.model else None,
        "tokens": tokens,
        **{
            k: getattr(args, k)
            for k in ("micro_batch", "accumulate", "seq_len", "steps", "warmup", "compile")
        },
        **{k: getattr(args, k) for k in ("sparsify_steps", "sparsify_l1", "l1")},
    }
    rows = []
    for ids in batches.values():
        for recompute in args.recompute_norms:
            for impl in args.impls:
                rows.append(time_impl(impl, recompute, mcfg, state, ids, args, device))
                common.free_memory()  # each variant compiles its own graphs (dynamo's cache has a limit)
    common.write_report(markdown(meta, rows), meta, rows, args.json, args.md)
    return rows


if __name__ == "__main__":
    main()
