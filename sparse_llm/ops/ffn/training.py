"""The training FFN front: `ffn_forward_train`, differentiable, with the sparsity statistics.

    out = ffn_forward_train(x, Wg, Wu, Wd, impl)  # impl: "reference" or "cuda", as decided
    out.y              [..., D]  like x; differentiable in x, Wg, Wu, Wd
    out.l0             []        mean number of active units (relu(g) > 0) per token (float32,
                                 float64 for float64 inputs)
    out.l1             []        mean over tokens of sum over units of |h| (float32, float64 for
                                 float64 inputs); differentiable
    out.nnz_per_token  [M] int64 active units per token (M = x.numel() // D, row-major)
    out.fire_counts    [H] int64 tokens on which each unit fired

so a model takes its FFNStats (l1, nnz_per_token, fire_counts) straight from one call, with no
second pass over the activations. The L1 weight lambda enters through autograd: the loss
`ce + lambda * mean_layers(l1)` hands each layer grad_l1 = lambda / L, and the backward op
consumes grad_y and grad_l1 together (dh = grad_y Wd + grad_l1 * sign(h) / M), so the L1
gradient costs no separate pass. Autograd saves x, the weights and a compact record of the
active entries (sparse_llm.ops.ffn.reference), never a dense M x H tensor.

Under autocast the op runs in the autocast dtype (inputs cast as autocast casts a matmul's);
gradients reach fp32 master weights through those casts.

Underneath, the training FFN as torch.library custom ops: forward, backward, fakes and autograd.

Two pairs with the same outputs (y, l1, nnz_per_token, fire_counts, active_rows: the rows with an
active unit, kept_rows, then the compact record of the active entries for the backward).
kept_rows are the active rows of the optional input `keep` ([M, *], [0, D] without it): a caller
that runs the op inside its own autograd function (ops.ffn.block) gets the rows it saves from
the op, where torch.compile saves them rather than the whole tensor they come from.

- `sparse_llm::ffn_train_fwd_ref` / `ffn_train_bwd_ref`: the PyTorch reference
  (sparse_llm.ops.ffn.reference), any device and float dtype.
- `sparse_llm::ffn_train_fwd_cuda` / `ffn_train_bwd_cuda`: the CUDA kernels (kernels/csr.cuh,
  kernels/train_bindings.cpp), bf16 on Hopper. The record (int32 columns) holds the light rows'
  entries only; then come the indices of the heavy rows (those on the dense GEMM path) and their
  own record, so the backward reads nothing on the host, then the dense units (int32): the units
  with at least `dense_unit_min_fires(M)` light entries, whose weight-gradient rows the backward
  takes by GEMMs over all rows instead of the per-unit kernels (kernels/csr_dense_units.cu).

The records' lengths are data-dependent (the numbers of active entries and of heavy rows),
declared to the compiler as unbacked sizes, so torch.compile(fullgraph=True) traces either pair
without a graph break.
Autograd saves x, the three weights and the compact record; never a dense M x H tensor. The
backward ops also take the weights wider than x (the fp32 master weights under autocast) and cast
them inside, where torch.compile cannot see the cast: a caller that saves the master weights
(ops.ffn.block) then keeps no bf16 copy of them from the forward to the backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from sparse_llm.ops._extension import extension
from sparse_llm.ops.ffn.checks import DEFAULT_HEAVY_THRESHOLD, check_ffn_inputs, check_heavy_threshold
from sparse_llm.ops.ffn.reference import (
    acc_dtype,
    col_dtype,
    ffn_train_backward_reference,
    ffn_train_forward_reference,
)
from sparse_llm.ops.ffn.select import check_impl, kernel_inputs
from sparse_llm.ops.precision import autocast_dtype

_T = torch.Tensor
# The forward ops' outputs, flat as torch.library returns them (named: TrainForward):
# (y, l1, nnz_per_token, fire_counts, active_rows, kept_rows, cols, a_vals, u_vals); the CUDA pair
# adds heavy_rows, the heavy rows' record (heavy_cols, heavy_a, heavy_u) and dense_units, and its
# capacity path host_sizes last.
RefForwardOutput = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T]
# The capacity path's host sizes: light entries, heavy rows, heavy entries, active rows, dense
# units, ready flag.
HOST_SIZE_FIELDS = 6
CudaForwardOutput = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]
CudaCapacityForwardOutput = tuple[_T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _T]
TrainBackwardOutput = tuple[_T, _T, _T, _T]
# A unit with light entries on at least this share of a step's rows is a dense unit of the CUDA
# backward: its rows of dWg, dWu and dWd by GEMMs over all M rows cost what ~1-2% of the rows' entries
# cost the per-unit kernels (an x and a grad_y row, 8 KB, read per entry). Swept on a 1b run's layers
# (benchmarks/dense_units.py, H200): 1/64 the fastest of 1/64-1/8 in every layer (docs/kernels.md).
DENSE_UNIT_ROW_SHARE = 1 / 64


def dense_unit_min_fires(rows: int, share: float = DENSE_UNIT_ROW_SHARE) -> int:
    """The light entries from which a unit is a dense unit of the CUDA backward, for a step of `rows`
    rows: those on `share` of them, rounded up, at least one."""
    return max(1, math.ceil(rows * share))


class TrainRecord(NamedTuple):
    """What the training forward keeps for its backward besides x and the weights: the active
    entries of a = relu(x Wg^T) in compact form (sparse_llm.ops.ffn.reference), never a dense
    M x H tensor. The CUDA pair's record also holds the heavy rows (those on the dense GEMM path)
    and their own entries; the reference's has None there."""

    nnz_per_token: torch.Tensor  # [M] int64: active units per row (the rows' lengths)
    cols: torch.Tensor  # [nnz]: column of each active entry (the light rows' on the CUDA path)
    a_vals: torch.Tensor  # [nnz]: relu(g) at that entry
    u_vals: torch.Tensor  # [nnz]: x Wu^T at that entry
    heavy_rows: torch.Tensor | None = None  # [n_heavy] int64, then the heavy rows' own entries
    heavy_cols: torch.Tensor | None = None
    heavy_a: torch.Tensor | None = None
    heavy_u: torch.Tensor | None = None
    # [n_dense] int32: the units whose weight-gradient rows the backward takes by GEMMs (the
    # capacity path's: [H], its first n_dense the units, n_dense among the host sizes)
    dense_units: torch.Tensor | None = None
    # The capacity path's (train_forward with `capacities`): the records sit at their capacities and
    # the GPU writes their true sizes here (pinned CPU int64 [6]); the backward reads them.
    host_sizes: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields that are set, in order: what a backward op and save_for_backward take."""
        return tuple(t for t in self if t is not None)


class TrainForward(NamedTuple):
    """A forward op's outputs by name."""

    y: torch.Tensor  # [M, D]
    l1: torch.Tensor  # []: mean over rows of sum over units of |h|
    fire_counts: torch.Tensor  # [H] int64: rows on which each unit fired
    active_rows: torch.Tensor  # [n_active] int64: the rows with an active unit
    kept_rows: torch.Tensor  # `keep`'s active rows ([0, D] without `keep`)
    record: TrainRecord


