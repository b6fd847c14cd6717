"""What `swapformer train` tells its user (issue 28): each slow stage before it starts, a resumed run
that had already finished, the Python arguments under the command line's names, and the native sparse
kernels' compilation whenever it happens."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap

import huggingface_hub
import pytest

from swapformer.cli import build_parser, main
from swapformer.modeling.cpu import sparse_native
from swapformer.training.args import TrainArgs, TrainArgumentError, flag
from swapformer.training.corpus import stdlib_documents

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread

# A run of a few seconds: 12 stdlib modules as text files, a 2-layer model, 2 steps.
TINY_FLAGS = dict(
    vocab_size=600, seq_len=32, batch_size=4, max_steps=2, warmup_steps=1, save_every=2, eval_every=2,
    max_train_chars=40_000, max_val_chars=6_000, val_fraction=0.2,
)  # fmt: skip
TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("texts")
    docs = [d for d in stdlib_documents() if 2_000 < len(d.text) < 15_000][:12]
    for i, d in enumerate(docs):
        (folder / f"doc{i:02d}.txt").write_text(d.text)
    return folder


def tiny_command(out, data, *extra: str) -> list[str]:
    argv = ["train", "--output-dir", str(out), "--data", str(data), *extra]
    for name, value in TINY_FLAGS.items():
        argv += [flag(name), str(value)]
    for name, value in TINY_MODEL.items():
        argv += ["--set", f"{name}={value}"]
    return argv


def test_data_and_tokenizer_stages_are_announced_before_the_first_step(tmp_path, texts, capsys):
    """The stages before the progress bar (reading the documents, training the tokenizer, tokenizing)
    each say what they do before they start, and how long it took after."""
    assert main(tiny_command(tmp_path / "run", texts)) == 0
    lines = [line.strip() for line in capsys.readouterr().err.replace("\r", "\n").splitlines()]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("train:"))
    before = lines[:first_step]

    def index(start: str) -> int:
        found = [i for i, line in enumerate(before) if line.startswith(start)]
        assert found, f"no line starting {start!r} before the first step:\n" + "\n".join(before)
        return found[0]

    reading = index(f"reading documents: {texts}...")
    read = index("reading documents: done in")
    training = index("training a tokenizer: byte-level BPE of 600 tokens on")
    trained = index("training a tokenizer: done in")
    tokenizing = index("tokenizing: ")
    tokenized = index("tokenizing: done in")
    assert reading < read < training < trained < tokenizing < tokenized
    assert (
        "12 documents" in before[read] and "for training" in before[read] and "for validation" in before[read]
    )
    assert "blocks of 32 tokens" in before[tokenizing]


def test_resuming_a_finished_run_says_so_and_writes_nothing(tmp_path, texts, capsys, monkeypatch):
    """Exit 0, the run's figures and what its folder holds, every file as it was; with --push-to-hub the
    folder is uploaded as it is."""
    out = tmp_path / "run"
    assert main(tiny_command(out, texts, "--no-progress")) == 0
    assert "reading documents" not in capsys.readouterr().err  # --no-progress: no stage lines either
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    assert main([*tiny_command(out, texts, "--no-progress"), "--resume"]) == 0
    said = capsys.readouterr().out
    assert f"the run in {out} had already finished (all 2 steps" in said, said
    assert "nothing was trained or written" in said
    for held in (
        "model.safetensors",
        "config.json",
        "README.md",
        "tokenizer.json",
        "metrics.json",
        "step_0000002",
    ):
        assert held in said, (held, said)
    assert "of training" not in said  # not the closing line of a run that trained
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files

    uploads = []
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **kw: None)
    monkeypatch.setattr(
        huggingface_hub.HfApi,
        "upload_folder",
        lambda self, **kw: uploads.append(kw) or "https://hub/commit/1",
    )
    assert main([*tiny_command(out, texts, "--no-progress"), "--resume", "--push-to-hub", "me/run"]) == 0
    assert [u["folder_path"] for u in uploads] == [str(out)]
    assert "uploaded to https://hub/commit/1" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == files


def test_every_train_flag_is_the_field_of_the_same_name():
    """`--no-progress` is `TrainArgs(no_progress=True)`, `--set` is `TrainArgs(set={...})`: one name each,
    read from the command's own parser."""
    parser = build_parser("train").commands["train"]
    actions = [a for a in parser._actions if a.dest not in ("help", "debug")]
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    for action in actions:
        assert action.option_strings == [flag(action.dest)], (action.option_strings, action.dest)
        assert action.dest in fields, action.dest
    assert fields == {a.dest for a in actions}
    assert TrainArgs(no_progress=True).no_progress and TrainArgs(set={"num_key_value_heads": 2}).set
    with pytest.raises(TrainArgumentError, match=r"set must be a dict .* got 'num_key_value_heads=2'"):
        TrainArgs(set="num_key_value_heads=2").resolved()


def test_a_run_saved_under_the_old_names_still_resumes():
    """training_args.json written before the rename holds `model_options` and `progress`."""
    saved = TrainArgs(set={"hidden_size": 32}).to_json()
    saved["model_options"], saved["progress"] = saved.pop("set"), not saved.pop("no_progress")
    assert TrainArgs(set={"hidden_size": 32}).differences(saved) == []
    assert TrainArgs(set={"hidden_size": 64}).differences(saved) == ["set"]
    assert TrainArgs.from_json(saved) == TrainArgs(set={"hidden_size": 32})


SPARSE_FORWARD = textwrap.dedent(
    """
    import torch, swapformer
    from swapformer.modeling.cpu import sparse_native
    config = swapformer.EncoderConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=48, layer_types=["sliding_attention"], sliding_window=5, attention_block_size=8,
        max_position_embeddings=64)
    model = swapformer.EncoderModel._from_config(config, attn_implementation="sparse").eval()
    with torch.no_grad():
        model(torch.randint(3, 50, (2, 40)))
    print("ROUTE", sparse_native.sparse_cpu_route())
    """
)


@pytest.mark.skipif(
    sparse_native._missing() is not None, reason=f"cannot build here: {sparse_native._missing()}"
)
@pytest.mark.slow
def test_the_native_kernels_say_when_they_compile_even_over_a_cached_build(tmp_path):
    """The first sparse forward with an empty kernel cache says it compiles; so does one whose cached
    build was made by another environment (here another compiler command: ninja compiles again, which
    took 12-14 s without a word before)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "SWAPFORMER_SPARSE_CPU": "native"}
    env.pop("CXX", None)

    def first_forward(**extra) -> tuple[str, int]:
        done = subprocess.run(
            [sys.executable, "-c", SPARSE_FORWARD], env={**env, **extra}, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0 and "ROUTE native" in done.stdout, done.stderr[-2000:]
        notices = [line for line in done.stderr.splitlines() if line.startswith("swapformer: compiling")]
        assert len(notices) == 1, done.stderr[-2000:]
        assert str(tmp_path) in notices[0]
        assert "SWAPFORMER_SPARSE_CPU=torch" in notices[0]
        (library,) = tmp_path.rglob("swapformer_sparse_native_*.so")
        return notices[0], library.stat().st_mtime_ns

    _, built = first_forward()
    notice, rebuilt = first_forward(CXX=shutil.which("c++"))
    assert rebuilt > built  # the cached library was really compiled again
    assert "again" in notice
