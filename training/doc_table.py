"""The documents of a run on disk, and the rows of each split.

The documents (corpus.iter_documents) are written once to an Arrow table by `datasets`
(`Dataset.from_generator`, memory-mapped), in a folder named by the inputs' paths, sizes and modification
times (`document_table`); a second run reads them back without reading the sources. Each split is a list of
row numbers in hash order, with the character budget as a per-row limit (`split_rows`: the rules of
corpus.split_documents, on arrays rather than strings, so no document is held in memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import pathlib
from dataclasses import dataclass

import numpy as np

from .args import TrainArgumentError
from .corpus import iter_documents, source_files

FORMAT = 1  # bumped when what a cached folder holds changes, so older folders are not read


@contextlib.contextmanager
def datasets_bars_off():
    """`datasets`' own progress bars off while swapformer shows its own; restored as they were."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _digest(*parts) -> str:
    h = hashlib.sha1()
    for part in parts:
        h.update(part if isinstance(part, bytes) else json.dumps(part, sort_keys=True).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _document_rows(data: list[str], text_column: str):
    for doc in iter_documents(data, text_column):
        rank = int.from_bytes(hashlib.sha1(doc.name.encode()).digest()[:8], "big") / 2**64
        yield {"name": doc.name, "text": doc.text, "split": doc.split, "rank": rank, "chars": len(doc.text)}


def document_table(data: list[str], text_column: str, cache: pathlib.Path):
    """(the documents as a memory-mapped `datasets.Dataset`, its key). The key hashes every input file's
    path, size and modification time: a changed file makes a new table, an unchanged one is read back."""
    from datasets import Dataset, concatenate_datasets

    stamps = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in source_files(data)]
    key = _digest(FORMAT, [os.path.abspath(p) for p in data], text_column, stamps)
    folder = cache / "documents" / key
    listing = folder / "files.json"  # written last: its presence marks a complete table
    if not listing.is_file():
        table = _write_table(data, text_column, folder)
        files = [os.path.relpath(f["filename"], folder) for f in table.cache_files]
        listing.write_text(json.dumps(files))
    with datasets_bars_off():
        parts = [Dataset.from_file(str(folder / f)) for f in json.loads(listing.read_text())]
    table = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    if len(table) == 0:
        raise TrainArgumentError(f"--data {data} holds no text")
    return table, key


def _write_table(data: list[str], text_column: str, folder: pathlib.Path):
    """The documents read once into Arrow files under `folder` by Dataset.from_generator."""
    from datasets import Dataset, Features, Value
    from datasets.exceptions import DatasetGenerationError

    kinds = dict(name="string", text="string", split="string", rank="float64", chars="int64")
    try:
        with datasets_bars_off():
            return Dataset.from_generator(
                _document_rows,
                features=Features({name: Value(kind) for name, kind in kinds.items()}),
                cache_dir=str(folder),
                gen_kwargs={"data": list(data), "text_column": text_column},
            )
    except DatasetGenerationError as e:  # a bad file met while reading: the reason, not datasets' wrapper
        raise (e.__cause__ if isinstance(e.__cause__, TrainArgumentError) else e) from None


def _column(table, name: str) -> np.ndarray:
    return table.data.column(name).to_numpy()


def _rank_order(table) -> np.ndarray:
    """Row numbers sorted by (rank, name), as corpus.split_documents sorts documents."""
    rank = _column(table, "rank")
    order = np.argsort(rank, kind="stable")
    tied = np.flatnonzero(np.diff(rank[order]) == 0)
    if len(tied):  # equal ranks (53 bits of a hash; practically never): those rows by name
        names = table.data.column("name").to_pylist()
        order = np.array(sorted(order.tolist(), key=lambda r: (rank[r], names[r])), dtype=np.int64)
    return order


def split_rows(table, val_fraction: float, max_train_chars: int, max_val_chars: int) -> dict:
    """{"train"|"validation"|"test": (row numbers, per-row character limits or None)}. A row a DatasetDict
    did not place goes to validation when its rank falls under `val_fraction`; each side is taken in rank
    order up to its character budget; test rows (a DatasetDict's test split) in name order."""
    import pyarrow.compute as pc

    column = table.data.column("split")

    def placed(name: str) -> np.ndarray:
        return pc.fill_null(pc.equal(column, name), False).to_numpy(zero_copy_only=False)

    unplaced = pc.is_null(column).to_numpy(zero_copy_only=False)
    rank, chars = _column(table, "rank"), _column(table, "chars")
    order = _rank_order(table)
    ranked = order[~placed("test")[order]]
    held = rank[ranked] < val_fraction
    val = ranked[placed("validation")[ranked] | (unplaced[ranked] & held)]
    train = ranked[placed("train")[ranked] | (unplaced[ranked] & ~held)]
    if not len(val) and len(train) > 1:  # few documents: hold the last one out rather than have no validation
        val, train = train[-1:], train[:-1]
    if not len(val):
        raise TrainArgumentError("--data has a single document; give at least two so one can be held out")
    test = np.flatnonzero(placed("test"))
    if len(test):
        names = table.select(test.tolist())["name"]
        test = test[np.array(sorted(range(len(test)), key=names.__getitem__), dtype=np.int64)]
    budgets = {"train": max_train_chars, "validation": max_val_chars, "test": max_val_chars}
    rows = {"train": train, "validation": val, "test": test}
    return {name: _budget(rows[name], chars, budgets[name]) for name in rows}


