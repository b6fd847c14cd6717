"""`swapformer train --streaming` (issue 29): the training documents read as a `datasets` IterableDataset,
tokenized as read and packed in order. The blocks are checked against `pack` of the documents an oracle
here picks (the source's rows in order, the hold-out by a hash of the text, the budget of corpus._budget);
a run SIGKILLed mid-pass resumes onto the uninterrupted losses from the position its checkpoint saved; the
flags and inputs the stream cannot honour are refused by preflight."""

from __future__ import annotations

import hashlib
import json
import pathlib
import sys

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetDict

from swapformer.cli import main
from swapformer.training import corpus, stream_source
from swapformer.training.args import TrainArgumentError
from swapformer.training.checkpointing import data_change
from swapformer.training.corpus import Document
from swapformer.training.data import pack, prepare_data, step_batch
from swapformer.training.loop import train
from swapformer.training.preflight import check_run

from training_runs import kill_after_step, losses, tiny_args, tiny_argv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def paragraphs(text_folder: pathlib.Path) -> list[str]:
    return [p for f in sorted(text_folder.glob("*.txt")) for p in f.read_text().split("\n\n") if p.strip()]


def jsonl_files(folder: pathlib.Path, texts: list[str], names=("part0", "part1")) -> list[list[str]]:
    """`texts` dealt into consecutive jsonl files (one per name) under `folder`; the texts of each."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(texts) // len(names))
    parts = [texts[i * size : (i + 1) * size] for i in range(len(names))]
    for name, part in zip(names, parts):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return parts


def hashed_out(text: str, fraction: float) -> bool:
    """The documented hold-out, written out here: sha1 of the text, first 8 bytes, as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:8], "big") / 2**64 < fraction


