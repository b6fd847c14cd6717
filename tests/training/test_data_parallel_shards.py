"""Data parallelism over the token shards (issue 29): in a 2-process DDP run on CPU the ranks train on
disjoint blocks, and over an epoch every training block is read exactly once."""

from __future__ import annotations

import collections

import pytest
from transformers import AutoTokenizer

from swapformer.training import corpus
from swapformer.training.data import pack

from parallel_worker import torchrun
from training_runs import TINY_RUN

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


@pytest.mark.slow
def test_two_ranks_read_disjoint_blocks_and_cover_the_epoch(tmp_path, text_folder, report):
    """Rank r's rows of step s are the global positions (s - 1) * 8 + 4r ... + 3 (batch 4 a rank); the
    positions of the first epoch, gathered from both ranks, are every training block once, as `pack`
    makes them from the documents (the reference read in memory)."""
    run = tmp_path / "run"
    steps, chars = 16, 8_000  # about 90 blocks of 32 tokens: an epoch is about 11 steps of 8 blocks
    seen = torchrun(2, "train_seen", text_folder, run, steps, chars, out=tmp_path / "seen.json")
    micro, world = TINY_RUN["batch_size"], 2
    assert [len(rank) for rank in seen] == [steps, steps]  # one micro-batch a step on each rank

    docs, _ = corpus.load_documents([str(text_folder)], "text")
    train_docs, _ = corpus.split_documents(docs, TINY_RUN["val_fraction"], chars, TINY_RUN["max_val_chars"])
    blocks = pack(AutoTokenizer.from_pretrained(run), train_docs, TINY_RUN["seq_len"]).tolist()
    n = len(blocks)
    assert steps * micro * world >= n, "the run must read a whole epoch"

    at = {}  # global position -> the block read there
    for rank, batches in enumerate(seen):
        for step, rows in enumerate(batches, start=1):
            for j, row in enumerate(rows):
                at[(step - 1) * micro * world + rank * micro + j] = tuple(row)
    for step in range(steps):  # within a step, the ranks' rows are different blocks
        first = {at[step * 8 + j] for j in range(micro)}
        second = {at[step * 8 + micro + j] for j in range(micro)}
        assert not first & second, f"step {step + 1}: a block read by both ranks"
    epoch = collections.Counter(at[p] for p in range(n))
    report(f"distinct blocks read in the first epoch (of {n})", float(len(epoch)))
    assert epoch == collections.Counter(map(tuple, blocks))  # each block once: none twice, none skipped
