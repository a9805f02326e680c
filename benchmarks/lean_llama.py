"""Our dense training step against a lean compiled Llama of the same shape, side by side.

The yardstick of docs/design.md section 5 ("our dense step within 3% of a lean compiled Llama"):
a plain Llama written here in ~80 lines (embedding, RMSNorm, SDPA attention with RoPE, ReLU-gated
MLP, tied head, plain cross-entropy), loaded with the same weights as ours. In one process, each
variant a fresh model on the same weights and tokens, AdamW (fused on a GPU), torch.compile'd:

- `ours`: our dense step exactly as benchmarks/model_step.py builds and times it (its L1 term and
  statistics included: that is what our training step runs), fp32 master weights + bf16 autocast;
- `lean`: the lean model in the same regime (fp32 master weights + bf16 autocast);
- `lean_bf16`: the lean model with bf16 parameters and bf16 AdamW state (no autocast).

Reports the median step ms, tokens/s, peak memory and ours / each (ms): a Markdown table, and JSON
/ Markdown with --json / --md (device, commit via $GIT_COMMIT or git, date). On fp32 weights and a
CPU (no autocast) ours and lean give the same loss: tests/benchmarks/test_lean_llama.py.

    python -m benchmarks.lean_llama --preset 1b --json lean_1b.json --md lean_1b.md
    python -m benchmarks.lean_llama --preset tiny --seq-len 64 --micro-batch 2 --steps 3 --no-compile
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import common
from benchmarks.model_step import model_step_args, time_impl, trainer_batches, untimed_steps
from sparse_llm.config import ModelConfig

VARIANTS = {
    "ours": "ours (dense), fp32 master + bf16 autocast",
    "lean": "lean, fp32 master + bf16 autocast",
    "lean_bf16": "lean, bf16 parameters + bf16 AdamW state",
}
# Explicit sizes: option -> ModelConfig field, applied over --preset.
SIZE_OPTIONS = {
    "vocab": "vocab_size",
    "hidden": "hidden_size",
    "intermediate": "intermediate_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
}


# ---- the lean model -------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeanConfig:
    vocab: int
    dim: int
    hidden: int
    layers: int
    heads: int
    rope_theta: float
    eps: float
    max_positions: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> LeanConfig:
        """The lean shape of one of our configs; the lean model has no GQA, no untied head, no SwiGLU."""
        if cfg.num_key_value_heads not in (0, cfg.num_attention_heads):
            raise ValueError("the lean model has multi-head attention only (num_key_value_heads 0)")
        if not cfg.tie_word_embeddings or cfg.hidden_act != "relu":
            raise ValueError("the lean model has a tied head and a ReLU gate only")
        return cls(
            cfg.vocab_size,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.rope_theta,
            cfg.rms_norm_eps,
            cfg.max_position_embeddings,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in fp32, cast back to x's dtype, then scaled (as Hugging Face Llama does)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention; x [B, T, heads, head_dim], cos/sin [T, 1, head_dim]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)


class LeanBlock(nn.Module):
    def __init__(self, c: LeanConfig) -> None:
        super().__init__()
        self.heads, self.eps = c.heads, c.eps
        self.attn_norm = nn.Parameter(torch.ones(c.dim))
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False) for _ in range(4))
        self.mlp_norm = nn.Parameter(torch.ones(c.dim))
        self.w_gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.w_up = nn.Linear(c.dim, c.hidden, bias=False)
        self.w_down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = rms_norm(x, self.attn_norm, self.eps)
        q, k, v = (w(h).view(b, t, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        out = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)), is_causal=True)
        x = x + self.wo(out.transpose(1, 2).reshape(b, t, d))
        h = rms_norm(x, self.mlp_norm, self.eps)
        return x + self.w_down(F.relu(self.w_gate(h)) * self.w_up(h))


class LeanLlama(nn.Module):
    """forward(ids, labels) -> mean next-token cross-entropy; the head is the embedding (tied)."""

    def __init__(self, c: LeanConfig) -> None:
        super().__init__()
        self.eps = c.eps
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(LeanBlock(c) for _ in range(c.layers))
        self.norm = nn.Parameter(torch.ones(c.dim))
        head_dim = c.dim // c.heads
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(c.max_positions).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos()[:, None], persistent=False)  # [positions, 1, head_dim]
        self.register_buffer("sin", angles.sin()[:, None], persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        cos, sin = self.cos[: ids.shape[1]], self.sin[: ids.shape[1]]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(rms_norm(x, self.norm, self.eps), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


# Our parameter names (Hugging Face's) -> the lean model's, per layer and outside the layers.
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "wq.weight",
    "self_attn.k_proj.weight": "wk.weight",
    "self_attn.v_proj.weight": "wv.weight",
    "self_attn.o_proj.weight": "wo.weight",
    "post_attention_layernorm.weight": "mlp_norm",
    "mlp.gate_proj.weight": "w_gate.weight",
    "mlp.up_proj.weight": "w_up.weight",
    "mlp.down_proj.weight": "w_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm",
    "lm_head.weight": None,
}


def lean_state(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict under the lean model's names (the tied lm_head is the embedding: dropped)."""
    state = {}
    for name, tensor in ours.items():
        if name in _TOP_NAMES:
            lean_name = _TOP_NAMES[name]
        else:
            _, _, index, rest = name.split(".", 3)  # model.layers.<i>.<rest>
            lean_name = f"layers.{index}.{_LAYER_NAMES[rest]}"
        if lean_name is not None:
            state[lean_name] = tensor
    return state


