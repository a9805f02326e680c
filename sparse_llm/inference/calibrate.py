"""The FFN plan of a model for inference: set by hand per phase, or the faster one by measurement.

`prefill_ffn` and `decode_ffn` take the values of `sparse_llm.ops.ffn.select` (dense, reference, cuda,
auto) or `fastest`, which never assumes the sparse kernels are faster:
  * where the kernels cannot run (no Hopper GPU, no built extension, a dtype other than
    bfloat16, D or H not a multiple of 8) `fastest` is `dense` (ops.ffn.select says why): the sparse
    front would run the PyTorch reference, which is the same arithmetic as the dense FFN;
  * otherwise both are timed on the model's own FFN inputs: one forward over a calibration batch
    captures every layer's FFN input, then each layer's FFN runs with `dense` and with `cuda` at
    the prefill shape (batch x prompt length tokens) and at the decode shape (batch tokens), and
    each phase takes the faster (`measure_ffn_impls`). The timings are kept for the report.
Decode (a few tokens per layer call) and prefill (thousands) sit at opposite ends of the
kernels' range, which is why the two phases are chosen separately.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from sparse_llm.model import FFNPlan, SparseLlamaForCausalLM
from sparse_llm.ops import KernelsUnavailable
from sparse_llm.ops.ffn.select import FFN_IMPLS, FFNSelection, select_ffn

FASTEST = "fastest"
CHOICES = (*FFN_IMPLS, FASTEST)
PHASES = ("prefill", "decode")


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


@torch.no_grad()
def time_ffn(
    model: SparseLlamaForCausalLM, inputs: Sequence[torch.Tensor], impl: str, reps: int = 5, warmup: int = 2
) -> float:
    """Median seconds of one pass of every layer's FFN over its captured input, with `impl`."""
    layers = list(model.model.layers)
    device = inputs[0].device
    times = []
    for i in range(warmup + reps):
        synchronize(device)
        start = time.perf_counter()
        for layer, x in zip(layers, inputs, strict=True):
            layer.mlp.run(x, impl)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def measure_ffn_impls(
    model: SparseLlamaForCausalLM,
    batch_size: int,
    prompt_len: int,
    candidates: Sequence[str] = ("dense", "cuda"),
    seed: int = 0,
    input_ids: torch.Tensor | None = None,
    reps: int = 5,
) -> dict:
    """Time each candidate per phase on the model's FFN inputs; returns the choice and timings.

    The calibration batch is `input_ids` or random tokens (seeded) of [batch_size, prompt_len].
    Prefill times every layer's FFN over all B x T inputs, decode over B of them (one per row).
    """
    device = model.lm_head.weight.device
    if input_ids is None:
        g = torch.Generator().manual_seed(seed)
        input_ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), generator=g)
    input_ids = input_ids.to(device)
    inputs = capture_ffn_inputs(model, input_ids)
    decode_inputs = [x[:, -1:].contiguous() for x in inputs]
    timings: dict[str, dict[str, float]] = {"prefill": {}, "decode": {}}
    for impl in candidates:
        timings["prefill"][impl] = time_ffn(model, inputs, impl, reps=reps)
        timings["decode"][impl] = time_ffn(model, decode_inputs, impl, reps=reps)
    choice = {phase: min(timings[phase], key=timings[phase].get) for phase in PHASES}
    return {
        "choice": choice,
        "timings_s": timings,
        "batch_size": input_ids.shape[0],
        "prompt_len": input_ids.shape[1],
    }


def choose_ffn_plan(
    model: SparseLlamaForCausalLM,
    prefill: str,
    decode: str,
    calibration_batch: int = 8,
    calibration_len: int = 512,
) -> tuple[FFNPlan, dict | None]:
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
            if measurement["choice"][phase] == "dense":
                selections[phase] = FFNSelection("dense", "measured faster than the kernels here")
    dense = FFNSelection("dense", "an inference model is not trained")
    plan = FFNPlan(train=dense, eval=selections["prefill"], **selections)
    return plan, measurement
