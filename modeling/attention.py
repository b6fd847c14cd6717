"""Attention functions and the checks made when a backend is chosen.

Every backend has transformers' `AttentionInterface` signature:

    fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out, weights)

B batch, H query heads, K key/value heads, T query length, S key length, D head dim.
query (B, H, T, D); key, value (B, K, S, D), GQA not expanded (`module.num_key_value_groups`);
out (B, T, H, D) contiguous; weights (B, H, T, S) or None.

`attention_mask` is what `masks.lower_mask` made for the backend: for eager an additive float mask
(0 where allowed, -inf where not, plus any position bias) or None; for sdpa a boolean mask (True
where allowed), an additive float mask when there is a position bias, or None. With None, causality
comes from `module.is_causal` (when T > 1), as in transformers.

Fully masked query rows (left padding under a causal mask) give zeros on every backend, as SDPA
and FlashAttention do, rather than the uniform average a plain softmax would give.

This module knows nothing of layers; layers call the backend through the registry.
"""

from __future__ import annotations

import torch
from torch import nn

from ..configuration.backends import BACKENDS, check_backend_for_config


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, K, S, D) -> (B, K * groups, S, D), each kv head repeated for its query heads."""
    if groups == 1:
        return x
    b, k, s, d = x.shape
    return x[:, :, None].expand(b, k, groups, s, d).reshape(b, k * groups, s, d)


def attention_probabilities(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """softmax(q k^T * scaling + mask) in fp32, with fully masked rows set to zero.

    `attention_mask` may be additive (float) or boolean (True = attend); both are accepted so the
    weights can be recomputed from whatever mask a fast backend was given.
    """
    key = repeat_kv(key, module.num_key_value_groups)
    scores = torch.matmul(query.float(), key.float().transpose(2, 3)) * scaling  # (B, H, T, S)
    if attention_mask is None and module.is_causal and query.shape[2] > 1:
        t, s = query.shape[2], key.shape[2]
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    finite = torch.finfo(torch.float32).min
    # Rows with no allowed key: softmax over finite values, then zeroed (no NaN forward or backward).
    has_key = scores.amax(dim=-1, keepdim=True) > finite
    probs = torch.softmax(scores.clamp(min=finite), dim=-1)
    return probs * has_key


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: explicit scores, softmax in fp32, dropout, weighted sum."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    probs = attention_probabilities(module, query, key, attention_mask, scaling).to(query.dtype)
    weights = probs
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, repeat_kv(value, module.num_key_value_groups))  # (B, H, T, D)
    return out.transpose(1, 2).contiguous(), weights


def check_backend_for_model(name: str, model: nn.Module) -> None:
    """Checks made when `model` is put on backend `name`: the config's needs, then the device."""
    check_backend_for_config(name, model.config)
    caps = BACKENDS[name]
    devices = {p.device.type for p in model.parameters() if p.device.type != "meta"}
    for device in devices:
        if device not in caps.devices:
            raise ValueError(
                f"attn_implementation={name!r} does not run on device {device!r} (it runs on "
                f"{', '.join(caps.devices)}); use 'eager' or move the model"
            )
