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

Shapes: D documents, N windows of all documents together, F features per window (labels or
hidden size), L window length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers.utils import ModelOutput

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

Aggregation = Literal["mean", "max", "first"]
OutputKind = Literal["auto", "logits", "embeddings"]
Pooling = Literal["mean", "cls"]

AGGREGATIONS = ("mean", "max", "first")
OUTPUT_KINDS = ("auto", "logits", "embeddings")
POOLINGS = ("mean", "cls")

Inputs = str | Sequence[str] | Mapping[str, Any]


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


@dataclass(frozen=True)
class Windows:
    """Documents cut into windows, each with the tokenizer's special tokens around it.

    Args:
        input_ids: N windows of token ids, at most `max_length` each, in document order.
        window_to_document: for each window, the index of its document.
        num_documents: D (every document has at least one window, an empty one too).
    """

    input_ids: list[list[int]]
    window_to_document: list[int]
    num_documents: int


# Splitting ----------------------------------------------------------------------------------------


def special_tokens_template(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a single sequence, e.g. ([CLS], [SEP]) for BERT.

    Read from the tokenizer itself (one word with and without special tokens), so it holds for
    any tokenizer: BERT's [CLS] x [SEP], RoBERTa's <s> x </s>, T5's x </s>, GPT-2's nothing.
    """
    plain = tokenizer("hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start]), list(full[start + len(plain) :])
    raise ValueError(
        f"cannot tell {type(tokenizer).__name__}'s special tokens apart: 'hello' is {plain} without them "
        f"and {full} with them; chunking needs a tokenizer that wraps a sequence in fixed tokens"
    )


def window_spans(length: int, size: int, stride: int) -> list[tuple[int, int]]:
    """[start, end) of the windows over `length` content tokens: `size` tokens each, consecutive
    windows sharing `stride` tokens, the last one ending at `length` (as a tokenizer's
    `return_overflowing_tokens=True, stride=stride` splits). An empty document has one empty span.
    """
    if length <= size:
        return [(0, length)]
    step = size - stride
    spans = []
    start = 0
    while True:
        spans.append((start, min(start + size, length)))
        if start + size >= length:
            return spans
        start += step


def _content_of_texts(texts: Sequence[str], tokenizer) -> list[list[int]]:
    # verbose=False: the whole document is tokenized on purpose, so no "longer than the maximum" warning
    encoded = tokenizer(list(texts), add_special_tokens=False, truncation=False, verbose=False)
    return [list(ids) for ids in encoded["input_ids"]]


def _rows(value: Any, name: str) -> list[list[int]]:
    """A (D, T) tensor, a list of lists or one list of ints (one document) as lists of ints."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 1:
            value = value[None]
        if value.dim() != 2:
            raise ValueError(
                f"{name} must be (documents, tokens); got a tensor of shape {tuple(value.shape)}"
            )
        return value.tolist()
    value = list(value)
    if value and not isinstance(value[0], (list, tuple, torch.Tensor)):
        return [[int(x) for x in value]]
    return [[int(x) for x in (row.tolist() if isinstance(row, torch.Tensor) else row)] for row in value]


def _strip(ids: list[int], prefix: list[int], suffix: list[int]) -> list[int]:
    """Remove the tokenizer's own special tokens at the ends, if the ids have them."""
    if prefix and ids[: len(prefix)] == prefix:
        ids = ids[len(prefix) :]
    if suffix and len(ids) >= len(suffix) and ids[len(ids) - len(suffix) :] == suffix:
        ids = ids[: len(ids) - len(suffix)]
    return ids


def _content_of_encoding(
    encoding: Mapping[str, Any], prefix: list[int], suffix: list[int]
) -> list[list[int]]:
    if "overflow_to_sample_mapping" in encoding:
        raise ValueError(
            "these inputs were already cut into windows by the tokenizer (return_overflowing_tokens=True); "
            "pass the texts, or the tokenizer's output without truncation, and let chunking cut them"
        )
    if "input_ids" not in encoding:
        raise ValueError(f"tokenizer outputs need 'input_ids'; got the keys {sorted(encoding)}")
    ids = _rows(encoding["input_ids"], "input_ids")
    masks = _rows(encoding["attention_mask"], "attention_mask") if "attention_mask" in encoding else None
    if masks is not None and [len(m) for m in masks] != [len(r) for r in ids]:
        raise ValueError(
            f"attention_mask rows have lengths {[len(m) for m in masks]} but input_ids rows {[len(r) for r in ids]}"
        )
    documents = []
    for d, row in enumerate(ids):
        real = row if masks is None else [t for t, m in zip(row, masks[d]) if m]  # either padding side
        documents.append(_strip(real, prefix, suffix))
    return documents


def split_into_windows(inputs: Inputs, tokenizer, *, max_length: int, stride: int) -> Windows:
    """Cut documents into windows of at most `max_length` tokens, special tokens included.

    Args:
        inputs: a text, a list of texts, or tokenizer output (a BatchEncoding or a dict with
            `input_ids` (D, T) and optionally `attention_mask` (D, T), tensors or lists, padded on
            either side, with or without the special tokens). Tokenizer output must not be truncated:
            what it cut off is lost.
        tokenizer: the model's tokenizer; it tokenizes texts and gives the special tokens and padding.
        max_length: tokens per window, the special tokens included.
        stride: tokens shared by consecutive windows (the overlap), as the tokenizer's `stride`.

    Raises:
        ValueError: `max_length` leaves no room for content, or `stride` is not below the content
            length of a window.
    """
    prefix, suffix = special_tokens_template(tokenizer)
    size = _window_content_size(max_length, prefix, suffix)
    if not 0 <= stride < size:
        raise ValueError(
            f"stride={stride} must be at least 0 and below the {size} content tokens of a window "
            f"(max_length={max_length} minus {len(prefix) + len(suffix)} special tokens); windows would "
            f"not advance. Use a smaller stride (e.g. {size // 4}) or a larger max_length"
        )
    if isinstance(inputs, str):
        documents = _content_of_texts([inputs], tokenizer)
    elif isinstance(inputs, Mapping):
        documents = _content_of_encoding(inputs, prefix, suffix)
    elif isinstance(inputs, Sequence) and all(isinstance(t, str) for t in inputs):
        documents = _content_of_texts(inputs, tokenizer)
    else:
        raise TypeError(
            f"inputs must be a text, a list of texts, or tokenizer output (a dict with input_ids); "
            f"got {type(inputs).__name__}"
        )
    windows, owners = [], []
    for d, content in enumerate(documents):
        for start, end in window_spans(len(content), size, stride):
            windows.append(prefix + content[start:end] + suffix)
            owners.append(d)
    return Windows(windows, owners, len(documents))


def _window_content_size(max_length: int, prefix: list[int], suffix: list[int]) -> int:
    special = len(prefix) + len(suffix)
    if not isinstance(max_length, int) or max_length <= special:
        raise ValueError(
            f"max_length={max_length!r} must be an int above the {special} special tokens each window "
            f"holds ({prefix} before, {suffix} after); e.g. 512"
        )
    return max_length - special


# Running ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Inference as a pipeline runs it (no dropout, no gradients), then the model's mode back."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _batches(windows: list[list[int]], batch_size: int, pad_id: int) -> Iterator[dict[str, torch.Tensor]]:
    """Padded (B, L) input_ids and attention_mask, `batch_size` windows at a time, in order.

    Always padded on the right, whatever the tokenizer's `padding_side`: encoders with learned
    absolute positions (BERT) count positions from the first column, so a left-padded window would
    not give what the window gives alone.
    """
    for first in range(0, len(windows), batch_size):
        rows = windows[first : first + batch_size]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        yield {"input_ids": ids, "attention_mask": mask}


def _pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """(B, L, H) right-padded hidden states -> (B, H): the mean over real tokens
    (sentence-transformers' pooling, special tokens included) or the first token ([CLS])."""
    if pooling == "cls":
        return hidden[:, 0]
    m = mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def _window_vectors(out: Any, batch: dict[str, torch.Tensor], kind: OutputKind, pooling: Pooling):
    """(kind, (B, F)) from one model output; "auto" becomes "logits" or "embeddings"."""
    logits = getattr(out, "logits", None)
    if kind in ("auto", "logits") and logits is not None and logits.dim() == 2:
        return "logits", logits
    if kind == "logits":
        shape = None if logits is None else tuple(logits.shape)
        raise ValueError(
            f"output='logits' needs one row of logits per window (a sequence-classification head); "
            f"{type(out).__name__} has logits of shape {shape}. Use output='embeddings' for pooled hidden states"
        )
    hidden = getattr(out, "last_hidden_state", None)
    if hidden is None and getattr(out, "hidden_states", None):
        hidden = out.hidden_states[-1]
    if hidden is None:
        raise ValueError(
            f"{type(out).__name__} has neither per-window logits nor hidden states to pool; "
            "chunking needs an encoder that returns last_hidden_state, hidden_states or (B, labels) logits"
        )
    return "embeddings", _pool(hidden, batch["attention_mask"], pooling)


def run_windows(
    model: torch.nn.Module,
    windows: Windows,
    tokenizer,
    *,
    batch_size: int = 8,
    output: OutputKind = "auto",
    pooling: Pooling = "mean",
) -> tuple[str, torch.Tensor]:
    """Run the model over every window, `batch_size` at a time, in eval mode without gradients.

    Returns:
        ("logits" or "embeddings", (N, F) one vector per window, on the model's device).
    """
    if tokenizer.pad_token_id is None:
        raise ValueError(
            f"{type(tokenizer).__name__} has no pad token, and windows of different lengths are padded; "
            "set one, e.g. tokenizer.pad_token = tokenizer.eos_token"
        )
    device = _model_device(model)
    # a head model returns no last_hidden_state: ask it for its hidden states when pooling them
    wants_hidden = output == "embeddings" and getattr(model, "base_model", model) is not model
    extra = {"output_hidden_states": True} if wants_hidden else {}
    kind: str = output
    values = []
    with _eval_mode(model):
        for batch in _batches(windows.input_ids, batch_size, tokenizer.pad_token_id):
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch, **extra, return_dict=True)
            kind, vectors = _window_vectors(out, batch, kind, pooling)
            values.append(vectors)
    return kind, torch.cat(values)


def aggregate(
    values: torch.Tensor, window_to_document: torch.Tensor, num_documents: int, how: Aggregation
) -> torch.Tensor:
    """(N, F) per-window values -> (D, F) per document: the mean, the elementwise max, or the
    first window's. Windows are in document order and every document has at least one."""
    counts = torch.bincount(window_to_document, minlength=num_documents).tolist()
    groups = values.split(counts)
    if how == "mean":
        return torch.stack([g.mean(0) for g in groups])
    if how == "max":
        return torch.stack([g.max(0).values for g in groups])
    return torch.stack([g[0] for g in groups])


# The entry points ---------------------------------------------------------------------------------


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
        stride = _window_content_size(max_length, prefix, suffix) // 4
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
