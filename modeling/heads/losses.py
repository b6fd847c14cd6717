"""The heads' losses: token cross-entropy (causal LM, masked LM, seq2seq, token classification), the
sequence classification losses and the answer-span loss, all computed in fp32."""

from __future__ import annotations

import torch
from torch import nn


def check_label_ids(labels: torch.Tensor, vocab_size: int, name: str = "labels", ignore_index: int = -100):
    """Token labels lie in [0, vocab_size) or equal `ignore_index`; checked where the user gave them,
    not as an index error inside the loss or the embedding."""
    if torch.compiler.is_compiling() or not labels.numel():
        return
    real = labels[labels != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds token ids in [{int(real.min())}, {int(real.max())}] but vocab_size={vocab_size}; "
            f"use ids in [0, {vocab_size}) and {ignore_index} for positions without loss (the tokenizer and the "
            "model disagree: resize_token_embeddings, or fix the tokenizer)"
        )


def shift_labels_left(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """(B, T) labels moved one place left, `ignore_index` at the end: position t's target is token t + 1.

    The causal-LM loss shifts the labels, not the logits (as transformers' `ForCausalLMLoss` does):
    `logits[:, :-1]` is a strided view that the loss would copy whole, and its backward writes the
    gradient into a zero-filled (B, T, V) tensor, two passes over the largest tensor of a training
    step. The positions given up are the same: the last one has no target either way."""
    return nn.functional.pad(labels[:, 1:], (0, 1), value=ignore_index)


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    name: str = "labels",
) -> torch.Tensor:
    """Cross-entropy over tokens, in fp32. The logits are read as they are (no slice, no copy in fp32).

    Args:
        logits: (B, T, V).
        labels: (B, T), `ignore_index` where no loss is taken.
        shift: predict token t + 1 from position t (causal LM); False for masked LM and seq2seq,
            whose labels are already aligned with the logits.
        num_items_in_batch: number of labelled tokens over the whole (accumulated) batch, as given by
            Trainer or an Accelerate loop; the sum is divided by it so that gradient accumulation gives
            the gradient of one big batch. Without it, the mean over this batch's labelled tokens.
        name: what the user called `labels`, for the error on ids outside the vocabulary.
    """
    check_label_ids(labels, logits.shape[-1], name, ignore_index)
    if shift:
        labels = shift_labels_left(labels, ignore_index)
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index)
    total = nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """transformers' `ForCausalLMLoss`: `labels` (B, T) are shifted inside; `shift_labels` (B, T),
    already aligned with the logits (context parallelism, packing collators), win when both are given."""
    if shift_labels is None:
        if labels is None:
            return None
        return token_cross_entropy(logits, labels, shift=True, num_items_in_batch=num_items_in_batch)
    if tuple(shift_labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"shift_labels has shape {tuple(shift_labels.shape)} but the logits cover {tuple(logits.shape[:-1])} "
            "positions: shift_labels[b, t] is the token that follows position t (-100 for none), one per position "
            "(with logits_to_keep, pass labels instead)"
        )
    return token_cross_entropy(
        logits, shift_labels, shift=False, num_items_in_batch=num_items_in_batch, name="shift_labels"
    )


def sequence_classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regression, single-label or multi-label loss, chosen as transformers does (`problem_type`)."""
    num_labels = logits.shape[-1]
    problem = config.problem_type
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return nn.functional.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float())
    if problem == "single_label_classification":
        return nn.functional.cross_entropy(logits.view(-1, num_labels).float(), labels.view(-1))
    return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())


def span_loss(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
) -> torch.Tensor:
    """Extractive question answering (BERT's): the mean of the start and end cross-entropies over the
    (B, T) logits; positions outside the sequence are clamped to T and ignored."""
    ignored = start_logits.shape[1]
    start = start_positions.view(-1).clamp(0, ignored)
    end = end_positions.view(-1).clamp(0, ignored)
    return (
        nn.functional.cross_entropy(start_logits.float(), start, ignore_index=ignored)
        + nn.functional.cross_entropy(end_logits.float(), end, ignore_index=ignored)
    ) / 2


__all__ = [
    "causal_lm_loss",
    "check_label_ids",
    "sequence_classification_loss",
    "shift_labels_left",
    "span_loss",
    "token_cross_entropy",
]
