from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


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
