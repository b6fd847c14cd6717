"""`--streaming` under data parallelism (issue 29): in a 2-process DDP run on CPU each rank reads its own part
of the stream (`split_dataset_by_node`: whole files when their number divides the ranks, else every other
row) and trains on the blocks of that part, packed in order: over a pass every block of its part once, none
read by the other rank. Killed mid-pass, a 2-process run resumes each rank where it was."""

from __future__ import annotations

import hashlib
import json
import subprocess

import pytest
from transformers import AutoTokenizer

from swapformer.training.corpus import Document
from swapformer.training.data import pack

from parallel_worker import torchrun
from training_runs import TINY_RUN, accelerate_launch, cpu_env, kill_after_step, losses, tiny_argv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def paragraphs(files) -> list[str]:
    """The non-empty paragraphs of text files, in order."""
    return [p for f in files for p in f.read_text().split("\n\n") if p.strip()]


def jsonl_parts(rows, texts: list[str], files: int) -> None:
    """`texts` dealt into `files` consecutive jsonl files rows/part{i}.jsonl (the last may be shorter)."""
    rows.mkdir()
    size = -(-len(texts) // files)
    for i in range(files):
        part = texts[i * size : (i + 1) * size]
        (rows / f"part{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))


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
    texts = paragraphs(sorted(text_folder.glob("*.txt"))[:3])[:60]
    rows, size = tmp_path / "rows", -(-len(texts) // files)
    jsonl_parts(rows, texts, files)
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


@pytest.mark.slow
def test_a_two_process_streaming_run_killed_mid_pass_resumes_onto_the_same_losses(
    tmp_path, text_folder, report
):
    """`accelerate launch` with 2 processes, a file per rank, SIGKILLed (launcher and workers) 2 steps past a
    checkpoint taken mid-way through a pass: resumed, each rank goes on from the stream position and the
    carried-over tokens it saved, and the run logs the uninterrupted 2-process run's losses."""
    rows = tmp_path / "rows"
    jsonl_parts(rows, paragraphs(sorted(text_folder.glob("*.txt"))), 2)
    steps, every, kill_at = 16, 5, 12
    flags = dict(max_steps=steps, save_every=every, eval_every=10, max_train_chars=4_000)
    launch = accelerate_launch(2)
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    argv = [*tiny_argv(killed, rows / "part*.jsonl", **flags), "--streaming"]
    logged_before = kill_after_step([*launch, *argv], killed, kill_at)
    assert logged_before < steps and not (killed / "model.safetensors").exists()
    state = json.loads((killed / "checkpoints" / "step_0000010" / "trainer_state.json").read_text())
    positions = state["stream"]["ranks"]
    assert len(positions) == 2 and all(p["stream"] is not None for p in positions)  # both mid-pass
    assert positions[0] != positions[1]

    for command in (
        [*launch, *argv, "--resume"],  # a second try resumes again, or finds the run finished
        [*launch, *tiny_argv(reference, rows / "part*.jsonl", **flags), "--streaming", "--overwrite"],
    ):
        for _ in range(3):  # gloo's rare abort of a launch (parallel_worker.torchrun) is tried again
            done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=300)
            if done.returncode == 0 or "terminate called" not in done.stderr:
                break
        assert done.returncode == 0, done.stderr[-3000:]
    a, b = losses(reference), losses(killed)
    assert [s for s, _ in b] == list(range(1, steps + 1))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    report(f"--streaming, 2 processes, killed at step {logged_before}, resumed: max |loss diff|", diff)
    assert diff == 0.0
