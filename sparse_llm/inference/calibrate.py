"""The FFN plan of a model for inference: set by hand per phase, or the faster one by measurement.

`prefill_ffn` and `decode_ffn` take the values of `sparse_llm.ops.ffn.select` (dense, reference, cuda,
auto) or `fastest`, which never assumes the sparse kernels are faster:
  * where the kernels cannot run (no Hopper GPU, no built extension, a dtype other than
    bfloat16, D or H not a multiple of 8) `fastest` is `dense` (ops.ffn.select says why): the sparse
    front would run the PyTorch reference, which is the same arithmetic as the dense FFN;
  * otherwise both are timed on the model's own FFN inputs: one forward over a calibration batch
    captures every layer's FFN input, then every layer's FFN runs with `dense` and with `cuda` at
    the prefill shape (batch x prompt length tokens, eager, as a prefill runs) and at the decode
    shape of each of DECODE_BATCHES (one token a row, replayed in a CUDA graph where both FFNs can
    be captured at that batch, as the graph decode runs them: timed eagerly, the kernels' extra
    launches would count against them), and each phase takes the faster (`measure_ffn_impls`).
    The timings are logged (one INFO line per phase and batch) and kept (`FFNMeasurement`,
    `Generator.ffn_measurement`).
Decode (a few tokens per layer call) and prefill (thousands) sit at opposite ends of the
kernels' range, which is why the two phases are chosen separately.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from sparse_llm.inference.decode import why_ffn_not_capturable
from sparse_llm.model import FFNPlan, SparseLlamaForCausalLM
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.ffn.select import FFN_IMPLS, FFNSelection, select_ffn

FASTEST = "fastest"
CHOICES = (*FFN_IMPLS, FASTEST)
PHASES = ("prefill", "decode")
# The calibration batch of `fastest`: rows and tokens a row (at most the model's context).
CALIBRATION_BATCH = 8
CALIBRATION_LEN = 512
# The batch sizes the decode phase is timed at (one token a row): a Generator decodes at any, and
# the kernels' edge over dense is largest at one row.
DECODE_BATCHES = (1, 8)

logger = logging.getLogger(__name__)


def _select(model: SparseLlamaForCausalLM, phase: str, requested: str) -> FFNSelection:
    weight = model.lm_head.weight
    cfg = model.config
    try:
        return select_ffn(
            requested,
            phase,
            device=weight.device,
            dtype=weight.dtype,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            where=f"{phase}_ffn",
            activation=cfg.hidden_act,
        )
    except KernelsUnavailable as err:
        raise ValueError(str(err)) from None


def synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work (a no-op off CUDA): what a wall-clock timing needs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def capture_ffn_inputs(model: SparseLlamaForCausalLM, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's FFN input ([B, T, D]) for one forward of `input_ids` (on the dense path)."""
    captured: list[torch.Tensor] = []
    dense = model.with_ffn_plan(FFNPlan.dense())
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda _m, _args, out: captured.append(out.detach())
        )
        for layer in dense.model.layers
    ]
    try:
        dense(input_ids, last_logits_only=True)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


@dataclass(frozen=True)
class FFNTiming:
    """One pass of every layer's FFN over its captured input: the phase, the batch (rows), the
    tokens of each layer call, how the pass ran ("graph": replayed in a CUDA graph; "eager") and
    the median milliseconds of each candidate."""

    phase: str
    batch: int
    tokens: int
    timed: str
    ms: dict[str, float]

    def line(self) -> str:
        times = ", ".join(f"{impl} {ms:.3f} ms" for impl, ms in self.ms.items())
        return (
            f"{self.phase} FFN at batch {self.batch} ({self.tokens} tokens a layer call, "
            f"{self.timed}): {times}"
        )


@dataclass
class FFNMeasurement:
    """What `fastest` measured and chose: the timings of each phase (per batch measured), and the
    choice per phase, the candidate with the smallest mean time relative to the first candidate
    (dense) over the phase's timings."""

    timings: list[FFNTiming]
    choice: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for phase in {t.phase for t in self.timings}:
            rows = [t for t in self.timings if t.phase == phase]
            base = next(iter(rows[0].ms))

            def relative(impl: str, rows: list[FFNTiming] = rows, base: str = base) -> float:
                return statistics.fmean(t.ms[impl] / t.ms[base] for t in rows)

            self.choice.setdefault(phase, min(rows[0].ms, key=relative))

    def summary(self, phase: str) -> str:
        """The phase's timings in a few words: 'dense 1.20 / cuda 0.91 ms at batch 1; ...'."""
        rows = [t for t in self.timings if t.phase == phase]
        return "; ".join(
            " / ".join(f"{impl} {ms:.3f}" for impl, ms in t.ms.items())
            + f" ms at batch {t.batch} ({t.timed})"
            for t in rows
        )

    def markdown(self) -> str:
        """The timings as a Markdown table, a row per phase and batch, with the choice."""
        impls = list(self.timings[0].ms)
        lines = [
            "| phase | batch | tokens a layer call | timed | "
            + " | ".join(f"{i} ms" for i in impls)
            + " | chosen |",
            "|---|---:|---:|---|" + "---:|" * len(impls) + "---|",
        ]
        for t in self.timings:
            times = " | ".join(f"{t.ms[i]:.3f}" for i in impls)
            lines.append(
                f"| {t.phase} | {t.batch} | {t.tokens} | {t.timed} | {times} | {self.choice[t.phase]} |"
            )
        return "\n".join(lines) + "\n"


