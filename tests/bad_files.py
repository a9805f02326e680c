"""Files that are not the text they claim to be, one per kind of fault and per format the `files`
data source reads, with the words the error about each must contain."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# The start of an ELF program, then every byte value: binary, with NUL bytes early.
BINARY = b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8
LATIN1 = "café au lait\n".encode("latin-1")  # é as one byte: not UTF-8


def _parquet(path: Path, table: pa.Table) -> Path:
    pq.write_table(table, path)
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _truncated_parquet(path: Path) -> Path:
    _parquet(path, pa.table({"text": ["a document"] * 10}))
    return _write(path, path.read_bytes()[:-20])  # the footer cut off


# name -> (file name, how to write it, words the error names)
BAD_FILES = {
    "txt_binary": ("a.txt", lambda p: _write(p, BINARY), "is not text: byte 7 is NUL"),
    "txt_undecodable": ("a.txt", lambda p: _write(p, LATIN1), "is not UTF-8 text: byte 0xe9 at offset 3"),
    "jsonl_binary": ("a.jsonl", lambda p: _write(p, BINARY), "is not text: byte 7 is NUL"),
    "jsonl_undecodable": ("a.jsonl", lambda p: _write(p, b'{"text": "' + LATIN1 + b'"}\n'), "not UTF-8"),
    "jsonl_unparseable": (
        "a.jsonl",
        lambda p: _write(p, b'{"text": "fine"}\n{"text": not json}\n'),
        "line 2 does not parse",
    ),
    "jsonl_without_field": (
        "a.jsonl",
        lambda p: _write(p, b'{"id": 1, "body": "x"}\n{"id": 2, "body": "y"}\n'),
        "no field 'text' in its first 2 rows (fields found: body, id;",
    ),
    "parquet_binary": ("a.parquet", lambda p: _write(p, BINARY), "is not a readable parquet file"),
    "parquet_unparseable": ("a.parquet", _truncated_parquet, "is not a readable parquet file"),
    "parquet_undecodable": (
        "a.parquet",
        lambda p: _parquet(p, pa.table({"text": pa.array([LATIN1], pa.binary())})),
        "no text in column 'text': it holds binary",
    ),
    "parquet_without_column": (
        "a.parquet",
        lambda p: _parquet(p, pa.table({"body": ["x"], "id": [1]})),
        "no column 'text' (columns found: body, id;",
    ),
}


def write_bad_file(directory: Path, name: str) -> tuple[Path, str]:
    """Write BAD_FILES[name] into `directory`: (its path, the words its error must contain)."""
    file_name, write, words = BAD_FILES[name]
    directory.mkdir(parents=True, exist_ok=True)
    return write(directory / file_name), words
