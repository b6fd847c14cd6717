"""Perplexity from per-token log-probabilities, as a local `evaluate` module.

Load it with `evaluate.load(path_to_this_file)`; evaluate's own "perplexity" lives on the Hub and
downloads a model by name, which an offline machine cannot do. This one scores any model: the caller
hands over, for each sequence, the natural-log probability the model gave each of its target tokens.

This file is loaded by evaluate as a standalone module: it imports nothing from swapformer.
"""

import math

import datasets
import evaluate

_DESCRIPTION = """Corpus perplexity exp(-sum(log p) / N) over all N target tokens of all sequences,
the mean negative log-likelihood in nats, and the token count."""

_KWARGS_DESCRIPTION = """
Args:
    log_probs: one list per sequence of the natural-log probabilities of its target tokens
        (each <= 0; empty lists count nothing).
Returns:
    perplexity: exp of the mean negative log-likelihood per token, over all tokens.
    nll: the mean negative log-likelihood per token (nats).
    num_tokens: the number of tokens scored.
Examples:
    >>> metric = evaluate.load("training/perplexity.py")
    >>> round(metric.compute(log_probs=[[math.log(0.5), math.log(0.25)]])["perplexity"], 6)
    2.828427
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"log_probs": datasets.Sequence(datasets.Value("float64"))}),
        )

    def _compute(self, log_probs):
        total, count = 0.0, 0
        for row in log_probs:
            for lp in row:
                if not lp <= 0.0:  # also catches NaN
                    raise ValueError(f"log_probs must be log-probabilities (<= 0), got {lp}")
                total += lp
                count += 1
        if count == 0:
            raise ValueError("perplexity needs at least one token; every log_probs list was empty")
        nll = -total / count
        return {"perplexity": math.exp(nll), "nll": nll, "num_tokens": count}
