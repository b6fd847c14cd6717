"""Streaming sinks (StreamingLLM, https://arxiv.org/abs/2309.17453) at their positions within the cache.

A decoder of `sliding_global_attention` layers with global_tokens=k is StreamingLLM's model: its cache
(cache_layers.py: GlobalWindowLayer) keeps the first k tokens and the window. With
`streaming_positions="cache"` the kept leading keys are rotated to just before the first window key
the cache holds, once per forward (`sink_shift`, made by the plan) and in the layer
(`StreamingAttention`), exact for RoPE of fixed frequencies because rotations compose. The cache keeps
the keys as they were, so each step rotates from their own positions.

Shape legend: B batch, K key/value heads, S keys, D head dim, R rotated dims.
"""

from __future__ import annotations

import torch

from ..core.layers import Attention
from ..core.positions import apply_rope


def sink_shift(pattern, dtype, rotary):
    """The rotation that moves the kept leading (sink) keys of a window + global cache from their own
    positions 0..k-1 to just before the first window key the cache holds (`pattern.key_offset`): by
    key_offset - key_prefix positions, (cos, sin) of shape (1, 1, R) from the stack's `rotary`
    (positions.py). None when nothing was dropped after them (the keys are then contiguous and keep their
    positions)."""
    if pattern.kind != "sliding_global" or not pattern.key_prefix:
        return None
    shift = torch.tensor([[pattern.key_offset - pattern.key_prefix]], device=pattern.device)
    angles = rotary.angles(shift)  # a pure rotation: yarn's attention factor is in the keys
    return angles.cos().to(dtype), angles.sin().to(dtype)


class StreamingAttention(Attention):
    """Self-attention of a window + global layer whose kept leading keys take StreamingLLM's positions
    within the cache (`streaming_positions="cache"`): rotated by `plan.sink_shift` after the cache
    hands them over, so the cache keeps them as they were."""

    def attend(self, hidden_states, q, k, v, attention_mask, plan, output_attentions: bool):
        if plan.sink_shift is not None:  # None until the cache has dropped keys after the leading ones
            k = shift_sinks(k, plan.pattern.key_prefix, *plan.sink_shift)
        return super().attend(hidden_states, q, k, v, attention_mask, plan, output_attentions)


def shift_sinks(key: torch.Tensor, prefix: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`key` (B, K, S, D) with its first `prefix` keys rotated by (cos, sin); the cache keeps them as
    they were, so each step rotates from their own positions."""
    return torch.cat([apply_rope(key[:, :, :prefix], cos, sin), key[:, :, prefix:]], dim=2)
