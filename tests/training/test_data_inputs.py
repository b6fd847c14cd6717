"""`--data` inputs beyond text files (issue 29): jsonl and parquet files by path or glob, read as rows of
--text-column through `datasets`' loaders, split by row name as text documents are, and tokenized into the
same blocks the in-memory path makes from the same rows."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset

from swapformer.cli import main
from swapformer.training import corpus
from swapformer.training.data import pack, prepare_data
from swapformer.training.preflight import check_run

from training_runs import tiny_args, tiny_argv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def row_files(tmp_path: pathlib.Path, text_folder: pathlib.Path, column: str = "text") -> pathlib.Path:
    """The text folder's files as rows: paragraphs of the first half in two jsonl files, of the second half
    in a parquet file, with another column beside the text."""
    paragraphs = [
        p for f in sorted(text_folder.glob("*.txt")) for p in f.read_text().split("\n\n") if p.strip()
    ]
    half = len(paragraphs) // 2
    folder = tmp_path / "rows"
    folder.mkdir()
    for i, part in enumerate((paragraphs[: half // 2], paragraphs[half // 2 : half])):
        lines = [json.dumps({column: text, "id": j}) for j, text in enumerate(part)]
        (folder / f"part{i}.jsonl").write_text("\n".join(lines) + "\n")
    Dataset.from_dict({column: paragraphs[half:], "id": list(range(len(paragraphs) - half))}).to_parquet(
        folder / "rest.parquet"
    )
    return folder


def test_jsonl_glob_and_parquet_rows_become_documents_and_blocks(tmp_path, text_folder):
    folder = row_files(tmp_path, text_folder, column="body")
    data = [str(folder / "part*.jsonl"), str(folder / "rest.parquet")]
    docs, _ = corpus.load_documents(data, "body")
    jsonl_rows = sum(len(p.read_text().splitlines()) for p in folder.glob("part*.jsonl"))
    assert len(docs) == jsonl_rows + len(Dataset.from_parquet(str(folder / "rest.parquet")))
    assert docs[0].name == "part0.jsonl/0" and docs[-1].name.startswith("rest.parquet/")
    assert docs[0].text == json.loads((folder / "part0.jsonl").read_text().splitlines()[0])["body"]

    given = tiny_args(tmp_path / "run", None, text_column="body", cache_dir=str(tmp_path / "c"))
    given.data = data
    args, _ = check_run(given)
    run = prepare_data(args, Accelerator(cpu=True), tmp_path / "run", fresh=True)
    train, val = corpus.split_documents(docs, args.val_fraction, args.max_train_chars, args.max_val_chars)
    for blocks, split in ((run.train_blocks, train), (run.val_blocks, val)):
        want = pack(run.tokenizer, split, args.seq_len)
        assert len(blocks) == len(want) > 0
        assert torch.equal(blocks[torch.arange(len(blocks))], want)


@pytest.mark.parametrize(
    "data, says",
    [
        ("rows/*.txt", "matches no file"),
        ("rows/part0.jsonl", "--text-column 'text' is not a column of --data file"),
    ],
)
def test_bad_row_inputs_are_refused_in_one_line_before_anything_is_written(
    data, says, tmp_path, text_folder, capsys
):
    row_files(tmp_path, text_folder, column="body")
    out = tmp_path / "run"
    argv = tiny_argv(out, tmp_path / data, max_steps=2, cache_dir=tmp_path / "c")
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
