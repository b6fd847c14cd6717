"""The checks of inputs a plain forward does not have, run only when they are given: the values of a 2D
`attention_mask` and the shape of `global_attention_mask` (inputs.py calls them)."""

from __future__ import annotations

import torch
from torch import nn


def check_mask_values(attention_mask: torch.Tensor, prefix: str) -> None:
    """A 2D mask holds 0 and 1: any other value used to be read as "keep", hiding a mistake upstream
    (a mask scaled, summed or shifted by -1)."""
    low, high = torch.aminmax(attention_mask)  # one pass; integer masks need nothing more
    if low >= 0 and high <= 1 and not (attention_mask.is_floating_point() and (attention_mask % 1).any()):
        return
    odd = attention_mask[(attention_mask != 0) & (attention_mask != 1)]
    found = ", ".join(f"{v:g}" for v in odd.unique()[:4].tolist())
    raise ValueError(
        f"{prefix}attention_mask holds {found} besides 0 and 1; a 2D mask holds 1 for tokens and 0 for "
        "padding (or True/False): pass the tokenizer's attention_mask, or build it as "
        "(input_ids != pad_token_id).long()"
    )


def check_global_mask(marks, batch: int, past, length: int, span: int, prefix: str = ""):
    """`global_attention_mask` (B, past + length), padded with zeros to a static cache's `span` slots."""
    widths = {span} | ({past + length} if isinstance(past, int) else set())
    if marks.dim() != 2 or marks.shape[0] != batch or marks.shape[1] not in widths:
        raise ValueError(
            f"{prefix}global_attention_mask has shape {tuple(marks.shape)}; it needs (batch={batch}, "
            f"length={' or '.join(map(str, sorted(widths)))}), one entry per cached and new token"
        )
    return nn.functional.pad(marks, (0, span - marks.shape[1]))
