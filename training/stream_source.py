"""What `--data` names under `--streaming`: a source `datasets` opens lazily, one split at a time, as an
`IterableDataset` (`load_dataset(..., streaming=True)`, or a saved dataset's `to_iterable_dataset`).

- no --data: the standard library's `.py` files (corpus.stdlib_files), each file one document;
- files and glob patterns of one kind: jsonl/json or parquet (rows of --text-column) or text files (each
  file one document: datasets' text loader with `sample_by="document"`), several --data of the same kind
  read as one stream in the order given;
- a folder: `load_dataset(folder)` (datasets infers the loader from its files, and its splits from their
  names: `train`, and `validation`/`test` where present), or a dataset saved with `save_to_disk`;
- any other name: a `datasets` dataset on the Hub (which needs a network).

`stream_source` resolves all of that from names, sizes and the listing, reading no row but the first line
of each JSON-lines file and each parquet file's schema (their columns must agree); it is what preflight
calls, so an input the stream cannot read is refused before anything is created.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

from .args import TrainArgumentError
from .corpus import is_saved_dataset, stdlib_files
from .data_files import ROW_KINDS, column_text, is_pattern, matches, rows_of

MAX_TEXT_FILE_BYTES = 256 << 20  # a text file is one document, read whole: larger ones are refused


@dataclass(frozen=True)
class StreamSource:
    """A streamable --data: `kind` is a datasets loader ("json", "parquet", "text") over `files`, "folder"
    (load_dataset of a local folder), "saved" (a save_to_disk folder) or "hub" (a Hub dataset name)."""

    kind: str
    path: str  # the folder, saved dataset or Hub name; "" for files
    files: tuple[str, ...]  # every local file read (their stamps key the run's data fingerprint)
    text_column: str
    loader: str = ""  # a folder's loader, as datasets infers it ("text": each file one document)

    def split(self, name: str):
        """The IterableDataset of split `name`, or None where the source has no such split (files have only
        "train": their validation split is held out by hash)."""
        from datasets import load_dataset

        if self.kind == "saved":
            return _saved_split(self.path, name)
        if self.kind in ("folder", "hub"):
            options = {"sample_by": "document"} if self.loader == "text" else {}
            splits = _opened(self.path, lambda: load_dataset(self.path, streaming=True, **options))
            return splits.get(name)
        if name != "train":
            return None
        options = {"sample_by": "document"} if self.kind == "text" else {}
        return load_dataset(self.kind, data_files=list(self.files), split="train", streaming=True, **options)

    def where(self, split: str) -> str:
        """`split` of this source, as the errors name it."""
        many = f" (and {len(self.files) - 1} more files)" if len(self.files) > 1 and not self.path else ""
        return f"the {split} split of --data {self.path or self.files[0]!r}{many}"

    def rows(self, dataset, split: str) -> Iterator[dict]:
        """The rows of `dataset`, this source's split `split` (rows of other columns refused in one line)."""
        return rows_of(dataset, self.where(split))

    def text_of(self, row: dict, split: str) -> str:
        """The document of one row of `split` (the text loader's column is always "text")."""
        column = "text" if "text" in (self.kind, self.loader) else self.text_column
        return column_text(row, column, self.where(split))


def stream_source(data: list[str], text_column: str) -> StreamSource:
    """The source of a --streaming run, or a TrainArgumentError naming the input and the fix."""
    if not data:
        return StreamSource("text", "", tuple(map(str, stdlib_files())), text_column)
    single = [p for p in data if not is_pattern(p) and not os.path.isfile(p)]
    if single and len(data) > 1:
        raise TrainArgumentError(
            f"--streaming reads one folder or dataset name alone, or files of one kind; got --data {data}: "
            f"give {single[0]!r} as the only --data, or give its files (a quoted glob) instead"
        )
    if single:
        return _named_source(data[0], text_column)
    files = [f for path in data for f in (matches(path)[0] if is_pattern(path) else [pathlib.Path(path)])]
    kinds = {ROW_KINDS.get(f.suffix.lower(), "text") for f in files}
    if len(kinds) > 1:
        raise TrainArgumentError(
            f"--streaming reads files of one kind as one stream; --data {data} mixes {sorted(kinds)}: give "
            "files of one kind (convert the others to it), or drop --streaming to read them all"
        )
    kind = kinds.pop()
    if kind == "text":
        big = [f for f in files if f.stat().st_size > MAX_TEXT_FILE_BYTES]
        if big:
            raise TrainArgumentError(
                f"--streaming reads a text file whole, as one document; {str(big[0])!r} holds "
                f"{big[0].stat().st_size:,} bytes (over {MAX_TEXT_FILE_BYTES:,}): split it into files, write "
                "it as jsonl rows, or drop --streaming (which cuts it into 20,000-character documents)"
            )
    if kind in ("json", "parquet"):
        _same_columns(files)
    return StreamSource(kind, "", tuple(map(str, files)), text_column)


