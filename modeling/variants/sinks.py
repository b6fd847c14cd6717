"""Learned attention sinks (`config.attention_sinks`), as gpt-oss has them.

Each self-attention layer holds `sinks` (H,): one logit per query head that joins the softmax's
denominator and carries no value. A row's output is

    sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink_h))  =  softmax-attention(row) * sigmoid(lse - sink_h)

where lse is the row's log-sum-exp over the keys it may see. A row that sees no key gives 0.

Eager computes this by its definition (attention.py: `attention_probabilities` appends the sink as a
score column, as transformers' gpt-oss eager does). The kernels take no sink logit, so for `sdpa` and
`sparse` the sink becomes one extra key that every query sees (`sink_key_inputs`): the head dimension
grows by G = H / K (query heads per kv head), queries get a one-hot of their head within its group in
those G columns, real keys get zeros there, and one extra key per kv head holds the G sinks of its
query heads divided by the scale, with a zero value. Then q'.k'_sink * scale = sink_h for query head h,
every real score is unchanged, and the extra key adds e^(sink_h) to the denominator and nothing to the
numerator: the definition exactly, forward and backward (autograd reaches `sinks` through the key),
with GQA left unexpanded. The mask gets one column, allowed for every row; an unpadded causal forward
without a mask (`is_causal`, top-left aligned) puts the sink key first and a dummy query row before the
queries instead, so the fused causal kernel stays in use; a sparse `BlockLayout` gets the sink as one
more global key (`sink_layout`). The cache stores the keys without the extra columns.

Streaming sinks (StreamingLLM's positions within the cache) are streaming.py.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..sparse.sparse_layout import BlockLayout, dead_rows

# Backends that compute the definition themselves (attention_probabilities reads module.sinks).
NATIVE = ("eager",)


def run_with_sinks(module: nn.Module, plan, q, k, v, attention_mask, output_attentions: bool, **kwargs):
    """`AttentionBase.run_backend` (layers.py) for a layer with learned sinks: eager computes them by definition,
    every other backend's function gets them folded in as one extra key (`attend_with_sinks`)."""
    fn = (
        None
        if plan.backend in NATIVE
        else partial(attend_with_sinks, plan.attention_fn, pattern=plan.pattern)
    )
    return module.run_backend(plan, q, k, v, attention_mask, output_attentions, fn=fn, **kwargs)


def sink_key_inputs(module: nn.Module, query, key, value, scaling: float, first: bool = False):
    """query (B, H, T, D), key and value (B, K, S, D) -> (B, H, T, D+G), (B, K, S+1, D+G) twice, the
    sink key last, or `first` (see the module docstring)."""
    batch, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    one_hot = torch.eye(groups, dtype=query.dtype, device=query.device)  # (G, G)
    q_extra = one_hot[None, :, None, :].expand(kv_heads, groups, t, groups).reshape(1, heads, t, groups)
    q2 = torch.cat([query, q_extra.expand(batch, heads, t, groups)], dim=-1)
    sinks = module.sinks.to(key.dtype).view(kv_heads, groups) / scaling  # (K, G)
    sink_key = torch.cat([key.new_zeros(kv_heads, d), sinks], dim=-1)  # (K, D+G)
    keys = [F.pad(key, (0, groups)), sink_key[None, :, None].expand(batch, kv_heads, 1, d + groups)]
    k2 = torch.cat(keys[::-1] if first else keys, dim=2)
    # a zero value for the sink, zero columns to match the key width
    v2 = F.pad(value, (0, groups, 1, 0) if first else (0, groups, 0, 1))
    return q2, k2, v2


def sink_dense_mask(mask, pattern, query_length: int):
    """The sdpa form of the mask (bool or additive, (B, 1 or H, T, S), or None) with a last column that
    every row may see. None stays None without causality; under causality (None meant `is_causal`) the
    pattern's dense mask is made, since `is_causal` would hide the last key."""
    if mask is None:
        if not (pattern.causal and query_length > 1):
            return None
        mask = pattern.dense_allowed()
    return F.pad(mask, (0, 1), value=True if mask.dtype == torch.bool else 0.0)


def sink_layout(layout: BlockLayout, key_length: int) -> BlockLayout:
    """`layout` with key `key_length` (the sink key appended) as one more global key of every row; the
    dense rows of global queries get a column for it too."""
    batch, n, _, b, _ = layout.mask.shape
    glob = torch.full((batch, 1), key_length, dtype=torch.long, device=layout.mask.device)
    seen = layout.mask.new_zeros(batch, n, 1, b, 1)
    keys, key_mask, dead = glob, seen, layout.dead
    if dead is None:  # rows without a key in the band + random segment (see sparse_layout.BlockLayout)
        dead = dead_rows(layout.mask)
    if layout.global_keys is not None:
        keys = torch.cat([layout.global_keys, glob], dim=1)
        key_mask = torch.cat([layout.global_key_mask, seen.expand(*layout.global_key_mask.shape[:-1], 1)], -1)
    global_mask = layout.global_mask
    if global_mask is not None:
        global_mask = F.pad(global_mask, (0, 1), value=0.0)
    return dataclasses.replace(
        layout, global_keys=keys, global_key_mask=key_mask, dead=dead, global_mask=global_mask
    )


def attend_with_sinks(fn, module: nn.Module, query, key, value, mask, *, pattern, scaling, **kwargs):
    """Attention function `fn` of a kernel backend with `module.sinks` folded in as an extra key:
    returns (out (B, T, H, D), None); the weights, when asked, are recomputed with eager's math."""
    d, t = query.shape[-1], query.shape[2]
    if mask is None and pattern.causal and 1 < t == key.shape[2]:
        # `is_causal` alone (top-left aligned): the sink key first, and a dummy query row before the
        # others, so query row i + 1 sees the sink and keys 0..i; the fused causal kernel stays in use
        q2, k2, v2 = sink_key_inputs(module, query, key, value, scaling, first=True)
        out, _ = fn(module, F.pad(q2, (0, 0, 1, 0)), k2, v2, None, scaling=scaling, **kwargs)
        return out[:, 1:, :, :d], None
    q2, k2, v2 = sink_key_inputs(module, query, key, value, scaling)
    if isinstance(mask, BlockLayout):
        mask = sink_layout(mask, key.shape[2])
    else:
        mask = sink_dense_mask(mask, pattern, t)
    out, _ = fn(module, q2, k2, v2, mask, scaling=scaling, **kwargs)
    return out[..., :d], None
