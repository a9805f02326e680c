"""Batched generation with a KV cache: left-padded prefill, then one token per row per step
(eager here, or the static-shape CUDA-graph decode of sparse_llm.inference.decode)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparse_llm.inference.calibrate import FASTEST, choose_ffn_plan
from sparse_llm.inference.decode import DECODE_MODES, StaticDecoder, cache_len_bucket, resolve_decode_mode
from sparse_llm.inference.loading import LoadedModel, load_model
from sparse_llm.inference.sampling import SamplingParams, sample_next
from sparse_llm.model import CausalLMOutput, KVCache, SparseLlamaForCausalLM


@dataclass
class GenerationOutput:
    tokens: list[list[int]]  # new tokens per prompt, the stopping EOS included
    finish_reasons: list[str]  # "eos" or "length" per prompt
    texts: list[str] = field(default_factory=list)  # decoded new tokens (Generator.generate only)


def check_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, max_positions: int, max_new: int
) -> None:
    if isinstance(prompts, (str, bytes)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
        if len(ids) + max_new > max_positions:
            raise ValueError(
                f"prompt {i}: {len(ids)} tokens + max_new_tokens {max_new} exceed the model's "
                f"max_position_embeddings ({max_positions})"
            )


@dataclass
class PaddedPrompts:
    """A batch of prompts left-padded to one width, as the prefill takes them."""

    ids: torch.Tensor  # [B, W] token ids, padding (0) on the left
    lengths: torch.Tensor  # [B] real tokens per row
    mask: torch.Tensor | None  # [B, W] True on real tokens; None when no row is padded
    positions: torch.Tensor  # [B, W] RoPE positions (0 on the padding)

    @property
    def width(self) -> int:
        return self.ids.shape[1]


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> PaddedPrompts:
    """The prompts left-padded to the longest, with each row's positions and padding mask (the
    lengths are read from the lists, not from a device tensor: no sync)."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    batch, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(batch, width, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
    columns = torch.arange(width, device=device)[None, :]
    pad = (width - lengths)[:, None]
    mask = None
    if any(len(p) != width for p in prompts):
        mask = columns >= pad
    return PaddedPrompts(ids.to(device), lengths, mask, (columns - pad).clamp(min=0))


@torch.no_grad()
def generate_ids(
    model: SparseLlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    prefill_forward: Callable[..., CausalLMOutput] | None = None,
    decoder: StaticDecoder | None = None,
) -> GenerationOutput:
    """Generate for a batch of token-id prompts of any lengths (left-padded internally).

    Each row stops at its first EOS (when params.stop_at_eos) or after max_new_tokens; the batch
    ends when every row has stopped. Rows are independent: a prompt gives the same tokens alone
    or in a batch (up to floating-point ties). The FFN of each phase is the model's plan
    (`model.ffn_plan`). `prefill_forward` runs the prefill instead of `model` itself, e.g.
    `torch.compile(model)` (see `compile_prefill`). Decode runs `eager_decode`, or with a
    `decoder` (a StaticDecoder of this model: sparse_llm.inference.decode) the static-shape step,
    CUDA-graph-captured when the decoder captures; both give the same tokens up to
    floating-point ties, the same seeded samples included.
    """
    cfg = model.config
    check_prompts(prompts, cfg.vocab_size, cfg.max_position_embeddings, params.max_new_tokens)
    if decoder is not None and decoder.model is not model:
        raise ValueError("decoder was made for another model (StaticDecoder(model, ...))")
    device = model.lm_head.weight.device
    padded = left_pad(prompts, device)
    eos = torch.tensor(list(eos_token_ids) if params.stop_at_eos else [], dtype=torch.long, device=device)
    if prefill_forward is not None:  # a compiled prefill reads the derived weights made before
        model.prepare_inference()
    forward = model if prefill_forward is None else prefill_forward

    def prefill(cache: KVCache) -> torch.Tensor:
        out = forward(
            padded.ids,
            cache=cache,
            position_ids=padded.positions,
            attention_mask=padded.mask,
            last_logits_only=True,
        )
        return out.logits[:, -1]

    if decoder is None:
        tokens = eager_decode(model, prefill, padded, params, eos)
    else:
        tokens = decoder.generate(prefill, padded.lengths, padded.width, params, eos)
    return _outputs(tokens.tolist(), set(eos.tolist()))


def eager_decode(
    model: SparseLlamaForCausalLM,
    prefill: Callable[[KVCache], torch.Tensor],
    padded: PaddedPrompts,
    params: SamplingParams,
    eos: torch.Tensor,
) -> torch.Tensor:
    """New tokens [B, n] (0 after a row's EOS): the prefill into a cache sized for the call, then
    `eager_decode_from`. The reference the static decode is checked against."""
    batch, width = padded.ids.shape
    # The static decode's cache length for this call: attention by column bounds splits a row's
    # columns by the cache's length (ops.decode_attention.chunks_for), so both decodes then
    # attend alike, bit for bit.
    cache_len = cache_len_bucket(width + params.max_new_tokens)
    cache = KVCache(model.config, batch, cache_len, padded.ids.device, model.lm_head.weight.dtype)
    return eager_decode_from(model, prefill(cache), cache, params, padded.lengths, eos)


