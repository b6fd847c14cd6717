"""The corpus and its deterministic train/validation/test split: the documents a run learns from.

Documents come from (in order of precedence) `--data` text files, folders of them, or `datasets`
datasets saved with `save_to_disk`; with no `--data`, from the Python standard library that runs
swapformer (its `.py` sources, docstrings included; test suites and site-packages left out), which
exists on every machine without a download.

Documents are listed in sorted path order, and each goes to validation or training by a hash of its
name, so the split depends neither on the file system's order nor on which other files exist.
data.py turns the documents into token blocks and batches.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

from .args import TrainArgumentError
from .data_files import is_pattern, is_row_file, iter_rows, matches

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".tex")
PIECE_CHARS = 20_000  # --data text files longer than this become several documents
STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Document:
    name: str  # a stable identifier: path relative to its root, or dataset row
    text: str
    # the split a `datasets` DatasetDict put it in ("train", "validation", "test"); None: the hash decides
    split: str | None = None


def stdlib_documents() -> list[Document]:
    """The `.py` files of the running Python's standard library, sorted by relative path."""
    return list(iter_stdlib())


def stdlib_files() -> list[pathlib.Path]:
    """The standard library's `.py` files swapformer train reads, sorted by relative path."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(root.rglob("*.py")) if not STDLIB_SKIP & set(p.relative_to(root).parts[:-1])]


def iter_stdlib() -> Iterator[Document]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        try:
            yield Document(path.relative_to(root).as_posix(), path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few files are not UTF-8; skipping them is as deterministic as reading them


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "dataset_info.json"))
        or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def saved_dataset_splits(path: str, text_column: str) -> list[tuple[object, str, str | None]]:
    """(dataset, name prefix, split) of a `datasets` Dataset saved with save_to_disk, or of the train,
    validation and test splits of a DatasetDict (its validation split replaces the hashed hold-out; its test
    split is scored once, after training). Checked here, before any row is read."""
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(path)
    except Exception as e:  # datasets raises several types for a damaged folder; all mean the same here
        raise TrainArgumentError(
            f"--data {path!r} looks like a saved `datasets` dataset but cannot be read ({type(e).__name__}: {e}); "
            "save it again with save_to_disk, or remove its dataset_info.json/dataset_dict.json to read it as "
            "a folder of text files"
        ) from e
    name = os.path.basename(os.path.normpath(path))
    if not isinstance(ds, DatasetDict):
        parts = [(ds, name, None)]
    elif "train" not in ds:
        raise TrainArgumentError(f"--data {path!r} is a DatasetDict without a 'train' split: {list(ds)}")
    else:
        validation = "validation" in ds
        parts = [(ds["train"], f"{name}/train" if validation else name, "train" if validation else None)]
        parts += [(ds[s], f"{name}/{s}", s) for s in ("validation", "test") if s in ds]
    for part, _, split in parts:
        if text_column not in part.column_names:
            raise TrainArgumentError(
                f"--text-column {text_column!r} is not a column of --data {path!r}; columns: {part.column_names}"
            )
        if split in ("validation", "test") and not any(part[text_column]):
            raise TrainArgumentError(
                f"--data {path!r}: its {split!r} split has no text in column {text_column!r} "
                f"({len(part)} rows); fill it, or drop the split from the DatasetDict"
            )
    return parts


def dataset_documents(path: str, text_column: str) -> list[Document]:
    """Rows of a saved `datasets` dataset (saved_dataset_splits), as documents."""
    return list(iter_saved_dataset(path, text_column))


def iter_saved_dataset(path: str, text_column: str) -> Iterator[Document]:
    for ds, prefix, split in saved_dataset_splits(path, text_column):
        i = 0
        for batch in ds.select_columns([text_column]).iter(batch_size=1000):
            for text in batch[text_column]:
                if text:
                    yield Document(f"{prefix}/{i}", text, split)
                i += 1


def path_documents(path: str, text_column: str = "text") -> list[Document]:
    """A file, every text file under a folder (sorted, by suffix in TEXT_SUFFIXES), or a glob's files."""
    return list(iter_path(path, text_column))


