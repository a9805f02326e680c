"""What `fastest` picks, and whether it picks the faster: on a model, the calibration a Generator
runs for `fastest` (sparse_llm.inference.calibrate: every layer's FFN timed with dense and with the
kernels, per phase and decode batch), then each phase timed side by side as generation runs it,
the whole model with each FFN: a prefill forward of the calibration batch (eager), and a greedy
decode step per batch at a context (the package's decode loop, one CUDA graph a step where both
FFNs can be captured, else the same step uncaptured).

    python -m benchmarks.ffn_choice --model runs/sparse_1b [--batches 1 8] [--context 1024] \
        [--json F] [--md F]
    python -m benchmarks.ffn_choice --tiny   # CPU: dense against the kernels' reference

On a CPU or without the kernels the sparse side is the reference (the PyTorch path of the front).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from benchmarks import common
from benchmarks.inference import time_decode_step, with_ffn
from sparse_llm.config import ModelConfig
from sparse_llm.inference import load_model
from sparse_llm.inference.calibrate import (
    CALIBRATION_BATCH,
    CALIBRATION_LEN,
    FFNMeasurement,
    measure_ffn_impls,
)
from sparse_llm.inference.decode import why_not_graph
from sparse_llm.model import SparseLlamaForCausalLM, build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--model", help="export, checkpoint or run directory")
    p.add_argument("--tiny", action="store_true", help="a random toy model on CPU")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="cache columns of a timed decode step")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps per repetition")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if (args.model is None) == (not args.tiny):
        p.error("give --model or --tiny")
    return args


def load(args: argparse.Namespace) -> SparseLlamaForCausalLM:
    if args.tiny:
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=512, max_position_embeddings=256, **common.TINY_MODEL)
        return build_model(cfg).eval()
    return load_model(args.model, args.device, args.dtype).model


def side_by_side(
    model: SparseLlamaForCausalLM, sparse: str, measurement: FFNMeasurement, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Each phase with the whole model on dense and on `sparse`: a row per phase and batch."""
    device = model.lm_head.weight.device
    models = {"dense": with_ffn(model, "dense"), sparse: with_ffn(model, sparse)}
    generator = torch.Generator().manual_seed(0)

    def tokens(batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, model.config.vocab_size, (batch, length), generator=generator).to(device)

    prefill_len = min(CALIBRATION_LEN, model.config.max_position_embeddings)
    ids = tokens(CALIBRATION_BATCH, prefill_len)
    rows = []
    with torch.no_grad():
        ms = {
            impl: common.median_ms(lambda m=m: m(ids, last_logits_only=True), device, args.warmup, args.reps)
            for impl, m in models.items()
        }
    rows.append(dict(phase="prefill", batch=CALIBRATION_BATCH, tokens=ids.numel(), mode="eager", ms=ms))
    context = min(args.context, model.config.max_position_embeddings)
    for batch in args.batches:
        capturable = device.type == "cuda" and all(why_not_graph(m, batch) is None for m in models.values())
        mode = "graph" if capturable else "static"
        prompt = tokens(batch, context - args.decode_steps)
        ms = {
            impl: 1000 * time_decode_step(m, prompt, mode, args.decode_steps, args.warmup, args.reps)
            for impl, m in models.items()
        }
        rows.append(dict(phase="decode", batch=batch, tokens=batch, mode=mode, ms=ms))
    for row in rows:
        row["faster"] = min(row["ms"], key=row["ms"].get)
        row["fastest_picked"] = measurement.choice[row["phase"]]
    return rows


def markdown(
    meta: dict[str, Any], measurement: FFNMeasurement, rows: list[dict[str, Any]], sparse: str
) -> str:
    lines = [
        "# What `fastest` picks",
        "",
        f"{meta['device']}, commit {meta['commit']}, {meta['date']}. Candidates: dense and {sparse}.",
        "",
        "## The calibration (every layer's FFN on the model's own inputs: what `fastest` decides on)",
        "",
        measurement.markdown(),
        "## Side by side (the whole model, each phase as generation runs it)",
        "",
        f"| phase | batch | tokens a layer call | how | dense ms | {sparse} ms | faster | fastest picked |",
        "|---|---:|---:|---|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['phase']} | {r['batch']} | {r['tokens']} | {r['mode']} | {r['ms']['dense']:.3f} | "
            f"{r['ms'][sparse]:.3f} | {r['faster']} | {r['fastest_picked']} |"
        )
    lines += ["", "Decode ms are per step (every row's token); prefill ms per forward of the batch."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = load(args)
    device = model.lm_head.weight.device
    sparse, _ = common.sparse_path("prefill", model.config, device, model.lm_head.weight.dtype)
    length = min(CALIBRATION_LEN, model.config.max_position_embeddings)
    measurement = measure_ffn_impls(model, CALIBRATION_BATCH, length, candidates=("dense", sparse))
    rows = side_by_side(model, sparse, measurement, args)
    meta = common.run_meta(device, model=args.model or "tiny", context=args.context)
    calibration = [
        dict(phase=t.phase, batch=t.batch, tokens=t.tokens, timed=t.timed, ms=t.ms)
        for t in measurement.timings
    ]
    meta |= {"calibration": calibration, "fastest": measurement.choice}
    common.write_report(markdown(meta, measurement, rows, sparse), meta, rows, args.json, args.md)


if __name__ == "__main__":
    main()
