from __future__ import annotations

import gc
import os
from collections import Counter
from typing import Any

import pytest

# Under pytest-xdist (`make test`: one worker per core) each worker computes on one thread, and so do
# the processes its tests start: two workers whose torch each spun two OpenMP threads on two cores
# took the controller test from 14 s to 150 s. (torch imported here only: xdist's controller process,
# which runs no test, need not spend seconds of a core importing it while the workers start.)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Inductor compiles a graph's C++ in this process, not in a pool of compile workers: the pool's
    # processes each import torch (seconds of a core), which on 2 cores the suite pays for and never
    # gets back (the suite: 286 -> 249 CPU-s, 146 -> 128 s). Read when inductor is first imported.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
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


def pytest_collection_finish(session: pytest.Session) -> None:
    """The ~800K objects of the modules imported by now (torch, transformers, the tests) live until
    the end: frozen, the garbage collector's full passes no longer walk them (~0.4 s a pass in an
    xdist worker: ~13 passes during the tests, 5 in pytest's cleanup at the end). Without them in
    its count of old objects, Python would then make a full pass every 10th generation-1 collection
    (~30 in a worker): one in 100 instead. The young generations are collected as before."""
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, 100)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """The files with the most `slow` tests first, each file's tests kept together in their order.
    pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder) hands out files in this order:
    the few long files start at once on different workers and the many short ones fill in after,
    instead of a long file starting last while the other worker idles."""
    slow = Counter(item.path for item in items if "slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.path])  # stable: the rest keep the collection's order


@pytest.fixture
def no_lm_eval_index(monkeypatch) -> None:
    """lm-eval's TaskManager made to fail when asked to index lm-eval's own ~14K task configs (~13 s
    of a core), for the tests of what is decided without them."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    real = lm_eval_tasks.TaskManager

    def shipped_only(**kwargs: Any) -> Any:
        assert not kwargs.get("include_defaults", True), "lm-eval's own task configs were indexed"
        return real(**kwargs)

    monkeypatch.setattr(lm_eval_tasks, "TaskManager", shipped_only)
