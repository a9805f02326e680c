"""FSDP2's collectives on this machine's interconnect: what a trainer step moves between the GPUs,
and how long that takes.

Under configs/accelerate/fsdp2.yaml each decoder layer is one FSDP2 unit and the rest of the model
(the tied embeddings, the final norm) is the root's. A step all-gathers each unit's parameters in
bf16 for its forward, again for its backward where they are resharded after the forward
(`fsdp_reshard_after_forward: true`; the config keeps them), and reduce-scatters its gradients in
fp32 (`trainer.fsdp2_mixed_precision`). This script times those
collectives alone, at the preset's unit sizes, over N processes (one GPU each, NCCL; `--cpu`: N CPU
processes over gloo, the CPU test), and reports for each the median ms, the algorithm bandwidth
(bytes of the gathered tensor / time) and the bus bandwidth (x (N-1)/N, NCCL's convention), then
what one step's collectives take in all. NCCL's transport between the GPUs (P2P over NVLink or
PCIe, SHM through host memory, NET) is read from NCCL's own log.

With `--runs` (whole_run JSONs of this N, single runs or `--join`ed pairs) each run's steady step time sits beside the step's
collectives: FSDP2 overlaps them with compute, so a run whose step is not much longer than its
collectives is bound by the interconnect, whatever its kernels save.

    python -m benchmarks.collectives --gpus 4 --runs whole_run_dense_4gpu.json whole_run_auto_4gpu.json \\
        --json collectives_4xh100.json --md collectives_4xh100.md
    python -m benchmarks.collectives --cpu --gpus 2 --tiny      # CPU, gloo, seconds
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import common

PARAM_DTYPE, REDUCE_DTYPE = torch.bfloat16, torch.float32  # trainer.fsdp2_mixed_precision's
COLLECTIVES = ("all_gather", "reduce_scatter")


def parse_args(argv: list[str] | None = None):
    p = common.script_parser(__doc__)
    p.add_argument(
        "--gpus", type=int, default=None, help="processes (default: every visible GPU; 2 with --cpu)"
    )
    p.add_argument("--preset", default="1b", help="configs/model/<preset>.yaml")
    p.add_argument("--tiny", action="store_true", help="the scripts' tiny model (with --cpu: seconds)")
    p.add_argument("--cpu", action="store_true", help="CPU processes over gloo (the CPU test)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--port", type=int, default=None, help="the rendezvous port (default: a free one)")
    p.add_argument(
        "--runs", type=Path, nargs="*", default=[], help="whole_run JSONs: their steady step times"
    )
    args = p.parse_args(argv)
    if args.gpus is None:
        args.gpus = 2 if args.cpu else torch.cuda.device_count()
    if args.gpus < 2:
        p.error(f"collectives need at least 2 processes, got {args.gpus}")
    if not args.cpu and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus}: {torch.cuda.device_count()} GPU(s) visible (--cpu for CPU processes)")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1 and --warmup >= 0")
    return args


def unit_params(fields: dict[str, Any]) -> dict[str, int]:
    """Parameters of each FSDP2 unit kind: one decoder layer, the root (the rest), and the layers'
    count, from the model built on the meta device (tied weights counted once)."""
    from sparse_llm.config import ModelConfig
    from sparse_llm.model import build_model
    from sparse_llm.model.llama import DecoderLayer

    cfg = ModelConfig(**{**fields, "vocab_size": fields.get("vocab_size") or 49152})
    with torch.device("meta"):
        model = build_model(cfg)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    total = sum(p.numel() for p in model.parameters())
    per_layer = sum(p.numel() for p in layers[0].parameters())
    return {"layer": per_layer, "root": total - per_layer * len(layers), "layers": len(layers)}


def shard_numel(params: int, world: int) -> int:
    """A rank's share of a unit's parameters (FSDP2 pads each parameter's first dimension to a
    multiple of the world size: the same for these presets' shapes)."""
    return math.ceil(params / world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# torch 2.13 renames the two (the old names deprecated there); 2.11-2.12 have only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _aligned(device: torch.device) -> None:
    """Before each timed collective: every rank at the same point, the GPU's queue empty."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure_one(
    unit: str, collective: str, shard: int, world: int, device: torch.device, args: dict
) -> dict:
    """One collective of one unit's shard, timed: a bf16 all-gather or an fp32 reduce-scatter."""
    dtype = PARAM_DTYPE if collective == "all_gather" else REDUCE_DTYPE
    small = torch.randn(shard, device=device).to(dtype)
    full = torch.randn(shard * world, device=device).to(dtype)
    if collective == "all_gather":
        call = lambda: _all_gather(full, small)
    else:
        call = lambda: _reduce_scatter(small, full)
    times = common.call_times_ms(call, device, args["warmup"], args["reps"], lambda: _aligned(device))
    return {
        "unit": unit,
        "collective": collective,
        "dtype": str(dtype).removeprefix("torch."),
        "bytes": full.numel() * full.element_size(),
        "ms": statistics.median(times),
        "ms_min": min(times),
    }


def _worker(rank: int, world: int, port: int, cpu: bool, units: dict[str, int], args: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if cpu else "nccl", rank=rank, world_size=world, device_id=None if cpu else device
    )
    try:
        rows = [
            _measure_one(unit, collective, shard_numel(units[unit], world), world, device, args)
            for unit in ("layer", "root")
            for collective in COLLECTIVES
        ]
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def nccl_transports(log_dir: Path) -> list[str]:
    """The transports NCCL's log names for its channels ('P2P/CUMEM/read', 'SHM/direct/direct', ...)."""
    found = set()
    for path in log_dir.glob("nccl.*.log"):
        for line in path.read_text(errors="replace").splitlines():
            match = re.search(r" via (\S+)", line)
            if match:
                found.add(match.group(1))
    return sorted(found)


def step_collectives_ms(rows: list[dict], units: dict[str, int], reshard_after_forward: bool = True) -> float:
    """A step's collectives, back to back: every unit all-gathered for the forward (and again for
    the backward where it reshards after the forward) and its gradients reduce-scattered once. The
    root counts as a layer does: an upper bound where the launcher keeps the root's parameters."""
    ms = {(r["unit"], r["collective"]): r["ms"] for r in rows}
    gathers = 2 if reshard_after_forward else 1
    per_unit = {u: gathers * ms[(u, "all_gather")] + ms[(u, "reduce_scatter")] for u in ("layer", "root")}
    return units["layers"] * per_unit["layer"] + per_unit["root"]


def run_step_times(path: Path) -> list[dict[str, Any]]:
    """The steady step time a GPU of each run in a whole_run JSON: one run's, or a joined
    comparison's (`--join`: each pair's dense and sparse runs); a GPU's tokens a step over its
    steady tokens/s."""
    result = json.loads(path.read_text())["results"][0]
    runs = (
        [result]
        if "pairs" not in result
        else [p[side] for p in result["pairs"] for side in ("dense", "sparse")]
    )
    times = []
    for run in runs:
        overrides = dict(o.split("=", 1) for o in run["overrides"] if "=" in o)
        # A GPU's tokens a step: the global batch over the GPUs (with any gradient accumulation).
        tokens = int(overrides["train.global_batch_size"]) * int(overrides["train.seq_len"]) // run["gpus"]
        times.append(
            {
                "run": path.name,
                "impl": run["impl"],
                "gpus": run["gpus"],
                "step_ms": 1e3 * tokens / run["steady_tokens_per_s_per_gpu"],
            }
        )
    return times


def _nccl_log_env(directory: str) -> dict[str, str]:
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT",
        "NCCL_DEBUG_FILE": f"{directory}/nccl.%h.%p.log",
    }


def measure(args) -> tuple[list[dict], list[str], dict[str, int]]:
    fields = dict(common.TINY_MODEL) if args.tiny else common.model_preset(args.preset)
    units = unit_params(fields)
    with tempfile.TemporaryDirectory() as tmp:
        # NCCL's log names each channel's transport; set for the workers only, as the caller had it after.
        logging = {} if args.cpu or "NCCL_DEBUG" in os.environ else _nccl_log_env(tmp)
        before = {key: os.environ.get(key) for key in logging}
        os.environ.update(logging)
        try:
            out = f"{tmp}/rows.json"
            options = {"warmup": args.warmup, "reps": args.reps}
            port = args.port or _free_port()
            mp.spawn(_worker, args=(args.gpus, port, args.cpu, units, options, out), nprocs=args.gpus)
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        rows = json.loads(Path(out).read_text())
        transports = nccl_transports(Path(tmp))
    for r in rows:
        r["algbw_gbs"] = r["bytes"] / r["ms"] / 1e6
        r["busbw_gbs"] = r["algbw_gbs"] * (args.gpus - 1) / args.gpus
    return rows, transports, units


def report(args, rows: list[dict], transports: list[str], units: dict[str, int]) -> tuple[str, dict]:
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    meta = common.run_meta(
        device,
        world_size=args.gpus,
        preset="tiny" if args.tiny else args.preset,
        backend="gloo" if args.cpu else "nccl",
    )
    step = step_collectives_ms(rows, units)
    kept = step_collectives_ms(rows, units, reshard_after_forward=False)
    runs = [run for path in args.runs for run in run_step_times(path)]
    lines = [
        f"# FSDP2's collectives over {args.gpus} processes: {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, {meta['backend']}; "
        f"preset `{meta['preset']}`: {units['layers']} layer units of {units['layer'] / 1e6:.1f}M parameters, "
        f"the root's {units['root'] / 1e6:.1f}M; median of {args.reps} calls after {args.warmup}.",
        "",
        f"NCCL's transports between the GPUs: {', '.join(transports) or '-'}",
        "",
        "| unit | collective | dtype | MB (the whole tensor) | ms | algbw GB/s | busbw GB/s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['unit']} | {r['collective']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | {r['ms']:.3f} "
            f"| {r['algbw_gbs']:.1f} | {r['busbw_gbs']:.1f} |"
        )
    lines += [
        "",
        f"A step's collectives back to back: **{step:.1f} ms** (each unit gathered for the forward and the "
        f"backward, its gradients reduce-scattered); {kept:.1f} ms with the parameters kept from the "
        "forward to the backward (`fsdp_reshard_after_forward: false`).",
    ]
    if runs:
        lines += [
            "",
            "| run | GPUs | steady step a GPU, ms | the step's collectives, ms | collectives / step |",
            "|---|---:|---:|---:|---:|",
        ]
        for run in runs:
            mark = "" if run["gpus"] == args.gpus else f" (measured over {args.gpus})"
            lines.append(
                f"| {run['run']} ({run['impl']}) | {run['gpus']} | {run['step_ms']:.1f} | {step:.1f}{mark} "
                f"| {step / run['step_ms']:.2f} |"
            )
    headline = {
        "step_collectives_ms": step,
        "step_collectives_kept_params_ms": kept,
        "transports": transports,
    }
    meta.update(units=units, runs=runs)
    return "\n".join(lines) + "\n", {"meta": meta, "headline": headline}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows, transports, units = measure(args)
    text, parts = report(args, rows, transports, units)
    common.write_report(text, parts["meta"], rows, args.json, args.md, headline=parts["headline"])


if __name__ == "__main__":
    main()
