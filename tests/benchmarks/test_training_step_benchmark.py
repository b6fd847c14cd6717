"""benchmarks/training_step.py runs (at a tiny size) and its two models train alike: the first
training step of swapformer gives the loss of the transformers model it was converted from, in every
mode the benchmark times (fp32, bf16 autocast, activation checkpointing). No timing is asserted."""

from __future__ import annotations

import pytest

from conftest import load_benchmark

TINY = "--layers 2 --hidden 32 --heads 2 --intermediate 64 --vocab 128 --batch 2 --length 16 --rounds 1"


def test_training_step_benchmark_runs_and_both_models_give_the_same_first_loss(capsys):
    benchmark = load_benchmark("training_step")
    results = benchmark.main(TINY.split())
    table = capsys.readouterr().out
    assert len(results) == 2 * len(benchmark.MODES)
    for (name, mode), r in results.items():
        assert f"| {name} | {mode} |" in table
        assert all(t > 0 for t in r["seconds"].values())
        loss = r["first_loss"]
        tolerance = 2e-2 if mode == "bf16 autocast" else 1e-4
        assert loss["swapformer"] == pytest.approx(loss["transformers"], abs=tolerance), (name, mode)
