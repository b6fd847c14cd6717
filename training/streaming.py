"""`--streaming`: the training documents read as a `datasets` IterableDataset (stream_source.py), tokenized as
they are read and packed into blocks in order; no token shard is written and the corpus is never held.

- The split. A document goes to validation when the hash of its text falls under --val-fraction (a
  source with its own `validation` split uses that instead); the validation (and a `test` split's)
  documents are the first ones of the stream within --max-val-chars, read once before training and held
  as blocks. Training reads the rest: the same documents in every process and on every run.
- The order. Documents are read in the source's order, never shuffled: a shuffle buffer cannot be restored
  exactly on resume, and a seeded order of shards shuffles nothing for the one-file corpora this takes.
  Shuffle the corpus once when writing it.
- A pass (an "epoch"): one reading of a process's part of the training split, or of its share of
  --max-train-chars (each document at most a tenth of that share, as the token shards' budget takes them).
  A pass's last partial block is dropped, as `pack` drops it, so every pass reads the same blocks.
- Processes. Each reads a disjoint part (`datasets.distributed.split_dataset_by_node`: whole files when
  their number divides the processes, else every world-th document) and packs its own blocks; the global
  batch of a step is gathered from all of them in the order step.forward_backward slices it.
- The position. A checkpoint holds, per process, the stream's `state_dict()` and the tokens of documents
  already read that no block has taken yet (`TokenStream.position`); a resumed run draws exactly the blocks
  the uninterrupted one would have.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .args import TrainArgs, TrainArgumentError
from .corpus import Document
from .doc_table import _digest
from .evaluation import target_labels
from .shards import tokenizer_key
from .stream_source import StreamSource

TOKENIZER_CHARS = 50_000_000  # the BPE is trained on at most this many characters of the training stream


def held_out(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation side: the hash of its text, not its place, decides."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2**64 < val_fraction


def budgeted(texts: Iterator[str], max_chars: int) -> Iterator[str]:
    """`texts` up to `max_chars` characters (0: all), each cut to a tenth of the budget (corpus._budget)."""
    taken, per_doc = 0, max(1, max_chars // 10)
    for text in texts:
        if max_chars and taken >= max_chars:
            return
        if max_chars:
            text = text[: min(per_doc, max_chars - taken)]
        taken += len(text)
        yield text


def stream_texts(source: StreamSource, dataset, split: str) -> Iterator[str]:
    """The non-empty documents of an IterableDataset of `source`, in its order."""
    for row in source.rows(dataset, split):
        text = source.text_of(row, split)
        if text:
            yield text


@dataclass
class StreamCorpus:
    """What a --streaming run knows before training: the source and the evaluation documents."""

    name: str
    source: StreamSource
    val_fraction: float
    hold_out: bool  # False where the source has its own validation split
    validation: list[Document]
    test: list[Document]

    def training_texts(self) -> Iterator[str]:
        """The training side of the whole (unsplit) training stream, in order."""
        texts = stream_texts(self.source, self.source.split("train"), "train")
        return (t for t in texts if not (self.hold_out and held_out(t, self.val_fraction)))

    def tokenizer_texts(self, max_train_chars: int) -> tuple[Iterator[str], str]:
        cap = min(max_train_chars or TOKENIZER_CHARS, TOKENIZER_CHARS)
        texts = budgeted(self.training_texts(), cap)
        return texts, f"at most the first {cap:,} characters of the training stream"

    def fingerprint(self, tokenizer) -> str:
        """`stream-<inputs>-<tokenizer>`: the inputs by their files' paths, sizes and modification times
        (a Hub dataset by its name), so a resume can say which of the two changed."""
        stamps = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in self.source.files]
        inputs = _digest(self.source.kind, self.source.path, stamps, self.val_fraction)[:12]
        return f"stream-{inputs}-{tokenizer_key(tokenizer)[:12]}"


def read_stream(args: TrainArgs, name: str, source: StreamSource) -> StreamCorpus:
    """The evaluation documents of a --streaming run (each split within --max-val-chars, in stream order)."""
    own = source.split("validation")
    if own is None:
        pool = stream_texts(source, source.split("train"), "train")
        own_texts = (t for t in pool if held_out(t, args.val_fraction))
    else:
        own_texts = stream_texts(source, own, "validation")
    validation = [
        Document(f"validation/{i}", t) for i, t in enumerate(budgeted(own_texts, args.max_val_chars))
    ]
    if not validation and own is not None:
        raise TrainArgumentError(
            f"--streaming: the validation split of --data {source.path!r} holds no non-empty document, and a "
            "source with its own validation split is evaluated on it (nothing is held out of train); put "
            "documents in it, or remove it to hold --val-fraction of train out"
        )
    if not validation:
        raise TrainArgumentError(
            f"--streaming: no document of --data falls in the validation hold-out (--val-fraction "
            f"{args.val_fraction}: the hash of a document's text decides); raise --val-fraction, or give "
            "more documents or a validation split"
        )
    test = source.split("test")
    test_texts = budgeted(stream_texts(source, test, "test"), args.max_val_chars) if test is not None else ()
    test_docs = [Document(f"test/{i}", t) for i, t in enumerate(test_texts)]
    return StreamCorpus(name, source, args.val_fraction, own is None, validation, test_docs)


class TokenStream:
    """One process's training blocks: its part of the training split, the held-out documents left out,
    tokenized as read (each document followed by `</s>`) and packed in order into blocks of `seq_len`."""

    def __init__(self, corpus: StreamCorpus, tokenizer, args: TrainArgs, rank: int = 0, world: int = 1):
        self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, args.seq_len
        self.rank, self.world = rank, world
        self.budget = max(1, args.max_train_chars // world) if args.max_train_chars else 0
        self.passes, self.chars, self.blocks_in_pass, self.pass_blocks = 0, 0, 0, None
        self.carry: list[int] = []
        self._dataset = self._rows = self._resume_at = None

    def _open(self) -> None:
        from datasets.distributed import split_dataset_by_node

        dataset = self.corpus.source.split("train")
        if self.world > 1:
            dataset = split_dataset_by_node(dataset, rank=self.rank, world_size=self.world)
        if self._resume_at is not None:
            dataset.load_state_dict(self._resume_at)
            self._resume_at = None
        self._dataset, self._rows = dataset, self.corpus.source.rows(dataset, "train")

    def _next_text(self) -> str | None:
        """The next training document of this pass (cut to the budget), or None when the pass is over."""
        while not (self.budget and self.chars >= self.budget):
            if self._rows is None:
                self._open()
            row = next(self._rows, None)
            if row is None:
                return None
            text = self.corpus.source.text_of(row, "train")
            if not text or (self.corpus.hold_out and held_out(text, self.corpus.val_fraction)):
                continue
            if self.budget:
                text = text[: min(max(1, self.budget // 10), self.budget - self.chars)]
            self.chars += len(text)
            return text
        return None

    def _next_pass(self) -> None:
        if not self.blocks_in_pass:
            raise TrainArgumentError(
                f"--streaming: process {self.rank} of {self.world} read its part of the training split "
                f"({self.chars:,} characters) without filling one --seq-len {self.seq_len} block; give more "
                "--data, raise --max-train-chars, or lower --seq-len"
            )
        self.passes, self.pass_blocks = self.passes + 1, self.blocks_in_pass
        self.chars, self.blocks_in_pass, self.carry = 0, 0, []
        self._dataset = self._rows = None

    def block(self) -> list[int]:
        """The next block of `seq_len` token ids (a new pass begins where this one ends)."""
        while len(self.carry) < self.seq_len:
            text = self._next_text()
            if text is None:
                self._next_pass()
                continue
            self.carry += self.tokenizer(text, add_special_tokens=False)["input_ids"]
            self.carry.append(self.tokenizer.eos_token_id)
        block, self.carry = self.carry[: self.seq_len], self.carry[self.seq_len :]
        self.blocks_in_pass += 1
        return block

    def epoch(self) -> float:
        """Passes read: whole ones, plus the share of this one once a pass's length is known."""
        return self.passes + (self.blocks_in_pass / self.pass_blocks if self.pass_blocks else 0.0)

    def position(self) -> dict:
        """All a checkpoint needs to go on exactly: the stream's state_dict and the tokens carried over."""
        stream = self._dataset.state_dict() if self._dataset is not None else self._resume_at
        fields = ("passes", "chars", "blocks_in_pass", "pass_blocks", "carry")
        return {"stream": stream, **{name: getattr(self, name) for name in fields}}

    def load_position(self, position: dict) -> None:
        self.passes, self.chars = position["passes"], position["chars"]
        self.blocks_in_pass, self.pass_blocks = position["blocks_in_pass"], position["pass_blocks"]
        self.carry = list(position["carry"])
        self._dataset = self._rows = None
        self._resume_at = position["stream"]


