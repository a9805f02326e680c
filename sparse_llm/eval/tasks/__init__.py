"""lm-evaluation-harness tasks whose data ships with the package: they run offline (no hub), so
tests, CI and a CPU-only user can run the whole evaluation path.

    python_completion   multiple choice: which of four continuations follows a few lines of Python
    python_perplexity   loglikelihood_rolling over short Python modules (bits per byte, perplexity)

The text is our own, in the style of the Python standard library the default model trains on
(data.source=embedded). Each task is a YAML file next to this one; its data is the jsonl file
named in its `dataset_kwargs`, read by `load_jsonl`. `lm_eval --include_path <this directory>`
finds them too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TASK_DIR = Path(__file__).resolve().parent
SHIPPED_TASKS = ("python_completion", "python_perplexity")


def load_jsonl(file: str, **_task_metadata: Any) -> Any:
    """The `test` split of the jsonl file `file` (beside this module) as a datasets.DatasetDict.

    lm-eval calls a task's `custom_dataset` with the task's metadata (its version, and whatever
    the caller passed to the TaskManager) besides `dataset_kwargs`; none of it changes the data."""
    import datasets

    rows = [json.loads(line) for line in (TASK_DIR / file).read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
