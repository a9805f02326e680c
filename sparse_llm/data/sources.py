"""Raw document sources (embedded stdlib, local files, hub) as streaming `datasets` iterables.

Each source is an `IterableDataset` (one shard per file; one in all under a `max_documents` cap),
cut down to one data-parallel rank's share. Its examples are raw rows; deciding what is a usable
document happens downstream. The order of rows is fixed (no shuffling), so
`IterableDataset.state_dict()` resumes exactly.
"""

from __future__ import annotations

import functools
import os
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import datasets
from datasets.distributed import split_dataset_by_node

from sparse_llm.config import DataConfig
from sparse_llm.data.errors import READ_ERRORS, DataError
from sparse_llm.data.file_check import check_files

EMBEDDED_SEED = 1234  # fixed permutation of the stdlib files, so documents of all packages mix
EMBEDDED_TEXT_FIELD = "text"
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages"}  # third-party code, differs per machine


@functools.lru_cache(maxsize=1)
def _sorted_stdlib_files() -> tuple[str, ...]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for folder, subfolders, names in os.walk(root):
        # Prune third-party trees while walking: site-packages holds most files under stdlib/.
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_STDLIB_DIRS and d != "__pycache__"]
        relative = Path(folder).relative_to(root)
        found.extend((relative / name).as_posix() for name in names if name.endswith(".py"))
    return tuple(str(Path(root) / rel) for rel in sorted(found))


def stdlib_files(max_documents: int = 0) -> list[Path]:
    """The standard library's own .py files: sorted, then a fixed seeded permutation."""
    files = list(_sorted_stdlib_files())
    random.Random(EMBEDDED_SEED).shuffle(files)  # the permutation depends on the length alone
    return [Path(p) for p in (files[:max_documents] if max_documents > 0 else files)]


def _read_text_files(paths: list[str]) -> Iterator[dict[str, str | None]]:
    """Generator behind the embedded source: one row per file; undecodable files yield None."""
    for path in paths:
        try:
            text: str | None = Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            text = None  # counted as malformed downstream
        yield {EMBEDDED_TEXT_FIELD: text}


def _rows_of(dataset: datasets.IterableDataset) -> Iterator[dict]:
    """Generator that re-exposes a dataset as a single shard."""
    yield from dataset


def _files_dataset(cfg: DataConfig) -> datasets.IterableDataset:
    files, fmt = check_files(cfg)
    # A .txt file is one document (a book, a source file), not one document per line.
    extra = {"sample_by": "document"} if fmt == "text" else {}
    try:
        return datasets.load_dataset(fmt, data_files=files, split="train", streaming=True, **extra)
    except READ_ERRORS as err:  # datasets reads the first block to infer the columns
        raise DataError(f"data.paths: cannot read the {fmt} files: {err}") from err


def _hub_dataset(cfg: DataConfig) -> datasets.IterableDataset:
    if not cfg.hub_id:
        raise ValueError("data.hub_id: data.source=hub needs a dataset id")
    try:
        return datasets.load_dataset(cfg.hub_id, name=cfg.hub_config, split=cfg.hub_split, streaming=True)
    except Exception as err:  # offline, unknown id or config: say which setting to check
        raise DataError(
            f"cannot open hub dataset data.hub_id={cfg.hub_id!r} (data.hub_config={cfg.hub_config!r}, "
            f"data.hub_split={cfg.hub_split!r}): {err}"
        ) from err


def open_source(cfg: DataConfig, rank: int = 0, world_size: int = 1) -> tuple[datasets.IterableDataset, str]:
    """This rank's share of the raw rows, and the column that holds the text.

    Sharding is by whole files when their number divides world_size, otherwise round-robin by
    row (datasets' `split_dataset_by_node`); either way the ranks together read every row once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    if cfg.source == "embedded":
        paths = [str(p) for p in stdlib_files(cfg.max_documents)]
        dataset = datasets.IterableDataset.from_generator(_read_text_files, gen_kwargs={"paths": paths})
        text_field = EMBEDDED_TEXT_FIELD
    elif cfg.source in ("files", "hub"):
        dataset = _files_dataset(cfg) if cfg.source == "files" else _hub_dataset(cfg)
        if cfg.max_documents > 0:
            # One shard forces row round-robin across ranks: with whole files per rank, `take`
            # would cap each rank separately and the capped set would depend on the rank count.
            capped = dataset.take(cfg.max_documents)
            dataset = datasets.IterableDataset.from_generator(_rows_of, gen_kwargs={"dataset": capped})
        text_field = cfg.text_field
    else:
        raise ValueError(f"data.source: {cfg.source!r} is not one of embedded, files, hub")
    if world_size > 1:
        dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)
    return dataset, text_field