class StreamOrder:
    """The blocks of each optimizer step under --streaming: every process draws its rows from its own
    TokenStream and the global batch is gathered, in the row order step.forward_backward slices. It also
    counts the training targets for the unigram baseline (the targets the run trained on)."""

    def __init__(self, stream: TokenStream, accelerator, args: TrainArgs, vocab_size: int):
        self.stream, self.accelerator = stream, accelerator
        self.micro, self.accum = args.batch_size, args.grad_accum
        self.targets = torch.zeros(vocab_size, dtype=torch.long)

    def blocks(self) -> torch.Tensor:
        """(batch x grad_accum x processes, seq_len): this step's global batch of blocks."""
        mine = [self.stream.block() for _ in range(self.accum * self.micro)]
        local = torch.tensor(mine, dtype=torch.long).view(self.accum, self.micro, -1)
        world = self.accelerator.num_processes
        if world > 1:  # (world * accum, micro, T) in rank order -> rows (accumulation step, rank, row)
            local = self.accelerator.gather(local).view(world, self.accum, self.micro, -1).transpose(0, 1)
        return local.reshape(-1, local.shape[-1])

    def count(self, batch: dict, shift: bool) -> None:
        labels = target_labels(batch, shift)
        self.targets += torch.bincount(labels[labels != -100], minlength=len(self.targets))

    def epoch(self, position: int) -> float:  # noqa: ARG002 (BlockOrder's signature: a stream counts passes)
        return self.stream.epoch()

    def position(self) -> dict:
        """Every process's stream position (a collective call) and the targets counted so far."""
        from accelerate.utils import gather_object

        ranks = [self.stream.position()]
        if self.accelerator.num_processes > 1:
            ranks = gather_object(ranks)
        return {"ranks": ranks, "targets": self.targets.tolist()}

    def restore(self, saved: dict, checkpoint) -> None:
        world = self.accelerator.num_processes
        ranks = saved.get("ranks", [])
        if len(ranks) != world:
            raise TrainArgumentError(
                f"--resume: {checkpoint} read its --streaming data in {len(ranks)} processes, each its own part; "
                f"resume it with {len(ranks)} processes (got {world})"
            )
        self.stream.load_position(ranks[self.accelerator.process_index])
        self.targets = torch.tensor(saved["targets"], dtype=torch.long)
