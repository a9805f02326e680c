"""The figure of record: a user's whole training run, dense FFN against the sparse kernels.

The real trainer (`python -m sparse_llm.train`, in its own process) from initialisation on a preset
to a target L0, with `model.ffn_impl` the only difference between two runs (same data, seed and
recipe). Each run is one process and one call of this script, compiling from empty caches of its
own (`trainer_env`); `--join` reads two of them and
writes the comparison:

    python -m benchmarks.whole_run --impl dense --out-dir $OUT      # ~5 min on an H100 (1b)
    python -m benchmarks.whole_run --impl auto --out-dir $OUT
    python -m benchmarks.whole_run --join dense.json auto.json --json run_1b_h100.json --md run_1b_h100.md
    python -m benchmarks.whole_run --impl dense --tag run2 --out-dir $OUT   # dense again: the A/A pair
    python -m benchmarks.whole_run --join dense.json auto.json --aa dense_run2.json ...
    python -m benchmarks.whole_run --tiny --impl reference --out-dir /tmp/w   # CPU, the script end to end
    python -m benchmarks.whole_run --impl auto --gpus 2 --out-dir $OUT   # FSDP2 over 2 GPUs
    python -m benchmarks.whole_run --join dense_2gpu.json auto_2gpu.json --baseline run_1b_h100.json ...

`--gpus N` launches the trainer with `accelerate launch` and configs/accelerate/fsdp2.yaml: each GPU
takes the 8 x 2048 tokens of one GPU's run, so the global batch is N times larger; the report adds
tokens/s per GPU and, with `--baseline` (a joined one-GPU comparison), the scaling over one GPU.

The recipe is benchmarks/sparse_weights.py's (the weights every fixed-weight benchmark times):
800 steps of 8 x 2048 tokens of the embedded corpus, AdamW at 1e-3 after 60 warm-up steps, the L1
coefficient ramped to 1e-3 over 100 steps and then driven by the controller to L0 30, compiled,
bf16. From the run's metrics.jsonl (a record at step 1 and every `--log-every` steps, each with the
wall clock of the steps so far) it reports: the wall clock of the steps with and without the first
step (which holds the first compile), tokens/s until L0 first reaches `--early-l0` and over the
last `--steady-steps` steps, the run's peak memory (the allocator's high-water mark over the whole
run), the layers' fallback flips, the graphs compiled after the first step, the last held-out loss,
and the L0 of the final weights on held-out text.

`--aa` adds, for each pair, a second dense run of the same seed and data: the A/A pair, whose
differences are the runs' own nondeterminism (the attention backward's order of sums, the compiled
kernels' choices). The report puts its loss and steady tokens/s ratios beside A/B's and says whether
the A/B loss ratio is further from 1 than the A/A one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.sparse_weights import heldout_layer_l0
from sparse_llm.analysis.runs import read_metrics
from sparse_llm.run_files import EXPORT_DIR, RUN_INFO_FILE

# (steps, micro-batch = global batch, seq_len, model preset, log_every)
FULL = dict(steps=800, batch=8, seq_len=2048, preset="1b", log_every=20)
TINY = dict(steps=8, batch=2, seq_len=32, preset="tiny", log_every=4)
ACCELERATE_FSDP2 = Path(__file__).resolve().parents[1] / "configs" / "accelerate" / "fsdp2.yaml"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__, report=False)
    p.add_argument("--impl", choices=["dense", "auto", "cuda", "reference"], help="model.ffn_impl of the run")
    p.add_argument("--out-dir", type=Path, help="where the run's JSON summary (whole_run_<impl>.json) goes")
    p.add_argument(
        "--run-dir", type=Path, default=None, help="the run directory (default /tmp/whole_run_<impl>)"
    )
    p.add_argument("--preset", default=None, help="configs/model/<preset>.yaml (default 1b)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="train.seed; not 0: the files are named ..._seed<N>")
    p.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="processes (one GPU each); over 1: FSDP2 through accelerate launch, 8 sequences per GPU",
    )
    p.add_argument("--port", type=int, default=29500, help="with --gpus > 1: the launcher's rendezvous port")
    p.add_argument(
        "--launch-arg",
        action="append",
        default=[],
        help="with --gpus > 1: an argument for accelerate launch, e.g. --launch-arg=--fsdp_reshard_after_forward=false",
    )
    p.add_argument("--target-l0", type=float, default=30.0)
    p.add_argument(
        "--early-l0", type=float, default=60.0, help="the early phase ends when L0 first reaches this"
    )
    p.add_argument("--steady-steps", type=int, default=400, help="the steady phase: the run's last N steps")
    p.add_argument("--tiny", action="store_true", help="the tiny model on CPU: checks the script end to end")
    p.add_argument("--override", action="append", default=[], help="an extra Hydra override for the run")
    p.add_argument("--tag", default=None, help="appended to the run's name: a repeat of an impl, e.g. run2")
    p.add_argument(
        "--join",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="pairs of summaries: DENSE_JSON SPARSE_JSON [...]",
    )
    p.add_argument(
        "--aa",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="with --join: for each pair in order, a second dense run of its seed and data (the A/A pair)",
    )
    p.add_argument("--json", type=Path, default=None, help="with --join: the comparison's JSON")
    p.add_argument("--md", type=Path, default=None, help="with --join: the comparison's Markdown")
    p.add_argument(
        "--plot", type=Path, default=None, help="with --join: tokens/s and L0 over the steps (PNG)"
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="with --join of multi-GPU runs: the one-GPU comparison (a --join JSON) to scale against",
    )
    args = p.parse_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.launch_arg and args.gpus == 1:
        p.error("--launch-arg goes with --gpus > 1 (one GPU runs without accelerate launch)")
    if args.join is None and (args.impl is None or args.out_dir is None):
        p.error("give --impl and --out-dir for a run, or --join DENSE_JSON SPARSE_JSON")
    if args.aa is not None and args.join is None:
        p.error("--aa goes with --join")
    if args.tiny:
        args.steady_steps = min(args.steady_steps, 4)
    if args.join is None:
        # The steady phase starts at a logged step, or the summary has no record to start from.
        shape = TINY if args.tiny else FULL
        steps, log_every = args.steps or shape["steps"], shape["log_every"]
        if not 0 < args.steady_steps < steps or (steps - args.steady_steps) % log_every:
            p.error(
                f"--steps {steps} minus --steady-steps {args.steady_steps} must be a positive multiple "
                f"of the runs' log_every ({log_every}), where the steady phase starts"
            )
    return args


def recipe(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The run's Hydra overrides."""
    shape = TINY if args.tiny else FULL
    steps = args.steps or shape["steps"]
    # The L1 ramp and the lr warm-up are the recipe's, whatever --steps truncates it to.
    recipe_steps = shape["steps"]
    overrides = [
        f"model={args.preset or shape['preset']}",
        f"model.ffn_impl={args.impl}",
        f"run_dir={run_dir}",
        "logger=none",
        "sparsity=target",
        "sparsity.target_sparsity=null",
        f"sparsity.target_l0={args.target_l0:g}",
        "sparsity.l1_coeff=1e-3",
        f"sparsity.l1_warmup_end={max(1, recipe_steps // 8)}",
        f"train.max_steps={steps}",
        f"train.seq_len={shape['seq_len']}",
        f"train.global_batch_size={shape['batch'] * args.gpus}",
        f"train.micro_batch_size={shape['batch']}",
        "train.lr=1e-3",
        f"train.warmup_steps={max(1, (recipe_steps * 3) // 40)}",
        f"train.log_every={shape['log_every']}",
        "train.eval_every=0",
        "train.checkpoint_every=0",
        # Sharded runs export the gathered weights, which the held-out L0 reads.
        f"train.export={str(args.gpus > 1).lower()}",
        "train.progress=false",
        f"train.seed={args.seed}",
    ]
    if args.tiny:
        overrides += ["train=cpu", "data.max_documents=300"]
    else:
        overrides += ["train=gpu_bench"]
    return overrides + list(args.override)


