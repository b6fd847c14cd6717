"""Chunking, step two: run a model over `Windows` in batches and aggregate one vector per document.

Shapes: D documents, N windows of all documents together, F features per window (labels or
hidden size), L window length, B windows in one forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import torch

from .chunk_windows import Windows

Aggregation = Literal["mean", "max", "first"]
OutputKind = Literal["auto", "logits", "embeddings"]
Pooling = Literal["mean", "cls"]

AGGREGATIONS = ("mean", "max", "first")
OUTPUT_KINDS = ("auto", "logits", "embeddings")
POOLINGS = ("mean", "cls")


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
