"""Nothing reaches the Hub before the preflight passes (issue 28): `model.push_to_hub` saves the folder and
runs the preflight first, then reads the repository's card, then creates the repository and commits. A
failed preflight makes no Hub call at all; with the Hub switched off (HF_HUB_OFFLINE=1) the upload stops
at once with one line naming the variable and what to do. Hub calls are recorded (tests/hub_recorder.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from transformers import Trainer, TrainingArguments

import swapformer
from swapformer.hub_cards import publish

from conftest import build, tiny_config
from hub_recorder import Hub

WRITES = ("create_repo", "create_commit")


def broken_save(monkeypatch, model):
    """model.save_pretrained writes a modeling file that fails to load without swapformer."""
    save = type(model).save_pretrained

    def save_broken(self, folder, *args, **kwargs):
        save(self, folder, *args, **kwargs)
        (Path(folder) / "modeling_decoder.py").write_text("raise ImportError('broken on purpose')\n")

    monkeypatch.setattr(type(model), "save_pretrained", save_broken)


def test_a_failed_preflight_makes_no_hub_call(monkeypatch):
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    broken_save(monkeypatch, model)
    with pytest.raises(publish.PublishError, match="broken on purpose"):
        model.push_to_hub("me/tiny")
    assert hub.calls == []  # not even an empty repository


def test_a_passing_preflight_creates_the_repository_then_commits(monkeypatch):
    """The repository's card is read first (the card uploaded depends on it); the two writes come last."""
    hub = Hub(monkeypatch)
    build(swapformer.DecoderForCausalLM, tiny_config("decoder")).push_to_hub("me/tiny")
    assert hub.calls[-2:] == [("create_repo", "me/tiny"), ("create_commit", "me/tiny")], hub.calls
    assert not [call for call in hub.calls[:-2] if call[0] in WRITES], hub.calls


def test_offline_push_says_so_in_one_line(tmp_path):
    """As a user runs it: a script that pushes, with HF_HUB_OFFLINE=1 in the environment."""
    script = tmp_path / "push.py"
    script.write_text(
        textwrap.dedent(
            """
            import swapformer
            config = swapformer.DecoderConfig(
                vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
            )
            swapformer.DecoderForCausalLM(config).push_to_hub("me/tiny")
            """
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert "HF_HUB_OFFLINE=1" in last and "unset" in last and "save_pretrained" in last, run.stderr
    assert "huggingface_hub" not in run.stderr.replace(last, ""), run.stderr  # stopped before the client


class CardTrainer(publish.CardTrainerMixin, Trainer):
    """The composition hub_cards documents."""


def card_trainer(model, folder, **args) -> CardTrainer:
    """A CardTrainer set to push to me/trained, after one training step on `model`."""
    rows = [{"input_ids": list(range(3, 11)), "labels": list(range(3, 11))} for _ in range(2)]
    arguments = TrainingArguments(
        folder, max_steps=1, per_device_train_batch_size=2, report_to=[], use_cpu=True, **args
    )
    trainer = CardTrainer(model=model, args=arguments, train_dataset=rows)
    trainer.train()
    return trainer


def test_a_trainers_failed_preflight_makes_no_hub_write(tmp_path, monkeypatch):
    """Trainer.push_to_hub creates the repository before it saves and writes the card (where the
    preflight runs); with the mixin the repository is created only once the preflight passed."""
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    trainer = card_trainer(model, tmp_path / "out", hub_model_id="me/trained")
    broken_save(monkeypatch, model)
    with pytest.raises(publish.PublishError, match="broken on purpose"):
        trainer.push_to_hub()
    assert not [call for call in hub.calls if call[0] in WRITES], hub.calls


def test_a_trainers_passing_preflight_creates_the_repository_then_uploads(tmp_path, monkeypatch):
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    card_trainer(model, tmp_path / "out", hub_model_id="me/trained").push_to_hub()
    assert hub.calls[-2:] == [("create_repo", "me/trained"), ("create_commit", "me/trained")], hub.calls
    assert publish.GENERATED_MARK in hub.readme()


def test_checkpoint_uploads_that_skip_the_preflight_are_refused_when_the_trainer_is_made(
    tmp_path, monkeypatch
):
    """push_to_hub=True with hub_strategy='every_save' (Trainer's default) uploads each checkpoint's folder
    during training, where no preflight runs: the mixin says so before training, and nothing is sent."""
    hub = Hub(monkeypatch)
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    arguments = TrainingArguments(tmp_path / "out", push_to_hub=True, hub_model_id="me/trained", report_to=[])
    with pytest.raises(ValueError, match="hub_strategy='every_save'.*hub_strategy='end'"):
        CardTrainer(model=model, args=arguments, train_dataset=[])
    assert hub.calls == []