def _columns(path: pathlib.Path) -> frozenset[str] | None:
    """The columns of a parquet file (its schema) or of a JSON-lines file (its first row's keys); None for a
    JSON file whose first line is not a whole object (an array: its columns cost a full read)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return frozenset(pq.read_schema(path).names)
    with open(path, encoding="utf-8", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except ValueError:
        return None
    return frozenset(row) if isinstance(row, dict) else None


def _same_columns(files: list[pathlib.Path]) -> None:
    """datasets streams row files as one dataset cast to the first file's columns, and fails where a later
    file has others, which may be hours into a run: the files' columns are compared here instead."""
    seen: tuple[pathlib.Path, frozenset[str]] | None = None
    for path in files:
        columns = _columns(path)
        if columns is None:
            continue
        if seen is not None and columns != seen[1]:
            raise TrainArgumentError(
                f"--streaming reads the --data files as one stream, whose rows must have the same columns; "
                f"{str(seen[0])!r} has columns {sorted(seen[1])} and {str(path)!r} has {sorted(columns)}: "
                "give files with the same columns (e.g. only the text column), or drop --streaming (which "
                "reads each file on its own)"
            )
        seen = seen or (path, columns)


def _named_source(path: str, text_column: str) -> StreamSource:
    """A folder, a saved dataset or a Hub dataset name; the split names are checked here."""
    if is_saved_dataset(path):
        files = tuple(str(p) for p in sorted(pathlib.Path(path).rglob("*")) if p.is_file())
        source = StreamSource("saved", path, files, text_column)
    elif os.path.isdir(path):
        from datasets import load_dataset_builder

        files = tuple(str(p) for p in sorted(pathlib.Path(path).rglob("*")) if p.is_file())
        loader = _opened(path, lambda: {"train": load_dataset_builder(path).name})["train"]
        source = StreamSource("folder", path, files, text_column, loader)
    else:
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        try:
            validate_repo_id(path)
        except HFValidationError:
            raise TrainArgumentError(
                f"--data {path!r}: no such file or folder, nor a `datasets` name (user-or-org/name)"
            ) from None
        return StreamSource("hub", path, (), text_column)  # opened (over the network) when the data is read
    if source.split("train") is None:
        raise TrainArgumentError(
            f"--data {path!r} has no 'train' split for --streaming to train on; name its training files "
            "train*, or give them as files"
        )
    return source


def _opened(path: str, load):
    """load() as a {split: IterableDataset} mapping, datasets' failure said in one line with the input."""
    try:
        splits = load()
    except TrainArgumentError:
        raise
    except Exception as e:  # datasets raises many types for a folder or name it cannot read
        where = " is no local file or folder, and" if not os.path.exists(path) else ""
        raise TrainArgumentError(
            f"--data {path!r}{where} cannot be streamed by `datasets` ({type(e).__name__}: {e}); give jsonl, "
            "parquet or text files, or drop --streaming"
        ) from e
    return splits if isinstance(splits, dict) else {"train": splits}


def _saved_split(path: str, name: str):
    """A split of a save_to_disk folder as an IterableDataset over its memory-mapped Arrow files."""
    from datasets import load_from_disk

    saved = _opened(path, lambda: load_from_disk(path))
    part = saved.get(name)
    if part is None:
        return None
    return part.to_iterable_dataset(num_shards=max(1, len(part.cache_files)))
