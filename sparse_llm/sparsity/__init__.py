"""The sparsity recipe: L1 penalty and schedule, statistics and dead units, targeted reinit.

`plots` (matplotlib) and `sweep` are imported explicitly where needed, not from here.
"""

from sparse_llm.sparsity.controller import L1Controller
from sparse_llm.sparsity.dead import DeadUnitTracker
from sparse_llm.sparsity.monitor import SparsityMonitor
from sparse_llm.sparsity.penalty import l1_coefficient, l1_penalty
from sparse_llm.sparsity.reinit import reinit_dead_units

__all__ = [
    "DeadUnitTracker",
    "L1Controller",
    "SparsityMonitor",
    "l1_coefficient",
    "l1_penalty",
    "reinit_dead_units",
]
