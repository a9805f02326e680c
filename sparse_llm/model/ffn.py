"""The ReLU-gated feed-forward block of a decoder layer and the plan that says which
implementation each phase runs.

y = down(act(gate(x)) * up(x)): transformers' LlamaMLP (`GatedMLP`: the weights, under their
transformers names, and the dense forward), with act = relu (the sparse recipe) or silu (SwiGLU,
the dense baseline; its FFN is always dense). A decoder layer calls its `FFNBlock` once: x +
MLP(norm(x)), where the block runs whichever implementation the phase has. The implementation is
fixed when the model is built (`FFNPlan`, resolved by `sparse_llm.ops.ffn.select`), one per phase:

  train    a forward with autograd: the dense FFN, or the sparse training block op
           (`ops.ffn_block_train`: norm + FFN + residual add, saving only the active rows)
  eval     a forward without autograd and without a KV cache (held-out loss)
  prefill  a forward over a KV cache with more than one new token per row
  decode   a forward over a KV cache with one new token per row

The one piece of state that changes while training is the per-layer dense fallback
(`FFNBlock.dense_fallback`, set by `sparse_llm.training.ffn_fallback` from the measured density
and saved in checkpoints): a layer too dense to gain from the sparse path trains dense. Both compute the
same function; the fallback changes speed, never the result. A layer that falls back recomputes
its dense FFN in the backward (unless the whole layer is recomputed already): the dense FFN keeps
three [tokens, H] tensors for its backward, so a run's dense early phase would otherwise set its
peak memory well above the sparse steady state's. The recompute runs in token chunks
(`RECOMPUTE_CHUNK_TOKENS`), so the backward holds one chunk's activations and their gradients at a
time rather than the whole layer's (five [tokens, H] tensors at the early phase's peak).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from sparse_llm.config import ModelConfig
from sparse_llm.model.derived_weights import DerivedWeight, transposed
from sparse_llm.model.norm import RMSNorm
from sparse_llm.ops.activation_counts import activation_counts
from sparse_llm.ops.ffn.block import ffn_block_train
from sparse_llm.ops.ffn.inference import ffn_add_, ffn_forward
from sparse_llm.ops.ffn.relu_gate import relu_gate_stats
from sparse_llm.ops.ffn.select import KERNEL_DTYPE, PHASES, FFNSelection, select_ffn
from sparse_llm.ops.ffn.training import TrainCapacities
from sparse_llm.ops.precision import autocast_dtype

# Tokens a falling-back layer's recompute handles at once: a quarter of a 1b step's 8 x 2048, where
# the dense GEMMs still run at full rate and one chunk's [tokens, H] tensors are 44 MB each.
RECOMPUTE_CHUNK_TOKENS = 4096


class FFNStats(NamedTuple):
    """FFN statistics of one forward pass: of one layer (l1 [], nnz_per_token [M], fire_counts [H]),
    or stacked over layers by the model ([L], [L, M], [L, H]).

    Counts, not means, so that micro-batches and ranks reduce by addition. The per-token counts
    are binned into a histogram by the sparsity monitor, outside any compiled graph; the counts
    themselves come from an op Inductor does not fuse (see ops/activation_counts.py).
    """

    l1: torch.Tensor  # float32, differentiable: mean over tokens of sum over units of |h|
    nnz_per_token: torch.Tensor  # int64: how many units were active for each token
    fire_counts: torch.Tensor  # int64: on how many tokens each unit fired (gate > 0)


@dataclass(frozen=True)
class FFNPlan:
    """The FFN implementation of every phase ("dense", "reference" or "cuda"), with why each is not
    the kernels where it is not."""

    train: FFNSelection
    eval: FFNSelection
    prefill: FFNSelection
    decode: FFNSelection
    # Whether training on the kernels takes the capacity path (ops.ffn_block_train's `capacities`:
    # no host read in the forward, so the host runs ahead of the GPU). Off where a run asks for
    # bitwise-reproducible steps: the capacity path's heavy-row GEMMs take a row count that follows
    # the run's recent steps, which a resumed run does not share.
    train_sync_free: bool = True

    @classmethod
    def dense(cls) -> FFNPlan:
        selection = FFNSelection("dense", "dense was asked for")
        return cls(selection, selection, selection, selection)

    @classmethod
    def resolve(
        cls,
        requested: str | Mapping[str, str],
        cfg: ModelConfig,
        device: torch.device | str,
        compute_dtype: torch.dtype,
        where: str = "model.ffn_impl",
    ) -> FFNPlan:
        """Ask `ops.ffn.select` for every phase: `requested` is one value for all phases or one per
        phase (missing phases: dense). Raises KernelsUnavailable for 'cuda' where the kernels
        cannot run."""
        per_phase = {phase: requested for phase in PHASES} if isinstance(requested, str) else dict(requested)
        unknown = set(per_phase) - set(PHASES)
        if unknown:
            raise ValueError(f"unknown FFN phases {sorted(unknown)}; phases are {', '.join(PHASES)}")
        selections = {
            phase: select_ffn(
                per_phase.get(phase, "dense"),
                phase,
                device=device,
                dtype=compute_dtype,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                where=where if isinstance(requested, str) else f"{phase}_ffn",
                activation=cfg.hidden_act,
            )
            for phase in PHASES
        }
        return cls(**selections)

    def impl(self, phase: str) -> str:
        return getattr(self, phase).impl

    def describe(self) -> str:
        """One line: each phase's implementation, and why not the kernels where they do not run
        (phases with the same choice and reason are named together)."""
        groups: dict[FFNSelection, list[str]] = {}
        for phase in PHASES:
            groups.setdefault(getattr(self, phase), []).append(phase)
        parts = []
        for selection, phases in groups.items():
            why = f" ({selection.reason})" if selection.impl != "cuda" and selection.reason else ""
            parts.append(f"{'+'.join(phases)}={selection.impl}{why}")
        return "; ".join(parts)


class GatedMLP(nn.Module):
    """y = down(act(gate(x)) * up(x)): transformers' LlamaMLP with hidden_act relu or silu. Its
    forward is the dense FFN; `FFNBlock` runs the sparse ops on its weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, h = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, h, bias=False)
        self.up_proj = nn.Linear(d, h, bias=False)
        self.down_proj = nn.Linear(h, d, bias=False)
        self.act = F.relu if cfg.hidden_act == "relu" else F.silu
        # A cache, not state: Wd^T for the sparse inference kernels (shared by with_ffn_plan;
        # H x D more memory, 23 MB a 1b layer).
        self.down_t_cache = DerivedWeight(transposed)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Wg, Wu, Wd) as the ops take them: the parameters, Hugging Face layout."""
        return self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight

    def forward(
        self, x: torch.Tensor, with_stats: bool, recompute: bool = False
    ) -> tuple[torch.Tensor, FFNStats | None]:
        """The dense FFN of x, with its statistics if asked for. With `recompute` (and autograd)
        it keeps x only: the gate, up and hidden activations are made again in the backward, one
        chunk of RECOMPUTE_CHUNK_TOKENS tokens at a time."""
        if recompute and torch.is_grad_enabled():
            return self._dense_recomputed(x, with_stats, RECOMPUTE_CHUNK_TOKENS)
        return self._dense(x, with_stats)

    def _dense(self, x: torch.Tensor, with_stats: bool) -> tuple[torch.Tensor, FFNStats | None]:
        y, *row_stats = self._dense_and_row_stats(x, with_stats)
        return y, _reduce_row_stats(*row_stats)

    def _dense_recomputed(
        self, x: torch.Tensor, with_stats: bool, chunk_tokens: int
    ) -> tuple[torch.Tensor, FFNStats | None]:
        """_dense(x) recomputed in the backward `chunk_tokens` tokens at a time: the same values
        (the statistics are reduced over all rows as _dense reduces them), but the backward remakes
        and frees one chunk's [tokens, H] tensors before the next."""
        ys, l1_rows, nnz_per_token, fire_counts = recompute_in_chunks(
            self._dense_own_casts, x.flatten(0, -2), with_stats, chunk_tokens=chunk_tokens
        )
        y = _concat(ys)
        y = y.view(*x.shape[:-1], y.shape[-1])
        if not with_stats:
            return y, None
        return y, _reduce_row_stats(
            _concat(l1_rows), _concat(nnz_per_token), sum(fire_counts[1:], fire_counts[0])
        )

    def _dense_own_casts(
        self, rows: torch.Tensor, with_stats: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """_dense_and_row_stats with autocast's cast cache off, for one chunk of several: each chunk
        then casts the weights itself and its weight gradients reach the fp32 weights through their
        own cast, summed in fp32; with the cache the chunks share one cast and autograd sums their
        gradients in the cast's dtype first (a bf16 rounding a chunk). Parameters that are bf16
        themselves (FSDP2's gathered ones) have no cast: there the chunks' gradients do add in bf16."""
        dtype = autocast_dtype(rows)
        if dtype is None:
            return self._dense_and_row_stats(rows, with_stats)
        with torch.autocast(rows.device.type, dtype=dtype, cache_enabled=False):
            return self._dense_and_row_stats(rows, with_stats)

    def _dense_and_row_stats(
        self, x: torch.Tensor, with_stats: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """The dense FFN of x [..., D] and, where asked for, its statistics by row (x's leading dims
        flattened): (y, each row's L1, its active units, each unit's fire count over the rows),
        else Nones."""
        if with_stats and self.act is F.relu:  # the product and its statistics in one pass
            g, u = self.gate_proj(x), self.up_proj(x)
            hidden, l1_rows, nnz_per_token, fire_counts = relu_gate_stats(g.flatten(0, -2), u.flatten(0, -2))
            return self.down_proj(hidden.view(g.shape)), l1_rows, nnz_per_token, fire_counts
        a = self.act(self.gate_proj(x))
        hidden = a * self.up_proj(x)
        y = self.down_proj(hidden)
        if not with_stats:
            return y, None, None, None
        # Summed in fp32 straight from the compute dtype: a `hidden.float()` copy would be what the
        # compiled graph saves for abs's backward (an fp32 [tokens, H] tensor a layer).
        nnz_per_token, fire_counts = activation_counts(a.detach().flatten(0, -2))
        return y, hidden.flatten(0, -2).abs().sum(-1, dtype=torch.float32), nnz_per_token, fire_counts

    @torch.no_grad()
    def run(self, x: torch.Tensor, impl: str) -> torch.Tensor:
        """The FFN of x with `impl` given explicitly, without autograd: what calibration times."""
        if impl == "dense":
            return self._dense(x, False)[0]
        operands = self._inference_operands(x)
        return ffn_forward(*operands, impl, wd_t=self._down_transposed(operands[0].dtype, impl))

    def add_sparse_forward_(self, residual: torch.Tensor, x: torch.Tensor, impl: str) -> torch.Tensor:
        """residual + self(x) for sparse inference, added in place into `residual` (the residual
        stream, given up by the caller) when it has the compute dtype: the CUDA path then touches
        only the rows with an active unit, and the separate y tensor and its add disappear."""
        operands = self._inference_operands(x)
        wd_t = self._down_transposed(operands[0].dtype, impl)
        if residual.dtype != operands[0].dtype:  # e.g. an fp32 stream under bf16 autocast
            return residual + ffn_forward(*operands, impl, wd_t=wd_t)
        return ffn_add_(residual, *operands, impl, wd_t=wd_t)

    def _inference_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x, Wg, Wu, Wd) in the dtype the dense matmuls would compute in: custom ops sit
        outside autocast, so cast as autocast would."""
        dtype = autocast_dtype(x) or x.dtype
        return (x.to(dtype), *(w.to(dtype) for w in self.weights()))

    @torch.no_grad()
    def prepare_inference(self) -> None:
        """Make Wd^T for the sparse inference kernels now (in bfloat16, the kernels' one dtype),
        before a graph is traced or captured: a trace that finds the cache empty transposes Wd
        inside the graph, and every replay then pays that pass (~14 us a 1b layer on an H100, a
        sixth of a captured decode step at batch 1)."""
        self.down_t_cache.get([self.down_proj.weight], KERNEL_DTYPE)

    def _down_transposed(self, dtype: torch.dtype, impl: str) -> torch.Tensor | None:
        """Wd^T for the sparse inference kernels (model/derived_weights.py); None for the reference
        or with autograd (the op then transposes itself). Traced by torch.compile, the copy made
        before (`prepare_inference`, or an eager call), else None: the op transposes in the graph."""
        if impl != "cuda" or torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling():
            return self.down_t_cache.traced(dtype, self.down_proj.weight.device)
        return self.down_t_cache.get([self.down_proj.weight], dtype)


class FFNBlock:
    """The FFN half of a decoder layer, x + MLP(norm(x)), in whichever implementation its phase has:
    the one place a layer's FFN path is chosen. Its modes are fixed when it is built (the plan,
    whether a fallen-back layer recomputes); the one run-time switch is `dense_fallback`.

    Not a module: the norm and the MLP are the layer's submodules, under their transformers names
    (post_attention_layernorm, mlp); the block holds them and the choice. Compiled layer by layer
    (model/compiling.py), a layer's graphs guard on the plan's choice for the phase, on
    `dense_fallback` and on `with_stats`: a flip of the flag selects another compiled variant.
    """

    def __init__(self, norm: RMSNorm, mlp: GatedMLP, plan: FFNPlan, recompute_fallback: bool) -> None:
        self.norm = norm
        self.mlp = mlp
        self.plan = plan
        # Training state, not a mode: set from the measured density (training/ffn_fallback.py),
        # saved in checkpoints.
        self.dense_fallback = False
        # Training state, not a mode: the units this layer's sparse training op computes as a dense
        # FFN over their columns (ops/ffn/hot_units.py; ascending int64 indices on the weights'
        # device, or None), set from the fire counts (training/hot_units.py), saved in checkpoints.
        self.hot_units: torch.Tensor | None = None
        # Fixed at build: whether a layer falling back recomputes its dense FFN in the backward.
        self.recompute_fallback = recompute_fallback
        # The layer's record capacities on the capacity path (host state the sparse training op
        # reads and sets; see ops.ffn.training.TrainCapacities), None off it.
        self.train_capacities = (
            TrainCapacities.new() if plan.train_sync_free and plan.impl("train") == "cuda" else None
        )

    def impl(self, phase: str) -> str:
        """What this layer runs in `phase` now: the plan's choice, or dense while it falls back."""
        if phase == "train" and self.dense_fallback:
            return "dense"
        return self.plan.impl(phase)

    def __call__(self, x: torch.Tensor, phase: str, with_stats: bool) -> tuple[torch.Tensor, FFNStats | None]:
        """(x + FFN(norm(x)), the FFN's statistics if asked for). Without autograd the sparse path
        adds into x in place (the residual stream; callers give that tensor up) and returns it."""
        impl = self.impl(phase)
        if impl != "dense" and phase == "train":
            return self._sparse_train(x, impl, with_stats)
        if impl != "dense" and not with_stats:  # statistics need the dense activations
            return self.mlp.add_sparse_forward_(x, self.norm(x), impl), None
        recompute = phase == "train" and self.dense_fallback and self.recompute_fallback
        y, stats = self.mlp(self.norm(x), with_stats, recompute)
        return x + y, stats

    def _sparse_train(
        self, x: torch.Tensor, impl: str, with_stats: bool
    ) -> tuple[torch.Tensor, FFNStats | None]:
        """x + FFN(norm(x)) for training, through `ops.ffn_block_train`: it saves the normalised
        rows of the tokens with an active unit (bf16 under autocast) plus a compact record of the
        active units (no dense M x H tensor, no norm output), and gives the layer's statistics from
        the same call."""
        out = ffn_block_train(
            x,
            self.norm.weight,
            self.norm.eps,
            *self.mlp.weights(),
            impl,
            capacities=self.train_capacities,
            hot_units=self.hot_units,
        )
        if not with_stats:
            return out.y, None
        return out.y, FFNStats(out.l1.float(), out.nnz_per_token, out.fire_counts)

    def prepare_inference(self) -> None:
        """Make what the sparse inference kernels read besides the parameters (Wd^T), if a prefill
        or decode phase runs them, before a graph is traced or captured."""
        if "cuda" in (self.plan.impl("prefill"), self.plan.impl("decode")):
            self.mlp.prepare_inference()


def recompute_in_chunks(
    fn: Callable[..., tuple[torch.Tensor | None, ...]],
    rows: torch.Tensor,
    *args: Any,
    chunk_tokens: int = RECOMPUTE_CHUNK_TOKENS,
) -> tuple[tuple[torch.Tensor | None, ...], ...]:
    """fn(chunk, *args) over `rows` in chunks of `chunk_tokens` along dim 0, each call checkpointed
    on its own (autograd keeps only the chunk; the backward runs fn again on one chunk at a time):
    fn's outputs grouped by position, each a tuple over the chunks."""
    outputs = [checkpoint(fn, chunk, *args, use_reentrant=False) for chunk in rows.split(chunk_tokens)]
    return tuple(zip(*outputs, strict=True))


def _concat(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The parts one after another along dim 0; a single part as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _reduce_row_stats(
    l1_rows: torch.Tensor | None, nnz_per_token: torch.Tensor | None, fire_counts: torch.Tensor | None
) -> FFNStats | None:
    """A layer's FFNStats from per-row statistics (None without them): L1 is the mean over rows."""
    if l1_rows is None or nnz_per_token is None or fire_counts is None:
        return None
    return FFNStats(l1_rows.mean(), nnz_per_token, fire_counts)