def lean_model(cfg: ModelConfig, ours: dict[str, torch.Tensor], device: str, bf16: bool) -> LeanLlama:
    """The lean model of `cfg` on `device` with our weights `ours` (fp32, or bf16 with `bf16`)."""
    with torch.device(device):
        model = LeanLlama(LeanConfig.of(cfg))
    model.load_state_dict(lean_state(ours))
    return model.to(torch.bfloat16) if bf16 else model


# ---- the benchmark --------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.script_parser(__doc__)
    p.add_argument("--preset", default="1b", help="configs/model/<preset>.yaml (e.g. 1b, tiny)")
    for option, field in SIZE_OPTIONS.items():
        p.add_argument(f"--{option}", type=int, default=None, help=f"{field}, over the preset's")
    p.add_argument("--model", type=Path, default=None, help="time these weights (export, checkpoint or run)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation included)")
    p.add_argument("--l1", type=float, default=2e-5, help="ours: the L1 term's coefficient in the step")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def weights(args: argparse.Namespace) -> tuple[ModelConfig, dict[str, torch.Tensor], Any]:
    """(config, fp32 CPU weights, tokenizer or None): of --model, else the preset with the size
    options over it, freshly initialised as our trainer does (seeded)."""
    if args.model is not None:
        return common.load_weights(args.model)
    fields = common.model_preset(args.preset)
    fields.update({f: getattr(args, o) for o, f in SIZE_OPTIONS.items() if getattr(args, o) is not None})
    return common.fresh_weights(fields, args.seed)


def step_args(args: argparse.Namespace, micro_batch: int) -> argparse.Namespace:
    """What model_step.time_impl (ours) and trainer_batches (the batches of both) read: this
    script's step settings."""
    return model_step_args(
        steps=args.steps,
        warmup=args.warmup,
        compile=args.compile,
        l1=args.l1,
        micro_batch=micro_batch,
        seed=args.seed,
    )


