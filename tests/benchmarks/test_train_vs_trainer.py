"""benchmarks/train_vs_trainer.py runs (tiny) and its two sides train the same model: the same blocks in
the same order, the same validation blocks, the same initial weights, first loss, schedule and decay
groups, hence the same perplexity. The checks themselves fail on a changed block or weight. No timing
is asserted."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark


@pytest.mark.slow
def test_the_race_runs_tiny_and_both_sides_train_the_same_model(tmp_path, capsys):
    race = load_benchmark("train_vs_trainer")
    # two rounds: the second starts with Trainer, on the first round's record of swapformer's blocks
    out = race.main(["--quick", "--rounds", "2", "--work", str(tmp_path)])
    table = capsys.readouterr().out
    assert "| | swapformer | Trainer | swapformer / Trainer |" in table
    assert "tokens/s of each round" in table
    for label, key, _ in race.ROWS:
        assert f"| {label} |" in table
        for side in ("swapformer", "Trainer"):
            assert out["results"][side][key] > 0, (side, key)
    failed = {name: detail for name, (ok, detail) in out["checks"].items() if not ok}
    assert not failed
    assert set(out["checks"]) >= {"same training blocks", "same validation blocks", "same initial weights"}
    sf, tr = (out["results"][side]["val_perplexity"] for side in ("swapformer", "Trainer"))
    assert sf == pytest.approx(tr, rel=1e-4)


def test_the_block_and_weight_checks_fail_on_a_difference(tmp_path):
    load_benchmark("train_vs_trainer")  # puts benchmarks/ on sys.path
    import race_checks
    from safetensors.torch import save_file

    blocks = torch.arange(24).view(4, 6)
    changed = blocks.clone()
    changed[2, 5] += 1
    assert race_checks.same_tensor_rows(blocks, blocks.clone(), "rows")[0]
    ok, detail = race_checks.same_tensor_rows(blocks, changed, "rows")
    assert not ok and "1 of 4 rows differ" in detail
    assert not race_checks.same_tensor_rows(blocks, blocks[:3], "rows")[0]

    weights = {"a": torch.ones(2, 2), "b": torch.zeros(3)}
    save_file(weights, tmp_path / "model.safetensors")
    assert race_checks.same_weights(dict(weights), str(tmp_path), 0.0)[0]
    assert not race_checks.same_weights({**weights, "b": torch.full((3,), 1e-6)}, str(tmp_path), 0.0)[0]
    assert not race_checks.same_weights({"a": weights["a"]}, str(tmp_path), 0.0)[0]


def test_trainer_side_refuses_blocks_its_recipe_did_not_make():
    load_benchmark("train_vs_trainer")
    import race_sides
    from datasets import Dataset

    made = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5, 6], [7, 8, 9]]})
    ordered = race_sides.in_order_of(made, torch.tensor([[7, 8, 9], [1, 2, 3]]))
    assert ordered["input_ids"] == [[7, 8, 9], [1, 2, 3]]
    with pytest.raises(RuntimeError, match="1 of the 2 blocks swapformer trained on"):
        race_sides.in_order_of(made, torch.tensor([[7, 8, 9], [1, 2, 4]]))
