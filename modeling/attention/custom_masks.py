"""4D attention masks given by the user (transformers' custom masks): their checks, their (B, T, S)
bool form and their place in a pattern (`AttentionPattern.custom_mask`, whose predicate masks.py
states). Reached only when a forward is given a 4D `attention_mask`.

Shape legend: B batch, T new tokens, S keys (cached and new, or a static cache's slots).
"""

from __future__ import annotations

import torch

from ...configuration.backends import DESCRIPTIONS, check_batch_feature

# A float 4D mask holds 0 where a query may attend a key and at most this where not (transformers' masks
# hold the dtype's minimum, BERT's original code -10000); values between are refused (check_custom_mask).
MASKED_AT_MOST = -1e4


def custom_allowed(mask: torch.Tensor, batch: int) -> torch.Tensor:
    """A checked 4D attention_mask (B or 1, 1, T, S), bool or float -> (B, T, S) bool, True where allowed."""
    allowed = mask if mask.dtype == torch.bool else mask > MASKED_AT_MOST
    return allowed[:, 0].expand(batch, -1, -1)


def check_custom_mask(mask: torch.Tensor, batch: int, length: int, spans: set, past, prefix: str) -> None:
    """A 4D mask (B or 1, 1, T, past + T): bool, True where a query may attend a key, or float, 0 there and
    at most `MASKED_AT_MOST` elsewhere (transformers' masks hold the dtype's minimum). Its values are
    checked in eager mode only (inputs.py says why). `spans` are the key lengths that fit, after `past`
    cached tokens."""
    name = f"{prefix}attention_mask"
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"4D {name} has dtype {mask.dtype}; it must be bool (True where a query may attend a key) or float "
            "(0 where it may, a large negative value such as torch.finfo(dtype).min where not)"
        )
    b, heads, t, s = mask.shape
    if b not in (1, batch) or heads != 1 or t != length or s not in spans:
        raise ValueError(
            f"4D {name} has shape {tuple(mask.shape)} but the inputs need (batch={batch} or 1, 1, query={length}, "
            f"key={_keys(spans, past, length)}: the second dimension is 1, one mask for every head (per-head "
            "masks are not supported)"
        )
    if mask.dtype != torch.bool and not torch.compiler.is_compiling():
        _check_float_values(mask, name)


def _keys(spans: set, past, length: int) -> str:
    """The key lengths a mask may have, in words (e.g. "12) (8 cached + 4 new")."""
    keys = " or ".join(map(str, sorted(spans))) or "every cache slot"
    cached = f" ({past} cached + {length} new)" if isinstance(past, int) and past else ""
    return f"{keys}){cached}"


def _check_float_values(mask: torch.Tensor, name: str) -> None:
    """A float mask is a mask, not a bias: each value keeps a key (0) or removes it."""
    rule = (
        f"a float mask holds 0 where a query may attend a key and at most {MASKED_AT_MOST:g} (such as "
        "torch.finfo(dtype).min or -inf) where not"
    )
    if bool(mask.isnan().any()):
        raise ValueError(f"4D {name} holds NaN; {rule}")
    top = float(mask.max())
    if top > 0:
        raise ValueError(f"4D {name} holds the positive value {top}; {rule}")
    soft = mask[(mask < 0) & (mask > MASKED_AT_MOST)]
    if soft.numel():
        raise ValueError(
            f"4D {name} holds {float(soft[0])}, between {MASKED_AT_MOST:g} and 0: a soft bias, which swapformer "
            f"does not add to the scores; {rule}, or pass a bool mask"
        )


def refuse_packing_with_custom_mask(packing_inputs: dict, prefix: str) -> None:
    """A 4D mask says which keys each query sees, packed sequences included: boundaries beside it would be
    a second, possibly different, statement of the same thing."""
    given = [name for name, value in packing_inputs.items() if value is not None]
    if given:
        raise ValueError(
            f"A 4D {prefix}attention_mask cannot be combined with packed-sequence boundaries ({', '.join(given)}): "
            "the mask already says which keys each query sees; pass one or the other"
        )


def refuse_custom_mask_backends(stack, backends) -> None:
    """The table's refusal of a 4D attention_mask by a backend without the `custom_mask` column; and
    Linformer's, whose layers attend to projected rows that no token mask applies to."""
    for backend in sorted(set(backends)):
        check_batch_feature(backend, "custom_mask", DESCRIPTIONS["custom_mask"])
    if getattr(stack, "linformer", None) is not None:
        raise ValueError(
            f"A 4D attention_mask cannot apply to Linformer's projected keys and values (linformer_k="
            f"{stack.config.linformer_k} mixes every token into each projected key); pass a (batch, length) "
            "padding mask, or use a model without linformer_k"
        )


def custom_mask_at_keys(custom: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, T, span) allowed -> (B, T, S) at the keys a cache layer hands over, whose absolute indices
    are `index` (S,); False at empty slots past the mask."""
    picked = custom[:, :, index.clamp(0, custom.shape[-1] - 1)]
    return picked.masked_fill(index >= custom.shape[-1], False)
