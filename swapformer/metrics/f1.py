"""F1 score (binary, macro, micro or weighted), as a local `evaluate` module: `evaluate.load(path)` works
without the Hub. `swapformer.metrics.load("f1")` finds this file for you.

Per class c: precision = TP / (TP + FP), recall = TP / (TP + FN), F1 = 2 TP / (2 TP + FP + FN), taken
as 0 where a class is neither predicted nor present (no division by zero).
- binary:   F1 of `pos_label`.
- macro:    the unweighted mean of the per-class F1 over every label seen in predictions or references.
- micro:    F1 of the summed counts (for single-label classification it equals accuracy).
- weighted: the per-class F1 weighted by each class's count among the references.

This file is loaded by evaluate as a standalone module: it imports nothing from swapformer but its
sibling _labels.py, which evaluate copies beside it.
"""

import evaluate

from ._labels import label_metric_info

_DESCRIPTION = "F1 = 2 * precision * recall / (precision + recall), per class and averaged."

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted labels (ints).
    references: true labels (ints), as many as predictions.
    average: "binary" (default), "macro", "micro" or "weighted".
    pos_label: the positive class for average="binary" (default 1).
Returns:
    f1: the score.
Examples:
    >>> metric = evaluate.load("swapformer/metrics/f1.py")
    >>> metric.compute(predictions=[0, 1, 1, 0], references=[0, 1, 0, 0])
    {'f1': 0.6666666666666666}
"""

AVERAGES = ("binary", "macro", "micro", "weighted")


def _counts(predictions, references, label):
    tp = sum(1 for p, r in zip(predictions, references) if p == label and r == label)
    fp = sum(1 for p, r in zip(predictions, references) if p == label and r != label)
    fn = sum(1 for p, r in zip(predictions, references) if p != label and r == label)
    return tp, fp, fn


def _f1(tp, fp, fn):
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class F1(evaluate.Metric):
    def _info(self):
        return label_metric_info(_DESCRIPTION, _KWARGS_DESCRIPTION)

    def _compute(self, predictions, references, average="binary", pos_label=1):
        if average not in AVERAGES:
            raise ValueError(f"average={average!r} is not one of {', '.join(AVERAGES)}")
        if not predictions:
            raise ValueError("f1 needs at least one prediction; none were given")
        labels = sorted(set(predictions) | set(references))
        if average == "binary":
            extra = [x for x in labels if x not in (0, 1, pos_label)]
            if extra:
                raise ValueError(
                    f"average='binary' needs two classes but the labels include {extra}; use average='macro', 'micro' or 'weighted'"
                )
            return {"f1": _f1(*_counts(predictions, references, pos_label))}
        per_class = {label: _counts(predictions, references, label) for label in labels}
        if average == "micro":
            tp, fp, fn = (sum(c[i] for c in per_class.values()) for i in range(3))
            return {"f1": _f1(tp, fp, fn)}
        scores = {label: _f1(*c) for label, c in per_class.items()}
        if average == "macro":
            return {"f1": sum(scores.values()) / len(scores)}
        support = {label: sum(1 for r in references if r == label) for label in labels}
        return {"f1": sum(scores[x] * support[x] for x in labels) / len(references)}
