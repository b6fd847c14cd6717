"""Token shards (issue 29): `swapformer train` tokenizes each split once into a memory-mapped array on disk,
makes the same blocks the in-memory `pack` made before, and a second run with the same data and tokenizer
reuses the shards without calling the tokenizer."""

from __future__ import annotations

import hashlib
import pathlib

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetDict, Features, Value
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from swapformer.training import corpus, doc_table
from swapformer.training.data import pack, prepare_data
from swapformer.training.preflight import check_run
from swapformer.training.tokenizer import train_tokenizer

from training_runs import tiny_args

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def prepared(out: pathlib.Path, data, **overrides):
    """What `swapformer train` prepares before its first step (a fresh run in `out`)."""
    args, _ = check_run(tiny_args(out, data, cache_dir=str(out.parent / "cache"), **overrides))
    return args, prepare_data(args, Accelerator(cpu=True), out, fresh=True)


def dataset_dict(tmp_path: pathlib.Path, text_folder: pathlib.Path) -> pathlib.Path:
    texts = [p.read_text() for p in sorted(text_folder.glob("*.txt"))]
    splits = {"train": texts[:14], "validation": texts[14:17], "test": texts[17:]}
    path = tmp_path / "dd"
    DatasetDict({k: Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(path)
    return path


def expected_blocks(args, tokenizer) -> dict[str, torch.Tensor]:
    """The blocks of each split as the in-memory path makes them: every document read into a string,
    split by corpus.split_documents, packed by data.pack."""
    docs, _ = corpus.load_documents(args.data, args.text_column)
    train, val = corpus.split_documents(docs, args.val_fraction, args.max_train_chars, args.max_val_chars)
    test = corpus.documents_of_test_split(docs, args.max_val_chars)
    return {
        name: pack(tokenizer, split, args.seq_len)
        for name, split in (("train", train), ("val", val), ("test", test))
    }


@pytest.mark.parametrize("source", ["stdlib", "folder", "dataset dict"])
def test_blocks_read_from_shards_are_those_pack_makes(source, tmp_path, text_folder):
    """The same token blocks as before (hence the same losses and perplexity), read through a memmap of the
    shard file: the default run on the standard library with the tiny preset's budgets, a folder of text
    files read whole, and a DatasetDict with its own validation and test splits."""
    data = {"stdlib": None, "folder": text_folder, "dataset dict": dataset_dict(tmp_path, text_folder)}[
        source
    ]
    budgets = dict(max_train_chars=200_000, max_val_chars=20_000) if data is None else dict(max_train_chars=0)
    args, run = prepared(tmp_path / "run", data, **budgets)
    want = expected_blocks(args, run.tokenizer)
    got = {"train": run.train_blocks, "val": run.val_blocks, "test": run.test_blocks}
    for name, blocks in got.items():
        assert blocks.shape == want[name].shape, name
        if len(blocks):
            assert isinstance(blocks.memmap(), np.memmap)  # read from the file, not from a copy in memory
            assert torch.equal(blocks[torch.arange(len(blocks))], want[name]), name
    assert (len(want["test"]) > 0) == (source == "dataset dict")
    # the checkpoint's data fingerprint is the one runs saved before the shards: they still resume
    assert run.fingerprint == hashlib.sha1(want["train"].numpy().tobytes()).hexdigest()[:16]


def test_a_second_run_reuses_the_shards_without_calling_the_tokenizer(tmp_path, text_folder, monkeypatch):
    """Same data, same tokenizer: the documents are not read again and no text is tokenized; the blocks are
    the first run's. A changed file makes new shards."""
    tokenizer = tmp_path / "tokenizer"
    train_tokenizer([p.read_text() for p in sorted(text_folder.glob("*.txt"))], 600).save_pretrained(
        tokenizer
    )
    data = tmp_path / "data"
    data.mkdir()
    for p in sorted(text_folder.glob("*.txt")):
        (data / p.name).write_text(p.read_text())
    _, first = prepared(tmp_path / "first", data, tokenizer=str(tokenizer))

    calls = []
    original_call, original_iter = PreTrainedTokenizerBase.__call__, doc_table.iter_documents
    monkeypatch.setattr(
        PreTrainedTokenizerBase,
        "__call__",
        lambda *a, **k: calls.append("tokenizer") or original_call(*a, **k),
    )
    monkeypatch.setattr(
        doc_table, "iter_documents", lambda *a, **k: calls.append("read") or original_iter(*a, **k)
    )
    _, second = prepared(tmp_path / "second", data, tokenizer=str(tokenizer))
    assert calls == []
    assert torch.equal(
        second.train_blocks[torch.arange(len(second.train_blocks))],
        first.train_blocks[torch.arange(len(first.train_blocks))],
    )

    edited = sorted(data.glob("*.txt"))[0]
    edited.write_text(edited.read_text().replace("def ", "fed "))
    _, third = prepared(tmp_path / "third", data, tokenizer=str(tokenizer))
    assert "tokenizer" in calls and "read" in calls
    assert third.fingerprint != first.fingerprint


def test_chunks_and_tokenizing_processes_do_not_change_the_blocks(tmp_path, text_folder, monkeypatch):
    """Tokenized in chunks of about 20,000 characters by 2 processes each (`Dataset.map(num_proc=2)`): the
    blocks made in one chunk by one process."""
    from swapformer.training import shards

    _, whole = prepared(tmp_path / "one" / "run", text_folder, max_train_chars=0, num_proc=1)
    chunks, cut = [], shards._chunks
    monkeypatch.setattr(shards, "CHUNK_CHARS", 20_000)
    monkeypatch.setattr(shards, "_chunks", lambda *a: chunks.append(cut(*a)) or chunks[-1])
    _, parts = prepared(tmp_path / "two" / "run", text_folder, max_train_chars=0, num_proc=2)
    assert len(chunks[0]) > 3  # the training split was cut into several chunks
    for name in ("train_blocks", "val_blocks"):
        a, b = getattr(whole, name), getattr(parts, name)
        assert torch.equal(a[torch.arange(len(a))], b[torch.arange(len(b))]), name


def test_the_splits_are_disjoint_and_cover_every_document(tmp_path, text_folder):
    """Without budgets every document is in exactly one split: the hashed hold-out, or the DatasetDict's own
    splits; the same rows on every call."""
    for data in ([str(text_folder)], [str(dataset_dict(tmp_path, text_folder))]):
        table, _ = doc_table.document_table(data, "text", tmp_path / "cache")
        rows = doc_table.split_rows(table, 0.15, 0, 0)
        taken = [r for split in rows.values() for r in split[0].tolist()]
        assert sorted(taken) == list(range(len(table)))  # each row once
        again = doc_table.split_rows(table, 0.15, 0, 0)
        assert all(np.array_equal(rows[s][0], again[s][0]) for s in rows)


def test_token_shards_go_to_the_swapformer_cache_folder_unless_given(tmp_path, monkeypatch):
    from swapformer.training.shards import cache_dir

    monkeypatch.setenv("SWAPFORMER_CACHE_DIR", str(tmp_path / "sf"))
    assert cache_dir(None) == tmp_path / "sf" / "tokens"
    assert cache_dir(str(tmp_path / "given")) == tmp_path / "given"
    monkeypatch.delenv("SWAPFORMER_CACHE_DIR")
    assert cache_dir(None).name == "swapformer-tokens"


def test_texts_read_by_byte_span_are_the_tables_texts_and_leave_no_mapping(tmp_path, text_folder):
    """The shards and the tokenizer read documents by byte span (doc_table.text_spans, read_texts) rather
    than through the table's memory map: every row's text is the table's, multi-byte characters and
    empty texts included, across several Arrow files, and no new mapping of the files is left behind."""
    from datasets import concatenate_datasets

    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "accents.txt").write_text("café, naïve, Ζεύς, 東京 ✓\n" * 50)
    first, _ = doc_table.document_table([str(text_folder)], "text", tmp_path / "cache")
    second, _ = doc_table.document_table([str(extra)], "text", tmp_path / "cache")
    table = concatenate_datasets([first, second])
    files = [f["filename"] for f in table.cache_files]
    assert len(files) == 2

    def mappings() -> int:
        text = pathlib.Path("/proc/self/maps").read_text()
        return sum(text.count(f) for f in files)

    before = mappings()
    found, spans = doc_table.text_spans(table)
    rows = np.arange(len(table))[::-1]
    assert found == files and spans.shape == (len(table), 3)
    assert doc_table.read_texts(found, spans[rows]) == table.select(rows.tolist())["text"]
    empty = spans[:1].copy()
    empty[0, 2] = empty[0, 1]
    assert doc_table.read_texts(found, empty) == [""]
    assert list(doc_table.split_texts(table, rows[:3], np.array([5, 5, 5]))) == [
        t[:5] for t in table.select(rows[:3].tolist())["text"]
    ]
    assert mappings() == before
    wide = Dataset.from_dict({"text": ["ab", "", "ζ✓"]}, features=Features({"text": Value("large_string")}))
    wide = wide.flatten_indices(cache_file_name=str(tmp_path / "wide.arrow"))  # 64-bit offsets, on disk
    assert doc_table.read_texts(*doc_table.text_spans(wide)) == ["ab", "", "ζ✓"]
