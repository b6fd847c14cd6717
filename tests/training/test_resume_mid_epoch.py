"""Exact resume in the middle of an epoch of token shards (issue 29): a `swapformer train` process reading jsonl
rows, killed with SIGKILL between checkpoints, resumes from the data position its checkpoint saved onto the
loss curve of the run that was never interrupted, to the last bit."""

from __future__ import annotations

import json
import sys

import pytest
from datasets import Dataset

from swapformer.cli import main

from training_runs import kill_after_step, losses, tiny_argv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def test_a_run_killed_mid_epoch_resumes_onto_the_same_losses(tmp_path, text_folder, report):
    rows = tmp_path / "rows"
    rows.mkdir()
    texts = [p.read_text() for p in sorted(text_folder.glob("*.txt"))]
    for i in range(2):
        Dataset.from_dict({"text": texts[i::2]}).to_json(rows / f"part{i}.jsonl")
    data = rows / "part*.jsonl"
    steps, every = 30, 5
    flags = dict(max_steps=steps, save_every=every, eval_every=10, cache_dir=tmp_path / "cache")
    killed, reference = tmp_path / "killed", tmp_path / "reference"
    command = [sys.executable, "-m", "swapformer", *tiny_argv(killed, data, **flags)]
    kill_after_step(command, killed, 2 * every + 2)  # past the checkpoint at 2 * every
    logged_before = losses(killed)[-1][0]
    assert logged_before < steps and not (killed / "model.safetensors").exists()
    (checkpoint,) = [
        p for p in sorted((killed / "checkpoints").iterdir()) if p.name == f"step_{2 * every:07d}"
    ]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["blocks_read"] == 2 * every * 4  # the data position: steps x global batch
    assert state["history"][-1]["epoch"] < 1  # in the middle of the first epoch

    assert main([*tiny_argv(killed, data, **flags), "--resume"]) == 0
    assert main(tiny_argv(reference, data, **flags)) == 0
    a, b = losses(reference), losses(killed)
    assert [s for s, _ in b] == list(range(1, steps + 1))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(a, b))
    report(f"killed at step {logged_before}, resumed: max |loss diff| over {steps} steps", diff)
    assert diff == 0.0
