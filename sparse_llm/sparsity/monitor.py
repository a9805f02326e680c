"""Sparsity statistics of training: accumulate per step, reduce over ranks, summarise per log window.

Per micro-batch the trainer calls `update(stats)`; after the step's last micro-batch,
`end_step(all_reduce_sum)` sums the step over data-parallel ranks and feeds the dead-unit
tracker; at log time `summary()` returns the metrics of the steps since the previous summary.
Everything stays on the training device between log steps, so nothing here forces a host sync
except `summary()` and `save_histograms()`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from sparse_llm.metric_keys import layer_metric
from sparse_llm.model import FFNStats
from sparse_llm.run_files import NNZ_HIST_FILE
from sparse_llm.sparsity.dead import DeadUnitTracker

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


class SparsityMonitor:
    def __init__(
        self,
        num_layers: int,
        num_units: int,
        dead_window_tokens: int,
        device: torch.device | str | None = None,
    ) -> None:
        """`num_units` is the FFN intermediate size H. `device=None`: keep the state where the
        first `update()` finds the statistics (the training device), so steps never sync with
        the host."""
        self.num_layers = num_layers
        self.num_units = num_units
        self._device_fixed = device is not None
        self.device = torch.device(device or "cpu")
        self.tracker = DeadUnitTracker(num_layers, num_units, dead_window_tokens, self.device)
        # Additive statistics, so they combine across micro-batches, ranks and steps. L1 is kept
        # as a sum over tokens (mean x tokens) in float64: micro-batches weigh by their tokens and
        # long windows keep their precision.
        self._step_l1 = self._zeros(num_layers, dtype=torch.float64)
        self._step_hist = self._zeros(num_layers, num_units + 1)
        self._step_fire = self._zeros(num_layers, num_units)
        self._window_l1 = self._zeros(num_layers, dtype=torch.float64)
        self._window_hist = self._zeros(num_layers, num_units + 1)
        self._step_has_data = False
        self._window_steps = 0
        self._last_step_hist: torch.Tensor | None = None  # the last completed step's, global
        self._last_step_fire: torch.Tensor | None = None  # [L, H], the last completed step's, global
        # Histogram of the last summarised window: what `save_histograms` falls back to when
        # the run ends right after a log step.
        self._last_window_hist: torch.Tensor | None = None

    def _zeros(self, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    # --- per micro-batch / per step -------------------------------------------------------

    def update(self, stats: FFNStats) -> None:
        """Add one micro-batch's statistics (this rank only)."""
        if not self._device_fixed:
            self._move_to(stats.nnz_per_token.device)
        nnz = stats.nnz_per_token.detach().to(self.device, torch.int64)
        if nnz.dim() != 2 or nnz.shape[0] != self.num_layers or stats.fire_counts.shape[-1] != self.num_units:
            raise ValueError(
                f"FFN stats have per-token counts of shape {tuple(nnz.shape)} and fire counts of shape "
                f"{tuple(stats.fire_counts.shape)}; the monitor expects ({self.num_layers}, tokens) and "
                f"({self.num_layers}, {self.num_units})"
            )
        # Binned here, eagerly (scatter_add_ does not sync with the host, unlike bincount).
        nnz_hist = torch.zeros_like(self._step_hist).scatter_add_(1, nnz, torch.ones_like(nnz))
        tokens = nnz.shape[1]
        self._step_l1.add_(stats.l1.detach().to(self.device, torch.float64) * tokens)
        self._step_hist.add_(nnz_hist)
        self._step_fire.add_(stats.fire_counts.detach().to(self.device))
        self._step_has_data = True

    def _move_to(self, device: torch.device) -> None:
        self._device_fixed = True
        if device == self.device:
            return
        self.device = device
        self.tracker.tokens_since_fired = self.tracker.tokens_since_fired.to(device)
        for name in ("_step_l1", "_step_hist", "_step_fire", "_window_l1", "_window_hist"):
            setattr(self, name, getattr(self, name).to(device))

    def end_step(self, all_reduce_sum: AllReduceSum) -> None:
        """Close an optimizer step: sum it over ranks, update the dead-unit tracker, add it to the window.

        Every rank must call this once per step (it runs collectives through `all_reduce_sum`).
        """
        if not self._step_has_data:
            raise RuntimeError("SparsityMonitor.end_step() called without any update() in this step")
        # Two collectives per step: the integer statistics packed together, and the L1 sums.
        counts = all_reduce_sum(torch.cat((self._step_hist, self._step_fire), dim=1))
        l1_sum = all_reduce_sum(self._step_l1)
        nnz_hist, fire_counts = counts.split((self.num_units + 1, self.num_units), dim=1)

        self.tracker.update(fire_counts, nnz_hist[0].sum())
        self._window_l1.add_(l1_sum)
        self._window_hist.add_(nnz_hist)
        self._window_steps += 1
        self._last_step_hist = nnz_hist  # a fresh tensor every step (the reduction's output)
        self._last_step_fire = fire_counts
        # Zeroed only now: with an identity reduction, l1_sum is _step_l1 itself.
        for t in (self._step_l1, self._step_hist, self._step_fire):
            t.zero_()
        self._step_has_data = False

    def last_step_fire_counts(self) -> tuple[torch.Tensor, int]:
        """([L, H] on how many tokens each unit fired, the tokens) of the last completed step,
        global over ranks; the token count syncs with the host."""
        if self._last_step_hist is None or self._last_step_fire is None:
            raise RuntimeError("SparsityMonitor.last_step_fire_counts() called before any end_step()")
        return self._last_step_fire, int(self._last_step_hist[0].sum())

    def last_step_l0(self) -> list[float]:
        """Per-layer L0 (active units per token) of the last completed step, global over ranks:
        what the L1 controller follows. Exact integer totals, so the same on every rank; syncs with
        the host."""
        return self.last_step_l0_tensor().tolist()

    def last_step_l0_tensor(self) -> torch.Tensor:
        """`last_step_l0` as a float64 [L] tensor on the statistics' device, without a host sync:
        the same values (integer totals, one correctly rounded division)."""
        if self._last_step_hist is None:
            raise RuntimeError("SparsityMonitor.last_step_l0() called before any end_step()")
        return _mean_active_units(self._last_step_hist)

    def last_step_histogram(self) -> torch.Tensor:
        """[L, H + 1] token counts of the last completed step by active units per token, global
        over ranks."""
        if self._last_step_hist is None:
            raise RuntimeError("SparsityMonitor.last_step_histogram() called before any end_step()")
        return self._last_step_hist.cpu()

    # --- dead units -------------------------------------------------------------------------

    def dead_mask(self) -> torch.Tensor:
        return self.tracker.dead_mask()

    def reset_units(self, units: torch.Tensor) -> None:
        """Restart the dead counters of `units` (after `reinit_dead_units` revived them)."""
        self.tracker.reset(units)

    # --- logging ----------------------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """Metrics over the steps since the previous summary (global over ranks); resets the window."""
        if self._window_steps == 0:
            raise RuntimeError("SparsityMonitor.summary() called with no completed step since the last one")
        hist = self._window_hist.to("cpu", copy=True)  # the window is zeroed below
        tokens = hist[0].sum().item()
        per_layer = {
            "l0": _mean_active_units(hist),
            "l1": self._window_l1.cpu() / tokens,
            "dead": self.tracker.dead_fraction().cpu().double(),
            "nnz_p50": _percentile(hist, 50).double(),
            "nnz_p99": _percentile(hist, 99).double(),
            "nnz_max": _max_nonzero_bin(hist).double(),
        }
        per_layer["sparsity"] = 1.0 - per_layer["l0"] / self.num_units

        metrics: dict[str, float] = {}
        for name in ("sparsity", "l0", "l1", "dead", "nnz_p50", "nnz_p99"):
            metrics[f"{name}/mean"] = per_layer[name].mean().item()
        metrics["nnz_max/max"] = per_layer["nnz_max"].max().item()
        for name, values in per_layer.items():
            for layer, value in enumerate(values.tolist()):
                metrics[layer_metric(name, layer, self.num_layers)] = value

        self._last_window_hist = hist
        self._window_l1.zero_()
        self._window_hist.zero_()
        self._window_steps = 0
        return metrics

    def save_histograms(self, run_dir: Path) -> Path:
        """Write `<run_dir>/nnz_hist.json`, the per-layer distribution of non-zeros per token
        that `plots.plot_run` draws.

        Uses the current log window, or the last summarised one if the window is empty (the run
        ended on a log step). Call on the main process at the end of training.
        """
        if self._window_steps:
            hist = self._window_hist.to("cpu", copy=True)
        elif self._last_window_hist is not None:
            hist = self._last_window_hist
        else:
            raise RuntimeError("SparsityMonitor.save_histograms(): no step has been recorded")
        last = int(_max_nonzero_bin(hist).max())
        payload = {
            "num_units": self.num_units,
            "tokens": int(hist[0].sum()),
            # counts[layer][k] = tokens with k active units; bins above the longest list are 0.
            "counts": hist[:, : last + 1].tolist(),
        }
        path = Path(run_dir) / NNZ_HIST_FILE
        path.write_text(json.dumps(payload))
        return path

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors only (safetensors). The log window is not saved: the first log after a resume
        covers fewer steps, nothing else changes."""
        return self.tracker.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tracker.load_state_dict(state)


def _percentile(hist: torch.Tensor, q: int) -> torch.Tensor:
    """Exact q-th percentile per row of an integer histogram (numpy's 'inverted_cdf').

    The smallest k whose cumulative count reaches q% of the tokens; integer arithmetic, so
    there is no rounding at the boundaries.
    """
    cumulative = hist.cumsum(-1)
    total = cumulative[:, -1:]
    return (cumulative * 100 < q * total).sum(-1)


def _max_nonzero_bin(hist: torch.Tensor) -> torch.Tensor:
    """Per row, the largest k with a non-zero count (0 for an empty row)."""
    bins = torch.arange(hist.shape[-1], device=hist.device)
    return torch.where(hist > 0, bins, 0).amax(-1)


def _mean_active_units(hist: torch.Tensor) -> torch.Tensor:
    """Per layer, the mean number of active units per token of a [L, H + 1] count histogram (L0),
    float64 on the histogram's device: the sums are exact integers and the division is correctly
    rounded, so every rank, device and caller agrees."""
    bins = torch.arange(hist.shape[-1], device=hist.device)
    return (hist * bins).sum(-1).double() / hist[0].sum().double()
