"""Longformer's global attention: the global tokens' query rows attend through their own projections
(`query_global`, `key_global`, `value_global` in Longformer; `q/k/v_global_proj` here), computed
outside the backend so every backend gives the same rows (docs/architecture.md, decision 18).

Shape legend: B batch, T queries, S keys, R global query rows, E hidden size, H heads, D head dim.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ...configuration.backends import LAYER_TYPE_PATTERN
from ...configuration.configuration_swapformer import GLOBAL_KINDS
from ..attention.functions import attention_probabilities, repeat_kv
from ..attention.masks import AttentionPattern
from ..core.layers import Attention, project
from ..core.positions import apply_rope


class GlobalProjectionAttention(Attention):
    """Self-attention of a bidirectional layer with global tokens under `config.global_projections`:
    the global tokens' query rows are attended through their own projections (`global_rows`)."""

    def __init__(self, config, layer_idx: int, *, is_causal: bool, layer_type: str = "full_attention"):
        super().__init__(config, layer_idx, is_causal=is_causal, layer_type=layer_type)
        e, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_global_proj = nn.Linear(e, self.num_heads * d, bias=bias)
        self.k_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)
        self.v_global_proj = nn.Linear(e, self.num_key_value_heads * d, bias=bias)

    def attend(self, hidden_states, q, k, v, attention_mask, plan, output_attentions: bool):
        out, weights = super().attend(hidden_states, q, k, v, attention_mask, plan, output_attentions)
        if plan.pattern.global_queries is None:
            return out, weights
        return global_rows(self, hidden_states, out, weights, plan.pattern, plan.rope)


def global_rows(attn: nn.Module, hidden_states, out, weights, pattern: AttentionPattern, rope):
    """Replace the rows of the global queries in `out` (B, T, H, D), and in `weights` (B, H, T, S)
    when given, by attention through the global projections of `attn` (a `GlobalProjectionAttention`).

    Computed here, outside the backend, as a small dense attention of the R gathered global rows
    over all S keys (O(R * S)), with eager's math: the same on every backend. The backend got a
    mask without global query rows (plan.pattern_for_backend leaves them out), so it pays nothing for
    rows that are replaced. Under torch.compile every row is computed (R = T): how many rows are
    global depends on the data.
    """
    flags = pattern.global_queries  # (B, T)
    b, t, e = hidden_states.shape
    if torch.compiler.is_compiling():
        rows = torch.arange(t, device=flags.device).expand(b, t)
    else:
        if not bool(flags.any()):
            return out, weights
        count = int(flags.sum(-1).max())
        rows = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)[:, :count]  # (B, R)
    present = torch.gather(flags, 1, rows)  # (B, R) False where a row has fewer global tokens
    r = rows.shape[1]
    picked = torch.gather(hidden_states, 1, rows[..., None].expand(b, r, e))
    q = project(attn.q_global_proj, picked).view(b, r, -1, attn.head_dim).transpose(1, 2)  # (B, H, R, D)
    # k, v: (B, K, S, D)
    k = project(attn.k_global_proj, hidden_states).view(b, t, -1, attn.head_dim).transpose(1, 2)
    v = project(attn.v_global_proj, hidden_states).view(b, t, -1, attn.head_dim).transpose(1, 2)
    if rope is not None:
        cos, sin = rope
        pick = lambda x: torch.gather(x, 1, rows[..., None].expand(b, r, x.shape[-1]))  # noqa: E731
        q, k = apply_rope(q, pick(cos), pick(sin)), apply_rope(k, cos, sin)
    mask = pattern.rows_additive(rows, torch.float32)
    mask = mask.masked_fill(~present[:, None, :, None], float("-inf"))  # (B, 1 or H, R, S)
    probs = attention_probabilities(attn, q, k, mask, attn.scaling).to(q.dtype)  # (B, H, R, S)
    dropped = nn.functional.dropout(probs, p=attn.attention_dropout, training=attn.training)
    rows_out = torch.matmul(dropped, repeat_kv(v, attn.num_key_value_groups))  # (B, H, R, D)
    rows_out = rows_out.transpose(1, 2)
    index = rows[:, :, None, None].expand(b, r, *out.shape[2:])
    keep = present[:, :, None, None]
    out = out.scatter(1, index, torch.where(keep, rows_out, torch.gather(out, 1, index)))
    if weights is not None:
        index = rows[:, None, :, None].expand(b, weights.shape[1], r, weights.shape[-1])
        new = torch.where(keep.transpose(1, 2), probs.to(weights.dtype), torch.gather(weights, 2, index))
        weights = weights.scatter(2, index, new)
    return out, weights


def pattern_for_backend(stack, layer_type: str, pattern: AttentionPattern) -> AttentionPattern:
    """The pattern the backend's mask is lowered from: with `global_projections`, the global query
    rows are left out (their every-key rows would be computed and thrown away), since the layers
    replace those rows by attention through the global projections (global_rows.py)."""
    if not stack.config.global_projections or stack.causal or pattern.global_queries is None:
        return pattern
    if LAYER_TYPE_PATTERN[layer_type] not in GLOBAL_KINDS:
        return pattern
    return dataclasses.replace(pattern, global_queries=None)
