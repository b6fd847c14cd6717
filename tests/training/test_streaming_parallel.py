"""`--streaming` under data parallelism (issue 29): in a 2-process DDP run on CPU each rank reads its own part
of the stream (`split_dataset_by_node`: whole files when their number divides the ranks, else every other
row) and trains on the blocks of that part, packed in order: over a pass every block of its part once, none
read by the other rank."""

from __future__ import annotations

import hashlib
import json

import pytest
from transformers import AutoTokenizer

from swapformer.training.corpus import Document
from swapformer.training.data import pack

from parallel_worker import torchrun
from training_runs import TINY_RUN

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def training_side(texts: list[str]) -> list[Document]:
    """The texts the hold-out leaves to training (sha1 of the text under --val-fraction goes to validation)."""
    fraction = TINY_RUN["val_fraction"]
    ranks = [int.from_bytes(hashlib.sha1(t.encode()).digest()[:8], "big") / 2**64 for t in texts]
    return [Document("", t) for t, r in zip(texts, ranks) if r >= fraction]


@pytest.mark.slow
@pytest.mark.parametrize(
    "files, accum", [(2, 1), (1, 2)], ids=["a file per rank", "every other row of one file, 2 micro-batches"]
)
def test_two_ranks_stream_disjoint_parts_and_read_each_block_once_a_pass(
    files, accum, tmp_path, text_folder, report
):
    """Each rank's forwards read its own part's blocks in order (with 2 micro-batches a step too: the gathered
    global batch puts each rank's rows where step.forward_backward takes them)."""
    texts = [
        p for f in sorted(text_folder.glob("*.txt"))[:3] for p in f.read_text().split("\n\n") if p.strip()
    ]
    texts = texts[:60]
    rows = tmp_path / "rows"
    rows.mkdir()
    size = -(-len(texts) // files)
    for i in range(files):
        part = texts[i * size : (i + 1) * size]
        (rows / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    run, steps = tmp_path / "run", 24 // accum
    data = rows / "part*.jsonl"
    seen = torchrun(2, "train_seen_streaming", data, run, steps, 0, accum, out=tmp_path / "seen.json")
    micro = TINY_RUN["batch_size"]
    assert [len(rank) for rank in seen] == [steps * accum] * 2  # a forward per micro-batch

    tokenizer = AutoTokenizer.from_pretrained(run)
    parts = [texts[:size], texts[size:]] if files == 2 else [texts[0::2], texts[1::2]]
    for rank, part in enumerate(parts):
        want = pack(tokenizer, training_side(part), TINY_RUN["seq_len"]).tolist()
        got = [row for step in seen[rank] for row in step]
        assert len(got) == steps * accum * micro > len(want) > 0, "each rank must read a whole pass"
        assert got[: len(want)] == want  # its part's blocks, each once, in order
        passes = -(-len(got) // len(want))
        assert got == (want * passes)[: len(got)]  # and every pass after it the same again
    first, second = ({tuple(r) for step in rank for r in step} for rank in seen)
    report("blocks read by both ranks", float(len(first & second)))
    assert not first & second
