"""Sparse FFN ops: CUDA TwELL kernels for Hopper behind one front, with a PyTorch reference.

Importable with torch alone; the CUDA extension builds on first use (or ahead of time with
`python -m sparse_llm.ops.build`) and missing pieces fall back to the reference with a warning.
"""

from sparse_llm.ops import cuda_ops  # noqa: F401  (registers torch.ops.sparse_llm.*)
from sparse_llm.ops.checks import DEFAULT_HEAVY_THRESHOLD, check_ffn_inputs
from sparse_llm.ops.ffn import ffn_add_, ffn_forward, twell_pack
from sparse_llm.ops.linear_add import linear_add_
from sparse_llm.ops.reference import ffn_forward_reference
from sparse_llm.ops.select import FFN_IMPLS, FFNSelection, KernelsUnavailable, kernels_unavailable, select_ffn
from sparse_llm.ops.train import FFNTrainOutput, ffn_forward_train
from sparse_llm.ops.train_block import ffn_block_train
from sparse_llm.ops.twell import SLOTS, TILE, TwellPacked, twell_pack_reference, twell_unpack

__all__ = [
    "DEFAULT_HEAVY_THRESHOLD",
    "FFN_IMPLS",
    "SLOTS",
    "TILE",
    "FFNSelection",
    "FFNTrainOutput",
    "KernelsUnavailable",
    "TwellPacked",
    "check_ffn_inputs",
    "ffn_add_",
    "ffn_block_train",
    "ffn_forward",
    "ffn_forward_reference",
    "ffn_forward_train",
    "kernels_unavailable",
    "linear_add_",
    "select_ffn",
    "twell_pack",
    "twell_pack_reference",
    "twell_unpack",
]
