"""Llama-style decoder with ReLU-gated feed-forward blocks.

Parameter names match transformers' `LlamaForCausalLM` (model.embed_tokens, model.layers.N.
self_attn.q_proj, ..., mlp.gate_proj, ..., model.norm, lm_head), so a state dict exports to a
Hugging Face checkpoint as it is. The FFN is the seam where sparse kernels plug in
(`ffn_impl`); every layer also reports the sparsity statistics the recipe needs.

Incremental decoding (sparse_llm.inference) passes a `KVCache`, per-row `position_ids` and a
padding `attention_mask` to `forward`; without them (training, evaluation) the forward is the
plain causal one, unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparse_llm.config import ModelConfig
from sparse_llm.kv_cache import KVCache
from sparse_llm.layer_stack import stack_layers
from sparse_llm.loss import linear_cross_entropy
from sparse_llm.norm import rms_norm
from sparse_llm.ops.activation_counts import activation_counts
from sparse_llm.precision import autocast_dtype
from sparse_llm.rope import RotaryEmbedding, apply_rotary


class FFNStats(NamedTuple):
    """Per-layer FFN statistics of one forward pass, stacked over layers.

    Counts, not means, so that micro-batches and ranks reduce by addition. The per-token counts
    are binned into a histogram by the sparsity monitor, outside any compiled graph; the counts
    themselves come from an op Inductor does not fuse (see ops/activation_counts.py).
    """

    l1: torch.Tensor  # [L] float32, differentiable: mean over tokens of sum over units of |h|
    nnz_per_token: torch.Tensor  # [L, M] int64: how many units were active for each token
    fire_counts: torch.Tensor  # [L, H] int64: on how many tokens each unit fired (gate > 0)


class CausalLMOutput(NamedTuple):
    logits: torch.Tensor | None  # [B, T, V]; None when a loss was asked for
    loss: torch.Tensor | None  # mean next-token cross-entropy over the labels that are not -100
    ffn_stats: FFNStats | None


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm. Under autocast the output is already in the autocast dtype, the
    dtype its consumers (projections, the FFN ops) would cast it to.

    With `recompute` on (train.recompute_norms), training recomputes the output in the backward
    from the input, which the backward keeps anyway, instead of every consumer saving it (the cast
    included): two [tokens, D] activations a layer less, for a few elementwise kernels."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.recompute = False  # SparseLlamaForCausalLM.set_recompute_norms (train.recompute_norms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and self.training and torch.is_grad_enabled():
            return checkpoint(self._normalise, x, use_reentrant=False)
        return self._normalise(x)

    def _normalise(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, autocast_dtype(x))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // cfg.num_attention_heads
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.attn_impl = cfg.attn_impl

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer_idx: int = 0,
        attn_mask: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention(x)), plus `residual` when given; without autograd `residual` is
        updated in place and returned (see `_project_out`)."""
        b, t, _ = x.shape
        # Token-major [B, T, heads, head_dim] as the projections leave them: RoPE and the KV-cache
        # write need no transpose; SDPA takes the head-major views.
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        is_causal = True
        if cache is not None:
            # Inference: attend over the cache's filled columns, this step's included (the cache
            # write applies RoPE to k). `attn_mask` (bool, [B, 1, T, S]) is given when rows are
            # padded or queries start after cached columns; None means plain causal attention
            # (a prefill into an empty cache).
            is_causal = cache.length == 0 and attn_mask is None
            k, v = cache.update(layer_idx, k, v, cos, sin)
        else:
            k = apply_rotary(k, cos, sin)
            if self.attn_impl == "flash":
                from flash_attn import flash_attn_func  # optional extra; checked in build_model

                return self._project_out(flash_attn_func(q, k, v, causal=True).reshape(b, t, -1), residual)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        q = q.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads
        ).transpose(1, 2)
        return self._project_out(out.reshape(b, t, -1), residual)

    def _project_out(self, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """o_proj(out) + residual. Without autograd and with everything in one dtype, the GEMM adds
        o_proj(out) into `residual` in place (ops.linear_add_: no separate pass over the residual
        stream) and returns it: the caller gives up that tensor."""
        if residual is None:
            return self.o_proj(out)
        weight = self.o_proj.weight
        if (
            torch.is_grad_enabled()
            or not residual.dtype == out.dtype == weight.dtype
            or not residual.is_contiguous()
        ):
            return residual + self.o_proj(out)
        from sparse_llm import ops

        return ops.linear_add_(residual, out, weight)


class ReluGatedMLP(nn.Module):
    """y = down(relu(gate(x)) * up(x)): transformers' LlamaMLP with hidden_act="relu"."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.ffn_impl = cfg.ffn_impl
        # Set by sparse_llm.training.ffn_fallback when this layer's measured density makes the
        # sparse training path slower than dense; only read when ffn_impl is not dense.
        self.train_dense_fallback = False

    def runs_sparse_inference(self, with_stats: bool) -> bool:
        """Whether a forward now takes the sparse inference ops (no gradients, no statistics)."""
        return self.ffn_impl != "dense" and not torch.is_grad_enabled() and not with_stats

    def runs_sparse_training(self) -> bool:
        """Whether a forward now takes the sparse training op (`add_sparse_train_forward`)."""
        return self.ffn_impl != "dense" and torch.is_grad_enabled() and not self.train_dense_fallback

    def forward(self, x: torch.Tensor, with_stats: bool) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The dense FFN, or the sparse inference ops; sparse training goes through
        `add_sparse_train_forward`, which takes the norm with it."""
        if self.runs_sparse_inference(with_stats):
            return self._sparse_forward(x), ()
        a = F.relu(self.gate_proj(x))
        hidden = a * self.up_proj(x)
        y = self.down_proj(hidden)
        if not with_stats:
            return y, ()
        return y, _ffn_stats(a.flatten(0, -2), hidden.flatten(0, -2))

    @property
    def _ops_impl(self) -> str:
        """The ops front's impl for this layer's ffn_impl: `cuda` asks for the kernels where they
        can run (`auto`), `reference` for the PyTorch reference."""
        return "auto" if self.ffn_impl == "cuda" else "reference"

    def _inference_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x, Wg, Wu, Wd) in the dtype the dense matmuls would compute in: custom ops sit
        outside autocast, so cast as autocast would."""
        dtype = autocast_dtype(x) or x.dtype
        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        return (x.to(dtype), *(w.to(dtype) for w in weights))

    def _sparse_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Inference through the sparse ops front: the CUDA kernels (`cuda`, falling back to the
        reference with a warning where they cannot run) or the PyTorch reference (`reference`)."""
        from sparse_llm import ops

        return ops.ffn_forward(*self._inference_operands(x), impl=self._ops_impl)

    def add_sparse_forward_(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x) for sparse inference, added in place into `residual` (the residual
        stream, given up by the caller) when it has the compute dtype: the CUDA path then touches
        only the rows with an active unit, and the separate y tensor and its add disappear."""
        from sparse_llm import ops

        operands = self._inference_operands(x)
        if residual.dtype != operands[0].dtype:  # e.g. an fp32 stream under bf16 autocast
            return residual + ops.ffn_forward(*operands, impl=self._ops_impl)
        return ops.ffn_add_(residual, *operands, impl=self._ops_impl)

    def add_sparse_train_forward(
        self, residual: torch.Tensor, norm: RMSNorm, with_stats: bool
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """residual + self(norm(residual)) for training, through `ops.ffn_block_train`: it saves
        the residual stream only on the tokens with an active unit plus a compact record of the
        active units (no dense M x H tensor, no norm output), and gives the layer's statistics
        from the same call. `cuda` runs the CUDA kernels where they can take the inputs (bf16 on
        Hopper) and the exact reference elsewhere."""
        from sparse_llm.ops.train_block import ffn_block_train

        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        out = ffn_block_train(residual, norm.weight, norm.eps, *weights, impl=self._ops_impl)
        if not with_stats:
            return out.y, ()
        return out.y, (out.l1.float(), out.nnz_per_token, out.fire_counts)


def _ffn_stats(a: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # Summed in fp32 straight from the compute dtype: a `hidden.float()` copy would be what the
    # compiled graph saves for abs's backward (an fp32 [tokens, H] tensor a layer).
    l1 = hidden.abs().sum(-1, dtype=torch.float32).mean()
    nnz_per_token, fire_counts = activation_counts(a.detach())
    return l1, nnz_per_token, fire_counts


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = ReluGatedMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        with_stats: bool,
        cache: KVCache | None = None,
        layer_idx: int = 0,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(x + attention + FFN, FFN statistics). Without autograd the layer adds both blocks into
        x in place (the residual stream; callers give that tensor up) and returns it."""
        x = self.self_attn(self.input_layernorm(x), cos, sin, cache, layer_idx, attn_mask, residual=x)
        if self.mlp.runs_sparse_inference(with_stats):
            return self.mlp.add_sparse_forward_(x, self.post_attention_layernorm(x)), ()
        if self.mlp.runs_sparse_training():
            return self.mlp.add_sparse_train_forward(x, self.post_attention_layernorm, with_stats)
        y, stats = self.mlp(self.post_attention_layernorm(x), with_stats)
        return x + y, stats


