"""What inputs.py reads without running it in a plain forward: the names of the base models' keyword
inputs (`BaseModelKwargs`), and the checks of inputs a plain forward does not have, run only when they
are given (the values of a 2D `attention_mask`, the shape of `global_attention_mask`)."""

from __future__ import annotations

from typing import TypedDict

import torch
from torch import nn

PACKING_INPUTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class BaseModelKwargs(TypedDict, total=False):
    """The inputs of every base model that pass as `**kwargs` (all of them names of transformers'
    `TransformersKwargs`, which generate() accepts without finding them in a signature).

    Args:
        output_attentions, output_hidden_states: return every layer's attention map / hidden state
            (default: the config's).
        cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx: packed sequences as
            `DataCollatorWithFlattening` marks them (restarting `position_ids` alone do too); each
            sequence then attends only to itself (modeling/attention/packing.py). Of the encoder input, for an
            encoder-decoder.

    transformers' models ignore a keyword they do not know; here a name outside these is a TypeError
    (`check_base_inputs`), as a misspelt keyword argument of a plain function is.
    """

    output_attentions: bool | None
    output_hidden_states: bool | None
    cu_seq_lens_q: torch.Tensor | None
    cu_seq_lens_k: torch.Tensor | None
    max_length_q: int | None
    max_length_k: int | None
    seq_idx: torch.Tensor | None


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
