"""Sparse FFN ops: CUDA TwELL kernels for Hopper behind one front, with a PyTorch reference.

Importable with torch alone; the CUDA extension builds on first use (or ahead of time with
`python -m sparse_llm.ops.build`). Which FFN implementation runs is decided once, by `select_ffn`
(where the kernels cannot run, `auto` is dense); the op fronts run the implementation they are
given. The sparse FFN op lives in `sparse_llm.ops.ffn` (its modules say which job each does); the
names below are the package's public front.
"""

from sparse_llm.ops._extension import KernelsUnavailable, kernels_unavailable
from sparse_llm.ops.ffn import cuda_ops  # noqa: F401  (registers torch.ops.sparse_llm.*)
from sparse_llm.ops.ffn.block import ffn_block_train
from sparse_llm.ops.ffn.checks import DEFAULT_HEAVY_THRESHOLD, check_ffn_inputs
from sparse_llm.ops.ffn.inference import ffn_add_, ffn_forward, twell_pack
from sparse_llm.ops.ffn.reference import ffn_forward_reference
from sparse_llm.ops.ffn.select import FFN_IMPLS, FFNSelection, select_ffn
from sparse_llm.ops.ffn.training import FFNTrainOutput, ffn_forward_train
from sparse_llm.ops.ffn.twell import SLOTS, TILE, TwellPacked, twell_pack_reference, twell_unpack
from sparse_llm.ops.linear_add import linear_add_

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
