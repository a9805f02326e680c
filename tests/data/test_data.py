"""Data pipeline: packing, accounting, skipping, sharding, exact resume, splits, errors, presets."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from sparse_llm.config import DataConfig
from sparse_llm.data import DataError, TokenStream, load_tokenizer, validation_batches
from sparse_llm.data.documents import split_of
from sparse_llm.data.sources import stdlib_files
from sparse_llm.data.tokenizer import EMBEDDED_TOKENIZER_DIR, EOS_TOKEN

REPO = Path(__file__).resolve().parents[2]
SEQ = 15  # rows of 16 tokens: small, so that batches cut documents in many places


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("embedded")


def make_docs(n: int, tag: str = "d") -> list[str]:
    """Distinct documents of varied length (some shorter than a row, some spanning several)."""
    return [f"def {tag}{i}(x):\n    return x * {i}\n" + "# note\n" * (i % 7) for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def packed(tok, texts: list[str]) -> list[int]:
    """The expected stream: each document's tokens followed by one EOS."""
    out: list[int] = []
    for text in texts:
        out += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return out


def read_tokens(stream: TokenStream, n_tokens: int, batch_size: int = 3) -> list[int]:
    out: list[int] = []
    while len(out) < n_tokens:
        batch = stream.next_batch(batch_size)
        assert batch.dtype == torch.int64 and batch.shape == (batch_size, SEQ + 1)
        out += batch.flatten().tolist()
    return out


def train_texts(texts: list[str], val_fraction: float = DataConfig.val_fraction) -> list[str]:
    return [t for t in texts if t.strip() and split_of(t, val_fraction) == "train"]


def one_epoch(tok, stream: TokenStream) -> list[str]:
    """Decode the stream's documents up to the first repeat of its first document."""
    tokens = read_tokens(stream, 64)
    while True:
        docs, start = [], 0
        for i, t in enumerate(tokens):
            if t == tok.eos_token_id:
                docs.append(tok.decode(tokens[start:i]))
                start = i + 1
        if docs.count(docs[0]) > 1:
            return docs[: docs.index(docs[0], 1)]
        tokens += read_tokens(stream, 64)


def files_cfg(paths: list[Path], **kw) -> DataConfig:
    return DataConfig(source="files", paths=[str(p) for p in paths], **kw)


# -- tokenizer ---------------------------------------------------------------------------------


def test_embedded_tokenizer_is_small_exportable_and_has_eos(tok, tmp_path):
    assert sum(f.stat().st_size for f in EMBEDDED_TOKENIZER_DIR.iterdir()) < 1_000_000
    assert len(tok) == 4096 and tok.eos_token == EOS_TOKEN and tok.eos_token_id is not None
    text = "def f(x):\n    return 'héllo' + x  # ünïcode 🙂\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.eos_token_id == tok.eos_token_id


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="cannot load tokenizer"):
        load_tokenizer(str(tmp_path))  # a directory without a tokenizer


# -- packing and accounting ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "txt"])
def test_packing_is_exact_for_each_file_type(tok, tmp_path, kind):
    texts = make_docs(30)
    parts = [texts[:13], texts[13:14], texts[14:]]  # files of very different sizes
    paths = []
    for i, part in enumerate(parts):
        if kind == "jsonl":
            paths.append(
                write_jsonl(tmp_path / f"p{i}.jsonl", [{"text": t, "id": n} for n, t in enumerate(part)])
            )
        elif kind == "parquet":
            paths.append(tmp_path / f"p{i}.parquet")
            pq.write_table(pa.table({"text": part}), paths[-1], row_group_size=4)
        else:
            for j, text in enumerate(part):  # a .txt file is one document
                paths.append(tmp_path / f"p{i}_{j:02d}.txt")
                paths[-1].write_text(text)
    pattern = str(tmp_path / f"p*.{kind}")  # a glob: files in sorted order
    stream = TokenStream(DataConfig(source="files", paths=[pattern]), tok, SEQ)
    expected = packed(tok, train_texts(texts))
    got = read_tokens(stream, 2 * len(expected))
    # Every token of every train document, and one EOS after each, exactly once and in order;
    # then the next epoch starts over.
    assert got[: len(expected)] == expected
    assert got[len(expected) : 2 * len(expected)] == expected
    assert stream.counters["epoch"] >= 1


