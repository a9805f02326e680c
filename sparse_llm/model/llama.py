"""Llama-style decoder with ReLU-gated feed-forward blocks.

Parameter names match transformers' `LlamaForCausalLM` (model.embed_tokens, model.layers.N.
self_attn.q_proj, ..., mlp.gate_proj, ..., model.norm, lm_head), so a state dict exports to a
Hugging Face checkpoint as it is. The FFN is the seam where sparse kernels plug in (`FFNPlan`,
fixed at build: `build_model`); every layer also reports the sparsity statistics the recipe needs.

A prefill (sparse_llm.inference) passes a `KVCache`, per-row `position_ids` and a padding
`attention_mask` to `forward`; without them (training, evaluation) the forward is the plain causal
one, unchanged. Decode steps run `decode_step`, the static-shape one-token forward (device tensors
in, logits out, no host sync) that sparse_llm.inference.decode captures in CUDA graphs and the
eager decode runs uncaptured.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparse_llm.config import ModelConfig
from sparse_llm.metric_keys import layer_metric
from sparse_llm.model.attention import Attention
from sparse_llm.model.ffn import FFNBlock, FFNPlan, FFNStats, GatedMLP
from sparse_llm.model.kv_cache import ColumnWriteCache, KVCache
from sparse_llm.model.loss import linear_cross_entropy
from sparse_llm.model.norm import RMSNorm
from sparse_llm.model.rope import RotaryEmbedding
from sparse_llm.ops.ffn.training import TrainCapacities
from sparse_llm.ops.stack_layers import stack_layers


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T, V]; None when a loss was asked for
    loss: torch.Tensor | None  # mean next-token cross-entropy over the labels that are not -100
    ffn_stats: FFNStats | None


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, plan: FFNPlan, recompute_norms: bool, recompute_ffn_fallback: bool = True
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, recompute_norms)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, recompute_norms)
        self.mlp = GatedMLP(cfg)
        # The FFN half of the layer over the two submodules above (a plain object, not a module:
        # the parameters keep their transformers names).
        self.ffn = FFNBlock(self.post_attention_layernorm, self.mlp, plan, recompute_ffn_fallback)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        phase: str,
        with_stats: bool,
        cache: KVCache | ColumnWriteCache | None = None,
        layer_idx: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, FFNStats | None]:
        """(x + attention + FFN, FFN statistics if asked for). Without autograd the layer adds both
        blocks into x in place (the residual stream; callers give that tensor up) and returns it."""
        x = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer_idx, attn_mask, residual=x)
        return self.ffn(x, phase, with_stats)


class LlamaBody(nn.Module):
    def __init__(
        self, cfg: ModelConfig, plan: FFNPlan, recompute_norms: bool, recompute_ffn_fallback: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, plan, recompute_norms, recompute_ffn_fallback)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, recompute_norms)
        self.rotary_emb = RotaryEmbedding(
            cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta, cfg.max_position_embeddings
        )


class SparseLlamaForCausalLM(nn.Module):
    """The model. Its modes are fixed here: the FFN implementation of each phase (`ffn_plan`),
    activation checkpointing of every layer in training, and RMSNorm recomputation."""

    def __init__(
        self,
        cfg: ModelConfig,
        ffn_plan: FFNPlan | None = None,
        *,
        activation_checkpointing: bool = False,
        recompute_norms: bool = False,
    ) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (resolve it from the tokenizer first)")
        self.config = cfg
        self.ffn_plan = ffn_plan or FFNPlan.dense()
        self.activation_checkpointing = activation_checkpointing
        self.recompute_norms = recompute_norms
        # A layer whose training FFN falls back to dense recomputes it in the backward, unless the
        # whole layer is recomputed already (model/ffn.py).
        self.model = LlamaBody(cfg, self.ffn_plan, recompute_norms, not activation_checkpointing)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.reset_parameters()

    def prepare_inference(self) -> None:
        """Make what inference reads besides the parameters (each layer's [Wq; Wk; Wv], and Wd^T
        where the sparse kernels run) before a prefill or decode graph is traced or captured
        (model/derived_weights.py)."""
        for layer in self.model.layers:
            layer.self_attn.prepare_inference()
            layer.ffn.prepare_inference()

    def with_ffn_plan(self, plan: FFNPlan) -> SparseLlamaForCausalLM:
        """A model with `plan` that shares this one's parameters and buffers (no copy): how a
        Generator fixes the plan it measured after loading."""
        with torch.device("meta"):
            other = SparseLlamaForCausalLM(
                self.config,
                plan,
                activation_checkpointing=self.activation_checkpointing,
                recompute_norms=self.recompute_norms,
            )
        other.load_state_dict(self.state_dict(keep_vars=True), assign=True)
        other.model.rotary_emb = self.model.rotary_emb  # its tables are buffers outside the state dict
        if self.config.tie_word_embeddings:
            other.lm_head.weight = other.model.embed_tokens.weight
        other.set_ffn_dense_fallback(self.ffn_dense_fallback())
        other.set_ffn_hot_units(self.ffn_hot_units())
        for mine, theirs in zip(self.model.layers, other.model.layers, strict=True):
            # One copy of each derived weight for models that share their weights.
            theirs.mlp.down_t_cache = mine.mlp.down_t_cache
            theirs.self_attn.qkv_cache = mine.self_attn.qkv_cache
        return other.train(self.training)

    def ffn_dense_fallback(self) -> list[bool]:
        """Per layer: whether its training FFN falls back to dense now (training state, saved in
        checkpoints; see model/ffn.py)."""
        return [bool(layer.ffn.dense_fallback) for layer in self.model.layers]

    def ffn_capacity_overflows(self) -> dict[str, float]:
        """This process's steps so far in which a layer's sparse training op overflowed a record
        capacity: `ffn/capacity_overflows` (summed over layers), then by size and by layer; empty
        where no layer takes the capacity path."""
        states = {i: layer.ffn.train_capacities for i, layer in enumerate(self.model.layers)}
        states = {i: s for i, s in states.items() if s is not None}
        if not states:
            return {}
        out = {"ffn/capacity_overflows": float(sum(TrainCapacities.overflows(s) for s in states.values()))}
        by_size = collections.Counter()
        for s in states.values():
            by_size.update(TrainCapacities.overflows_by_size(s))
        out.update(
            {f"ffn/capacity_overflows/{name}": float(by_size[name]) for name in TrainCapacities.SIZE_NAMES}
        )
        num_layers = len(self.model.layers)
        for i, s in states.items():
            out[layer_metric("ffn/capacity_overflows", i, num_layers)] = float(TrainCapacities.overflows(s))
        return out

    def set_ffn_dense_fallback(self, flags: Sequence[bool]) -> None:
        if len(flags) != len(self.model.layers):
            raise ValueError(
                f"got dense-fallback flags for {len(flags)} layers, the model has {len(self.model.layers)}"
            )
        for layer, flag in zip(self.model.layers, flags, strict=True):
            layer.ffn.dense_fallback = bool(flag)

    def ffn_hot_units(self) -> list[torch.Tensor | None]:
        """Per layer: the units its sparse training op computes as a dense block (training state,
        saved in checkpoints; see model/ffn.py), or None."""
        return [layer.ffn.hot_units for layer in self.model.layers]

    def set_ffn_hot_units(self, units: Sequence[torch.Tensor | Sequence[int] | None]) -> None:
        """Set every layer's hot units: index tensors or lists (moved to the layer's weights'
        device); None or empty: every unit through the sparse op."""
        if len(units) != len(self.model.layers):
            raise ValueError(f"got hot units for {len(units)} layers, the model has {len(self.model.layers)}")
        for layer, hot in zip(self.model.layers, units, strict=True):
            if hot is not None and len(hot) > 0:
                hot = torch.as_tensor(hot, dtype=torch.int64, device=layer.mlp.gate_proj.weight.device)
                # Its length follows the run: one compiled graph for every length, not one each.
                torch._dynamo.maybe_mark_dynamic(hot, 0)
            layer.ffn.hot_units = hot if hot is not None and len(hot) > 0 else None

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        with_stats: bool = False,
        *,
        cache: KVCache | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        last_logits_only: bool = False,
    ) -> CausalLMOutput:
        """Training and evaluation pass `input_ids` (and `labels`) only.

        Incremental decoding passes `cache` (filled in place, its length advanced by T),
        `position_ids` ([B, T] RoPE positions; default: cache.length + 0..T-1 for every row) and
        `attention_mask` ([B, cache.length + T], 1 for real tokens, 0 for padding; default: all
        real). `last_logits_only` computes the logits of the last column only ([B, 1, V]).
        """
        if cache is None:
            if position_ids is not None or attention_mask is not None:
                raise ValueError("position_ids and attention_mask are only taken together with a KVCache")
            return self._forward(input_ids, labels, with_stats, last_logits_only)
        return self._forward_cached(input_ids, cache, position_ids, attention_mask, last_logits_only)

    def _forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None, with_stats: bool, last_logits_only: bool
    ) -> CausalLMOutput:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(input_ids.shape[1], x.dtype)
        phase = "train" if torch.is_grad_enabled() else "eval"
        per_layer = []
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training:
                x, stats = checkpoint(layer, x, cos, sin, phase, with_stats, use_reentrant=False)
            else:
                x, stats = layer(x, cos, sin, phase, with_stats)
            per_layer.append(stats)
        if last_logits_only:
            x = x[:, -1:]
        ffn_stats = None
        if with_stats:
            # One launch per statistic after the last layer, not a copy kernel per layer (see
            # layer_stack).
            ffn_stats = FFNStats(*(stack_layers(list(t)) for t in zip(*per_layer, strict=True)))
        logits, loss = self.output(x, labels)
        return CausalLMOutput(logits, loss, ffn_stats)

    def output(
        self, x: torch.Tensor, labels: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(logits, None) of the last layer's output x, or (None, loss) with labels: the head,
        a region of its own under compile_model."""
        if labels is None:
            return self.lm_head(self.model.norm(x)), None
        # Fused with the projection: the [tokens, vocab] logits never exist whole.
        return None, linear_cross_entropy(self.model.norm(x), self.lm_head.weight, labels)

    @torch.no_grad()
    def _forward_cached(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        last_logits_only: bool,
    ) -> CausalLMOutput:
        b, t = input_ids.shape
        past, total = cache.length, cache.length + t
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(past, total, device=device).expand(b, t)
        if attention_mask is not None and tuple(attention_mask.shape) != (b, total):
            raise ValueError(
                f"attention_mask must be [B, cache.length + T] = {(b, total)}, got {tuple(attention_mask.shape)}"
            )
        attn_mask = None
        if attention_mask is not None or (past > 0 and t > 1):
            # Query i (cache column past + i) sees key columns <= past + i that are real tokens,
            # and always itself, so that a padding query never has an empty (NaN) softmax row.
            cols = torch.arange(total, device=device)
            query_cols = cols[past:, None]
            attn_mask = cols[None, :] <= query_cols  # [T, S]
            if attention_mask is not None:
                real = attention_mask.to(torch.bool)[:, None, None, :]  # [B, 1, 1, S]
                attn_mask = (attn_mask & real) | (cols[None, :] == query_cols)
            else:
                attn_mask = attn_mask[None, None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(t, x.dtype, position_ids)
        phase = "decode" if t == 1 else "prefill"
        for i, layer in enumerate(self.model.layers):
            x, _ = layer(x, cos, sin, phase, False, cache, i, attn_mask)
        cache.length = total
        if last_logits_only:
            x = x[:, -1:]
        return CausalLMOutput(self.lm_head(self.model.norm(x)), None, None)

    @torch.no_grad()
    def decode_step(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,
        columns: torch.Tensor,
        first_columns: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [B, V] of one new token per row, with shapes that never change and no host sync:
        the decode forward a CUDA graph captures once and replays (sparse_llm.inference.decode).

        All [B] int64 device tensors: `tokens` (the row's new token), `positions` (its RoPE
        position), `columns` (the cache column it is written to) and `first_columns` (the row's
        first real column; left padding lies before it). The row attends to its columns
        first_columns..columns. Unlike `forward(cache=...)`, attention takes those columns from
        their device-side bounds (`ColumnWriteCache.attend`), and `cache.length` is
        neither read nor advanced: the caller advances `positions` and `columns`. The FFN is the
        plan's decode phase, as in `forward`.
        """
        x = self.model.embed_tokens(tokens[:, None])
        cos, sin = self.model.rotary_emb(1, x.dtype, positions[:, None])
        view = ColumnWriteCache(cache, columns, first_columns)
        for i, layer in enumerate(self.model.layers):
            x, _ = layer(x, cos, sin, "decode", False, view, i, None)
        return self.lm_head(self.model.norm(x))[:, 0]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.model.embed_tokens.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 N + attention, as in the PaLM paper."""
        cfg = self.config
        # Parameters that do matmuls: all but the embedding lookup, with the head counted once
        # whether or not it is tied to the embedding.
        n = self.num_parameters(exclude_embeddings=True)
        if cfg.tie_word_embeddings:
            n += self.lm_head.weight.numel()
        attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len
        return 6 * n + attention


def build_model(
    cfg: ModelConfig,
    *,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype = torch.float32,
    ffn: str | dict[str, str] | None = None,
    activation_checkpointing: bool = False,
    recompute_norms: bool = False,
    ffn_sync_free: bool = True,
) -> SparseLlamaForCausalLM:
    """The model with its modes fixed: the FFN plan is resolved by `ops.ffn.select` from `ffn` (one
    value for every phase or one per phase; default `cfg.ffn_impl`) for the device and compute
    dtype the model will run in; `ffn_sync_free`: training on the kernels takes the capacity path
    (FFNPlan.train_sync_free). The parameters are created on the current default device (CPU
    unless a `torch.device` context says otherwise); moving them is the caller's business."""
    if cfg.attn_impl == "flash":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ValueError(
                "model.attn_impl=flash needs the flash-attn package (pip install '.[flash]'); "
                "use model.attn_impl=sdpa otherwise"
            ) from None
    plan = FFNPlan.resolve(cfg.ffn_impl if ffn is None else ffn, cfg, device, compute_dtype)
    plan = dataclasses.replace(plan, train_sync_free=ffn_sync_free)
    return SparseLlamaForCausalLM(
        cfg, plan, activation_checkpointing=activation_checkpointing, recompute_norms=recompute_norms
    )