class LlamaBody(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            cfg.hidden_size // cfg.num_attention_heads, cfg.rope_theta, cfg.max_position_embeddings
        )


class SparseLlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be set (resolve it from the tokenizer first)")
        self.config = cfg
        self.model = LlamaBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.activation_checkpointing = False
        self.reset_parameters()

    def set_recompute_norms(self, recompute: bool) -> None:
        """Whether training recomputes the RMSNorm outputs in the backward (less memory) or saves them."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.recompute = recompute

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
        per_layer = []
        for layer in self.model.layers:
            if self.activation_checkpointing and self.training:
                x, stats = checkpoint(layer, x, cos, sin, with_stats, use_reentrant=False)
            else:
                x, stats = layer(x, cos, sin, with_stats)
            per_layer.append(stats)
        if last_logits_only:
            x = x[:, -1:]
        ffn_stats = None
        if with_stats:
            # One launch per statistic after the last layer, not a copy kernel per layer (see
            # layer_stack).
            ffn_stats = FFNStats(*(stack_layers(list(t)) for t in zip(*per_layer, strict=True)))
        if labels is None:
            return CausalLMOutput(self.lm_head(self.model.norm(x)), None, ffn_stats)
        # Fused with the projection: the [tokens, vocab] logits never exist whole.
        loss = linear_cross_entropy(self.model.norm(x), self.lm_head.weight, labels)
        return CausalLMOutput(None, loss, ffn_stats)

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
        for i, layer in enumerate(self.model.layers):
            x, _ = layer(x, cos, sin, False, cache, i, attn_mask)
        cache.length = total
        if last_logits_only:
            x = x[:, -1:]
        return CausalLMOutput(self.lm_head(self.model.norm(x)), None, None)

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


def build_model(cfg: ModelConfig) -> SparseLlamaForCausalLM:
    if cfg.attn_impl == "flash":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ValueError(
                "model.attn_impl=flash needs the flash-attn package (pip install '.[flash]'); "
                "use model.attn_impl=sdpa otherwise"
            ) from None
    return SparseLlamaForCausalLM(cfg)
