"""`--data` inputs read as rows: jsonl/json and parquet files, given by path or by a glob pattern, through
`datasets`' packaged loaders (`load_dataset("json"|"parquet", data_files=..., streaming=True)`: rows are
read in batches, never a whole file at once). Each row of `--text-column` is a document named
`{file}/{row}` (the file relative to the pattern's folder), so the hashed split does not depend on which
other files exist. A glob of text files reads them as text files, as a folder does."""

from __future__ import annotations

import glob
import os
import pathlib
from collections.abc import Iterator

from .args import TrainArgumentError

ROW_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def is_pattern(path: str) -> bool:
    return glob.has_magic(path)


def matches(pattern: str) -> tuple[list[pathlib.Path], pathlib.Path]:
    """(the files a --data glob matches, sorted; the folder their names are relative to)."""
    files = sorted(pathlib.Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise TrainArgumentError(
            f"--data {pattern!r} matches no file; check the pattern (quote it in the shell)"
        )
    root = pathlib.Path(pattern.split("*")[0].split("?")[0].split("[")[0])
    return files, root if root.is_dir() else root.parent


def is_row_file(path: pathlib.Path) -> bool:
    return path.suffix.lower() in ROW_KINDS


def iter_rows(path: pathlib.Path, name: str, text_column: str) -> Iterator[tuple[str, str]]:
    """(document name `name/row`, text) of each non-empty `text_column` of a jsonl/json or parquet file."""
    from datasets import load_dataset

    rows = load_dataset(ROW_KINDS[path.suffix.lower()], data_files=str(path), split="train", streaming=True)
    for i, row in enumerate(rows):
        if text_column not in row:
            raise TrainArgumentError(
                f"--text-column {text_column!r} is not a column of --data file {str(path)!r}; columns: "
                f"{sorted(row)}; name the text's column with --text-column"
            )
        if row[text_column]:
            yield f"{name}/{i}", row[text_column]
