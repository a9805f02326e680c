from __future__ import annotations

import hashlib
import os
import pickle
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Under pytest-xdist (`make test`: one worker per core) each worker computes on one thread, and so do
# the processes its tests start: two workers whose torch each spun two OpenMP threads on two cores
# took the controller test from 14 s to 150 s. (torch imported here only: xdist's controller process,
# which runs no test, need not spend seconds of a core importing it while the workers start.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    import torch

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


@pytest.fixture(scope="session")
def _session_dir(tmp_path_factory) -> Path:
    """A directory of this session that every pytest-xdist worker shares (their temporary
    directories are siblings), else this process's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _built_once(path: Path, build: Callable[[], Any]) -> Any:
    """build() in the first process that asks, pickled at `path` for the others (a file lock
    between them)."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        if path.is_file():
            return pickle.loads(path.read_bytes())
        built = build()
        path.write_bytes(pickle.dumps(built))
        return built


@pytest.fixture
def shared_task_managers(monkeypatch, _task_managers, _session_dir) -> Callable[..., Any]:
    """lm-eval's TaskManager built once per session for each set of arguments, whichever worker
    asks first: indexing lm-eval's own ~15K task configs (any task not shipped here) takes 13 s, and
    the index never changes; another worker loads the pickled index in about 1 s."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    real = lm_eval_tasks.TaskManager

    def shared(**kwargs: Any) -> Any:
        key = repr(sorted(kwargs.items()))
        if key not in _task_managers:
            path = _session_dir / f"task_manager_{hashlib.sha256(key.encode()).hexdigest()[:16]}.pkl"
            _task_managers[key] = _built_once(path, lambda: real(**kwargs))
        return _task_managers[key]

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", shared)
    return shared
