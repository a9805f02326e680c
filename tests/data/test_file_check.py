"""Up-front checks of local data files (sparse_llm.data.file_check), and what the stream says about
faults they cannot see."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_files import BAD_FILES, write_bad_file

from sparse_llm.config import DataConfig
from sparse_llm.data import DataError, TokenStream, load_tokenizer
from sparse_llm.data.file_check import HEAD_BYTES, check_file, file_format


def check(path: Path, text_field: str = "text") -> None:
    check_file(str(path), file_format(str(path)), text_field)


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_each_bad_file_is_one_error_naming_it_and_the_fault(tmp_path, name):
    path, words = write_bad_file(tmp_path, name)
    with pytest.raises(DataError) as caught:
        check(path)
    message = str(caught.value)
    assert message.startswith(f"data.paths: {path} ") and words in message
    assert "\n" not in message


def test_good_files_pass(tmp_path):
    (tmp_path / "a.txt").write_text("def f():\n    return 'héllo'\n")
    rows = [{"id": 1}, {"text": "x", "id": 2}]  # the field in one of the first rows is enough
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "b.jsonl").write_text("")  # no rows: nothing to say (the stream counts documents)
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "compressed"}) + "\n")
    (tmp_path / "d.json").write_text(json.dumps([{"text": "one JSON array"}]))
    pq.write_table(pa.table({"text": pa.array(["x"]).dictionary_encode()}), tmp_path / "e.parquet")
    # A multi-byte character cut by the end of the bytes read is not a decoding error.
    (tmp_path / "f.txt").write_bytes(b"a" * (HEAD_BYTES - 1) + "é".encode() + b"b")
    for path in sorted(tmp_path.iterdir()):
        check(path)


def test_other_text_field_and_compressed_binary(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    check(path, text_field="content")
    with pytest.raises(DataError, match="fields found: content"):
        check(path)
    with gzip.open(tmp_path / "b.txt.gz", "wb") as f:
        f.write(b"\x00\x01binary")
    with pytest.raises(DataError, match=r"b\.txt\.gz is not text"):
        check(tmp_path / "b.txt.gz")
    (tmp_path / "c.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"c\.jsonl\.gz cannot be read"):
        check(tmp_path / "c.jsonl.gz")


def test_a_fault_past_the_start_of_a_file_is_a_data_error_while_reading(tmp_path):
    rows = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(200))
    path = tmp_path / "late.jsonl"
    path.write_text(rows + '{"text": not json}\n')
    check(path)  # its first rows are fine
    stream = TokenStream(
        DataConfig(source="files", paths=[str(path)], val_fraction=0.0), load_tokenizer("embedded"), 15
    )
    with pytest.raises(
        DataError, match=r"cannot read data\.source='files' after 0 rows of epoch 0: JSON parse"
    ):
        stream.next_batch(1)


def test_a_truncated_archive_is_a_data_error_when_opened(tmp_path):
    rows = "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(5000)).encode()
    packed = gzip.compress(rows)
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(packed[: len(packed) // 2])
    check(path)  # its start decompresses
    with pytest.raises(DataError, match="cannot read the json files: Compressed file ended"):
        TokenStream(DataConfig(source="files", paths=[str(path)]), load_tokenizer("embedded"), 15)


def test_no_usable_documents_names_the_fields_the_rows_have(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"text": 42, "body": "x"}) + "\n")  # the field is there, not text
    stream = TokenStream(
        DataConfig(source="files", paths=[str(path)], val_fraction=0.0), load_tokenizer("embedded"), 15
    )
    with pytest.raises(
        DataError, match=r"1 malformed \(no string under 'text'; the first one's fields: body, text\)"
    ):
        stream.next_batch(1)