def _pass_over_layers(
    model: SparseLlamaForCausalLM, inputs: Sequence[torch.Tensor], impl: str
) -> Callable[[], None]:
    layers = list(model.model.layers)

    def run() -> None:
        for layer, x in zip(layers, inputs, strict=True):
            layer.mlp.run(x, impl)

    return run


def _captured(run: Callable[[], None], device: torch.device, warmup: int) -> Callable[[], None]:
    """`run` captured in a CUDA graph (its own memory pool, freed with it): its replay. Warm-up
    and capture on one stream, so that per-stream one-time work (cuBLAS workspaces) is not
    captured."""
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run()
    return graph.replay


@torch.no_grad()
def time_ffn(
    model: SparseLlamaForCausalLM,
    inputs: Sequence[torch.Tensor],
    impl: str,
    reps: int = 5,
    warmup: int = 2,
    graph: bool = False,
) -> float:
    """Median seconds of one pass of every layer's FFN over its captured input, with `impl`;
    `graph`: the pass replayed in a CUDA graph (as the graph decode runs it)."""
    device = inputs[0].device
    run = _pass_over_layers(model, inputs, impl)
    if graph:
        run = _captured(run, device, warmup)
    times = []
    for i in range(warmup + reps):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _decode_in_graphs(model: SparseLlamaForCausalLM, candidates: Sequence[str], batch: int) -> bool:
    """Whether the decode phase is timed in CUDA graphs at `batch`: on a GPU, where every
    candidate's FFN can be captured at that batch (side by side, both run the same way)."""
    hidden = model.config.hidden_size
    on_gpu = model.lm_head.weight.device.type == "cuda"
    return on_gpu and all(why_ffn_not_capturable(impl, hidden, batch) is None for impl in candidates)


@torch.no_grad()
def measure_ffn_impls(
    model: SparseLlamaForCausalLM,
    batch_size: int,
    prompt_len: int,
    candidates: Sequence[str] = ("dense", "cuda"),
    seed: int = 0,
    input_ids: torch.Tensor | None = None,
    reps: int = 5,
    decode_batches: Sequence[int] = DECODE_BATCHES,
) -> FFNMeasurement:
    """Time each candidate per phase on the model's FFN inputs, log the timings, and choose.

    The calibration batch is `input_ids` or random tokens (seeded) of [batch_size, prompt_len].
    Prefill times every layer's FFN over all B x T inputs, eagerly; decode over one input a row
    (the last) of the first b rows for each b of `decode_batches` (up to B), in a CUDA graph where
    every candidate can be captured (`_decode_in_graphs`).
    """
    device = model.lm_head.weight.device
    if input_ids is None:
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), generator=g)
    input_ids = input_ids.to(device)
    inputs = capture_ffn_inputs(model, input_ids)
    batch, length = input_ids.shape
    timings = [
        FFNTiming(
            "prefill",
            batch,
            batch * length,
            "eager",
            {impl: 1000 * time_ffn(model, inputs, impl, reps=reps) for impl in candidates},
        )
    ]
    for rows in sorted({min(b, batch) for b in decode_batches}):
        decode_inputs = [x[:rows, -1:].contiguous() for x in inputs]
        graph = _decode_in_graphs(model, candidates, rows)
        ms = {
            impl: 1000 * time_ffn(model, decode_inputs, impl, reps=reps, graph=graph) for impl in candidates
        }
        timings.append(FFNTiming("decode", rows, rows, "graph" if graph else "eager", ms))
    measurement = FFNMeasurement(timings)
    for timing in timings:
        logger.info("fastest: %s", timing.line())
    for phase in PHASES:
        logger.info("fastest: the %s FFN is %s", phase, measurement.choice[phase])
    return measurement


def choose_ffn_plan(
    model: SparseLlamaForCausalLM,
    prefill: str,
    decode: str,
    calibration_batch: int = CALIBRATION_BATCH,
    calibration_len: int = CALIBRATION_LEN,
) -> tuple[FFNPlan, FFNMeasurement | None]:
    """The inference plan for `prefill` and `decode` (values of CHOICES), and the measurement
    when `fastest` timed the candidates (else None). Evaluation takes the prefill's choice, and
    training is dense (an inference model is not trained)."""
    requested = {"prefill": prefill, "decode": decode}
    for phase, value in requested.items():
        if value not in CHOICES:
            raise ValueError(f"{phase}_ffn must be one of {', '.join(CHOICES)}, got {value!r}")
    selections = {
        phase: _select(model, phase, "auto" if value == FASTEST else value)
        for phase, value in requested.items()
    }
    to_measure = [p for p, v in requested.items() if v == FASTEST and selections[p].impl == "cuda"]
    measurement = None
    if to_measure:
        length = min(calibration_len, model.config.max_position_embeddings)
        measurement = measure_ffn_impls(model, calibration_batch, length)
        for phase in to_measure:
            if measurement.choice[phase] == "dense":
                why = f"measured faster than the kernels here: {measurement.summary(phase)}"
                selections[phase] = FFNSelection("dense", why)
    dense = FFNSelection("dense", "an inference model is not trained")
    plan = FFNPlan(train=dense, eval=selections["prefill"], **selections)
    return plan, measurement
