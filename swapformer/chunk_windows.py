"""Chunking, step one: documents cut into windows of a model's length, special tokens around each.

`split_into_windows` takes texts or untruncated tokenizer output and returns `Windows`, which
`swapformer.chunking` runs and aggregates. The windows overlap by `stride` tokens, as a tokenizer's
`return_overflowing_tokens=True, stride=stride` splits, and each gets the tokenizer's own special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Inputs = str | Sequence[str] | Mapping[str, Any]


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
    size = window_content_size(max_length, prefix, suffix)
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


def window_content_size(max_length: int, prefix: list[int], suffix: list[int]) -> int:
    special = len(prefix) + len(suffix)
    if not isinstance(max_length, int) or max_length <= special:
        raise ValueError(
            f"max_length={max_length!r} must be an int above the {special} special tokens each window "
            f"holds ({prefix} before, {suffix} after); e.g. 512"
        )
    return max_length - special
