"""The run log's FFN line: which FFN each phase runs, and why, in words a user reads.

`FFNPlan.describe` names every phase and setting (`train+eval+prefill+decode=dense (...)`), which
suits a benchmark's table; a run's log says instead "FFN: dense (asked for); the sparse kernels
need a Hopper GPU".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sparse_llm.ops.ffn.select import PHASES, FFNSelection

if TYPE_CHECKING:  # only read here: its phases' selections
    from sparse_llm.model.ffn import FFNPlan

IMPL_WORDS = {
    "dense": "dense",
    "reference": "the sparse ops' PyTorch reference",
    "cuda": "the sparse CUDA kernels",
}
PHASE_WORDS = {"train": "training", "eval": "evaluation", "prefill": "prefill", "decode": "decode"}


def describe_ffn(plan: FFNPlan, requested: str, device: torch.device) -> str:
    """One line: what the FFN runs (per phase where they differ) for `requested` (model.ffn_impl),
    and why where it was not asked for."""
    groups: dict[tuple[str, str], list[str]] = {}
    for phase in PHASES:
        selection: FFNSelection = getattr(plan, phase)
        groups.setdefault((selection.impl, _why(selection, requested)), []).append(phase)
    parts = []
    for (impl, why), phases in groups.items():
        where = "" if len(groups) == 1 else f"{' and '.join(PHASE_WORDS[p] for p in phases)}: "
        parts.append(f"{where}{IMPL_WORDS[impl]} ({why})")
    line = "; ".join(parts)
    # A choice that was asked for gives no reason; say once what would run the kernels.
    if requested in ("dense", "reference") and not _is_hopper(device):
        line += "; the sparse kernels need a Hopper GPU"
    return line


def _why(selection: FFNSelection, requested: str) -> str:
    if selection.impl == requested:
        return "asked for"
    reason = f": {selection.reason}" if selection.reason else ""
    return f"model.ffn_impl={requested} chose it{reason}"


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