def sources(kind: str, tmp_path: pathlib.Path, text_folder: pathlib.Path):
    """(--data, the training texts in stream order, the own validation texts or None, the test texts)."""
    files = sorted(text_folder.glob("*.txt"))
    texts = [p.read_text() for p in files]
    if kind == "jsonl glob":
        parts = jsonl_files(tmp_path / "rows", paragraphs(text_folder))
        return str(tmp_path / "rows" / "part*.jsonl"), parts[0] + parts[1], None, []
    if kind == "text files":
        return str(text_folder / "*.txt"), texts, None, []
    if kind == "saved DatasetDict":
        splits = {"train": texts[:14], "validation": texts[14:17], "test": texts[17:]}
        DatasetDict({k: Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
            tmp_path / "dd"
        )
        return str(tmp_path / "dd"), splits["train"], splits["validation"], splits["test"]
    folder = tmp_path / "splits"  # load_dataset(folder) names the splits by the files' names
    jsonl_files(folder, texts[:14], names=("train",))
    jsonl_files(folder, texts[14:17], names=("validation",))
    return str(folder), texts[:14], texts[14:17], []


def prepared_args(tmp_path: pathlib.Path, data: str, **overrides):
    """The checked arguments of a --streaming run of --data `data` into tmp_path/run."""
    return check_run(tiny_args(tmp_path / "run", pathlib.Path(data), streaming=True, **overrides))


def prepared(tmp_path: pathlib.Path, data: str, **overrides):
    args, _ = prepared_args(tmp_path, data, **overrides)
    return args, prepare_data(args, Accelerator(cpu=True), tmp_path / "run", fresh=True)


@pytest.mark.parametrize("kind", ["jsonl glob", "text files", "saved DatasetDict", "folder with splits"])
def test_streamed_blocks_are_the_source_packed_in_order_and_validation_is_held_apart(
    kind, tmp_path, text_folder
):
    data, train_texts, own_validation, test_texts = sources(kind, tmp_path, text_folder)
    args, run = prepared(tmp_path, data)
    assert run.train_blocks is None and run.stream is not None  # no token shard: read as it goes

    fraction = args.val_fraction
    held = [t for t in train_texts if own_validation is None and hashed_out(t, fraction)]
    training = [Document("", t) for t in train_texts if t not in held]
    validation = [Document("", t) for t in (own_validation if own_validation is not None else held)]
    assert validation and training and not {d.text for d in validation} & {d.text for d in training}
    want_val = pack(run.tokenizer, corpus._budget(validation, args.max_val_chars), args.seq_len)
    assert torch.equal(run.val_blocks, want_val)
    tests = corpus._budget([Document("", t) for t in test_texts], args.max_val_chars)
    want_test = pack(run.tokenizer, tests, args.seq_len)
    assert torch.equal(run.test_blocks, want_test)

    want = pack(run.tokenizer, corpus._budget(training, args.max_train_chars), args.seq_len)
    per_step = args.batch_size * args.grad_accum
    steps = len(want) // per_step + 3  # the whole first pass, and into the second
    got = torch.cat([run.stream.blocks() for _ in range(steps)])
    n = len(want)
    assert torch.equal(got[:n], want)  # pass 1: every block once, in the source's order
    assert torch.equal(got[n:], want[: len(got) - n])  # pass 2 reads the same blocks again
    assert run.stream.epoch(0) == pytest.approx(1 + (len(got) - n) / n)


def test_step_batches_are_the_objective_on_the_streamed_blocks(tmp_path, text_folder):
    """step_batch of a streamed run: the objective of the next blocks, with the step's generator, and the
    targets counted for the unigram baseline."""
    parts = jsonl_files(tmp_path / "rows", paragraphs(text_folder))
    data = str(tmp_path / "rows" / "part*.jsonl")
    args, run = prepared(tmp_path / "a", data, arch="encoder")
    _, again = prepared(tmp_path / "b", data, arch="encoder")
    assert parts[0] and run.fingerprint == again.fingerprint
    batch = step_batch(run, 1, args.batch_size, args.seed)
    blocks = again.stream.blocks()
    masked = batch["input_ids"] != blocks
    assert masked.any() and torch.equal(batch["labels"][masked], blocks[masked])  # masked LM of those blocks
    labels = batch["labels"]
    assert torch.equal(
        run.stream.targets, torch.bincount(labels[labels != -100], minlength=len(run.tokenizer))
    )


def test_a_streaming_run_killed_mid_pass_resumes_onto_the_same_losses(tmp_path, text_folder, report):
    """SIGKILLed in its second pass over the stream, 2 steps past a checkpoint: resumed from the stream
    position and the carried-over tokens that checkpoint saved, it logs the uninterrupted run's losses."""
    rows = tmp_path / "rows"
    jsonl_files(rows, paragraphs(text_folder))
    data = rows / "part*.jsonl"
    steps, every, kill_at = 30, 5, 22
    flags = dict(max_steps=steps, save_every=every, eval_every=10, max_train_chars=4_000)
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    argv = [*tiny_argv(killed, data, **flags), "--streaming"]
    kill_after_step([sys.executable, "-m", "swapformer", *argv], killed, kill_at)
    logged_before = losses(killed)[-1][0]
    assert logged_before < steps and not (killed / "model.safetensors").exists()
    state = json.loads((killed / "checkpoints" / "step_0000020" / "trainer_state.json").read_text())
    (position,) = state["stream"]["ranks"]
    assert position["passes"] == 1 and position["stream"] is not None  # mid-way through the second pass
    assert 0 < len(position["carry"]) and 1 < state["history"][-1]["epoch"] < 2

    assert main([*argv, "--resume"]) == 0
    assert main([*tiny_argv(reference, data, **flags), "--streaming"]) == 0
    a, b = losses(reference), losses(killed)
    assert [s for s, _ in b] == list(range(1, steps + 1))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    report(f"--streaming, killed at step {logged_before}, resumed: max |loss diff| over {steps} steps", diff)
    assert diff == 0.0
    got, want = (json.loads((run / "metrics.json").read_text()) for run in (killed, reference))
    for name in (
        "val_perplexity",
        "unigram_perplexity",
        "train_blocks",
        "epochs",
    ):  # counted targets restored
        assert got[name] == want[name], name


def test_resume_refuses_a_stream_whose_files_changed(tmp_path, text_folder):
    rows = tmp_path / "rows"
    jsonl_files(rows, paragraphs(text_folder))
    out = tmp_path / "run"
    given = dict(streaming=True, save_every=2)
    assert train(tiny_args(out, rows / "part*.jsonl", stop_after=3, **given)) == {"stopped_at": 3}
    with (rows / "part1.jsonl").open("a") as f:
        f.write(json.dumps({"text": "one more row"}) + "\n")
    with pytest.raises(
        TrainArgumentError, match=r"the --data files \(a path, size or modification time\) changed"
    ):
        train(tiny_args(out, rows / "part*.jsonl", resume="latest", **given))
    assert "the tokenizer in the run's folder changed" in data_change("stream-aaa-bbb", "stream-aaa-ccc")
    with pytest.raises(TrainArgumentError, match="these arguments differ.*: streaming"):  # not a flag to drop
        train(tiny_args(out, rows / "part*.jsonl", resume="latest", save_every=2))


def test_a_stream_position_saved_by_another_number_of_processes_is_refused(tmp_path, text_folder):
    jsonl_files(tmp_path / "rows", paragraphs(text_folder))
    _, run = prepared(tmp_path, str(tmp_path / "rows" / "part*.jsonl"))
    saved = {"ranks": [run.stream.stream.position()] * 2, "targets": run.stream.targets.tolist()}
    with pytest.raises(
        TrainArgumentError, match="read its --streaming data in 2 processes.*with 2 processes \\(got 1\\)"
    ):
        run.stream.restore(saved, "checkpoints/step_0000002")


def refused(tmp_path: pathlib.Path, text_folder: pathlib.Path, case: str):
    """The --data and flags of one refused case."""
    rows = tmp_path / "rows"
    jsonl_files(rows, paragraphs(text_folder)[:40])
    plain = dict(data=[str(rows / "part0.jsonl")])
    empty = tmp_path / "bins"
    empty.mkdir()
    (empty / "weights.bin").write_bytes(b"\0" * 64)
    no_train = tmp_path / "only_validation"
    jsonl_files(no_train, paragraphs(text_folder)[:5], names=("validation",))
    (rows / "with_id.jsonl").write_text(json.dumps({"text": "one more", "id": 7}) + "\n")
    Dataset.from_dict({"text": ["a"]}).to_parquet(tmp_path / "a.parquet")
    Dataset.from_dict({"body": ["b"]}).to_parquet(tmp_path / "b.parquet")
    return {
        "unbounded validation": dict(plain, max_val_chars=0),
        "tokenizing processes": dict(plain, num_proc=2),
        "token cache": dict(plain, cache_dir=str(tmp_path / "c")),
        "mixed kinds": dict(data=[str(rows / "part0.jsonl"), str(text_folder / "doc00.txt")]),
        "a folder beside files": dict(data=[str(text_folder), str(rows / "part0.jsonl")]),
        "not a path nor a name": dict(data=[str(tmp_path / "missing" / "x.jsonl")]),
        "unreadable folder": dict(data=[str(empty)]),
        "no train split": dict(data=[str(no_train)]),
        "files whose columns differ": dict(data=[str(rows / "part0.jsonl"), str(rows / "with_id.jsonl")]),
        "parquet schemas that differ": dict(data=[str(tmp_path / "*.parquet")]),
    }[case]


@pytest.mark.parametrize(
    "case, says",
    [
        ("unbounded validation", r"--max-val-chars 0 \(all\) would read the whole stream first"),
        ("tokenizing processes", "--num-proc 2 sets how token shards are written"),
        ("token cache", "--cache-dir '.*' sets how token shards are written"),
        ("mixed kinds", r"mixes \['json', 'text'\]: give files of one kind"),
        ("a folder beside files", "as the only --data"),
        ("not a path nor a name", "no such file or folder, nor a `datasets` name"),
        ("unreadable folder", "cannot be streamed by `datasets`"),
        ("no train split", "has no 'train' split"),
        (
            "files whose columns differ",
            r"'.*part0.jsonl' has columns \['text'\] and '.*with_id.jsonl' has \['id', 'text'\]",
        ),
        (
            "parquet schemas that differ",
            r"'.*a.parquet' has columns \['text'\] and '.*b.parquet' has \['body'\]",
        ),
    ],
)
def test_what_streaming_cannot_honour_is_refused_by_preflight(case, says, tmp_path, text_folder):
    overrides = refused(tmp_path, text_folder, case)
    data = overrides.pop("data", None)
    args = tiny_args(tmp_path / "run", None, streaming=True, **overrides)
    args.data = data
    with pytest.raises(TrainArgumentError, match=says):
        check_run(args)


def test_a_text_file_too_large_to_read_whole_is_refused(tmp_path, text_folder, monkeypatch):
    monkeypatch.setattr(stream_source, "MAX_TEXT_FILE_BYTES", 1_000)
    args = tiny_args(tmp_path / "run", text_folder / "doc00.txt", streaming=True)
    with pytest.raises(TrainArgumentError, match="reads a text file whole.*split it into files"):
        check_run(args)


def test_an_empty_validation_split_of_the_source_is_named_as_such(tmp_path, text_folder):
    """A source with its own validation split is evaluated on it, so an empty one is what the message names
    (not --val-fraction, which does not apply to such a source)."""
    folder = tmp_path / "splits"
    jsonl_files(folder, paragraphs(text_folder)[:20], names=("train",))
    (folder / "validation.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(TrainArgumentError, match="the validation split of --data .* holds no non-empty doc"):
        prepared(tmp_path, str(folder))


def test_a_missing_text_column_fails_in_one_line_before_anything_is_written(tmp_path, text_folder, capsys):
    rows = tmp_path / "rows"
    jsonl_files(rows, paragraphs(text_folder))
    out = tmp_path / "run"
    argv = [*tiny_argv(out, rows / "part*.jsonl", text_column="body"), "--streaming"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "--text-column 'body' is not a column of the train split of --data" in err
        and len(err.strip().splitlines()) == 1
    ), err
    assert not out.exists()


def test_rows_whose_columns_change_past_preflight_fail_in_one_line(tmp_path, text_folder, capsys):
    """Preflight compares the files' first rows; a column that appears further into the second file reaches
    datasets' cast (to the first file's columns), and that is said in one line too, with both column lists."""
    rows, texts = tmp_path / "rows", paragraphs(text_folder)
    jsonl_files(rows, texts[:3], names=("part0",))
    (rows / "part1.jsonl").write_text(
        "".join(json.dumps({"text": t} | ({"id": i} if i else {})) + "\n" for i, t in enumerate(texts[3:]))
    )
    out = tmp_path / "run"
    capsys.readouterr()
    assert main([*tiny_argv(out, rows / "part*.jsonl"), "--streaming"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "rows of the train split of --data" in err
    assert "with columns ['text', 'id'] follow rows with ['text']" in err


def test_a_dataset_name_that_cannot_be_opened_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """A --data that is no local path is taken as a `datasets` name (preflight checks its form only); opening it
    offline fails in prepare_data with the input named and datasets' reason, and no folder is made."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args, _ = prepared_args(tmp_path, "someorg/no-such-corpus")
    with pytest.raises(
        TrainArgumentError, match="'someorg/no-such-corpus' is no local file or folder, and cannot be"
    ):
        prepare_data(args, Accelerator(cpu=True), tmp_path / "run", fresh=True)
    assert not (tmp_path / "run").exists()
