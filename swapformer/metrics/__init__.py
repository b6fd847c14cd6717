"""Metrics that work offline: local `evaluate` modules shipped in the package.

`evaluate.load("accuracy")` downloads the metric's script from the Hugging Face Hub, so it fails on a
machine without Hub access. These files are evaluate modules of their own, loaded by path:

    from swapformer import metrics
    accuracy = metrics.load("accuracy")            # or evaluate.load(metrics.path("accuracy"))
    trainer = Trainer(..., compute_metrics=metrics.classification_metrics("accuracy", "f1"))
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# name -> module; perplexity lives beside the training job that reports it (docs/architecture.md, decision 11)
MODULES = {
    "accuracy": "swapformer.metrics.accuracy",
    "f1": "swapformer.metrics.f1",
    "perplexity": "swapformer.training.perplexity",
}


def path(name: str) -> str:
    """The file of metric `name`, for `evaluate.load(path)` (found without importing it)."""
    if name not in MODULES:
        raise ValueError(f"no local metric {name!r}; the local metrics are {', '.join(sorted(MODULES))}")
    return os.fspath(Path(importlib.util.find_spec(MODULES[name]).origin))


def load(name: str, **kwargs):
    """`evaluate.load` of the local metric `name` ("accuracy", "f1" or "perplexity")."""
    import evaluate

    return evaluate.load(path(name), **kwargs)


def classification_metrics(*names: str, average: str = "macro"):
    """A `compute_metrics` function for `Trainer` (sequence or token classification): the argmax of
    the logits against the labels, positions labelled -100 left out, for each metric in `names`
    ("accuracy", "f1"; default both). F1 is averaged with `average` and reported as "f1_<average>"."""
    names = names or ("accuracy", "f1")
    unknown = [n for n in names if n not in ("accuracy", "f1")]
    if unknown:
        raise ValueError(f"classification_metrics takes 'accuracy' and 'f1', got {unknown}")
    loaded = {name: load(name) for name in names}

    def compute_metrics(eval_pred) -> dict[str, float]:
        import numpy as np

        logits, labels = eval_pred.predictions, eval_pred.label_ids
        if isinstance(logits, tuple):  # models returning more than logits
            logits = logits[0]
        predictions = np.asarray(logits).argmax(-1).reshape(-1)
        labels = np.asarray(labels).reshape(-1)
        keep = labels != -100
        predictions, labels = predictions[keep].tolist(), labels[keep].tolist()
        results = {}
        for name, metric in loaded.items():
            if name == "f1":
                results[f"f1_{average}"] = metric.compute(
                    predictions=predictions, references=labels, average=average
                )["f1"]
            else:
                results.update(metric.compute(predictions=predictions, references=labels))
        return results

    return compute_metrics