@torch.no_grad()
def eager_decode_from(
    model: SparseLlamaForCausalLM,
    logits: torch.Tensor,
    cache: KVCache,
    params: SamplingParams,
    lengths: torch.Tensor,
    eos: torch.Tensor | None = None,
) -> torch.Tensor:
    """New tokens [B, n] (n <= max_new_tokens; 0 after a row's EOS) after a prefill of prompts
    left-padded to `cache.length` columns into `cache`, whose last logits are `logits` [B, V];
    `lengths`: [B] real prompt tokens a row (int64), the RoPE position of its first new token.

    Each step runs `model.decode_step`, the forward the static decode captures, uncaptured: the
    new token written at the next column, each row attending to its columns from its first real
    one. On a GPU that attention reads the rows' column bounds, whose logits repeat call after
    call (cuDNN's attention under a padding mask did not: a seeded call's text changed between
    identical calls, issue 51). What this decode leaves out is what the static one adds: its
    buffers, slots and graphs; and it syncs with the host for the EOS check every step (none
    without `eos` ids)."""
    batch, device = logits.shape[0], logits.device
    if cache.length + params.max_new_tokens - 1 > cache.max_len:
        raise ValueError(
            f"the cache holds {cache.max_len} columns: too few for {cache.length} filled and "
            f"max_new_tokens {params.max_new_tokens}"
        )
    generator = None
    if params.seed is not None and not params.greedy:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    positions = lengths.clone()
    columns = torch.full_like(lengths, cache.length)
    first_columns = cache.length - lengths
    steps = []
    for step in range(params.max_new_tokens):
        token = sample_next(logits, params, generator)
        token = torch.where(finished, torch.zeros_like(token), token)
        steps.append(token)
        if eos is not None and eos.numel():
            finished |= torch.isin(token, eos)
            if bool(finished.all()):
                break
        if step == params.max_new_tokens - 1:
            break
        logits = model.decode_step(token, cache, positions, columns, first_columns)
        positions += 1
        columns += 1
        cache.length += 1
    return torch.stack(steps, dim=1)


def _outputs(table: list[list[int]], eos: set[int]) -> GenerationOutput:
    """Each row's tokens up to and including its first EOS, and why it stopped."""
    tokens, reasons = [], []
    for row in table:
        stop = next((j for j, t in enumerate(row) if t in eos), None)
        tokens.append(row if stop is None else row[: stop + 1])
        reasons.append("length" if stop is None else "eos")
    return GenerationOutput(tokens, reasons)


def compile_prefill(model: SparseLlamaForCausalLM, **compile_kwargs) -> Callable[..., CausalLMOutput]:
    """`model` under torch.compile, for prefills: thousands of tokens per layer call, where the
    eager RMSNorm, rotary and residual passes cost as much as the attention they surround.
    Decode (one token per row) is launch-bound instead: CUDA graphs take it (the Generator's
    `decode`, sparse_llm.inference.decode). Each FFN implementation compiles once, on its first
    prefill. The kernels' Wd^T copies are made first (`prepare_inference`), so no trace holds a
    transpose."""
    model.prepare_inference()
    return torch.compile(model, **compile_kwargs)


class Generator:
    """A loaded model with its tokenizer and per-phase FFN implementations (fixed when it is made:
    see sparse_llm.inference.calibrate for the values; `fastest` times dense against the kernels).

    gen = Generator.from_pretrained("runs/x/export", prefill_ffn="fastest", decode_ffn="fastest")
    out = gen.generate(["def main():"], max_new_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    out.texts[0]

    `compile=True` also compiles the static decode step (sparse_llm.inference.decode) before it is
    captured. It runs prefills through torch.compile (`compile_prefill`): the first prefill of
    each shape family pays the compilation, later ones run faster.

    `decode` (sparse_llm.inference.decode.resolve_decode_mode) is fixed here too: `auto` (the
    default) replays the decode step in CUDA graphs on a CUDA device with a capturable decode FFN,
    and decodes eagerly elsewhere (`decode_reason` says why); `graph` raises where graphs cannot
    run; `eager` and `static` (the graphs' step, uncaptured) run anywhere. `gen.decode` holds the
    mode. Graphs are captured per batch bucket on first use and kept with their KV cache
    (`gen.decoder.clear()` frees them).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        prefill_ffn: str = FASTEST,
        decode_ffn: str = FASTEST,
        compile: bool = False,
        decode: str = "auto",
    ) -> None:
        if decode not in DECODE_MODES:  # before calibration, which runs on the GPU
            raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
        self.loaded = loaded
        plan, self.ffn_measurement = choose_ffn_plan(loaded.model, prefill_ffn, decode_ffn)
        self.model = loaded.model.with_ffn_plan(plan)
        self.ffn = {"prefill": plan.prefill.impl, "decode": plan.decode.impl}
        self.ffn_plan = plan
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.prefill_forward = compile_prefill(self.model) if compile else None
        self.decode, self.decode_reason = resolve_decode_mode(self.model, decode)
        self.decoder = None
        if self.decode != "eager":
            self.decoder = StaticDecoder(self.model, capture=self.decode == "graph", compile=compile)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        prefill_ffn: str = FASTEST,
        decode_ffn: str = FASTEST,
        compile: bool = False,
        decode: str = "auto",
    ) -> Generator:
        return cls(load_model(path, device, dtype), prefill_ffn, decode_ffn, compile, decode)

    def encode(self, prompts: Sequence[str]) -> list[list[int]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        return [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def generate_ids(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> GenerationOutput:
        return generate_ids(
            self.model,
            prompts,
            params,
            self.eos_token_ids,
            self.prefill_forward,
            self.decoder,
        )

    def generate(self, prompts: str | Sequence[str], **sampling) -> GenerationOutput:
        """Generate for text prompts; keyword arguments are SamplingParams fields."""
        params = SamplingParams(**sampling)
        ids = self.encode([prompts] if isinstance(prompts, str) else list(prompts))
        out = self.generate_ids(ids, params)
        out.texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in out.tokens]
        return out