def _budget(rows: np.ndarray, chars: np.ndarray, max_chars: int) -> tuple[np.ndarray, np.ndarray | None]:
    """The rows taken up to `max_chars` (0: all), each limited to a tenth of the budget (its beginning), as
    corpus._budget takes documents."""
    if not max_chars:
        return rows, None
    limits, total, per_doc = [], 0, max(1, max_chars // 10)
    for r in rows:
        if total >= max_chars:
            break
        limit = min(per_doc, max_chars - total)
        limits.append(limit)
        total += min(int(chars[r]), limit)
    return rows[: len(limits)], np.array(limits, dtype=np.int64)


def split_texts(table, rows: np.ndarray, limits: np.ndarray | None):
    """The texts of a split in order, each within its limit (read in batches, for training a tokenizer; with
    file reads, as the token shards read them, so no page of the table stays resident)."""
    files, spans = text_spans(table)
    for start in range(0, len(rows), 1000):
        texts = read_texts(files, spans[rows[start : start + 1000]])
        for i, text in enumerate(texts):
            yield text if limits is None else text[: limits[start + i]]


def split_chars(table, rows: np.ndarray, limits: np.ndarray | None) -> int:
    chars = _column(table, "chars")[rows]
    return int(chars.sum() if limits is None else np.minimum(chars, limits).sum())


def text_spans(table) -> tuple[list[str], np.ndarray]:
    """(the table's Arrow files, a (rows, 3) array of each row's file number and the byte range of its text in
    that file). Texts are then read with `read_texts` (plain file reads), not through a memory map: read
    through a map, each document left about 1.1 MB of the file resident (measured on Linux 6.18, ext4), so
    a chunk of documents spread over a 1 GB table kept about 600 MB in each process that read it."""
    import pyarrow as pa

    files = [f["filename"] for f in table.cache_files]
    spans = []
    for number, path in enumerate(files):
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            view = pa.py_buffer(mapped)  # only buffer addresses are read: no page of text is touched
            for batch in pa.ipc.open_stream(pa.BufferReader(view)):
                column = batch.column("text")
                if column.null_count:
                    raise ValueError(
                        f"the document table {path} holds {column.null_count} missing texts; delete its "
                        "folder so that the next run writes it again"
                    )
                spans.append(_batch_spans(column, view.address, handle.fileno(), number))
                del column
                del batch
            del view
    return files, np.concatenate(spans) if spans else np.zeros((0, 3), dtype=np.int64)


def _batch_spans(column, base: int, fd: int, number: int) -> np.ndarray:
    """(file number, start, end) of each text of one record batch, its offsets read from the file."""
    import pyarrow as pa

    width = 8 if pa.types.is_large_string(column.type) else 4
    _, offsets, data = column.buffers()
    where = offsets.address - base + column.offset * width
    raw = os.pread(fd, (len(column) + 1) * width, where)
    bounds = np.frombuffer(raw, dtype=np.int64 if width == 8 else np.int32).astype(np.int64)
    start = (data.address - base) if data is not None else 0
    out = np.empty((len(column), 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = number, start + bounds[:-1], start + bounds[1:]
    return out


def read_texts(files: list[str], spans: np.ndarray) -> list[str]:
    """The texts at `spans` (rows of `text_spans`), read with plain file reads."""
    texts = []
    for number, start, end in spans.tolist():
        with open(files[number], "rb") as handle:
            texts.append(os.pread(handle.fileno(), end - start, start).decode("utf-8"))
    return texts


@dataclass
class Corpus:
    """The documents of a run on disk and the rows of each split (shards.split_rows)."""

    name: str
    table: object  # a memory-mapped datasets.Dataset
    key: str
    rows: dict  # {split: (row numbers, character limits or None)}

    def tokenizer_texts(self, max_train_chars: int) -> tuple[object, str]:  # noqa: ARG002 (the budget is in the rows)
        """(the training split's texts, how much that is in words): what the tokenizer is trained on."""
        rows = self.rows["train"]
        return split_texts(
            self.table, *rows
        ), f"{split_chars(self.table, *rows):,} characters of the training split"