def text_files(path: str) -> tuple[list[pathlib.Path], pathlib.Path]:
    """(the files of a --data file, folder or glob pattern, the root their names are relative to)."""
    if is_pattern(path):
        return matches(path)
    if os.path.isfile(path):
        return [pathlib.Path(path)], pathlib.Path(path).parent
    root = pathlib.Path(path)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise TrainArgumentError(f"--data {path!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return files, root


def iter_path(path: str, text_column: str = "text") -> Iterator[Document]:
    """The documents of a --data file, folder or pattern. A jsonl/json/parquet file named by its path or a
    pattern is read as rows of `text_column` (data_files.py); a folder's files, like any other file, as text."""
    files, root = text_files(path)
    rows = not os.path.isdir(path)
    for f in files:
        name = f.relative_to(root).as_posix()
        if rows and is_row_file(f):
            yield from (Document(n, text) for n, text in iter_rows(f, name, text_column))
            continue
        pieces = _file_pieces(f, PIECE_CHARS)
        first = next(pieces, None)
        second = next(pieces, None)
        if second is None:  # one piece: the document keeps the file's name
            if first is not None:
                yield Document(name, first)
            continue
        for i, piece in enumerate(itertools.chain((first, second), pieces)):
            yield Document(f"{name}#{i}", piece)


def _file_pieces(path: pathlib.Path, size: int) -> Iterator[str]:
    """The file cut at line ends into pieces of about `size` characters (a long file, such as a single
    corpus file, becomes many documents, so the split can hold some of it out). Read line by line, so a
    file larger than memory is never held whole; `str.splitlines` cuts each line where it cuts the whole."""
    current, length = [], 0
    try:
        with open(path, encoding="utf-8") as handle:
            for raw in handle:
                for line in raw.splitlines(keepends=True):
                    current.append(line)
                    length += len(line)
                    if length >= size:
                        yield "".join(current)
                        current, length = [], 0
    except UnicodeDecodeError as e:
        raise TrainArgumentError(f"--data file {str(path)!r} is not UTF-8 text: {e}") from e
    if current:
        yield "".join(current)


def iter_documents(data: list[str], text_column: str) -> Iterator[Document]:
    """Every document of the run, in a fixed order: the standard library's files without --data, else
    each --data input in turn."""
    if not data:
        yield from iter_stdlib()
    for path in data:
        yield from (
            iter_saved_dataset(path, text_column) if is_saved_dataset(path) else iter_path(path, text_column)
        )


def source_files(data: list[str]) -> list[pathlib.Path]:
    """Every file the documents of `data` are read from (what a cached copy of them depends on)."""
    if not data:
        return stdlib_files()
    files = []
    for path in data:
        if is_saved_dataset(path):
            files += sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())
        else:
            files += text_files(path)[0]
    return files


def corpus_name(data: list[str]) -> str:
    """A short name of the corpus (for the model card)."""
    if not data:
        return f"python-{sys.version_info[0]}.{sys.version_info[1]}-stdlib"
    return "+".join(os.path.basename(os.path.normpath(p)) for p in data)


def load_documents(data: list[str], text_column: str) -> tuple[list[Document], str]:
    """All documents of the run and a short name of the corpus (for the model card)."""
    docs = list(iter_documents(data, text_column))
    if not docs:
        raise TrainArgumentError(f"--data {data} holds no text")
    return docs, corpus_name(data)


def split_documents(
    docs: list[Document], val_fraction: float, max_train_chars: int, max_val_chars: int
) -> tuple[list[Document], list[Document]]:
    """Train and validation documents (test documents are left out: `documents_of_test_split`). A document
    a DatasetDict did not place is in validation when the hash of its name falls under `val_fraction`;
    each side is then taken in hash order up to its character budget (0: all), so a budget picks a
    spread-out sample rather than the first folders alphabetically."""

    def rank(doc: Document) -> float:
        return int.from_bytes(hashlib.sha1(doc.name.encode()).digest()[:8], "big") / 2**64

    ranked = sorted((d for d in docs if d.split != "test"), key=lambda d: (rank(d), d.name))
    val = [d for d in ranked if d.split == "validation" or (d.split is None and rank(d) < val_fraction)]
    train = [d for d in ranked if d.split == "train" or (d.split is None and rank(d) >= val_fraction)]
    if not val and len(train) > 1:  # few documents: hold the last one out rather than have no validation
        val = [train.pop()]
    if not val:
        raise TrainArgumentError("--data has a single document; give at least two so one can be held out")
    return _budget(train, max_train_chars), _budget(val, max_val_chars)


def documents_of_test_split(docs: list[Document], max_chars: int) -> list[Document]:
    """The test split's documents (DatasetDict test splits), in name order, within `max_chars`."""
    return _budget(sorted((d for d in docs if d.split == "test"), key=lambda d: d.name), max_chars)


def _budget(docs: list[Document], max_chars: int) -> list[Document]:
    """Documents in order up to `max_chars` (0: all), each contributing at most a tenth of the budget
    (its beginning), so one large file (a generated table, say) cannot make up a whole split."""
    if not max_chars:
        return docs
    out, total, per_doc = [], 0, max(1, max_chars // 10)
    for d in docs:
        if total >= max_chars:
            break
        text = d.text[: min(per_doc, max_chars - total)]
        out.append(Document(d.name, text))
        total += len(text)
    return out
