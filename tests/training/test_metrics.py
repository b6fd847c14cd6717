"""Offline metrics (issue 14, item 3): the local evaluate modules against values worked out by hand,
and Trainer's compute_metrics on a machine without Hub access."""

from __future__ import annotations

import math

import evaluate
import numpy as np
import pytest
import torch
from transformers import EvalPrediction, Trainer, TrainingArguments

import swapformer
from swapformer import metrics

from conftest import build, tiny_config

# 3 classes, 8 examples. Per class (TP, FP, FN): 0: (2, 1, 1), 1: (1, 1, 2), 2: (2, 1, 0).
PREDICTIONS = [0, 0, 1, 2, 2, 1, 0, 2]
REFERENCES = [0, 1, 1, 2, 2, 0, 0, 1]
F1_BY_CLASS = {0: 4 / 6, 1: 2 / 5, 2: 4 / 5}  # 2 TP / (2 TP + FP + FN)


def test_accuracy_by_hand():
    accuracy = metrics.load("accuracy")
    assert accuracy.compute(predictions=PREDICTIONS, references=REFERENCES) == {"accuracy": 5 / 8}
    assert accuracy.compute(predictions=PREDICTIONS, references=REFERENCES, normalize=False) == {
        "accuracy": 5
    }
    weights = [1, 1, 1, 1, 1, 1, 1, 3]  # the last (wrong) prediction weighs 3
    assert accuracy.compute(predictions=PREDICTIONS, references=REFERENCES, sample_weight=weights) == {
        "accuracy": 5 / 10
    }


@pytest.mark.parametrize(
    "average, want",
    [
        ("macro", sum(F1_BY_CLASS.values()) / 3),
        ("micro", 5 / 8),  # summed counts TP 5, FP 3, FN 3: 10 / 16
        ("weighted", (F1_BY_CLASS[0] * 3 + F1_BY_CLASS[1] * 3 + F1_BY_CLASS[2] * 2) / 8),
    ],
)
def test_f1_averages_by_hand(average, want):
    got = metrics.load("f1").compute(predictions=PREDICTIONS, references=REFERENCES, average=average)["f1"]
    assert math.isclose(got, want, rel_tol=1e-12)


def test_binary_f1_and_its_errors():
    f1 = metrics.load("f1")
    # pos_label 1: TP 1, FP 1, FN 1 -> 2 / 4
    assert f1.compute(predictions=[1, 1, 0, 0], references=[1, 0, 1, 0]) == {"f1": 0.5}
    assert f1.compute(predictions=[0, 0], references=[0, 0]) == {"f1": 0.0}  # no positive anywhere: 0, no NaN
    with pytest.raises(ValueError, match=r"average='binary' needs two classes but the labels include \[2\]"):
        f1.compute(predictions=PREDICTIONS, references=REFERENCES)
    with pytest.raises(ValueError, match="average='samples' is not one of binary, macro, micro, weighted"):
        f1.compute(predictions=[0], references=[0], average="samples")


def test_local_paths_and_unknown_names():
    assert metrics.path("perplexity").endswith("perplexity.py")
    assert evaluate.load(metrics.path("accuracy")).compute(predictions=[1], references=[1]) == {
        "accuracy": 1.0
    }
    with pytest.raises(
        ValueError, match="no local metric 'bleu'; the local metrics are accuracy, f1, perplexity"
    ):
        metrics.path("bleu")


def test_compute_metrics_skips_ignored_positions():
    compute = metrics.classification_metrics("accuracy", "f1", average="micro")
    logits = np.eye(3)[PREDICTIONS][None]  # (1, 8, 3): token classification shape
    labels = np.array(REFERENCES)[None]
    labels_ignored = np.concatenate([labels, [[-100]]], axis=1)
    logits_ignored = np.concatenate([logits, np.eye(3)[[1]][None]], axis=1)
    want = {"accuracy": 5 / 8, "f1_micro": 5 / 8}
    assert compute(EvalPrediction(predictions=logits, label_ids=labels)) == pytest.approx(want)
    assert compute(EvalPrediction(predictions=logits_ignored, label_ids=labels_ignored)) == pytest.approx(
        want
    )


def test_trainer_evaluates_with_local_metrics_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build(swapformer.EncoderForSequenceClassification, tiny_config("encoder", num_labels=3)).eval()
    torch.manual_seed(0)
    data = [{"input_ids": torch.randint(3, 50, (6,)).tolist(), "labels": i % 3} for i in range(12)]
    args = TrainingArguments(tmp_path, per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    trainer = Trainer(
        model=model, args=args, eval_dataset=data, compute_metrics=metrics.classification_metrics()
    )
    result = trainer.evaluate()
    with torch.no_grad():
        predicted = model(torch.tensor([d["input_ids"] for d in data])).logits.argmax(-1).tolist()
    references = [d["labels"] for d in data]
    assert result["eval_accuracy"] == pytest.approx(sum(p == r for p, r in zip(predicted, references)) / 12)
    seen = sorted(set(predicted) | set(references))  # macro F1 averages over the labels that occur
    scores = []
    for c in seen:
        tp = sum(p == c and r == c for p, r in zip(predicted, references))
        wrong = sum((p == c) != (r == c) for p, r in zip(predicted, references))
        scores.append(2 * tp / (2 * tp + wrong))
    assert result["eval_f1_macro"] == pytest.approx(sum(scores) / len(seen))