def _named(flat: Sequence[torch.Tensor]) -> TrainForward:
    y, l1, nnz_per_token, fire_counts, active_rows, kept_rows, *entries = flat
    return TrainForward(y, l1, fire_counts, active_rows, kept_rows, TrainRecord(nnz_per_token, *entries))


def _fake_record(x: torch.Tensor, cols: torch.dtype) -> tuple[_T, _T, _T]:
    nnz = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty(nnz, dtype=cols), x.new_empty(nnz), x.new_empty(nnz)


def _fake_forward(
    x: torch.Tensor, wg: torch.Tensor, keep: torch.Tensor | None, cols: torch.dtype
) -> RefForwardOutput:
    m, hidden = x.shape[0], wg.shape[0]
    n_active = torch.library.get_ctx().new_dynamic_size()
    return (
        x.new_empty(m, x.shape[1]),
        x.new_empty((), dtype=acc_dtype(x.dtype)),
        x.new_empty(m, dtype=torch.int64),
        x.new_empty(hidden, dtype=torch.int64),
        x.new_empty(n_active, dtype=torch.int64),
        x.new_empty(0, x.shape[1]) if keep is None else keep.new_empty(n_active, keep.shape[1]),
        *_fake_record(x, cols),
    )


def _kept_rows(keep: torch.Tensor | None, active_rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """keep's active rows, or an empty [0, D] tensor without `keep`."""
    return x.new_empty(0, x.shape[1]) if keep is None else keep.index_select(0, active_rows)


def _in_dtype_of(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """The weights in x's (compute) dtype; contiguous, as the CUDA kernels take them."""
    return [w.to(x.dtype).contiguous() for w in weights]


def _cuda_backward_weights(x: torch.Tensor, *weights: torch.Tensor) -> list[torch.Tensor]:
    """The weights as the CUDA backward takes them: float32 ones as they are (the master weights
    under bf16 autocast: the op reads bf16 casts of them and writes float32 gradients, rounded once,
    with no bf16 gradient and cast between), any other dtype cast to x's."""
    if all(w.dtype == torch.float32 for w in weights):
        return [w.contiguous() for w in weights]
    return _in_dtype_of(x, *weights)


def _as_weights(grads: list[torch.Tensor], *weights: torch.Tensor) -> list[torch.Tensor]:
    """Each weight's gradient in that weight's dtype (what autograd's cast would have given)."""
    return [g.to(w.dtype) for g, w in zip(grads, weights, strict=True)]


def _fake_backward(x, wg, wu, wd) -> TrainBackwardOutput:
    return x.new_empty(x.shape), wg.new_empty(wg.shape), wu.new_empty(wu.shape), wd.new_empty(wd.shape)


# --- reference pair ------------------------------------------------------------------------------


@torch.library.custom_op("sparse_llm::ffn_train_fwd_ref", mutates_args=())
def ffn_train_fwd_ref(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, keep: torch.Tensor | None
) -> RefForwardOutput:
    """x: [M, D]; wg, wu: [H, D]; wd: [D, H]; keep: None or [M, *] (see the module doc).
    (y, l1, nnz_per_token, fire_counts, active_rows, kept_rows, cols, a_vals, u_vals)."""
    y, l1, nnz_per_token, fire_counts, *record = ffn_train_forward_reference(x, wg, wu, wd)
    active_rows = nnz_per_token.nonzero().squeeze(1)
    return y, l1, nnz_per_token, fire_counts, active_rows, _kept_rows(keep, active_rows, x), *record


@ffn_train_fwd_ref.register_fake
def _(x, wg, wu, wd, keep):
    return _fake_forward(x, wg, keep, col_dtype(wg.shape[0]))


@torch.library.custom_op("sparse_llm::ffn_train_bwd_ref", mutates_args=())
def ffn_train_bwd_ref(
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    nnz_per_token: torch.Tensor,
    cols: torch.Tensor,
    a_vals: torch.Tensor,
    u_vals: torch.Tensor,
) -> TrainBackwardOutput:
    """(dx, dWg, dWu, dWd) from grad_y [M, D] and grad_l1 [] in one pass (see the reference); the
    weights as for the CUDA backward."""
    dx, *weight_grads = ffn_train_backward_reference(
        grad_y, grad_l1, x, *_in_dtype_of(x, wg, wu, wd), nnz_per_token, cols, a_vals, u_vals
    )
    return dx, *_as_weights(weight_grads, wg, wu, wd)


@ffn_train_bwd_ref.register_fake
def _(grad_y, grad_l1, x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals):
    return _fake_backward(x, wg, wu, wd)


# --- CUDA pair -----------------------------------------------------------------------------------


@torch.library.custom_op("sparse_llm::ffn_train_fwd_cuda", mutates_args=())
def ffn_train_fwd_cuda(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    keep: torch.Tensor | None,
    heavy_threshold: int,
) -> CudaForwardOutput:
    """The CUDA kernels: bf16, contiguous, Hopper. The reference's outputs (cols int32; keep as
    there) with the light rows' record, then the heavy rows' indices and record: rows with more
    than heavy_threshold active units take the dense path (a speed knob only)."""
    # keep's active rows are taken inside the extension: after its one host read, every step
    # until the next kernel is queued leaves the GPU idle.
    return extension().ffn_train_forward(
        x, wg, wu, wd, keep, heavy_threshold, dense_unit_min_fires(x.shape[0])
    )


@ffn_train_fwd_cuda.register_fake
def _(x, wg, wu, wd, keep, heavy_threshold):
    ctx = torch.library.get_ctx()
    return (
        *_fake_forward(x, wg, keep, torch.int32),
        x.new_empty(ctx.new_dynamic_size(), dtype=torch.int64),
        *_fake_record(x, torch.int32),
        x.new_empty(ctx.new_dynamic_size(), dtype=torch.int32),
    )


@torch.library.custom_op("sparse_llm::ffn_train_bwd_cuda", mutates_args=())
def ffn_train_bwd_cuda(
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    nnz_per_token: torch.Tensor,
    cols: torch.Tensor,
    a_vals: torch.Tensor,
    u_vals: torch.Tensor,
    heavy_rows: torch.Tensor,
    heavy_cols: torch.Tensor,
    heavy_a: torch.Tensor,
    heavy_u: torch.Tensor,
    dense_units: torch.Tensor,
) -> TrainBackwardOutput:
    """(dx, dWg, dWu, dWd) by the CUDA backward kernels (L1 gradient fused). The weights may be
    the master weights (wider than x): cast to x's dtype inside the op, and their gradients
    returned in their dtypes, so that a caller can keep the master weights for the backward
    instead of casts."""
    dx, *weight_grads = extension().ffn_train_backward(
        grad_y,
        grad_l1,
        x,
        *_cuda_backward_weights(x, wg, wu, wd),
        nnz_per_token,
        cols,
        a_vals,
        u_vals,
        heavy_rows,
        heavy_cols,
        heavy_a,
        heavy_u,
        dense_units,
    )
    return dx, *_as_weights(weight_grads, wg, wu, wd)


@ffn_train_bwd_cuda.register_fake
def _(grad_y, grad_l1, x, wg, wu, wd, nnz_per_token, cols, a_vals, u_vals, *heavy):
    return _fake_backward(x, wg, wu, wd)


# --- CUDA pair, capacity path (no host read in the forward) -----------------------------------------


@torch.library.custom_op("sparse_llm::ffn_train_fwd_cuda_cap", mutates_args=())
def ffn_train_fwd_cuda_cap(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    keep: torch.Tensor | None,
    heavy_threshold: int,
    capacities: torch.Tensor,
) -> CudaCapacityForwardOutput:
    """The CUDA pair's forward with no host read (kernels/train_bindings.cpp,
    ffn_train_forward_capacity): its outputs with the light record whole (M x min(heavy_threshold,
    H) entries, the true size first, the rest unset: 8 bytes an entry, so a threshold near H keeps
    an M x H record) and the heavy one at the capacities on the host (`capacities`, a
    TrainCapacities tensor), the dense units whole ([H], the first of them listed), then the pinned
    host_sizes the GPU writes the true sizes to. y and l1 are exact whatever the capacities;
    active_rows are all rows."""
    capacities = TrainCapacities.capacities(capacities)
    return extension().ffn_train_forward_capacity(
        x, wg, wu, wd, keep, heavy_threshold, dense_unit_min_fires(x.shape[0]), capacities
    )


@ffn_train_fwd_cuda_cap.register_fake
def _(x, wg, wu, wd, keep, heavy_threshold, capacities):
    # As the CUDA pair's, except that active_rows and kept_rows cover every row (M, not a count)
    # and the light record has its room for every row's most.
    m, d = x.shape
    light = m * min(heavy_threshold, wg.shape[0])
    return (
        x.new_empty(m, d),
        x.new_empty((), dtype=acc_dtype(x.dtype)),
        x.new_empty(m, dtype=torch.int64),
        x.new_empty(wg.shape[0], dtype=torch.int64),
        x.new_empty(m, dtype=torch.int64),
        x.new_empty(0, d) if keep is None else keep.new_empty(m, keep.shape[1]),
        x.new_empty(light, dtype=torch.int32),
        x.new_empty(light),
        x.new_empty(light),
        x.new_empty(torch.library.get_ctx().new_dynamic_size(), dtype=torch.int64),
        *_fake_record(x, torch.int32),
        x.new_empty(wg.shape[0], dtype=torch.int32),
        torch.empty(HOST_SIZE_FIELDS, dtype=torch.int64),
    )


@torch.library.custom_op("sparse_llm::ffn_train_bwd_cuda_cap", mutates_args=())
def ffn_train_bwd_cuda_cap(
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    nnz_per_token: torch.Tensor,
    cols: torch.Tensor,
    a_vals: torch.Tensor,
    u_vals: torch.Tensor,
    heavy_rows: torch.Tensor,
    heavy_cols: torch.Tensor,
    heavy_a: torch.Tensor,
    heavy_u: torch.Tensor,
    dense_units: torch.Tensor,
    host_sizes: torch.Tensor,
    capacities: torch.Tensor,
    heavy_threshold: int,
    zeroed_units: torch.Tensor | None,
) -> TrainBackwardOutput:
    """The CUDA backward of a capacity forward: waits for the forward's sizes on the host (written
    long before in steady state), cuts each record to its size, or rebuilds the heavy record where a
    heavy size was over its capacity (rebuild_heavy_record: in the forward's layout, no host read
    either), sets the layer's capacities for the next step from these sizes, then runs the CUDA backward.
    `zeroed_units`: the units whose Wg rows the forward ran with zeroed (train_backward), zeroed
    again for a rebuild.

    `capacities` is updated in place though not declared mutated: it is host state that only the
    forward op reads, at run time, so no graph ever reads a stale copy of it."""
    sizes = extension().wait_host_sizes(host_sizes)
    light, n_heavy, heavy_entries, _, n_dense = sizes
    fits = n_heavy <= heavy_rows.numel() and heavy_entries <= heavy_cols.numel()  # the light record is whole
    if fits:
        heavy = (
            heavy_rows[:n_heavy],
            heavy_cols[:heavy_entries],
            heavy_a[:heavy_entries],
            heavy_u[:heavy_entries],
        )
    else:
        forward_wg = wg if zeroed_units is None else wg.index_fill(0, zeroed_units, 0)
        heavy = rebuild_heavy_record(
            x, *_in_dtype_of(x, forward_wg, wu), nnz_per_token, heavy_threshold, n_heavy, heavy_entries
        )
    record = (nnz_per_token, cols[:light], a_vals[:light], u_vals[:light], *heavy)
    TrainCapacities.update(capacities, sizes)
    dx, *weight_grads = extension().ffn_train_backward(
        grad_y, grad_l1, x, *_cuda_backward_weights(x, wg, wu, wd), *record, dense_units[:n_dense]
    )
    return dx, *_as_weights(weight_grads, wg, wu, wd)


REBUILD_CHUNK_ROWS = 1024  # heavy rows a rebuild takes at a time: ~0.2 GB of transients at H = 5632


def rebuild_heavy_record(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    nnz_per_token: torch.Tensor,
    heavy_threshold: int,
    n_heavy: int,
    heavy_entries: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heavy record (heavy_rows, heavy_cols, heavy_a, heavy_u) of a forward whose heavy record
    overflowed, in that forward's layout, with no host read: the rows with more than
    `heavy_threshold` entries in its `nnz_per_token`, ascending (`n_heavy` of them, holding
    `heavy_entries`: its sizes, read on the host already), each row's segment as long as its count
    there. The values come from a second gate GEMM on x (bf16 weights as the forward had them):
    each segment holds its row's active units ascending, at most the segment's length, the rest
    padded with units where a = u = 0 (which add nothing). x need not be the forward's op input bit
    for bit (the block's backward recomputes it from bf16 rows): where the two gate GEMMs disagree
    on a unit, its g is at rounding level of zero, so is a, and the record stays inside its layout
    whatever g is. (A record mixed from a second forward's own split and the first's light record
    read past its ends in a 1b run, 9fd08f4.)"""
    device = x.device
    heavy_rows = torch.nonzero_static(nnz_per_token > heavy_threshold, size=n_heavy).squeeze(1)
    counts = nnz_per_token.index_select(0, heavy_rows)
    starts = torch.cumsum(counts, 0) - counts
    # One slot past the record: where the units a row does not keep are written, then dropped.
    cols = torch.zeros(heavy_entries + 1, dtype=torch.int32, device=device)
    heavy_a = x.new_zeros(heavy_entries + 1)
    heavy_u = x.new_zeros(heavy_entries + 1)
    units = torch.arange(wg.shape[0], dtype=torch.int32, device=device)
    for first in range(0, n_heavy, REBUILD_CHUNK_ROWS):
        rows = slice(first, first + REBUILD_CHUNK_ROWS)
        x_rows = x.index_select(0, heavy_rows[rows])
        g = x_rows @ wg.t()
        active = g > 0
        # Each unit's place in its row: the active units first (ascending), then the others.
        rank_active = torch.cumsum(active, 1, dtype=torch.int32) - 1
        rank_idle = (
            torch.cumsum(~active, 1, dtype=torch.int32) - 1 + active.sum(1, keepdim=True, dtype=torch.int32)
        )
        place = torch.where(active, rank_active, rank_idle)
        kept = place < counts[rows].unsqueeze(1)
        # Kept units in column order take the segment's places in order: ascending units a row.
        rank_kept = torch.cumsum(kept, 1, dtype=torch.int32) - 1
        dest = torch.where(kept, starts[rows].unsqueeze(1) + rank_kept, heavy_entries).flatten()
        u = torch.where(active, x_rows @ wu.t(), 0)
        cols.scatter_(0, dest, units.expand_as(g).flatten())
        heavy_a.scatter_(0, dest, g.clamp(min=0).flatten())
        heavy_u.scatter_(0, dest, u.flatten())
    return heavy_rows, cols[:heavy_entries], heavy_a[:heavy_entries], heavy_u[:heavy_entries]


@ffn_train_bwd_cuda_cap.register_fake
def _(grad_y, grad_l1, x, wg, wu, wd, *record_and_options):
    return _fake_backward(x, wg, wu, wd)


class TrainCapacities:
    """A layer's capacities for the heavy rows' record on the capacity path, as host state: a CPU
    int64 tensor whose first two values are the capacities the forward op reads (heavy rows, heavy
    entries), then each capacity's envelope (the most a recent step needed, with headroom and
    rounded up to the granule, forgotten by 1% a step), then the number of the layer's steps that
    overflowed any capacity, then how many overflowed each one. (The light record needs none: it
    is kept whole, ffn_train_fwd_cuda_cap.)

    The backward sets them from the sizes it read: an envelope rises at once to what the step
    needs and otherwise decays; a capacity is its envelope rounded up to the granule. So a capacity
    comes down slowly from the largest recent need and never below the last step's, and a sparse
    layer whose heavy rows come and go keeps room for them. An overflow costs the overflow kernel
    in the forward (one CTA a heavy row past the capacity) and rebuild_heavy_record in the backward;
    the headroom is wide (2x) and the decay slow, as set when a rebuild drained the launch queue
    (~20-70 ms on a 1b step): a handful of heavy rows that comes back every 64 steps (one granule,
    its envelope down by one a step) finds room each time. Room for heavy entries costs memory only;
    room for heavy rows costs compute, since the forward's two heavy-row GEMMs run at the capacity's
    row count: a layer at L0 50-95 has 3000-7700 heavy rows of a 1b step's 16384, where 2x room
    doubled those GEMMs. So a size's room is capped where ROOM_CAP says: past it the room above the
    size is ROOM_CAP or a quarter of the size, the more of the two. A fresh tensor is zero: the first
    step with heavy rows overflows and rebuilds. A "step" here is one backward of the layer, a
    micro-batch where a step accumulates several; the state is not checkpointed (a resumed run
    starts from zero)."""

    SIZE_NAMES = ("heavy_rows", "heavy_entries")
    HEADROOM = (2.0, 2.0)
    ROOM_CAP = (1024, None)  # room above the size at most, or a quarter of the size if more; None: 2x
    # Integer decay: an envelope of one heavy-row granule (64) reaches zero in 64 steps without
    # heavy rows, so a layer that never has them stops launching their GEMMs.
    DECAY_PERCENT = 99
    GRANULES = (64, 4096)  # rounding of each capacity (64: the heavy GEMMs' row granule)
    SIZES = 2  # capacities, then as many envelopes
    OVERFLOWS = 2 * SIZES  # steps that overflowed any capacity, then each capacity's count
    FIELDS = OVERFLOWS + 1 + SIZES
    # Where the capacities' sizes sit among the forward's host sizes (light entries, heavy rows,
    # heavy entries, active rows, dense units).
    FROM_HOST_SIZES = slice(1, 3)

    @classmethod
    def new(cls) -> torch.Tensor:
        return torch.zeros(cls.FIELDS, dtype=torch.int64)

    @classmethod
    def capacities(cls, state: torch.Tensor) -> torch.Tensor:
        """The capacities alone (a view): what the extension's forward reads."""
        return state[: cls.SIZES]

    @classmethod
    def overflows(cls, state: torch.Tensor) -> int:
        """Steps in which some size was over its capacity."""
        return int(state[cls.OVERFLOWS])

    @classmethod
    def overflows_by_size(cls, state: torch.Tensor) -> dict[str, int]:
        """Steps in which each size (SIZE_NAMES) was over its capacity."""
        counts = state[cls.OVERFLOWS + 1 :].tolist()
        return dict(zip(cls.SIZE_NAMES, counts, strict=True))

    @classmethod
    def need(cls, i: int, size: int) -> int:
        """What size i (SIZE_NAMES) needs with its headroom, before rounding to the granule."""
        room = int(size * cls.HEADROOM[i]) - size
        cap = cls.ROOM_CAP[i]
        return size + (room if cap is None else min(room, max(cap, size // 4)))

    @classmethod
    def update(cls, state: torch.Tensor, host_sizes: Sequence[int]) -> None:
        """Set the next step's capacities from the sizes a step's forward wrote (its host sizes)."""
        # Written through numpy: every forward saves this tensor for its backward, and a torch
        # in-place write would bump the version that a pending backward checks it against.
        if len(host_sizes) < HOST_SIZE_FIELDS - 1:  # the sizes, without the ready flag
            raise ValueError(f"need the forward's {HOST_SIZE_FIELDS - 1} host sizes, got {list(host_sizes)}")
        sizes = [int(size) for size in host_sizes[cls.FROM_HOST_SIZES]]
        values = state.numpy()
        over = [size > int(values[i]) for i, size in enumerate(sizes)]
        values[cls.OVERFLOWS] += any(over)
        values[cls.OVERFLOWS + 1 :] += over
        for i, (size, granule) in enumerate(zip(sizes, cls.GRANULES, strict=True)):
            need = -(-cls.need(i, size) // granule) * granule
            envelope = max(need, int(values[cls.SIZES + i]) * cls.DECAY_PERCENT // 100)
            values[cls.SIZES + i] = envelope
            values[i] = -(-envelope // granule) * granule


# --- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    # Inputs: x, the weights, then options that get no gradient (keep; the CUDA pair's
    # heavy_threshold).
    x, wg, wu, wd, *options = inputs
    out = _named(output)
    record = out.record.tensors()
    ctx.n_options = len(options)
    ctx.save_for_backward(x, wg, wu, wd, *record)
    ctx.mark_non_differentiable(out.fire_counts, out.active_rows, out.kept_rows, *record)


def _backward_with(backward_op: Callable[..., TrainBackwardOutput]) -> Callable:
    def backward(ctx, grad_y, grad_l1, *_unused):
        x, wg, wu, wd, *record = ctx.saved_tensors  # the record flat, as the op takes it
        if grad_y is None:
            grad_y = x.new_zeros(x.shape)
        if grad_l1 is None:
            grad_l1 = x.new_zeros((), dtype=acc_dtype(x.dtype))
        grads = backward_op(grad_y.contiguous(), grad_l1, x, wg, wu, wd, *record)
        return (*grads, *(None,) * ctx.n_options)

    return backward


ffn_train_fwd_ref.register_autograd(_backward_with(ffn_train_bwd_ref), setup_context=_setup_context)
ffn_train_fwd_cuda.register_autograd(_backward_with(ffn_train_bwd_cuda), setup_context=_setup_context)


# --- dispatch by implementation (for callers that run the pair inside their own autograd) ---------


def train_forward(
    impl: str,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    heavy_threshold: int,
    keep: torch.Tensor | None = None,
    capacities: torch.Tensor | None = None,
) -> TrainForward:
    """The forward op of `impl` ('cuda' or 'reference'), its outputs by name. With `capacities`
    (TrainCapacities; 'cuda' only) the capacity path: no host read, records at the capacities."""
    if impl == "cuda" and capacities is not None:
        return _named(ffn_train_fwd_cuda_cap(x, wg, wu, wd, keep, heavy_threshold, capacities))
    if impl == "cuda":
        return _named(ffn_train_fwd_cuda(x, wg, wu, wd, keep, heavy_threshold))
    return _named(ffn_train_fwd_ref(x, wg, wu, wd, keep))


def train_backward(
    impl: str,
    grad_y: torch.Tensor,
    grad_l1: torch.Tensor,
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    record: TrainRecord,
    capacities: torch.Tensor | None = None,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
    zeroed_units: torch.Tensor | None = None,
) -> TrainBackwardOutput:
    """The backward op of `impl`: (dx, dWg, dWu, dWd) from grad_y, grad_l1, x, the weights (in x's
    dtype or wider: their gradients come back in their dtypes) and the forward's record; a capacity
    path's record with the capacities and the heavy threshold its forward had.

    `zeroed_units` (int64 unit indices): units whose Wg rows the forward ran with zeroed (the hot
    units'), passed with Wg as it is, not a zeroed copy. Those units hold no entry of the record and
    a zero pre-activation gradient on every heavy row, so the backward never reads their rows, and
    their gradient rows come out zero; only the capacity path's rebuild of an overflowed record
    runs the forward again, which zeroes them as the forward had them."""
    if record.host_sizes is not None:
        if capacities is None:
            raise ValueError("a capacity path's record needs the capacities its forward read")
        return ffn_train_bwd_cuda_cap(
            grad_y, grad_l1, x, wg, wu, wd, *record.tensors(), capacities, heavy_threshold, zeroed_units
        )
    op = ffn_train_bwd_cuda if impl == "cuda" else ffn_train_bwd_ref
    return op(grad_y, grad_l1, x, wg, wu, wd, *record.tensors())


# --- the front ----------------------------------------------------------------------------------


class FFNTrainOutput(NamedTuple):
    y: torch.Tensor
    l0: torch.Tensor
    l1: torch.Tensor
    nnz_per_token: torch.Tensor
    fire_counts: torch.Tensor


def check_train_weights(
    x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, impl: str, heavy_threshold: int
) -> None:
    """Check the weights (one float dtype, possibly wider than x's: master weights that the caller
    casts) against the FFN's input x, in the compute dtype, then heavy_threshold and `impl` (for
    'cuda': that the training kernels take these inputs)."""
    check_ffn_inputs(x.new_empty((0, x.shape[-1]), dtype=wg.dtype), wg, wu, wd)
    check_heavy_threshold(heavy_threshold, inference=False)
    check_impl(impl, True, kernel_inputs(x, wg, wu, wd))


def ffn_forward_train(
    x: torch.Tensor,
    wg: torch.Tensor,
    wu: torch.Tensor,
    wd: torch.Tensor,
    impl: str,
    *,
    heavy_threshold: int = DEFAULT_HEAVY_THRESHOLD,
) -> FFNTrainOutput:
    """Training forward of y = (relu(x Wg^T) * (x Wu^T)) Wd^T with L0, L1 and the unit counts.

    x: [..., D]; Wg, Wu: [H, D]; Wd: [D, H] (Hugging Face layout). impl: the implementation decided
    for the inputs (sparse_llm.ops.ffn.select), 'reference' or 'cuda' (KernelsUnavailable where the
    kernels cannot run: no fallback here). Exact on every pattern. See the module docstring for
    the outputs and how the L1 gradient is fused. On the CUDA path, rows
    with more than `heavy_threshold` active units take dense GEMMs on the gathered rows (a speed
    knob: any value is exact); the forward reads the numbers of active entries and heavy rows on
    the host once (they size the records and the GEMMs) while the GPU packs and projects the light
    rows, and the backward reads nothing."""
    dtype = autocast_dtype(x)
    if dtype is not None:  # cast as autocast casts a matmul's inputs
        x, wg, wu, wd = (t.to(dtype) for t in (x, wg, wu, wd))
    check_ffn_inputs(x, wg, wu, wd)
    wg, wu, wd = wg.contiguous(), wu.contiguous(), wd.contiguous()
    check_heavy_threshold(heavy_threshold, inference=False)
    check_impl(impl, True, kernel_inputs(x, wg, wu, wd))
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = train_forward(impl, x2, wg, wu, wd, heavy_threshold)
    nnz_per_token = out.record.nnz_per_token
    l0 = nnz_per_token.to(acc_dtype(x.dtype)).mean()
    return FFNTrainOutput(out.y.view(x.shape), l0, out.l1, nnz_per_token, out.fire_counts)
