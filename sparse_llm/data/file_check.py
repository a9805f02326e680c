"""Up-front checks of local data files: they exist, and each one is the text its suffix claims.

`datasets` reads a file only when the stream reaches it, and a binary, undecodable or
unparseable file then fails deep inside it (a UnicodeDecodeError or pyarrow traceback, possibly
after the run directory exists). `check_file` reads only a file's start (its first bytes, its
first JSON lines, a parquet footer) and raises one DataError naming the file and what is wrong,
before anything is built. A fault further into a file is caught where the stream reads it
(sparse_llm.data.stream). Neither torch nor `datasets` is imported here: the training command checks
the files before it imports the trainer (a bad file is reported in a second, not after the imports).
"""

from __future__ import annotations

import codecs
import glob
import json
from pathlib import Path
from typing import TextIO

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from sparse_llm.config import DataConfig
from sparse_llm.data.errors import DataError

HEAD_BYTES = 1 << 16  # the start of a file read for the text checks
JSON_ROWS = 16  # the first rows of a JSON-lines file parsed, and searched for the text field
MAX_LINE_CHARS = 1 << 24  # a first "line" longer than this is not parsed (a file of one huge line)
MAX_FIELDS_SHOWN = 12
TEXT_TYPES = ("string", "large_string", "string_view")  # arrow types of a parquet text column
# fsspec's names of the compressions `file_format` accepts.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def check_files(cfg: DataConfig) -> tuple[list[str], str]:
    """The files of `data.paths` (source=files) and their `datasets` builder, each file checked with
    `check_file`: DataError for no matching file, mixed types or a file that is not its type."""
    files = resolve_paths(cfg.paths)
    formats = {file_format(f) for f in files}
    if len(formats) > 1:
        raise DataError(f"data.paths mixes file types ({', '.join(sorted(formats))}); use one type per run")
    fmt = formats.pop()
    for path in files:  # before the stream reaches them: one clear error, not a parser's traceback
        check_file(path, fmt, cfg.text_field)
    return files, fmt


def resolve_paths(patterns: list[str]) -> list[str]:
    """Expand `data.paths` (files or globs, `**` allowed) into a de-duplicated ordered file list."""
    if not patterns:
        raise DataError("data.paths: none given; data.source=files needs at least one file or glob")
    files: list[str] = []
    for pattern in patterns:
        expanded = str(Path(pattern).expanduser())
        matches = sorted(p for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
        if not matches:
            glob_in_dir = f"{pattern.rstrip('/')}/*.jsonl"
            hint = f" (a directory: use a glob such as {glob_in_dir!r})" if Path(expanded).is_dir() else ""
            raise DataError(f"data.paths: no file matches {pattern!r}{hint}")
        files.extend(str(Path(p).resolve()) for p in matches)
    return list(dict.fromkeys(files))


def file_format(path: str) -> str:
    """The `datasets` builder for a file, from its suffix (compressed files allowed)."""
    name = path.lower()
    for suffix in COMPRESSIONS:
        name = name.removesuffix(suffix)
    fmt = _FORMATS.get(Path(name).suffix)
    if fmt is None:
        raise DataError(f"data.paths: unsupported file type {path!r} (use .jsonl, .json, .parquet or .txt)")
    return fmt


def check_file(path: str, fmt: str, text_field: str) -> None:
    """Raise DataError when `path`, read as `fmt` ("text", "json" or "parquet", _FORMATS),
    is not what that format holds or (json, parquet) has no `text_field`."""
    suffix = Path(path).suffix.lower()
    compression = COMPRESSIONS.get(suffix)
    inner_suffix = Path(Path(path).stem).suffix.lower() if compression else suffix  # a.jsonl.gz: .jsonl
    if fmt == "parquet" and compression is None:
        _check_parquet(path, text_field)
        return
    try:
        with fsspec.open(path, "rb", compression=compression) as raw:
            head = raw.read(HEAD_BYTES)
            at_end = raw.read(1) == b""
        if fmt == "parquet":  # compressed parquet: its footer is out of reach, its magic is not
            if not head.startswith(b"PAR1"):
                raise _bad(path, "is not a parquet file (it does not start with PAR1)")
            return
        _check_text(head, path, at_end)
        # A .json file may hold one JSON array instead of lines (datasets reads it whole).
        array = inner_suffix == ".json" and head.lstrip().startswith(b"[")
        if fmt == "json" and not array:
            with fsspec.open(path, "rt", compression=compression, encoding="utf-8", newline="") as text:
                _check_json_lines(text, path, text_field)
    except DataError:
        raise
    except (OSError, ValueError, EOFError) as err:
        # A corrupt archive, or a compression this machine cannot read (.zst needs zstandard).
        raise _bad(path, f"cannot be read: {err}") from None


def _bad(path: str, problem: str) -> DataError:
    return DataError(f"data.paths: {path} {problem}")


def _check_text(head: bytes, path: str, at_end: bool) -> None:
    """`head`, the first bytes of a file (all of it when `at_end`), is UTF-8 text."""
    if b"\x00" in head:
        raise _bad(path, f"is not text: byte {head.index(0)} is NUL (a binary file?)")
    try:
        # Incremental: a character cut by the end of `head` is not an error unless the file ends.
        codecs.getincrementaldecoder("utf-8")().decode(head, final=at_end)
    except UnicodeDecodeError as err:
        raise _bad(path, f"is not UTF-8 text: byte 0x{head[err.start]:02x} at offset {err.start}") from None


def _check_json_lines(lines: TextIO, path: str, text_field: str) -> None:
    """The first JSON_ROWS non-blank lines are JSON objects, and one of them has `text_field`."""
    fields: set[str] = set()
    rows = number = 0
    found = False
    while rows < JSON_ROWS:
        number += 1
        try:
            line = lines.readline(MAX_LINE_CHARS)
        except UnicodeDecodeError as err:
            raise _bad(path, f"is not UTF-8 text past its first {HEAD_BYTES} bytes ({err.reason})") from None
        if not line or (len(line) == MAX_LINE_CHARS and not line.endswith("\n")):
            break  # the end, or a line too long to parse here (the stream still checks it)
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise _bad(path, f"is not JSON lines: line {number} does not parse ({err.msg})") from None
        if not isinstance(row, dict):
            raise _bad(path, f"is not JSON lines: line {number} is a {type(row).__name__}, not an object")
        found = found or text_field in row
        fields.update(row)
        rows += 1
    if rows and not found:
        raise _bad(
            path, f"has no field {text_field!r} in its first {rows} rows ({_listed('fields', fields)})"
        )


def _check_parquet(path: str, text_field: str) -> None:
    try:
        schema = pq.read_schema(path)  # the footer only
    except (pa.ArrowException, OSError) as err:
        raise _bad(path, f"is not a readable parquet file: {err}") from None
    if text_field not in schema.names:
        raise _bad(path, f"has no column {text_field!r} ({_listed('columns', schema.names)})")
    kind = schema.field(text_field).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if str(kind) not in TEXT_TYPES:
        raise _bad(path, f"has no text in column {text_field!r}: it holds {kind}")


def _listed(kind: str, names: set[str] | list[str]) -> str:
    shown = sorted(names)[:MAX_FIELDS_SHOWN]
    more = f", ... ({len(names)} in all)" if len(names) > len(shown) else ""
    return f"{kind} found: {', '.join(shown)}{more}; set data.text_field to the one holding the text"