def time_lean(
    bf16: bool, cfg: ModelConfig, state: dict, ids: torch.Tensor, args: argparse.Namespace, device: str
) -> dict[str, Any]:
    """The lean model's step, timed as model_step.time_impl times ours (the trainer's step): the wall
    clock of each step from an idle GPU to its end, median; peak memory over the timed steps; the
    losses. Like the trainer's, it clips the gradient norm at 1.0."""
    model = lean_model(cfg, state, device, bf16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")  # as time_impl's
    forward = torch.compile(model) if args.compile else model
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda" and not bf16)
    # The batches our step reads from the trainer's stream, in the same order.
    batches = iter(
        trainer_batches(
            cfg,
            tuple(ids.shape),
            step_args(args, ids.shape[0]),
            device,
            untimed_steps(args.warmup) + args.steps + 1,
        )
    )
    losses: list[torch.Tensor] = []

    def step() -> None:
        batch = next(batches).to(device, non_blocking=True)
        with autocast:
            loss = forward(batch[:, :-1], batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # as the trainer's step clips
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(untimed_steps(args.warmup)):  # as time_impl (its memory probe on a GPU aside)
        step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = common.median_ms(step, torch.device("cpu"), warmup=0, reps=args.steps)  # wall clock: step() syncs
    timed = [loss.item() for loss in losses[untimed_steps(args.warmup) :]]
    return {
        "ms_step": ms,
        "tokens_per_s": (ids.numel() - ids.shape[0]) / (ms / 1000),  # each row drops its last id
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan"),
        "loss_first": timed[0],
        "loss_last": timed[-1],
    }


def time_variant(
    variant: str, cfg: ModelConfig, state: dict, ids: torch.Tensor, args: argparse.Namespace, device: str
) -> dict[str, Any]:
    """One variant's row: ours through model_step.time_impl, the lean model through time_lean."""
    if variant == "ours":
        record = time_impl("dense", "off", cfg, state, ids, step_args(args, ids.shape[0]), device)
    else:
        record = time_lean(variant == "lean_bf16", cfg, state, ids, args, device)
    keep = ("ms_step", "tokens_per_s", "peak_mem_gib", "loss_first", "loss_last")
    return {"variant": variant, "precision": VARIANTS[variant], **{k: record[k] for k in keep}}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """ours / each variant: step ms and peak memory (> 1: ours is slower / holds more)."""
    ours = next((r for r in rows if r["variant"] == "ours"), None)
    for r in rows:
        r["ours_over_this_ms"] = ours["ms_step"] / r["ms_step"] if ours else None
        r["ours_over_this_peak"] = ours["peak_mem_gib"] / r["peak_mem_gib"] if ours else None


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    ratio = lambda v: "-" if v is None or v != v else f"{v:.3f}x"  # None: no ours row; NaN: CPU peak
    gib = lambda v: "-" if v != v else f"{v:.2f}"  # NaN: peak memory is measured on a GPU only
    regime = "" if meta["autocast"] else " On a CPU every variant but lean_bf16 runs in fp32 (no autocast)."
    lines = [
        f"# Our dense training step against a lean compiled Llama: {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['torch']}, {meta['shape']}, "
        f"{meta['micro_batch']} x {meta['seq_len']} tokens a step ({meta['tokens']}), AdamW, "
        f"compile={meta['compile']}, median of {meta['steps']} steps after {meta['warmup']} warm-up; "
        f"ours with its L1 term at {meta['l1']:g}. Target: ours / lean (same precision) <= 1.03x.{regime}",
        "",
        "| variant | ms/step | tokens/s | peak GiB | ours / this, ms | ours / this, peak | loss first | loss last |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['precision']} | {r['ms_step']:.1f} | {r['tokens_per_s']:,.0f} | {gib(r['peak_mem_gib'])} "
            f"| {ratio(r['ours_over_this_ms'])} | {ratio(r['ours_over_this_peak'])} "
            f"| {r['loss_first']:.5f} | {r['loss_last']:.5f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    device = common.bench_device().type
    cfg, state, _ = weights(args)
    # The shape of a step's batch; both steps read the trainer's stream (model_step.trainer_batches).
    ids = torch.empty(args.micro_batch, args.seq_len + 1, dtype=torch.long)
    tokens = "the trainer's data stream (its training split)"
    rows: list[dict[str, Any]] = []
    for variant in args.variants:
        rows.append(time_variant(variant, cfg, state, ids, args, device))
        print(f"{variant}: {rows[-1]['ms_step']:.1f} ms/step", file=sys.stderr, flush=True)
        common.free_memory()
    add_ratios(rows)
    meta = {
        **common.run_meta(device),
        "shape": f"{cfg.num_hidden_layers} layers, D {cfg.hidden_size}, H {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads} heads, vocabulary {cfg.vocab_size}",
        "preset": args.preset,
        "model": str(args.model) if args.model else None,
        "tokens": tokens,
        "autocast": device == "cuda",
        **{k: getattr(args, k) for k in ("micro_batch", "seq_len", "steps", "warmup", "compile", "l1")},
    }
    common.write_report(markdown(meta, rows), meta, rows, args.json, args.md)
    return rows


if __name__ == "__main__":
    main()