def test_empty_and_malformed_documents_are_skipped_and_counted(tok, tmp_path):
    good = make_docs(4)
    rows = [
        {"text": good[0]},
        {"text": ""},
        {"text": "  \n\t"},
        {"id": 3},  # text missing
        {"text": None},
        {"text": 42},
        {"text": ["a", "list"]},
        {"text": good[1]},
        {"text": good[2]},
        {"text": good[3]},
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    stream = TokenStream(files_cfg([path], val_fraction=0.0), tok, SEQ)
    expected = packed(tok, good)
    assert read_tokens(stream, len(expected), batch_size=1)[: len(expected)] == expected
    while stream.counters["epoch"] == 0:
        stream.next_batch(1)
    counters = stream.counters
    assert counters["empty_skipped"] == 2 and counters["malformed_skipped"] == 4
    assert counters["documents"] == len(good) + 1  # the first document of epoch 1 has started
    assert counters["tokens"] % (SEQ + 1) == 0 and counters["tokens"] > len(expected)


# -- sharding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_files", [3, 4])  # 3: round-robin by row; 4: whole files per rank
def test_two_ranks_cover_every_document_once(tok, tmp_path, n_files):
    texts = make_docs(41)
    paths = [
        write_jsonl(tmp_path / f"s{i}.jsonl", [{"text": t} for t in texts[i::n_files]])
        for i in range(n_files)
    ]
    cfg = files_cfg(paths)
    per_rank = [one_epoch(tok, TokenStream(cfg, tok, SEQ, rank=r, world_size=2)) for r in range(2)]
    for docs in per_rank:
        assert docs and len(set(docs)) == len(docs)
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(train_texts(texts))
    # A cap on rows means the same rows for any rank count.
    capped = [t for p in paths for t in (json.loads(line)["text"] for line in p.read_text().splitlines())][:9]
    cfg = files_cfg(paths, max_documents=9)
    per_rank = [one_epoch(tok, TokenStream(cfg, tok, SEQ, rank=r, world_size=2)) for r in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == sorted(train_texts(capped))


# -- resume --------------------------------------------------------------------------------------


def assert_resumes_exactly(make_stream, steps: int, batch_size: int, stops: list[int], epochs: int) -> None:
    """A stream restored from the state after k batches continues exactly like the original."""
    reference = make_stream()
    states, batches, counters = [], [], []
    for _ in range(steps):
        states.append(json.loads(json.dumps(reference.state_dict())))  # as stored in a checkpoint
        counters.append(reference.counters)
        batches.append(reference.next_batch(batch_size))
    assert reference.counters["epoch"] >= epochs  # the batches cross epoch boundaries
    assert any(states[k]["offset"] > 0 for k in stops)  # some stops cut a document
    for k in stops:
        resumed = make_stream()
        resumed.load_state_dict(states[k])
        assert resumed.counters == counters[k]
        for j in range(k, steps):
            assert torch.equal(resumed.next_batch(batch_size), batches[j]), f"resumed at {k}, batch {j}"


def test_resume_is_exact_across_epochs_files(tok, tmp_path):
    texts = make_docs(25)
    paths = [write_jsonl(tmp_path / f"r{i}.jsonl", [{"text": t} for t in texts[i::3]]) for i in range(3)]
    # ~1100 tokens per epoch, 48 per batch: 40 batches cross two epoch boundaries.
    assert_resumes_exactly(
        lambda: TokenStream(files_cfg(paths), tok, SEQ), 40, 3, [0, 1, 7, 22, 23, 31], epochs=2
    )
    assert_resumes_exactly(
        lambda: TokenStream(files_cfg(paths), tok, SEQ, rank=1, world_size=2), 20, 2, [0, 5, 13, 19], epochs=1
    )
    capped = files_cfg(paths, max_documents=7)
    assert_resumes_exactly(lambda: TokenStream(capped, tok, SEQ, "train", 1, 2), 12, 2, [0, 4, 9], epochs=1)


def test_resume_is_exact_embedded(tok):
    cfg = DataConfig(max_documents=3, val_fraction=0.0)
    epoch_tokens = len(
        packed(tok, train_texts([f.read_text(encoding="utf-8") for f in stdlib_files(3)], 0.0))
    )
    steps = epoch_tokens * 3 // (2 * 8 * 256) + 2  # one and a half epochs of 8 x 256 tokens
    stops = [0, steps // 3, steps // 2, steps - 1]
    assert_resumes_exactly(lambda: TokenStream(cfg, tok, 255), steps, 8, stops, epochs=1)


def test_resume_rejects_a_different_setup(tok, tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in make_docs(5)])
    stream = TokenStream(files_cfg([path]), tok, SEQ)
    stream.next_batch(2)
    state = stream.state_dict()
    with pytest.raises(ValueError, match="world_size"):
        TokenStream(files_cfg([path]), tok, SEQ, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="val_fraction"):
        TokenStream(files_cfg([path], val_fraction=0.5), tok, SEQ).load_state_dict(state)


# -- train / validation split --------------------------------------------------------------------


def test_train_and_val_are_disjoint_and_independent_of_rank_count(tok, tmp_path):
    texts = make_docs(60)
    paths = [write_jsonl(tmp_path / f"v{i}.jsonl", [{"text": t} for t in texts[i::3]]) for i in range(3)]
    cfg = files_cfg(paths, val_fraction=0.3)
    train = one_epoch(tok, TokenStream(cfg, tok, SEQ))
    val = one_epoch(tok, TokenStream(cfg, tok, SEQ, split="val"))
    assert val and not set(train) & set(val)
    assert sorted(train + val) == sorted(texts)
    val_two_ranks = [one_epoch(tok, TokenStream(cfg, tok, SEQ, "val", r, 2)) for r in range(2)]
    assert sorted(val_two_ranks[0] + val_two_ranks[1]) == sorted(val)

    batches = validation_batches(cfg, tok, SEQ, batch_size=4, num_batches=3)
    again = validation_batches(cfg, tok, SEQ, batch_size=4, num_batches=3)
    assert len(batches) == 3 and all(b.shape == (4, SEQ + 1) and b.dtype == torch.int64 for b in batches)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert validation_batches(files_cfg(paths, val_fraction=0.0), tok, SEQ, 4, 3) == []


# -- embedded source -----------------------------------------------------------------------------


def test_embedded_source_is_stdlib_in_a_fixed_mixed_order(tok):
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)
    assert stdlib_files(7) == files[:7]
    assert files != sorted(files)  # mixed, not alphabetical
    batches = validation_batches(DataConfig(max_documents=40, val_fraction=0.2), tok, 63, 2, 2)
    assert len(batches) == 2 and batches[0].shape == (2, 64)
    stream = TokenStream(DataConfig(max_documents=2, val_fraction=0.0), tok, 63)
    first = stream.next_batch(2)[0, :10].tolist()
    assert first == tok(files[0].read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"][:10]


# -- errors --------------------------------------------------------------------------------------


def test_clear_errors(tok, tmp_path):
    with pytest.raises(DataError, match="no file matches"):
        TokenStream(files_cfg([tmp_path / "missing*.jsonl"]), tok, SEQ)
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"text": " "}, {"text": None}, {"other": "x"}])
    with pytest.raises(ValueError, match="no usable train documents"):
        TokenStream(files_cfg([blank]), tok, SEQ).next_batch(1)
    (tmp_path / "doc.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match="unsupported file type"):
        TokenStream(files_cfg([tmp_path / "doc.csv"]), tok, SEQ)
    (tmp_path / "doc.txt").write_text("hello")
    with pytest.raises(ValueError, match="mixes file types"):
        TokenStream(files_cfg([blank, tmp_path / "doc.txt"]), tok, SEQ)
    with pytest.raises(ValueError, match="val_fraction is 0"):
        TokenStream(files_cfg([blank], val_fraction=0.0), tok, SEQ, split="val")


# -- hub (no network: datasets.load_dataset is replaced) ----------------------------------------


def test_hub_source_passes_its_settings(tok, monkeypatch):
    texts = make_docs(9)
    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False, **kwargs):
        calls.append({"path": path, "name": name, "split": split, "streaming": streaming, **kwargs})
        return datasets.Dataset.from_dict({"content": texts}).to_iterable_dataset(num_shards=3)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(
        source="hub",
        hub_id="org/corpus",
        hub_config="sample",
        hub_split="train",
        text_field="content",
        val_fraction=0.0,
    )
    stream = TokenStream(cfg, tok, SEQ)
    expected = packed(tok, texts)
    assert read_tokens(stream, len(expected))[: len(expected)] == expected
    assert calls == [{"path": "org/corpus", "name": "sample", "split": "train", "streaming": True}]


# -- Hydra presets -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["embedded", "files", "fineweb_edu"])
def test_data_presets_match_the_schema(preset):
    raw = OmegaConf.load(REPO / "configs" / "data" / f"{preset}.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), raw))
    assert cfg.name == preset
    if preset == "embedded":  # the default group: the schema's defaults but a larger held-out set
        assert cfg == DataConfig(val_fraction=cfg.val_fraction)
