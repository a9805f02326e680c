from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

# Under pytest-xdist (`make test`: one worker per core) each worker computes on one thread, and so do
# the processes its tests start: two workers whose torch each spun two OpenMP threads on two cores
# took the controller test from 14 s to 150 s.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """The files with the most `slow` tests first, each file's tests kept together in their order.
    pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder) hands out files in this order:
    the few long files start at once on different workers and the many short ones fill in after,
    instead of a long file starting last while the other worker idles."""
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: the rest keep the collection's order


@pytest.fixture(scope="session")
def _task_managers() -> dict[str, Any]:
    return {}


@pytest.fixture
def shared_task_managers(monkeypatch, _task_managers) -> Callable[..., Any]:
    """lm-eval's TaskManager built once per session for each set of arguments: indexing lm-eval's
    own ~15K task configs (any task not shipped here) takes seconds, and the index never changes."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    real = lm_eval_tasks.TaskManager

    def shared(**kwargs: Any) -> Any:
        key = repr(sorted(kwargs.items()))
        if key not in _task_managers:
            _task_managers[key] = real(**kwargs)
        return _task_managers[key]

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", shared)
    return shared
