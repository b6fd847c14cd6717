"""Attention masks: predicates over (batch, head, query index, key index), lowered per backend.

A predicate is a function `pred(b, h, q, k) -> bool tensor` on broadcastable index tensors: the
`mask_mod` convention of torch's flex attention, so the same predicates can later be compiled into
a BlockMask. Models combine predicates once per forward (`and_masks`, `or_masks`), and
`lower_mask` turns the result into what the chosen backend consumes. Layers never build masks.

Query indices are positions in the key sequence: with a cache holding P tokens, query i of this
step has index P + i.

Lowered forms (B batch, H heads, T queries, S keys):
    eager: additive float (B, 1 or H, T, S), 0 where allowed and -inf elsewhere, plus any position
           bias; or None when nothing is masked and there is no bias.
    sdpa:  bool (B, 1, T, S), True where allowed; additive float when there is a position bias; or
           None when the kernel's own `is_causal` (or no mask at all) computes the same thing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Predicate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def causal_mask() -> Predicate:
    def pred(b, h, q, k):
        return k <= q

    return pred


def padding_mask(key_valid: torch.Tensor) -> Predicate:
    """key_valid (B, S) bool: False for padding keys."""

    def pred(b, h, q, k):
        return key_valid[b, k]

    return pred


def and_masks(*preds: Predicate) -> Predicate:
    def pred(b, h, q, k):
        out = preds[0](b, h, q, k)
        for p in preds[1:]:
            out = out & p(b, h, q, k)
        return out

    return pred


def or_masks(*preds: Predicate) -> Predicate:
    def pred(b, h, q, k):
        out = preds[0](b, h, q, k)
        for p in preds[1:]:
            out = out | p(b, h, q, k)
        return out

    return pred


def materialize(
    pred: Predicate, batch: int, query_offset: int, query_length: int, key_length: int, device
) -> torch.Tensor:
    """Evaluate `pred` densely: (B, 1, T, S) bool."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    q = torch.arange(query_offset, query_offset + query_length, device=device)[None, None, :, None]
    k = torch.arange(key_length, device=device)[None, None, None, :]
    return pred(b, h, q, k).expand(batch, 1, query_length, key_length)


def lower_mask(
    backend: str,
    *,
    batch: int,
    query_length: int,
    key_length: int,
    causal: bool,
    key_valid: torch.Tensor | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    device,
) -> torch.Tensor | None:
    """Build the mask `backend` consumes for one attention kind (self or cross) of one forward.

    Args:
        causal: keys after the query are hidden (queries sit at the end of the key sequence).
        key_valid: (B, S) bool, False for padding keys; None when there is no padding.
        bias: additive position bias broadcastable to (B, H, T, S), or None.
    """
    if key_valid is not None and bool(key_valid.all()):
        key_valid = None
    offset = key_length - query_length
    # Without a cache, or for a single new token, a causal mask is exactly the kernel's own `is_causal`.
    causal_is_trivial = not causal or query_length == 1
    if key_valid is None and bias is None:
        if backend == "sdpa" and (not causal or offset == 0 or query_length == 1):
            return None
        if causal_is_trivial:
            return None
    preds = []
    if causal and query_length > 1:
        preds.append(causal_mask())
    if key_valid is not None:
        preds.append(padding_mask(key_valid))
    if preds:
        allowed = materialize(and_masks(*preds), batch, offset, query_length, key_length, device)
    else:
        allowed = None
    if bias is None and backend == "sdpa":
        return allowed
    if allowed is None:
        return bias.to(dtype)
    zeros = torch.zeros((), dtype=dtype, device=device)
    neg_inf = torch.full((), float("-inf"), dtype=dtype, device=device)
    additive = torch.where(allowed, zeros, neg_inf)
    return additive if bias is None else additive + bias.to(dtype)
