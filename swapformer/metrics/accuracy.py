"""Accuracy, as a local `evaluate` module: `evaluate.load(path_to_this_file)` works without the Hub
(`evaluate.load("accuracy")` downloads its script from the Hub). `swapformer.metrics.load("accuracy")`
finds this file for you.

This file is loaded by evaluate as a standalone module: it imports nothing from swapformer but its
sibling _labels.py, which evaluate copies beside it.
"""

import evaluate

from ._labels import label_metric_info

_DESCRIPTION = """The share of predictions equal to their reference label (or, with sample_weight, the
weighted share)."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (ints).
    references: true labels (ints), as many as predictions.
    normalize: True (default) for the share of correct predictions, False for their count (or weight).
    sample_weight: optional weight per example.
Returns:
    accuracy: the share (or count) of correct predictions.
Examples:
    >>> metric = evaluate.load("swapformer/metrics/accuracy.py")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'accuracy': 0.75}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return label_metric_info(_DESCRIPTION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        if not predictions:
            raise ValueError("accuracy needs at least one prediction; none were given")
        weights = [1.0] * len(predictions) if sample_weight is None else [float(w) for w in sample_weight]
        if len(weights) != len(predictions):
            raise ValueError(f"sample_weight has {len(weights)} entries for {len(predictions)} predictions")
        correct = sum(w for p, r, w in zip(predictions, references, weights) if p == r)
        return {"accuracy": correct / sum(weights) if normalize else correct}
