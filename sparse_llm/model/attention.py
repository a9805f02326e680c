"""Causal self-attention with RoPE, over a KV cache when decoding.

At a decode step (one new token a row over a KV cache, no autograd) q, k and v come from one GEMM
over [Wq; Wk; Wv] (`qkv_cache`, a copy of the three weights: 25 MB a 1b layer): three GEMVs of 8 MB
each spend most of their time ramping up (21 us a 1b layer on an H100, against ~9 us for the bytes
of one). A prefill keeps three GEMMs (one was no faster there: cuBLAS picks a 192x192 tile for
N = 6144, H200 at d5138f9; 1b prefill 1.30x dense with it against 1.35x with three, H100 at bc46d57
and c76b869), and so does training, whose parameters a Llama checkpoint names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparse_llm.config import ModelConfig
from sparse_llm.model.derived_weights import DerivedWeight, stacked_rows
from sparse_llm.model.kv_cache import ColumnWriteCache, KVCache
from sparse_llm.model.rope import apply_rotary
from sparse_llm.ops.linear_add import linear_add_
from sparse_llm.ops.precision import autocast_dtype


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
        # A cache, not state: [Wq; Wk; Wv] for the inference projection (shared by with_ffn_plan).
        self.qkv_cache = DerivedWeight(stacked_rows)

    def _projection_weights(self) -> list[torch.Tensor]:
        return [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]

    @torch.no_grad()
    def prepare_inference(self) -> None:
        """Make [Wq; Wk; Wv] in the weights' dtype before a prefill or decode graph is traced or
        captured (a trace uses only a copy made before it)."""
        self.qkv_cache.get(self._projection_weights(), self.q_proj.weight.dtype)

    def _project_qkv(self, x: torch.Tensor, stacked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v: [B, T, features] each; `stacked`: views of one GEMM's output over [Wq; Wk; Wv],
        which the KV-cache write reads at their token stride."""
        weights = self._projection_weights()
        weight = None
        if stacked:
            dtype = autocast_dtype(x) or x.dtype
            compiling = torch.compiler.is_compiling()
            weight = (
                self.qkv_cache.traced(dtype, x.device) if compiling else self.qkv_cache.get(weights, dtype)
            )
        if weight is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = F.linear(x, weight).split([w.shape[0] for w in weights], dim=-1)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | ColumnWriteCache | None = None,
        layer_idx: int = 0,
        attn_mask: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention(x)), plus `residual` when given; without autograd `residual` is
        updated in place and returned (see `_project_out`)."""
        b, t, _ = x.shape
        # Token-major [B, T, heads, head_dim] as the projections leave them: RoPE and the KV-cache
        # write need no transpose; SDPA takes the head-major views.
        q, k, v = self._project_qkv(x, stacked=t == 1 and cache is not None and not torch.is_grad_enabled())
        q = q.view(b, t, self.num_heads, self.head_dim)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        is_causal = True
        if cache is not None:
            # Inference: attend over the cache's filled columns, this step's included (the cache
            # write applies RoPE to k). `attn_mask` (bool, [B, 1, T, S]) is given when rows are
            # padded or queries start after cached columns; None means plain causal attention
            # (a prefill into an empty cache). A static decode step (ColumnWriteCache) attends
            # as it was made to (ColumnWriteCache.attend).
            is_causal = cache.length == 0 and attn_mask is None
            k, v = cache.update(layer_idx, k, v, cos, sin)
            if isinstance(cache, ColumnWriteCache):  # a static decode step: its own attention
                return self._project_out(cache.attend(q, k, v).reshape(b, t, -1), residual)
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
        return linear_add_(residual, out, weight)
