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


def rows_of(dataset, where: str) -> Iterator[dict]:
    """The rows of a streamed `datasets` dataset read from `where` (said in the error). datasets casts every
    row to the columns of the first rows it read, and fails where later rows have others: that is said in
    one line with the columns and the fix, not as datasets' multi-line cast report."""
    from datasets.exceptions import CastError

    rows = iter(dataset)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except CastError as e:
            found, before = (getattr(e, n, "?") for n in ("table_column_names", "requested_column_names"))
            raise TrainArgumentError(
                f"rows of {where} do not all have the same columns: rows with columns {found} follow rows with "
                f"{before}, and `datasets` reads a stream's rows with the columns it met first; give every "
                "row the same columns (e.g. keep only the text column)"
            ) from e
        yield row


def iter_rows(path: pathlib.Path, name: str, text_column: str) -> Iterator[tuple[str, str]]:
    """(document name `name/row`, text) of each non-empty `text_column` of a jsonl/json or parquet file."""
    from datasets import load_dataset

    rows = load_dataset(ROW_KINDS[path.suffix.lower()], data_files=str(path), split="train", streaming=True)
    where = f"--data file {str(path)!r}"
    for i, row in enumerate(rows_of(rows, where)):
        text = column_text(row, text_column, where)
        if text:
            yield f"{name}/{i}", text


def column_text(row: dict, column: str, where: str) -> str:
    """The text in `column` of a row read from `where` ("" for a null), or the error that names the columns."""
    if column not in row:
        raise TrainArgumentError(
            f"--text-column {column!r} is not a column of {where}; columns: {sorted(row)}; name the text's "
            "column with --text-column"
        )
    return row[column] or ""
