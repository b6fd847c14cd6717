"""attn_implementation="auto" from the command line (issue 30): `swapformer train --attn auto` trains, saves
"auto" and records in metrics.json what auto chose; `swapformer env` lists this machine's cached choices.
The cache lives in tmp_path (SWAPFORMER_CACHE_DIR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import swapformer
from swapformer.cli import main

from conftest import pattern_config
from training_runs import tiny_argv

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def test_train_with_attn_auto_records_the_choices(tmp_path, text_folder, auto_cache_dir):
    out = tmp_path / "run"
    argv = tiny_argv(out, text_folder, max_steps=2, save_every=2, eval_every=2)
    argv += [
        "--attn",
        "auto",
        "--set",
        'layer_types=["sliding_attention","full_attention"]',
        "--set",
        "sliding_window=8",
    ]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["attn_implementation"] == "auto"
    chosen = json.loads((out / "metrics.json").read_text())["attention_auto"]
    assert set(chosen) == {"sliding_attention", "full_attention"}
    for layer_type, choices in chosen.items():
        grads = {c["situation"]["grad"] for c in choices}
        assert grads == {True, False}, (layer_type, choices)  # the training steps, and the evaluation
        for c in choices:
            assert c["backend"] in c["times_ms"] or c["how"] == "the only candidate", c


def test_env_lists_the_cached_choices(auto_cache_dir):
    model = swapformer.EncoderModel._from_config(
        pattern_config("encoder", "sliding_attention"), attn_implementation="auto"
    )
    with torch.no_grad():
        model.eval()(torch.randint(3, 60, (1, 30)))
    env = {**os.environ, "SWAPFORMER_CACHE_DIR": str(auto_cache_dir)}
    done = subprocess.run(
        [sys.executable, "-m", "swapformer", "env", "--json"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    listed = json.loads(done.stdout)["auto backend choices"]
    assert listed["cache"] == str(auto_cache_dir / "auto_backend.json")
    lines = listed["choices"]
    assert len(lines) == 2 and all("measured" in line and " ms" in line for line in lines), lines
    assert sorted(line.split(" (")[0] for line in lines) == ["full", "sliding"], lines
    assert all(line.split(": ", 1)[1].startswith(("sparse", "sdpa", "eager")) for line in lines), lines
