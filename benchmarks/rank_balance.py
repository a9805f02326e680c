"""How unevenly the ranks of a multi-GPU step compute, layer by layer, from the Chrome traces that
`benchmarks.step_profile` writes for every rank of the same steps.

Under FSDP2 every decoder layer's all-gather (and, in the backward, its reduce-scatter) is a
collective: a rank that finishes a layer early waits at the next one for the slowest. Dense layers
take the same time on every rank; the sparse kernels' time depends on each rank's own batch (its
active units, its heavy rows), so the ranks drift apart layer by layer. This splits each rank's
compute stream (the stream with the most device events) into layers at the attention kernels
(forward and backward: one a layer and pass) and reports, per layer, each rank's GPU busy time and
its FFN kernels' share (our extension's kernels and the compiled regions that wrap the op), then
sums, over the layers, the slowest rank's time less the ranks' mean: what the ranks would wait for
per step if every layer were a barrier and nothing absorbed the difference (prefetching the next
layers' weights absorbs some).

    python -m benchmarks.rank_balance DIR/trace_rank*_steps_783_785.json.gz --steps 3 --md out.md
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks import common
from benchmarks.trace_lead import DEVICE_CATEGORIES, read_trace

# The attention kernels that open a layer's forward and backward: cuDNN's and flash attention's.
FORWARD_MARK = r"sdpa.*fprop|flash_fwd|flash_attn.*fwd"
BACKWARD_MARK = r"sdpa.*bprop|flash_bwd|flash_attn.*bwd"
# The FFN op's kernels: the extension's, and Inductor's kernels fused around the custom ops.
FFN_KERNELS = r"sparse_llm::|ffn_train"


@dataclass(frozen=True)
class Segment:
    """A rank's compute stream from one attention kernel to the next: the passes of the two
    marks ("FF": a forward layer, "BB": a backward one, "FB"/"BF": the turn between the passes),
    and the GPU busy time of the events in between, all of them and the FFN op's."""

    passes: str
    busy_us: float
    ffn_us: float


def compute_stream_events(trace: dict) -> list[dict]:
    """The device events of the stream with the most of them (the compute stream: FSDP2's and
    NCCL's streams carry a few per layer), in start order."""
    device = [
        e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES
    ]
    if not device:
        raise ValueError("the trace has no device events (was it recorded with CUDA activity?)")
    busiest = collections.Counter(e.get("args", {}).get("stream") for e in device).most_common(1)[0][0]
    return sorted((e for e in device if e.get("args", {}).get("stream") == busiest), key=lambda e: e["ts"])


def layer_segments(
    events: list[dict], forward_mark: str = FORWARD_MARK, backward_mark: str = BACKWARD_MARK
) -> list[Segment]:
    """`events` cut at every attention kernel; what precedes the first mark is left out."""
    forward, backward, ffn = re.compile(forward_mark), re.compile(backward_mark), re.compile(FFN_KERNELS)

    def pass_of(name: str) -> str | None:
        return "F" if forward.search(name) else "B" if backward.search(name) else None

    marks = [(i, kind) for i, e in enumerate(events) if (kind := pass_of(e["name"]))]
    segments = []
    for (start, first), (end, second) in itertools.pairwise(marks):
        inside = events[start:end]
        segments.append(
            Segment(
                passes=first + second,
                busy_us=sum(float(e.get("dur", 0.0)) for e in inside),
                ffn_us=sum(float(e.get("dur", 0.0)) for e in inside if ffn.search(e["name"])),
            )
        )
    return segments


def balance(ranks: list[list[Segment]], steps: int) -> dict:
    """The ranks' segments side by side (the first `n` of each, n the fewest any rank has)."""
    if len(ranks) < 2:
        raise ValueError(f"needs the traces of at least 2 ranks, got {len(ranks)}")
    n = min(len(r) for r in ranks)
    if n == 0:
        raise ValueError("a trace has no attention kernels to cut its layers at")
    layers = []
    spread_us = ffn_spread_us = 0.0
    for k in range(n):
        busy = [r[k].busy_us for r in ranks]
        ffn = [r[k].ffn_us for r in ranks]
        passes = {r[k].passes for r in ranks}
        if len(passes) != 1:
            raise ValueError(f"segment {k} is not the same on every rank ({sorted(passes)}): unlike steps?")
        spread_us += max(busy) - statistics.mean(busy)
        ffn_spread_us += max(ffn) - statistics.mean(ffn)
        layers.append(
            {
                "segment": k,
                "passes": passes.pop(),
                "busy_ms": [b / 1000 for b in busy],
                "ffn_ms": [f / 1000 for f in ffn],
            }
        )
    per_rank = [sum(s.busy_us for s in r[:n]) / 1000 / steps for r in ranks]
    return {
        "ranks": len(ranks),
        "steps": steps,
        "segments": n,
        "busy_ms_per_step": per_rank,
        "mean_busy_ms_per_step": statistics.mean(per_rank),
        "slowest_rank_over_mean_ms_per_step": max(per_rank) - statistics.mean(per_rank),
        "layer_barrier_wait_ms_per_step": spread_us / 1000 / steps,
        "ffn_layer_barrier_wait_ms_per_step": ffn_spread_us / 1000 / steps,
        "layers": layers,
    }


def markdown(result: dict, sources: list[str]) -> str:
    lines = [
        "# How evenly the ranks compute, layer by layer",
        "",
        f"From {result['ranks']} ranks' traces of the same {result['steps']} step(s) ({', '.join(sources)}); each "
        "rank's compute stream cut into layers at its attention kernels. Per step:",
        "",
        "| | ms |",
        "|---|---:|",
        f"| GPU busy, mean over ranks | {result['mean_busy_ms_per_step']:.1f} |",
        "| busy per rank | " + " / ".join(f"{b:.1f}" for b in result["busy_ms_per_step"]) + " |",
        f"| slowest rank over the mean, whole step | {result['slowest_rank_over_mean_ms_per_step']:.1f} |",
        f"| sum over layers of (slowest rank - mean): the wait if every layer were a barrier | "
        f"{result['layer_barrier_wait_ms_per_step']:.1f} |",
        f"| the same, FFN kernels only | {result['ffn_layer_barrier_wait_ms_per_step']:.1f} |",
        "",
        "| segment | passes | busy ms per rank | FFN ms per rank |",
        "|---:|---|---|---|",
    ]
    for layer in result["layers"]:
        lines.append(
            f"| {layer['segment']} | {layer['passes']} | "
            + " / ".join(f"{b:.2f}" for b in layer["busy_ms"])
            + " | "
            + " / ".join(f"{f:.2f}" for f in layer["ffn_ms"])
            + " |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("traces", type=Path, nargs="+", help="one Chrome trace per rank, same steps")
    p.add_argument("--steps", type=int, default=1, help="steps the traces cover")
    p.add_argument("--forward-mark", default=FORWARD_MARK, help="regex: the kernel opening a forward layer")
    p.add_argument(
        "--backward-mark", default=BACKWARD_MARK, help="regex: the kernel opening a backward layer"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    missing = [str(t) for t in args.traces if not t.is_file()]
    if missing:
        raise SystemExit(f"no trace at {', '.join(missing)}")
    ranks = [
        layer_segments(compute_stream_events(read_trace(t)), args.forward_mark, args.backward_mark)
        for t in args.traces
    ]
    result = balance(ranks, args.steps)
    text = markdown(result, [t.name for t in args.traces])
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"traces": [str(t) for t in args.traces], **result}, indent=1))
    if args.md:
        args.md.write_text(text)


if __name__ == "__main__":
    main()
