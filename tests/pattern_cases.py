"""A window + global `AttentionPattern` for one sparse layer, built by hand: the lowering and kernel tests
of tests/attention/test_patterns.py and tests/cpu/test_sparse_native.py start from it."""

from __future__ import annotations

import torch

from swapformer.modeling.attention.masks import AttentionPattern


def layer_pattern(
    causal, padding, globals_per_row, length=45, batch=2, query_offset=0, key_offset=0, slots=0, bias=False
):
    """A window + global pattern for one sparse layer: row r has `globals_per_row[r]` global tokens (the
    first real ones), `padding` pads row 1 by 9 tokens; `query_offset` > 0 is a cached chunk, `key_offset`
    a window cache that dropped keys, `slots` empty static-cache slots after the keys."""
    total = query_offset + length
    keys = total - key_offset + slots
    key_valid = torch.ones(batch, keys, dtype=torch.bool)
    if padding == "left":
        key_valid[1, :9] = False
    elif padding == "right":
        key_valid[1, total - key_offset - 9 : total - key_offset] = False
    real = key_valid.long().cumsum(-1) - 1 + key_offset  # position among real tokens, for key_offset = 0
    glob = key_valid & (real < torch.tensor(globals_per_row)[:, None])
    bias_kw = {}
    if bias:
        positions = torch.arange(key_offset, key_offset + keys)[None].expand(batch, -1)
        bias_kw = dict(
            bias_fn=lambda q, k: 0.05 * (q - k).float()[..., None] * torch.tensor([1.0, -2.0, 0.5, 3.0]),
            query_pos=torch.arange(query_offset, total)[None].expand(batch, -1),
            key_pos=positions,
        )
    valid = key_valid if padding != "none" else None
    glob = glob if any(globals_per_row) else None
    more = dict(past=query_offset, key_offset=key_offset, slots=slots, query_globals=not key_offset)
    return sparse_layer_pattern(batch, length, causal, 5, 8, valid, glob, **more, **bias_kw)


def sparse_layer_pattern(
    batch, length, causal, window, block_size, key_valid, glob, past=0, key_offset=0, slots=0, **more
) -> AttentionPattern:
    """A CPU window layer's pattern over `past` cached and `length` new tokens: `glob` (batch, keys) marks
    the global keys (None: a plain window layer), and the same tokens are global queries unless
    `query_globals=False`; keys start at `key_offset` and end with `slots` empty static-cache slots.
    The rest of `more` (a position bias) goes to the pattern as it is."""
    total = past + length
    query_globals = more.pop("query_globals", True) and glob is not None
    return AttentionPattern(
        kind="sliding" if glob is None else "sliding_global",
        causal=causal,
        batch=batch,
        query_offset=past,
        query_length=length,
        key_offset=key_offset,
        key_length=total - key_offset + slots,
        total_length=total,
        device=torch.device("cpu"),
        window=window,
        block_size=block_size,
        key_valid=key_valid,
        global_keys=glob,
        global_queries=glob[:, past - key_offset :] if query_globals else None,
        **more,
    )
