"""The data stage: token blocks, and the global batch of each optimizer step rebuilt from its number.

Determinism, which `--resume` and the multi-process run rely on:
- the documents and their split are deterministic (corpus.py, doc_table.py);
- tokens are packed into blocks of `seq_len` (documents joined by `</s>`), read from token shards on disk
  (shards.py: tokenized once, memory-mapped, the same blocks `pack` makes in memory); with `--packing` each
  document of a block is its own sequence (`DocumentPacking`: position ids restart after every
  `</s>`), so no token attends across a document boundary;
- the block read at global position p (step * global batch + row) is a pure function of
  (seed, p): a fresh permutation per epoch, and the objective's random draws come from a generator
  seeded by (seed, step). Resuming at step s therefore needs only s (`step_batch`).

`prepare_data` makes all of it before a fresh run's folder exists: a bad file, an empty split or an
unusable tokenizer fails the run before anything is written.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from .args import TrainArgs, TrainArgumentError
from .checkpointing import start_run_folder

# the in-memory path (tests and benchmarks compare the shards with it, and read documents through data)
from .corpus import Document, corpus_name, documents_of_test_split, load_documents, split_documents  # noqa: F401
from .doc_table import Corpus, document_table, split_chars, split_rows, split_texts
from .notices import stage
from .objectives import make_objective
from .shards import TokenBlocks, cache_dir, fingerprint, token_shard
from .tokenizer import load_tokenizer, train_tokenizer

AUTO_PROC_CHARS = 50_000_000  # one more tokenizing process per this many characters of a split


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
            # int32 where it fits: the same permutation (torch draws it alike for both types) in half the
            # memory, which grows with the corpus (8.5 M blocks of a 5 GB corpus: 34 MB rather than 68)
            small = self.num_blocks < 2**31
            self._perms[epoch] = torch.randperm(
                self.num_blocks, generator=g, dtype=torch.int32 if small else torch.int64
            )
            if len(self._perms) > 2:  # a batch spans at most two epochs
                self._perms.pop(min(self._perms))
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Block indices at global positions start, ..., start + count - 1."""
        out = [self._perm(p // self.num_blocks)[p % self.num_blocks] for p in range(start, start + count)]
        return torch.stack(out).long()

    def epoch(self, position: int) -> float:
        return position / self.num_blocks


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random stream of one step's objective (masks, spans), the same in every process. Negative
    `step`s are the streams of the evaluation batches and of the unigram baseline's counts."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 7919 * step + 1)


@dataclass
class RunData:
    """Everything derived from the corpus; the same in every process."""

    tokenizer: object
    corpus_name: str
    documents: dict[str, int]  # documents per split ("train", "validation", "test")
    train_blocks: TokenBlocks  # (N, seq_len) token ids, read from the shard on disk
    val_blocks: TokenBlocks
    objective: object
    order: BlockOrder
    val_batches: list[dict]  # the objective applied once, with a fixed generator
    test_blocks: TokenBlocks  # a DatasetDict's test split, scored once after training (may be empty)
    test_batches: list[dict]
    fingerprint: str  # of the training blocks: a resumed run refuses data that changed since the checkpoint


def step_batch(data: RunData, step: int, global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The whole global batch of optimizer step `step` (1-based): every process builds the same one
    and takes its rows (step.forward_backward)."""
    indices = data.order.indices((step - 1) * global_batch, global_batch)
    return data.objective(data.train_blocks[indices], step_generator(seed, step))


def prepare_data(args: TrainArgs, accelerator, out: pathlib.Path, fresh: bool) -> RunData:
    """Documents, split, tokenizer, token blocks and evaluation batches, all checked before anything is
    written (a bad file, an empty split or an unusable tokenizer must not leave a folder behind).

    The main process reads the documents, trains or loads the tokenizer and writes the token shards; if
    that fails, every process raises its error. Only then does it create the output folder of a fresh run
    (tokenizer and training_args.json), from which the other processes read the tokenizer, and find the
    documents and the shards the main process cached."""
    given = _given_tokenizer(args) if fresh else None  # a bad --tokenizer fails before the documents are read
    data, error = None, None
    if accelerator.is_main_process:
        try:
            with tempfile.TemporaryDirectory() as scratch:
                corpus = _read_documents(args, accelerator)
                tokenizer = _run_tokenizer(args, out, fresh, given, corpus, scratch, accelerator)
                with stage(
                    accelerator, "tokenizing", f"the splits into blocks of {args.seq_len} tokens"
                ) as told:
                    data = _tokenized(args, tokenizer, corpus, show=not args.no_progress)
                    told.result = (
                        f"{len(data.train_blocks):,} training, {len(data.val_blocks):,} validation blocks"
                    )
                if fresh:
                    start_run_folder(out, args, tokenizer)
        except Exception as e:
            error = e
    _raise_everywhere(accelerator, error)
    accelerator.wait_for_everyone()
    if data is None:
        corpus = _read_documents(args, accelerator)
        data = _tokenized(args, load_tokenizer(str(out), args.arch), corpus, show=False)
    return data


def _read_documents(args: TrainArgs, accelerator) -> Corpus:
    """The documents on disk and the rows of each split, said with their sizes."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = ", ".join(args.data) or f"the Python {version} standard library"
    with stage(accelerator, "reading documents", source) as told:
        table, key = document_table(args.data, args.text_column, cache_dir(args.cache_dir))
        rows = split_rows(table, args.val_fraction, args.max_train_chars, args.max_val_chars)
        sizes = [f"{len(rows[s][0]):,} for {name} ({split_chars(table, *rows[s]):,} characters)"
                 for s, name in (("train", "training"), ("validation", "validation"), ("test", "test"))
                 if len(rows[s][0])]  # fmt: skip
        told.result = f"{len(table):,} documents: {', '.join(sizes)}"
    return Corpus(corpus_name(args.data), table, key, rows)


def _given_tokenizer(args: TrainArgs):
    """The tokenizer --tokenizer names (loaded in every process: cheap, and each raises the same error),
    or None when the run trains its own."""
    if args.tokenizer is None:
        return None
    try:
        return load_tokenizer(args.tokenizer, args.arch)
    except TrainArgumentError:
        raise
    except (OSError, ValueError) as e:  # what transformers raises for a folder it cannot read
        raise TrainArgumentError(
            f"--tokenizer {args.tokenizer!r} is not a saved tokenizer folder ({e}); give a folder written "
            "by save_pretrained, or omit --tokenizer to train one"
        ) from e


def _run_tokenizer(
    args: TrainArgs, out: pathlib.Path, fresh: bool, given, corpus: Corpus, scratch: str, accelerator
):
    """The run's tokenizer as every process will read it back from the output folder: a fresh one
    (`given` by --tokenizer, or trained) goes through save_pretrained and load_tokenizer in `scratch` first."""
    if not fresh:
        return load_tokenizer(str(out), args.arch)
    if given is not None:
        tokenizer = given
    else:
        chars = split_chars(corpus.table, *corpus.rows["train"])
        detail = f"byte-level BPE of {args.vocab_size} tokens on {chars:,} characters of the training split"
        with stage(accelerator, "training a tokenizer", detail):
            tokenizer = train_tokenizer(split_texts(corpus.table, *corpus.rows["train"]), args.vocab_size)
    tokenizer.save_pretrained(scratch)
    return load_tokenizer(scratch, args.arch)


def _raise_everywhere(accelerator, error: Exception | None) -> None:
    """Re-raise the main process's preparation error in it, and a copy in every other process (which
    would otherwise wait for it at the next collective call forever)."""
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        verdict = [None if error is None else (isinstance(error, TrainArgumentError), str(error))]
        broadcast_object_list(verdict)
        if not accelerator.is_main_process and verdict[0] is not None:
            users, message = verdict[0]
            raise (TrainArgumentError if users else RuntimeError)(message)
    if error is not None:
        raise error


def _shards(args: TrainArgs, tokenizer, corpus: Corpus, show: bool) -> dict:
    """{split: its token shard}, tokenized now or found cached; refuses a split too short for one block."""
    shards = {}
    for split, (rows, limits) in corpus.rows.items():
        chars = split_chars(corpus.table, rows, limits)
        num_proc = args.num_proc or min(os.cpu_count() or 1, 1 + chars // AUTO_PROC_CHARS)
        bar = functools.partial(
            tqdm, total=len(rows), desc=f"tokenizing {split}", unit="doc", disable=not show, leave=False
        )
        shards[split] = token_shard(
            corpus.table,
            corpus.key,
            rows,
            limits,
            tokenizer,
            cache_dir(args.cache_dir),
            num_proc=num_proc,
            bar=bar,
        )
        if (split != "test" or len(rows)) and len(shards[split].blocks(args.seq_len)) == 0:
            name = {"train": "training"}.get(split, split)
            raise TrainArgumentError(
                f"the {name} split ({len(rows)} documents, {chars} characters) is shorter than one "
                f"--seq-len {args.seq_len} block; give more --data, raise --max-train-chars/--max-val-chars "
                "or lower --seq-len"
            )
    return shards


def _tokenized(args: TrainArgs, tokenizer, corpus: Corpus, show: bool) -> RunData:
    """Token blocks (memory-mapped views of the shards), the objective and the fixed evaluation batches."""
    shards = _shards(args, tokenizer, corpus, show)
    objective = make_objective(tokenizer, args)
    if args.packing:
        objective = DocumentPacking(objective, tokenizer.eos_token_id)
    train_blocks, val_blocks, test_blocks = (
        shards[s].blocks(args.seq_len) for s in ("train", "validation", "test")
    )
    return RunData(
        tokenizer,
        corpus.name,
        {split: len(rows) for split, (rows, _) in corpus.rows.items()},
        train_blocks,
        val_blocks,
        objective,
        BlockOrder(len(train_blocks), args.seed),
        _eval_batches(args, objective, val_blocks, -1),
        test_blocks,
        _eval_batches(args, objective, test_blocks, -3),
        fingerprint(shards["train"], args.seq_len),
    )


def _eval_batches(args: TrainArgs, objective, blocks: torch.Tensor, stream: int) -> list[dict]:
    """The objective applied once to evaluation blocks, with a generator of their own (`stream`)."""
    generator = step_generator(args.seed, stream)
    return [
        objective(blocks[i : i + args.batch_size], generator) for i in range(0, len(blocks), args.batch_size)
    ]
