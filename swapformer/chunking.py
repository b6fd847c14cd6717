"""Chunking: run an ordinary encoder over documents longer than its window.

The other answer to long inputs (the first is a long model: window + global attention on the
`sparse` backend). Each document is cut into overlapping windows of `max_length` tokens, the
tokenizer's special tokens ([CLS] ... [SEP]) are put back around every window, the windows run
through the model in batches, and one vector per window (the logits of a sequence-classification
head, or the pooled last hidden state) is aggregated per document with `mean`, `max` or `first`.

It works with any encoder that takes `input_ids` and `attention_mask`: a swapformer model or a
plain transformers one (`BertModel`, `BertForSequenceClassification`, ...). The price is one forward
per window (about (n - stride) / (max_length - stride) windows for n tokens) and a blind spot: no
window sees two tokens further apart than `max_length`, and the aggregation adds up per-window
evidence, so a label that depends on a relation between far-apart tokens cannot be learned.

    from swapformer.chunking import chunked_forward, classify_long

    out = chunked_forward(model, texts, tokenizer, max_length=512, stride=128)
    out.logits          # (D, num_labels), one row per document
    classify_long(model, tokenizer, texts)   # [{"label": ..., "score": ...}, ...] as a pipeline

This module is the front (options, `chunked_forward`, `classify_long`); the two steps live beside it:
`chunk_windows.py` cuts documents into windows, `chunk_run.py` runs them and aggregates.

Shapes: D documents, N windows of all documents together, F features per window (labels or
hidden size), L window length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from .chunk_run import (
    AGGREGATIONS,
    OUTPUT_KINDS,
    POOLINGS,
    Aggregation,
    OutputKind,
    Pooling,
    aggregate,
    run_windows,
)
from .chunk_windows import (
    Inputs,
    Windows,
    special_tokens_template,
    split_into_windows,
    window_content_size,
    window_spans,
)

__all__ = [
    "ChunkedOutput",
    "Windows",
    "aggregate",
    "chunked_forward",
    "classify_long",
    "run_windows",
    "split_into_windows",
    "window_spans",
]


@dataclass
class ChunkedOutput(ModelOutput):
    """What `chunked_forward` returns: one row per document, plus the per-window values.

    Args:
        logits: (D, num_labels) aggregated logits, when the model has a sequence-classification head
            (and `output` is "auto" or "logits").
        embeddings: (D, hidden) aggregated pooled hidden states, when `output` is "embeddings" (or
            "auto" and the model returns no per-sequence logits).
        window_values: (N, F) the vector of each window before aggregation.
        window_to_document: (N,) the document of each window (as the tokenizer's
            `overflow_to_sample_mapping`).
    """

    logits: torch.FloatTensor | None = None
    embeddings: torch.FloatTensor | None = None
    window_values: torch.FloatTensor | None = None
    window_to_document: torch.LongTensor | None = None


def default_max_length(model: torch.nn.Module, tokenizer) -> int:
    """The shorter of the tokenizer's `model_max_length` and the model's `max_position_embeddings`."""
    limits = [
        getattr(tokenizer, "model_max_length", None),
        getattr(getattr(model, "config", None), "max_position_embeddings", None),
    ]
    limits = [
        n for n in limits if isinstance(n, int) and 0 < n < 1_000_000
    ]  # tokenizers say 1e30 for "unset"
    if not limits:
        raise ValueError(
            "neither the tokenizer nor the model config states a maximum length; pass max_length="
        )
    return min(limits)


def _check_options(
    model, max_length: int, batch_size: int, aggregation: str, output: str, pooling: str
) -> None:
    for name, value, allowed in (
        ("aggregation", aggregation, AGGREGATIONS),
        ("output", output, OUTPUT_KINDS),
        ("pooling", pooling, POOLINGS),
    ):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive int (windows per forward)")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ValueError(
            f"max_length={max_length} is longer than the model's max_position_embeddings={limit}; "
            f"use max_length={limit} or less"
        )


def chunked_forward(
    model: torch.nn.Module,
    inputs: Inputs,
    tokenizer,
    *,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 8,
    aggregation: Aggregation = "mean",
    output: OutputKind = "auto",
    pooling: Pooling = "mean",
) -> ChunkedOutput:
    """Run an encoder over documents of any length, window by window, one result per document.

    A document that fits in one window gives what the model gives on it directly.

    Args:
        model: an encoder taking `input_ids` and `attention_mask` (swapformer or transformers).
            Run in eval mode without gradients; its mode is restored afterwards.
        inputs: a text, a list of texts, or untruncated tokenizer output (see `split_into_windows`).
        tokenizer: the model's tokenizer (special tokens, padding, and tokenizing texts).
        max_length: tokens per window, special tokens included (default: the shorter of the
            tokenizer's `model_max_length` and the model's `max_position_embeddings`).
        stride: tokens shared by consecutive windows (default: a quarter of a window's content).
        batch_size: windows per forward.
        aggregation: "mean", "max" (elementwise) or "first" (the first window's, i.e. truncation).
        output: "logits" (a sequence-classification head's), "embeddings" (pooled last hidden
            state; a head model is asked for its hidden states), or "auto": logits when the model
            returns one row of logits per window, embeddings otherwise.
        pooling: for embeddings, "mean" over the window's tokens or "cls" (its first token).

    Raises:
        ValueError: an option out of range, named with the fix; TypeError: inputs of another kind.
    """
    max_length = default_max_length(model, tokenizer) if max_length is None else max_length
    _check_options(model, max_length, batch_size, aggregation, output, pooling)
    if stride is None:
        prefix, suffix = special_tokens_template(tokenizer)
        stride = window_content_size(max_length, prefix, suffix) // 4
    windows = split_into_windows(inputs, tokenizer, max_length=max_length, stride=stride)
    kind, values = run_windows(
        model, windows, tokenizer, batch_size=batch_size, output=output, pooling=pooling
    )
    owners = torch.tensor(windows.window_to_document, dtype=torch.long, device=values.device)
    per_document = aggregate(values, owners, windows.num_documents, aggregation)
    return ChunkedOutput(
        **{kind: per_document},
        window_values=values,
        window_to_document=owners,
    )


def classify_long(
    model: torch.nn.Module,
    tokenizer,
    texts: str | Sequence[str],
    *,
    top_k: int | None = 1,
    **chunking: Any,
) -> list[dict[str, Any]] | list[list[dict[str, Any]]]:
    """Classify texts of any length as transformers' "text-classification" pipeline does.

    Aggregated logits (see `chunked_forward`, whose keyword arguments `chunking` takes) go through a
    sigmoid for multi-label or single-output models and a softmax otherwise, and are named with
    `model.config.id2label`.

    Returns:
        with `top_k=1`, one {"label", "score"} per text (a list of one for a single text, as the
        pipeline); otherwise per text a list of the `top_k` best (all labels for None), best first.
    """
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k={top_k!r} must be a positive int or None (all labels)")
    logits = chunked_forward(model, texts, tokenizer, output="logits", **chunking).logits.float()
    config = model.config
    if getattr(config, "problem_type", None) == "multi_label_classification" or logits.shape[-1] == 1:
        scores = logits.sigmoid()
    else:
        scores = logits.softmax(-1)
    id2label = getattr(config, "id2label", None) or {}
    results = []
    for row in scores.cpu():
        order = row.argsort(descending=True)[: top_k or len(row)].tolist()
        ranked = [{"label": id2label.get(i, f"LABEL_{i}"), "score": float(row[i])} for i in order]
        results.append(ranked[0] if top_k == 1 else ranked)
    return results
