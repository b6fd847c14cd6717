"""Attention functions and the checks made when a backend is chosen or run.

Every backend has transformers' `AttentionInterface` signature:

    fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs) -> (out, weights)

B batch, H query heads, K key/value heads, T query length, S key length, D head dim.
query (B, H, T, D); key, value (B, K, S, D), GQA not expanded (`module.num_key_value_groups`);
out (B, T, H, D) contiguous; weights (B, H, T, S) or None. `attention_mask` is what lowering.py made
for the backend. With None, causality comes from `module.is_causal` (when T > 1), as in transformers.

Fully masked query rows (left padding under a causal mask) give zeros on every backend, as SDPA and
FlashAttention do, rather than the uniform average a plain softmax would give.

`eager` is the default passed to `get_interface`; `sdpa`, `flex_attention` and `flash_attention_2`
are transformers' own functions, fed with swapformer's masks; `sparse` (sparse.py) and `sdpa_fa`
(here) are registered with transformers by hf_compat.py. What each backend can do is the capability
table (configuration/backends.py); the checks here only gather the torch facts it is checked against.
This module knows nothing of layers. A forward reaches a backend through its plan (core/plan.py lowers
the mask, core/layers.py calls the function), so a forward on sdpa runs nothing here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ...configuration.backends import check_backend_available

if TYPE_CHECKING:
    from .masks import AttentionPattern


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
    """softmax(q k^T * scaling + mask) in fp32, fully masked rows set to zero; with `module.sinks`,
    one more logit per head in the denominator (sinks.py).

    `attention_mask` is additive (float) or boolean (True = attend).
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
    if getattr(module, "sinks", None) is not None:  # learned sinks (sinks.py): one more logit per head
        return sink_probabilities(scores, module.sinks)
    finite = torch.finfo(torch.float32).min
    # Rows with no allowed key: softmax over finite values, then zeroed (no NaN forward or backward).
    has_key = scores.amax(dim=-1, keepdim=True) > finite
    probs = torch.softmax(scores.clamp(min=finite), dim=-1)
    return probs * has_key


def sink_probabilities(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """softmax over `scores` (B, H, T, S) (fp32, -inf where masked) and one sink logit per head, the
    sink's column dropped: rows sum to less than 1; a row with no key is all zeros."""
    column = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def attention_weights(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    pattern: AttentionPattern,
    scaling: float,
    chunk: int = 256,
) -> torch.Tensor:
    """Dense (B, H, T, S) weights equal to eager's, recomputed from the pattern `chunk` queries at a
    time, so the extra memory beyond the result is O(chunk * S). Masked entries are exactly zero."""
    t = query.shape[2]
    out = query.new_empty(query.shape[0], query.shape[1], t, key.shape[2], dtype=torch.float32)
    for start in range(0, t, chunk):
        rows = slice(start, min(start + chunk, t))
        mask = pattern.additive(torch.float32, rows)
        out[:, :, rows] = attention_probabilities(module, query[:, :, rows], key, mask, scaling)
    return out


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


def sdpa_fa_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA restricted to its FlashAttention kernel (CUDA): full attention, causal or not, no mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if attention_mask is not None:
        raise ValueError("sdpa_fa received a mask; its lowering should have refused this batch")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return sdpa_attention(module, query, key, value, None, scaling, dropout), None


def check_backend_for_model(name: str, model: nn.Module, is_init_check: bool = False) -> None:
    """Checks made when `model` is put on backend `name` (`configuration/backends.py:
    check_backend_available`), given the torch facts: CUDA, and the device of the weights (skipped while
    the model is being built, as transformers does)."""
    devices = (
        set() if is_init_check else {p.device.type for p in model.parameters() if p.device.type != "meta"}
    )
    check_backend_available(name, model.config, cuda=torch.cuda.is_available(), weight_devices=devices)


@torch.compiler.disable
def run_uncompiled(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` outside torch.compile: dynamo skips this frame and every frame it calls."""
    return fn(*args, **kwargs)


def fold_groups(query, mask, kv_heads: int):
    """GQA folded into query rows, so the kv heads need no repeating: query (B, H, T, D) ->
    (B, K, G*T, D), and an additive or bool mask (B, 1 or H, T, S) (or None) -> (B, 1 or K, G*T, S)."""
    batch, heads, t, d = query.shape
    groups = heads // kv_heads
    if groups == 1:
        return query, mask
    q = query.reshape(batch, kv_heads, groups * t, d)
    if mask is not None and mask.shape[1] != 1:
        mask = mask.reshape(batch, kv_heads, groups * t, -1)
    elif mask is not None:
        mask = mask.expand(batch, 1, t, mask.shape[-1]).repeat(1, 1, groups, 1)
    return q, mask


def sdpa_attention(module, query, key, value, mask, scaling, dropout):
    """SDPA with GQA folded into the query rows; returns (B, T, H, D)."""
    batch, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    is_causal = mask is None and module.is_causal and t > 1
    if groups > 1 and not is_causal:
        q, mask = fold_groups(query, mask, kv_heads)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
        out = out.view(batch, heads, t, -1)  # the values' width, which may differ from d (MLA)
    else:
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )
    return out.transpose(1, 2).contiguous()
