"""Which FFN implementation each phase (prefill, decode) runs: set by hand or chosen by measurement.

`auto` never assumes the sparse kernels are faster. The rule:
  * where the CUDA kernels cannot run (no Hopper GPU, no built extension, a dtype other than
    bfloat16, D or H not a multiple of 8) `auto` is `dense`: the sparse front would run the
    PyTorch reference, which is the same arithmetic as the dense FFN;
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

from sparse_llm.model import SparseLlamaForCausalLM

FFN_CHOICES = ("auto", "dense", "reference", "cuda")
PHASES = ("prefill", "decode")


def set_ffn_impl(model: SparseLlamaForCausalLM, impl: str) -> None:
    """Route every layer's no-grad FFN through `impl` (dense, reference or cuda)."""
    if impl not in ("dense", "reference", "cuda"):
        raise ValueError(f"ffn impl must be dense, reference or cuda, got {impl!r}")
    for layer in model.model.layers:
        layer.mlp.ffn_impl = impl


def cuda_unavailable_reason(model: SparseLlamaForCausalLM) -> str | None:
    """Why ffn_impl=cuda cannot run the kernels for this model, or None when it can."""
    from sparse_llm.ops import _extension
    from sparse_llm.ops.checks import CUDA_ALIGN, CUDA_MAX_DIM

    weight = model.lm_head.weight
    cfg = model.config
    if weight.device.type != "cuda":
        return f"the model is on {weight.device}, the kernels need a CUDA (Hopper) GPU"
    if weight.dtype != torch.bfloat16:
        return f"the model is in {weight.dtype}, the kernels take bfloat16 (load with dtype=bfloat16)"
    if cfg.hidden_size % CUDA_ALIGN or cfg.intermediate_size % CUDA_ALIGN or cfg.hidden_size > CUDA_MAX_DIM:
        return f"hidden/intermediate sizes {cfg.hidden_size}/{cfg.intermediate_size} do not fit the kernels"
    reason = _extension.unavailable_reason()
    if reason is not None:
        return reason
    if not _extension.available():
        return "the CUDA extension failed to build (see the warning above)"
    return None


def check_ffn_choice(model: SparseLlamaForCausalLM, phase: str, impl: str) -> None:
    if impl not in FFN_CHOICES:
        raise ValueError(f"{phase}_ffn must be one of {', '.join(FFN_CHOICES)}, got {impl!r}")
    if impl == "cuda":
        reason = cuda_unavailable_reason(model)
        if reason is not None:
            raise ValueError(f"{phase}_ffn=cuda cannot run: {reason}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def capture_ffn_inputs(model: SparseLlamaForCausalLM, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's FFN input ([B, T, D]) for one forward of `input_ids`."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach()))
        for layer in model.model.layers
    ]
    try:
        model(input_ids, last_logits_only=True)
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
    previous = [layer.mlp.ffn_impl for layer in layers]
    set_ffn_impl(model, impl)
    device = inputs[0].device
    times = []
    try:
        for i in range(warmup + reps):
            _sync(device)
            start = time.perf_counter()
            for layer, x in zip(layers, inputs, strict=True):
                layer.mlp(x, False)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
    finally:
        for layer, impl_before in zip(layers, previous, strict=True):
            layer.mlp.ffn_impl = impl_before
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


def resolve_ffn_impls(
    model: SparseLlamaForCausalLM,
    prefill: str,
    decode: str,
    calibration_batch: int = 8,
    calibration_len: int = 512,
) -> tuple[dict[str, str], dict | None]:
    """Concrete impls for both phases; `auto` per the module's rule. Returns (choice, measurement)."""
    check_ffn_choice(model, "prefill", prefill)
    check_ffn_choice(model, "decode", decode)
    choice = {"prefill": prefill, "decode": decode}
    if "auto" not in choice.values():
        return choice, None
    if cuda_unavailable_reason(model) is not None:
        return {phase: "dense" if impl == "auto" else impl for phase, impl in choice.items()}, None
    length = min(calibration_len, model.config.max_position_embeddings)
    measurement = measure_ffn_impls(model, calibration_batch, length)
    return {
        p: measurement["choice"][p] if impl == "auto" else impl for p, impl in choice.items()
    }, measurement
