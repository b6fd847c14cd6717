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
With `--streaming` (streaming.py) the blocks are instead the stream packed in order, each process reading
its own part, and the position to resume from is state the checkpoint holds (`RunData.stream`).

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

import torch
from tqdm.auto import tqdm

from .args import TrainArgs, TrainArgumentError
from .checkpointing import start_run_folder

# the in-memory path (tests and benchmarks compare the shards with it, and read documents through data)
from .corpus import Document, corpus_name, documents_of_test_split, load_documents, split_documents  # noqa: F401
from .doc_table import Corpus, document_table, split_chars, split_rows
from .notices import stage
from .objectives import make_objective
from .packing import DocumentPacking, document_positions, pack  # noqa: F401 (tests read them here)
from .shards import TokenBlocks, cache_dir, fingerprint, token_shard
from .stream_source import stream_source
from .streaming import StreamCorpus, StreamOrder, TokenStream, read_stream
from .tokenizer import given_tokenizer, load_tokenizer, train_tokenizer

AUTO_PROC_CHARS = 50_000_000  # one more tokenizing process per this many characters of a split


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
    train_blocks: TokenBlocks | None  # (N, seq_len) token ids, read from the shard on disk (None: streamed)
    val_blocks: TokenBlocks
    objective: object
    order: BlockOrder
    val_batches: list[dict]  # the objective applied once, with a fixed generator
    test_blocks: TokenBlocks  # a DatasetDict's test split, scored once after training (may be empty)
    test_batches: list[dict]
    fingerprint: str  # of the training blocks: a resumed run refuses data that changed since the checkpoint
    stream: StreamOrder | None = None  # --streaming: the blocks of each step, read on (then also `order`)


