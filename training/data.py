"""The corpus, its deterministic train/validation split, and the order in which blocks are read.

Documents come from (in order of precedence) `--data` text files, folders of them, or `datasets`
datasets saved with `save_to_disk`; with no `--data`, from the Python standard library that runs
swapformer (its `.py` sources, docstrings included; test suites and site-packages left out), which
exists on every machine without a download.

Determinism, which `--resume` and the multi-process run rely on:
- documents are listed in sorted path order, and each goes to validation or training by a hash of
  its name, so the split does not depend on the file system's order or on which files exist;
- tokens are packed into blocks of `seq_len` (documents joined by `</s>`); with `--packing` each
  document of a block is its own sequence (`DocumentPacking`: position ids restart after every
  `</s>`), so no token attends across a document boundary;
- the block read at global position p (step * global batch + row) is a pure function of
  (seed, p): a fresh permutation per epoch. Resuming at step s therefore needs only s.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys
import sysconfig
from dataclasses import dataclass

import numpy as np
import torch

from .args import TrainArgumentError

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
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if STDLIB_SKIP & set(rel.parts[:-1]):
            continue
        try:
            docs.append(Document(rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few files are not UTF-8; skipping them is as deterministic as reading them
    return docs


def is_saved_dataset(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "dataset_info.json"))
        or os.path.isfile(os.path.join(path, "dataset_dict.json"))
    )


def dataset_documents(path: str, text_column: str) -> list[Document]:
    """Rows of a `datasets` Dataset saved with save_to_disk, or of the train, validation and test splits
    of a DatasetDict (its validation split replaces the hashed hold-out; its test split is scored once,
    after training)."""
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
        return _rows(ds, path, text_column, name, None)
    if "train" not in ds:
        raise TrainArgumentError(f"--data {path!r} is a DatasetDict without a 'train' split: {list(ds)}")
    validation = "validation" in ds
    docs = _rows(
        ds["train"],
        path,
        text_column,
        f"{name}/train" if validation else name,
        "train" if validation else None,
    )
    for split in ("validation", "test"):
        if split in ds:
            rows = _rows(ds[split], path, text_column, f"{name}/{split}", split)
            if not rows:
                raise TrainArgumentError(
                    f"--data {path!r}: its {split!r} split has no text in column {text_column!r} "
                    f"({len(ds[split])} rows); fill it, or drop the split from the DatasetDict"
                )
            docs += rows
    return docs


def _rows(ds, path: str, text_column: str, prefix: str, split: str | None) -> list[Document]:
    if text_column not in ds.column_names:
        raise TrainArgumentError(
            f"--text-column {text_column!r} is not a column of --data {path!r}; columns: {ds.column_names}"
        )
    return [Document(f"{prefix}/{i}", text, split) for i, text in enumerate(ds[text_column]) if text]


def path_documents(path: str) -> list[Document]:
    """A text file, or every text file under a folder (sorted, by suffix in TEXT_SUFFIXES)."""
    if os.path.isfile(path):
        files, root = [pathlib.Path(path)], pathlib.Path(path).parent
    else:
        root = pathlib.Path(path)
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise TrainArgumentError(f"--data {path!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise TrainArgumentError(f"--data file {str(f)!r} is not UTF-8 text: {e}") from e
        name = f.relative_to(root).as_posix()
        pieces = _pieces(text, PIECE_CHARS)
        docs += [Document(name if len(pieces) == 1 else f"{name}#{i}", p) for i, p in enumerate(pieces)]
    return docs


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters (a long file, such as a single
    corpus file, becomes many documents, so the split can hold some of it out)."""
    pieces, current, length = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        length += len(line)
        if length >= size:
            pieces.append("".join(current))
            current, length = [], 0
    if current:
        pieces.append("".join(current))
    return [p for p in pieces if p]


def load_documents(data: list[str], text_column: str) -> tuple[list[Document], str]:
    """All documents of the run and a short name of the corpus (for the model card)."""
    if not data:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        return stdlib_documents(), f"python-{version}-stdlib"
    docs = []
    for path in data:
        docs += dataset_documents(path, text_column) if is_saved_dataset(path) else path_documents(path)
    if not docs:
        raise TrainArgumentError(f"--data {data} holds no text")
    return docs, "+".join(os.path.basename(os.path.normpath(p)) for p in data)


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


def pack(tokenizer, docs: list[Document], seq_len: int) -> torch.Tensor:
    """Token ids of the documents, each followed by `</s>`, cut into (N, seq_len) blocks."""
    if not docs:  # the tokenizer fails on an empty batch
        return torch.empty(0, seq_len, dtype=torch.long)
    encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    stream = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=np.int64)
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].copy()).view(n, seq_len)


def document_positions(blocks: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(N, T) position of each token within its document: 0 at the start of a block and after every
    `</s>` (a document ends with its `</s>`; one cut by a block boundary continues as a new sequence)."""
    starts = torch.zeros_like(blocks, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = blocks[:, :-1] == eos_id
    index = torch.arange(blocks.shape[1]).expand_as(blocks)
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


class DocumentPacking:
    """`--packing`: an objective whose batches keep documents apart. The blocks are the same, and so is
    everything drawn from the generator; the batch gains `position_ids` restarting at every document
    (what the models read as packed sequences), and a causal LM takes no loss on a document's first
    token (which would be predicted from the previous document, as DataCollatorWithFlattening's
    labels also leave out). A pure function of the blocks: batches stay a function of (seed, step)."""

    def __init__(self, objective, eos_id: int):
        self.objective = objective
        self.eos_id = eos_id
        self.shift = objective.shift

    def __call__(self, blocks: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        batch = self.objective(blocks, generator)
        positions = document_positions(blocks, self.eos_id)
        batch["position_ids"] = positions
        if self.shift:
            batch["labels"] = batch["labels"].masked_fill(positions == 0, -100)
        return batch

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        return self.objective.num_targets(batch)


class BlockOrder:
    """Which training block sits at each global position: epoch e reads a permutation drawn from
    (seed, e), so any step's batch can be rebuilt from the step number alone."""

    def __init__(self, num_blocks: int, seed: int):
        self.num_blocks = num_blocks
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_blocks, generator=g)
            if len(self._perms) > 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Block indices at global positions start, ..., start + count - 1."""
        out = [self._perm(p // self.num_blocks)[p % self.num_blocks] for p in range(start, start + count)]
        return torch.stack(out)

    def epoch(self, position: int) -> float:
        return position / self.num_blocks


def fingerprint(blocks: torch.Tensor) -> str:
    """A short hash of the token blocks: a resumed run refuses data that changed since the checkpoint."""
    return hashlib.sha1(blocks.numpy().tobytes()).hexdigest()[:16]