def train_command(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """The trainer's command line: one process, or FSDP2 over `--gpus` processes."""
    if args.gpus == 1:
        return [sys.executable, "-m", "sparse_llm.train", *overrides]
    launch = ["--config_file", str(ACCELERATE_FSDP2), "--num_processes", str(args.gpus)]
    launch += ["--main_process_port", str(args.port), *args.launch_arg]
    return [sys.executable, "-m", "accelerate.commands.launch", *launch, "-m", "sparse_llm.train", *overrides]


def reshard_after_forward(run_dir: Path) -> bool | None:
    """Whether FSDP2 freed each layer's gathered parameters after its forward in the run at
    `run_dir`, as its trainer recorded it (run_info.json); None for a run without FSDP2."""
    parallel = json.loads((run_dir / RUN_INFO_FILE).read_text()).get("parallel", {})
    return parallel.get("reshard_after_forward")


def trainer_env(compile_cache: Path) -> dict[str, str]:
    """The trainer's environment: this one's, with Inductor's and Triton's caches in `compile_cache`
    (empty, the run's own). Runs on one machine shared those caches, so a run after another of the
    same model compiled from its graphs: on an H200 an `auto` run after a hot-unit run took 3.4 s for
    its first step and 142 s after it, against 13-16 s and 144-150 s for `auto` runs on fresh
    machines. Every run compiles as a user's first run on a machine does, whatever ran before it."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache / "inductor"),
        "TRITON_CACHE_DIR": str(compile_cache / "triton"),
    }


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.run_dir or Path(f"/tmp/{run_name(args)}")
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} holds a run already: remove it or give another --run-dir")
    overrides = recipe(args, run_dir)
    # Hydra's group choices (train=...) come before their keys' overrides.
    overrides.sort(key=lambda o: "." in o.split("=")[0])
    command = train_command(args, overrides)
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="whole_run_compile_cache_") as cache:
        subprocess.run(command, check=True, env=trainer_env(Path(cache)))
    process_s = time.perf_counter() - start
    records = [r for r in read_metrics(run_dir) if "elapsed_s" in r]
    config = _read_yaml(run_dir / "config.yaml")
    seq_len = int(config["train"]["seq_len"])
    weights = run_dir / EXPORT_DIR if (run_dir / EXPORT_DIR).is_dir() else run_dir
    layer_l0 = heldout_layer_l0(weights, rows=16, seq_len=seq_len)
    summary = summarize(
        records,
        args.early_l0,
        args.steady_steps,
        int(config["train"]["global_batch_size"]) * seq_len,
        args.target_l0,
    )
    summary.update(
        impl=args.impl,
        seed=args.seed,
        gpus=args.gpus,
        steady_tokens_per_s_per_gpu=summary["steady_tokens_per_s"] / args.gpus,
        preset=config["model"].get("name", args.preset),
        process_s=process_s,
        heldout_l0=sum(layer_l0) / len(layer_l0),
        heldout_layer_l0=layer_l0,
        overrides=overrides,
        sparsity=config["sparsity"],  # resolved: the controller's settings, defaults included
        **(
            dict(launch_args=args.launch_arg, reshard_after_forward=reshard_after_forward(run_dir))
            if args.gpus > 1
            else {}
        ),
        series=[
            {
                k: r.get(k)
                for k in (
                    "step",
                    "elapsed_s",
                    "tokens_per_s",
                    "l0/mean",
                    "l1_coeff",  # the controller's lambda beside the L0 it drives
                    "ce",
                    "peak_mem_gib",
                    "ffn_fallback/dense_layers",
                    "ffn/capacity_overflows",
                    "ffn_hot/units",
                    "gc_s",
                )
            }
            for r in records
        ],
    )
    meta = common.run_meta(common.bench_device(), world_size=args.gpus)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"{run_name(args)}.json"
    path.write_text(json.dumps({"meta": meta, "results": [summary]}, indent=1) + "\n")
    print(
        f"{args.impl}: {json.dumps({k: v for k, v in summary.items() if k not in ('series', 'overrides', 'heldout_layer_l0', 'capacity_overflows_by')})}"
    )
    return summary


def run_name(args: argparse.Namespace) -> str:
    """whole_run_<impl>[_<preset>][_<N>gpu][_seed<S>][_<tag>]: the 1b preset on one GPU, seed 0 unmarked."""
    preset = args.preset or (TINY if args.tiny else FULL)["preset"]
    return (
        f"whole_run_{args.impl}"
        + (f"_{preset}" if preset not in ("1b", "tiny") else "")
        + (f"_{args.gpus}gpu" if args.gpus > 1 else "")
        + (f"_seed{args.seed}" if args.seed else "")
        + (f"_{args.tag}" if args.tag else "")
    )


def _read_yaml(path: Path) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def l0_tracking(records: list[dict[str, Any]], target_l0: float, after_step: int) -> dict[str, float | None]:
    """How closely a run's logged L0 held its target over the records after `after_step`: their
    mean, and the RMS of log(L0 / target) (0.1: about 10% off). Each record's `l0/mean` is its
    log window's, so a dip shorter than a window shows only as a lower mean."""
    l0s = [float(r["l0/mean"]) for r in records if int(r["step"]) > after_step and r.get("l0/mean")]
    if not l0s:
        return {"mean": None, "log_rms": None}
    return {
        "mean": statistics.fmean(l0s),
        "log_rms": math.sqrt(statistics.fmean(math.log(v / target_l0) ** 2 for v in l0s)),
    }


def summarize(
    records: list[dict[str, Any]],
    early_l0: float,
    steady_steps: int,
    tokens_per_step: int,
    target_l0: float,
) -> dict[str, Any]:
    """The run's figures from its timed records (step 1, then every log_every steps)."""
    by_step = {int(r["step"]): r for r in records}
    first, last = min(by_step), max(by_step)
    steady_from = last - steady_steps
    if steady_from not in by_step:
        raise ValueError(
            f"no record at step {steady_from}: --steady-steps must be a multiple of train.log_every"
        )
    early_end = next(
        (s for s in sorted(by_step) if by_step[s].get("l0/mean", float("inf")) <= early_l0), None
    )

    def tokens_per_s(a: int, b: int) -> float:
        return (b - a) * tokens_per_step / (by_step[b]["elapsed_s"] - by_step[a]["elapsed_s"])

    final = by_step[last]
    steady_l0 = l0_tracking(records, target_l0, steady_from)
    return {
        "steps": last,
        "wall_s": final["elapsed_s"],
        "first_step_s": by_step[first]["elapsed_s"],
        "wall_s_after_first_step": final["elapsed_s"] - by_step[first]["elapsed_s"],
        "early_end_step": early_end,
        "early_tokens_per_s": tokens_per_s(first, early_end) if early_end and early_end > first else None,
        "steady_tokens_per_s": tokens_per_s(steady_from, last),
        "peak_mem_gib": max(r.get("peak_mem_gib", 0.0) for r in records),
        "flips": final.get("ffn_fallback/flips", 0.0),
        "capacity_overflows": final.get("ffn/capacity_overflows"),
        "capacity_overflows_steady": (
            final["ffn/capacity_overflows"] - by_step[steady_from]["ffn/capacity_overflows"]
            if "ffn/capacity_overflows" in final and "ffn/capacity_overflows" in by_step[steady_from]
            else None
        ),
        # rank 0's, by size and by layer (which record runs out of room, where)
        "capacity_overflows_by": {
            k.removeprefix("ffn/capacity_overflows/"): v
            for k, v in final.items()
            if k.startswith("ffn/capacity_overflows/")
        },
        "dense_layers_at_end": final.get("ffn_fallback/dense_layers", 0.0),
        "graphs": final.get("compile/graphs"),
        "recompiles": final.get("compile/recompiles"),
        "final_val_loss": final.get("val_loss"),
        "final_train_ce": final.get("ce"),
        "train_l0_last": final.get("l0/mean"),
        "target_l0": target_l0,
        "steady_l0_mean": steady_l0["mean"],
        "steady_l0_log_rms": steady_l0["log_rms"],
        # model.ffn_hot_share's units over the layers at the end (None for a run without them)
        "hot_units_at_end": final.get("ffn_hot/units"),
    }


RATIO_KEYS = ("wall_speedup", "steady_speedup", "run_peak_mem_ratio", "final_loss_ratio", "heldout_l0")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def compare(dense: dict[str, Any], sparse: dict[str, Any]) -> dict[str, Any]:
    """One pair's figures: dense time / sparse time, sparse memory and loss / dense's."""
    return {
        "wall_speedup": dense["wall_s_after_first_step"] / sparse["wall_s_after_first_step"],
        "wall_speedup_with_first_step": dense["wall_s"] / sparse["wall_s"],
        "steady_speedup": sparse["steady_tokens_per_s"] / dense["steady_tokens_per_s"],
        "early_speedup": ratio(sparse["early_tokens_per_s"], dense["early_tokens_per_s"]),
        "run_peak_mem_ratio": ratio(sparse["peak_mem_gib"], dense["peak_mem_gib"]),
        "recompiles": sparse["recompiles"],
        "flips": sparse["flips"],
        "final_loss_ratio": ratio(sparse["final_val_loss"], dense["final_val_loss"]),
        "heldout_l0": sparse["heldout_l0"],
        "dense": dense,
        "sparse": sparse,
    }


def compare_aa(pair: dict[str, Any], again: dict[str, Any]) -> dict[str, Any]:
    """A pair's A/A figures: its dense run repeated (`again`) over the first, and whether the A/B loss
    ratio is further from 1 than the A/A one (None without both losses)."""
    aa_loss = ratio(again["final_val_loss"], pair["dense"]["final_val_loss"])
    ab_loss = pair["final_loss_ratio"]
    return {
        "final_loss_ratio": aa_loss,
        "steady_speedup": again["steady_tokens_per_s"] / pair["dense"]["steady_tokens_per_s"],
        "loss_ab_exceeds_aa": None if None in (aa_loss, ab_loss) else abs(ab_loss - 1) > abs(aa_loss - 1),
        "dense_again": again,
    }


def _check_comparable(dense: dict[str, Any], other: dict[str, Any], path: Path) -> None:
    """A run compared with a dense run must match its GPUs and, where both say, its FSDP2 setting
    (runs from before the setting was recorded say nothing)."""
    gpus = dense.get("gpus", 1), other.get("gpus", 1)
    if gpus[0] != gpus[1]:
        raise SystemExit(f"{path} differs from its dense run in gpus: {gpus[1]} vs {gpus[0]}")
    reshard = dense.get("reshard_after_forward"), other.get("reshard_after_forward")
    if None not in reshard and reshard[0] != reshard[1]:
        raise SystemExit(
            f"{path} differs from its dense run in reshard_after_forward: {reshard[1]} vs {reshard[0]}"
        )


def join(args: argparse.Namespace) -> dict[str, Any]:
    """The pairs (dense, sparse) of --join, each compared, with their A/A figures where --aa gives a
    second dense run; the top-level figures are the median over the pairs (recompiles: the most of
    any pair)."""
    if len(args.join) % 2:
        raise SystemExit("--join takes pairs: DENSE_JSON SPARSE_JSON [DENSE_JSON SPARSE_JSON ...]")
    if args.aa is not None and 2 * len(args.aa) != len(args.join):
        raise SystemExit("--aa takes one second dense run per pair of --join")
    loaded = [_load(p) for p in args.join]
    for (_, dense), (_, sparse), path in zip(loaded[::2], loaded[1::2], args.join[1::2], strict=True):
        _check_comparable(dense, sparse, path)
    pairs = [compare(d[1], s[1]) for d, s in zip(loaded[::2], loaded[1::2], strict=True)]
    metas = [{"dense": d[0], "sparse": s[0]} for d, s in zip(loaded[::2], loaded[1::2], strict=True)]
    result: dict[str, Any] = {
        key: statistics.median(p[key] for p in pairs if p[key] is not None) for key in RATIO_KEYS
    }
    result["recompiles"] = max(p["recompiles"] or 0 for p in pairs)
    if args.aa is not None:
        for pair, meta, path, (_, dense) in zip(pairs, metas, args.aa, loaded[::2], strict=True):
            meta["dense_again"], again = _load(path)
            _check_comparable(dense, again, path)
            pair["aa"] = compare_aa(pair, again)
        aa_losses = [p["aa"]["final_loss_ratio"] for p in pairs if p["aa"]["final_loss_ratio"] is not None]
        result["aa_final_loss_ratio"] = statistics.median(aa_losses) if aa_losses else None
    result["pairs"] = pairs
    if args.baseline is not None:
        result["scaling"] = scaling(pairs, json.loads(args.baseline.read_text())["results"][0]["pairs"])
    if args.plot:
        plot(pairs[0]["dense"], pairs[0]["sparse"], args.plot)
    text = "\n".join(markdown(p, m) for p, m in zip(pairs, metas, strict=True))
    if "scaling" in result:
        text += scaling_markdown(result["scaling"], args.baseline)
    if len(pairs) > 1:
        text += (
            "\nMedian over the pairs: "
            + ", ".join(f"{k} {result[k]:.4g}" for k in RATIO_KEYS)
            + (f"; recompiles at most {result['recompiles']:g}.\n")
        )
    common.write_report(text, {"pairs": metas}, [result], args.json, args.md)
    return result


def scaling(pairs: list[dict[str, Any]], one_gpu_pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Multi-GPU runs against one GPU's (medians over each side's pairs): steady tokens/s over one
    GPU's, per implementation, and the sparse/dense steady ratio on each side."""

    def steady(side: list[dict[str, Any]], impl: str) -> float:
        return statistics.median(p[impl]["steady_tokens_per_s"] for p in side)

    gpus = pairs[0]["sparse"].get("gpus", 1)
    result: dict[str, Any] = {"gpus": gpus}
    for impl in ("dense", "sparse"):
        result[f"{impl}_scaling"] = steady(pairs, impl) / steady(one_gpu_pairs, impl)
        result[f"{impl}_tokens_per_s_per_gpu"] = steady(pairs, impl) / gpus
        result[f"{impl}_tokens_per_s_one_gpu"] = steady(one_gpu_pairs, impl)
    result["steady_speedup"] = statistics.median(p["steady_speedup"] for p in pairs)
    result["steady_speedup_one_gpu"] = statistics.median(p["steady_speedup"] for p in one_gpu_pairs)
    result["steady_speedup_change"] = result["steady_speedup"] - result["steady_speedup_one_gpu"]
    return result


def scaling_markdown(s: dict[str, Any], baseline: Path) -> str:
    return "\n".join(
        [
            "",
            f"Against one GPU (`{baseline.name}`, steady tokens/s, medians over its pairs):",
            "",
            f"| | one GPU, tokens/s | {s['gpus']} GPUs, tokens/s per GPU | scaling over one GPU |",
            "|---|---|---|---|",
            *(
                f"| {name} | {s[f'{impl}_tokens_per_s_one_gpu']:.0f} | {s[f'{impl}_tokens_per_s_per_gpu']:.0f} "
                f"| **{s[f'{impl}_scaling']:.3f}x** |"
                for name, impl in (("dense", "dense"), ("sparse", "sparse"))
            ),
            f"| sparse/dense steady ratio | {s['steady_speedup_one_gpu']:.3f}x | {s['steady_speedup']:.3f}x "
            f"| change **{s['steady_speedup_change']:+.3f}** |",
            "",
        ]
    )


def _load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    data = json.loads(path.read_text())
    return data["meta"], data["results"][0]


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


# The comparison table: (label, formatted with the sparse run's figures; the runs' key and format, the pair's ratio key or "", its format,
# bold: a figure of record).
TABLE_ROWS = (
    ("steps", "steps", "d", "", "", False),
    ("wall clock of the steps, s", "wall_s", ".0f", "wall_speedup_with_first_step", ".3f", False),
    ("first step (first compile), s", "first_step_s", ".1f", "", "", False),
    ("wall clock after the first step, s", "wall_s_after_first_step", ".0f", "wall_speedup", ".3f", True),
    (
        "tokens/s until L0 first <= the early L0 (step {early_end_step})",
        "early_tokens_per_s",
        ".0f",
        "early_speedup",
        ".3f",
        False,
    ),
    ("tokens/s, steady (the last steps)", "steady_tokens_per_s", ".0f", "steady_speedup", ".3f", True),
    ("tokens/s per GPU, steady", "steady_tokens_per_s_per_gpu", ".0f", "", "", False),
    ("the run's peak memory (per GPU), GiB", "peak_mem_gib", ".2f", "run_peak_mem_ratio", ".3f", True),
    ("graphs compiled", "graphs", ".0f", "", "", False),
    ("graphs compiled after the first step", "recompiles", ".0f", "", "", False),
    ("fallback flips", "flips", ".0f", "", "", False),
    ("steps a layer's record overflowed its capacity (rank 0)", "capacity_overflows", ".0f", "", "", False),
    ("of them in the steady phase", "capacity_overflows_steady", ".0f", "", "", False),
    ("layers running dense at the end", "dense_layers_at_end", ".0f", "", "", False),
    ("hot units over the layers at the end (model.ffn_hot_share)", "hot_units_at_end", ".0f", "", "", False),
    ("final held-out loss", "final_val_loss", ".4f", "final_loss_ratio", ".4f", False),
    ("L0 of the final weights, held-out text", "heldout_l0", ".2f", "", "", False),
    ("L0 in the steady phase, mean of its logged windows", "steady_l0_mean", ".1f", "", "", False),
    (
        "L0 off the target in the steady phase, RMS of log(L0 / target)",
        "steady_l0_log_rms",
        ".3f",
        "",
        "",
        False,
    ),
    ("whole process (build, compile, eval, checkpoint), s", "process_s", ".0f", "", "", False),
)


def markdown(r: dict[str, Any], meta: dict[str, Any]) -> str:
    d, s = r["dense"], r["sparse"]
    rows = []
    for label, key, spec, ratio_key, ratio_spec, bold in TABLE_ROWS:
        ratio = f"{_fmt(r[ratio_key], ratio_spec)}x" if ratio_key else ""
        rows.append(
            (label, _fmt(d.get(key), spec), _fmt(s.get(key), spec), f"**{ratio}**" if bold else ratio)
        )
    rows[4] = (f"tokens/s until L0 first <= the early L0 (step {s['early_end_step']})", *rows[4][1:])
    dm, sm = meta["dense"], meta["sparse"]
    lines = [
        f"# A whole training run, dense FFN against `{s['impl']}`, seed {s.get('seed', 0)}: {sm.get('device')}",
        "",
        f"preset `{s['preset']}`, {_gpus_text(s)}, from initialisation to a target L0, "
        f"{s['steps']} steps; dense run: commit "
        f"`{dm.get('commit')}`, {dm.get('date')}; {s['impl']} run: commit `{sm.get('commit')}`, {sm.get('date')}; "
        f"torch {sm.get('torch')}. Ratios: dense time / sparse time, sparse memory / dense memory, "
        "sparse loss / dense loss. Each run is `python -m sparse_llm.train` with "
        "`benchmarks/whole_run.py`'s overrides (in the JSON).",
        "",
        f"| | dense | {s['impl']} | ratio |",
        "|---|---|---|---|",
        *(f"| {name} | {a} | {b} | {c} |" for name, a, b, c in rows),
    ]
    if "aa" in r:
        lines += ["", aa_markdown(r, meta["dense_again"])]
    return "\n".join(lines) + "\n"


def aa_markdown(r: dict[str, Any], again_meta: dict[str, Any]) -> str:
    """The A/A line of a pair: its dense run repeated, against the A/B loss ratio."""
    aa, ab_loss = r["aa"], r["final_loss_ratio"]
    text = (
        f"A/A: dense again, same seed and data (commit `{again_meta.get('commit')}`, {again_meta.get('date')}): "
        f"final held-out loss {_fmt(aa['dense_again'].get('final_val_loss'), '.4f')}, "
        f"{_fmt(aa['final_loss_ratio'], '.4f')}x the first dense run's; steady tokens/s "
        f"{aa['steady_speedup']:.3f}x. "
    )
    if aa["loss_ab_exceeds_aa"] is None:
        return text + "A run without a held-out loss: no loss comparison."
    ab_gap, aa_gap = abs(ab_loss - 1), abs(aa["final_loss_ratio"] - 1)
    exceeds = aa["loss_ab_exceeds_aa"]
    return text + (
        f"The A/B loss ratio ({ab_loss:.4f}x) is {'further' if exceeds else 'no further'} from 1 ({ab_gap:.4f}) "
        f"than A/A's ({aa_gap:.4f}): {'more than' if exceeds else 'within'} the runs' own nondeterminism."
    )


def _gpus_text(summary: dict[str, Any]) -> str:
    gpus = summary.get("gpus", 1)
    if gpus == 1:
        return "one GPU"
    # Runs from before the setting was recorded say nothing of it.
    keeps = {
        True: ", parameters resharded after the forward",
        False: ", parameters kept from the forward to the backward",
    }
    return f"{gpus} GPUs (FSDP2{keeps.get(summary.get('reshard_after_forward'), '')}, 8 sequences per GPU a step)"


def plot(dense: dict[str, Any], sparse: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tok, ax_l0) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax_coeff = ax_l0.twinx()  # the controller's lambda beside the L0 it drives (dashed)
    for run, color in ((dense, "C0"), (sparse, "C1")):
        pts = [p for p in run["series"] if p["step"] > 1]
        steps = [p["step"] for p in pts]
        label = "dense" if run is dense else run["impl"]
        ax_tok.plot(steps, [p["tokens_per_s"] for p in pts], color=color, marker=".", label=label)
        ax_l0.plot(steps, [p["l0/mean"] for p in pts], color=color, label=label)
        coeff = [(s, p["l1_coeff"]) for s, p in zip(steps, pts, strict=True) if p.get("l1_coeff")]
        if coeff:  # absent from runs written before it was kept
            ax_coeff.plot(*zip(*coeff, strict=True), color=color, linestyle="--", linewidth=0.8)
    ax_tok.set_ylabel("tokens/s (each logging window)")
    ax_tok.legend()
    ax_l0.set_yscale("log")
    ax_l0.set_ylabel("active units per token (L0)")
    ax_coeff.set_yscale("log")
    ax_coeff.set_ylabel("L1 coefficient (dashed)")
    ax_l0.set_xlabel("step")
    fig.suptitle("A whole training run: throughput and sparsity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    return join(args) if args.join else run_one(args)


if __name__ == "__main__":
    main()