def step_batch(data: RunData, step: int, global_batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The whole global batch of optimizer step `step` (1-based): every process builds the same one
    and takes its rows (step.forward_backward). A streamed run's steps must be drawn in order, once each."""
    if data.stream is not None:
        batch = data.objective(data.stream.blocks(), step_generator(seed, step))
        data.stream.count(batch, data.objective.shift)
        return batch
    indices = data.order.indices((step - 1) * global_batch, global_batch)
    return data.objective(data.train_blocks[indices], step_generator(seed, step))


def prepare_data(args: TrainArgs, accelerator, out: pathlib.Path, fresh: bool) -> RunData:
    """Documents, split, tokenizer, token blocks and evaluation batches, all checked before anything is
    written (a bad file, an empty split or an unusable tokenizer must not leave a folder behind).

    The main process reads the documents, trains or loads the tokenizer and writes the token shards; if
    that fails, every process raises its error. Only then does it create the output folder of a fresh run
    (tokenizer and training_args.json), from which the other processes read the tokenizer, and find the
    documents and the shards the main process cached."""
    given = (
        given_tokenizer(args.tokenizer, args.arch) if fresh else None
    )  # a bad --tokenizer fails before the documents are read
    data, error = None, None
    if accelerator.is_main_process:
        try:
            with tempfile.TemporaryDirectory() as scratch:
                corpus = _read_documents(args, accelerator)
                tokenizer = _run_tokenizer(args, out, fresh, given, corpus, scratch, accelerator)
                with stage(
                    accelerator, "tokenizing", f"the splits into blocks of {args.seq_len} tokens"
                ) as told:
                    data = _tokenized(args, tokenizer, corpus, accelerator, show=not args.no_progress)
                    training = (
                        "training read as it goes" if data.stream else f"{len(data.train_blocks):,} training"
                    )
                    told.result = f"{training}, {len(data.val_blocks):,} validation blocks"
                if fresh:
                    start_run_folder(out, args, tokenizer)
        except Exception as e:
            error = e
    _raise_everywhere(accelerator, error)
    accelerator.wait_for_everyone()
    if data is None:
        corpus = _read_documents(args, accelerator)
        data = _tokenized(args, load_tokenizer(str(out), args.arch), corpus, accelerator, show=False)
    return data


def _read_documents(args: TrainArgs, accelerator) -> Corpus | StreamCorpus:
    """The documents on disk and the rows of each split, said with their sizes (--streaming: the
    evaluation documents only)."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    source = ", ".join(args.data) or f"the Python {version} standard library"
    if args.streaming:
        with stage(accelerator, "reading the evaluation documents", source) as told:
            corpus = read_stream(args, corpus_name(args.data), stream_source(args.data, args.text_column))
            sizes = [f"{len(docs):,} {name} ({sum(len(d.text) for d in docs):,} characters)"
                     for name, docs in (("validation", corpus.validation), ("test", corpus.test)) if docs]  # fmt: skip
            told.result = f"{', '.join(sizes)}; training read as a stream"
        return corpus
    with stage(accelerator, "reading documents", source) as told:
        table, key = document_table(args.data, args.text_column, cache_dir(args.cache_dir))
        rows = split_rows(table, args.val_fraction, args.max_train_chars, args.max_val_chars)
        sizes = [f"{len(rows[s][0]):,} for {name} ({split_chars(table, *rows[s]):,} characters)"
                 for s, name in (("train", "training"), ("validation", "validation"), ("test", "test"))
                 if len(rows[s][0])]  # fmt: skip
        told.result = f"{len(table):,} documents: {', '.join(sizes)}"
    return Corpus(corpus_name(args.data), table, key, rows)


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
        texts, amount = corpus.tokenizer_texts(args.max_train_chars)
        detail = f"byte-level BPE of {args.vocab_size} tokens on {amount}"
        with stage(accelerator, "training a tokenizer", detail):
            tokenizer = train_tokenizer(texts, args.vocab_size)
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
            _too_short(split, len(rows), chars, args)
    return shards


def _too_short(split: str, documents: int, chars: int, args: TrainArgs):
    name = {"train": "training"}.get(split, split)
    raise TrainArgumentError(
        f"the {name} split ({documents} documents, {chars} characters) is shorter than one "
        f"--seq-len {args.seq_len} block; give more --data, raise --max-train-chars/--max-val-chars "
        "or lower --seq-len"
    )


def _objective(args: TrainArgs, tokenizer):
    objective = make_objective(tokenizer, args)
    return DocumentPacking(objective, tokenizer.eos_token_id) if args.packing else objective


def _tokenized(args: TrainArgs, tokenizer, corpus: Corpus | StreamCorpus, accelerator, show: bool) -> RunData:
    """Token blocks (memory-mapped views of the shards), the objective and the fixed evaluation batches."""
    if isinstance(corpus, StreamCorpus):
        return _streamed(args, tokenizer, corpus, accelerator)
    shards = _shards(args, tokenizer, corpus, show)
    objective = _objective(args, tokenizer)
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


def _streamed(args: TrainArgs, tokenizer, corpus: StreamCorpus, accelerator) -> RunData:
    """--streaming: evaluation blocks packed in memory, and this process's stream of training blocks
    (checked here to hold one block at least, before anything is written)."""
    objective = _objective(args, tokenizer)
    val, test = (pack(tokenizer, docs, args.seq_len) for docs in (corpus.validation, corpus.test))
    if not len(val):
        _too_short("validation", len(corpus.validation), sum(len(d.text) for d in corpus.validation), args)
    TokenStream(corpus, tokenizer, args).block()
    stream = TokenStream(corpus, tokenizer, args, accelerator.process_index, accelerator.num_processes)
    order = StreamOrder(stream, accelerator, args, len(tokenizer))
    return RunData(
        tokenizer,
        corpus.name,
        {"train": None, "validation": len(corpus.validation), "test": len(corpus.test)},
        None,
        val,
        objective,
        order,
        _eval_batches(args, objective, val, -1),
        test,
        _eval_batches(args, objective, test, -3),
        corpus.fingerprint(tokenizer),
        stream=order,
    )


def _eval_batches(args: TrainArgs, objective, blocks: torch.Tensor, stream: int) -> list[dict]:
    """The objective applied once to evaluation blocks, with a generator of their own (`stream`)."""
    generator = step_generator(args.seed, stream)
    return [
        objective(blocks[i : i + args.batch_size], generator) for i in range(0, len(blocks), args.batch_size)
    ]
