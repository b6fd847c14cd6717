"""`swapformer train` run again where its output folder already holds a run (issue 28): the console script
refuses before importing torch, in the words and with the exit code of the full command, and leaves every
case it cannot be sure of to the full command."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import swapformer_command
from swapformer.cli import build_parser, error_line
from swapformer.training.args import TrainArgs, TrainArgumentError
from swapformer.training.checkpointing import RUN_FILE
from swapformer.training.preflight import check_output_dir

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
# the console script's main() (swapformer_command.py), then which heavy modules the process imported
RUNNER = """
import sys
from swapformer_command import main
code = main(sys.argv[1:])
print("IMPORTED " + ",".join(m for m in ("torch", "transformers", "swapformer") if m in sys.modules), file=sys.stderr)
sys.exit(code)
"""


def finished_run(folder: Path) -> Path:
    """What a finished run leaves that the output-folder check reads: its arguments and the model's config."""
    folder.mkdir(parents=True)
    (folder / RUN_FILE).write_text(json.dumps(dataclasses.asdict(TrainArgs(output_dir=str(folder)))))
    (folder / "config.json").write_text(json.dumps({"model_type": "swapformer_decoder"}))
    return folder


def command(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize(
    "argv, folder",
    [([], TrainArgs().output_dir), (["--output-dir=runs/first/", "--max-steps", "3"], "runs/first")],
)
def test_the_refusal_comes_before_torch_in_the_full_commands_words(tmp_path, monkeypatch, argv, folder):
    """The reference is the full command's own: the output folder its parser reads from ARGV, refused by
    training/preflight.py's check, printed as swapformer.cli prints an error."""
    finished_run(tmp_path / folder)
    monkeypatch.chdir(tmp_path)
    parsed = build_parser("train").parse_args(["train", *argv])
    with pytest.raises(TrainArgumentError) as refused:
        check_output_dir(TrainArgs(output_dir=parsed.output_dir))
    done = command(tmp_path, "-c", RUNNER, "train", *argv)
    *said, imported = done.stderr.splitlines()
    assert (done.returncode, said) == (2, [error_line("swapformer train", refused.value)])
    assert imported == "IMPORTED "


# an abbreviation argparse reads as the flag it abbreviates: the full parser's reading is what counts
ABBREVIATED = {"--overw": "overwrite", "--res": "resume", "--outp": "output_dir"}


@pytest.mark.parametrize(
    "argv",
    [["--overwrite"], ["--resume"], ["--resume", "latest"], ["--help"], ["-h"], ["--output-dir"]]
    + [[flag, "x"] if dest == "output_dir" else [flag] for flag, dest in ABBREVIATED.items()],
)
def test_the_launcher_leaves_overwrite_resume_help_and_abbreviations_to_the_full_command(
    tmp_path, monkeypatch, argv
):
    monkeypatch.chdir(tmp_path)
    finished_run(tmp_path / TrainArgs().output_dir)
    assert swapformer_command.finished_run_refusal(argv) is None


def test_argparse_reads_the_abbreviations_as_their_flags():
    """Why the launcher must not answer for them: `--overw` is --overwrite to the real parser."""
    parser = build_parser("train")
    for flag, dest in ABBREVIATED.items():
        args = parser.parse_args(["train", flag, "x"] if dest == "output_dir" else ["train", flag])
        assert getattr(args, dest) not in (None, False, TrainArgs().output_dir), flag


@pytest.mark.parametrize("files", [(), (RUN_FILE,), ("config.json",)])
def test_a_folder_without_a_finished_run_goes_to_the_full_command(tmp_path, monkeypatch, files):
    """An empty folder, a run that stopped before its first checkpoint (no config.json yet: the full
    command says what to do), a folder holding something else: the full command's checks decide."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / TrainArgs().output_dir
    folder.mkdir()
    for name in files:
        (folder / name).write_text("{}")
    assert swapformer_command.finished_run_refusal([]) is None
    assert swapformer_command.finished_run_refusal(["--output-dir", "missing"]) is None
