"""The block-sparse attention backend (`attn_implementation="sparse"`), in plain PyTorch.

Queries are cut into blocks of `attention_block_size` rows aligned to absolute positions. Each query
block gathers only the keys its rows may need, in three segments:

    band     the contiguous run of keys covering every row's window (a strided view, no copy)
    globals  the global keys (per batch row)
    random   the block's random key blocks (bigbird)

and one call of `F.scaled_dot_product_attention` attends each block to its gathered keys with an
additive mask built from the *same predicate* the dense backends use (masks.AttentionPattern),
restricted so that every allowed (query, key) pair is counted in exactly one segment. Queries that
are themselves global attend to all keys in a second, dense-rows call whose result replaces theirs.

Cost: time and memory O(T * (window + globals + random)), forward and backward (autograd through
gather, SDPA's fused CPU/CUDA kernel and scatter), no torch.compile. Shape legend: B batch, H query
heads, K kv heads, G = H / K, T queries, S keys, D head dim, N query blocks, b block size, L keys
gathered per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .masks import LOWERINGS, AttentionPattern, lower_sdpa


@dataclass
class BlockLayout:
    """What the sparse backend consumes; built once per forward per layer type."""

    block: int
    front: int  # rows added before the first query so blocks start at multiples of `block`
    n_blocks: int
    band_start: int  # local key index of the first band key of the first block (may be negative)
    band_length: int
    extra_keys: torch.Tensor | None  # (B or 1, N, E) local indices of global and random keys
    mask: torch.Tensor  # (B or 1, N, 1 or H, b, L) additive float mask
    global_rows: torch.Tensor | None  # (B, R) local query rows that attend everywhere
    global_mask: torch.Tensor | None  # (B, 1 or H, R, S) additive float mask of those rows


def lower_sparse(pattern: AttentionPattern, dtype):
    """Full layers run dense (sdpa form); windowed kinds get a BlockLayout."""
    if pattern.kind == "full":
        return lower_sdpa(pattern, dtype)
    device, b = pattern.device, pattern.block_size
    first_block = pattern.query_offset // b
    front = pattern.query_offset - first_block * b
    n_blocks = -(-(front + pattern.query_length) // b)
    w = pattern.window
    left, right = w - 1, (0 if pattern.causal else w - 1)
    band_length = b + left + right
    block_start = (
        torch.arange(n_blocks, device=device) + first_block
    ) * b  # absolute first row of each block
    band_abs = block_start[:, None] - left + torch.arange(band_length, device=device)  # (N, band)

    # Extra keys: globals (per batch row) then random blocks (shared), as absolute indices.
    batch = pattern.batch
    extra, extra_valid, n_glob = [], [], 0
    if pattern.global_keys is not None and pattern.global_keys.numel():
        n_glob = int(pattern.global_keys.sum(-1).max())
        if n_glob:
            order = torch.argsort((~pattern.global_keys).to(torch.int8), dim=-1, stable=True)[:, :n_glob]
            present = torch.gather(pattern.global_keys, 1, order)  # (B, n_glob)
            extra.append((order + pattern.key_offset)[:, None, :].expand(-1, n_blocks, -1))
            extra_valid.append(present[:, None, :].expand(-1, n_blocks, -1))
    if pattern.random_table is not None:
        rows = pattern.random_table[first_block : first_block + n_blocks]  # (N, key blocks)
        per_block = int(rows.sum(-1).max()) if rows.numel() else 0
        if per_block:
            chosen = torch.argsort((~rows).to(torch.int8), dim=-1, stable=True)[:, :per_block]  # (N, r)
            present = torch.gather(rows, 1, chosen)
            keys = (chosen[:, :, None] * b + torch.arange(b, device=device)).reshape(n_blocks, per_block * b)
            extra.append(keys[None])
            extra_valid.append(present.repeat_interleave(b, dim=1)[None])
    if extra:
        extra_abs = torch.cat([e.expand(batch, n_blocks, -1) for e in extra], dim=-1)  # (B, N, E)
        extra_ok = torch.cat([v.expand(batch, n_blocks, -1) for v in extra_valid], dim=-1)
        # A key already in the band is counted there; a global key is counted once, as a global.
        in_band = (extra_abs >= band_abs[None, :, :1]) & (extra_abs <= band_abs[None, :, -1:])
        extra_ok = extra_ok & ~in_band
        if n_glob and extra_abs.shape[-1] > n_glob:
            local = (extra_abs[..., n_glob:] - pattern.key_offset).clamp(0, pattern.key_length - 1)
            is_global = torch.gather(pattern.global_keys, 1, local.reshape(batch, -1)).view_as(local)
            extra_ok[..., n_glob:] &= ~is_global
        key_abs = torch.cat([band_abs[None].expand(batch, -1, -1), extra_abs], dim=-1)  # (B, N, L)
        band_ok = torch.ones(batch, n_blocks, band_length, dtype=torch.bool, device=device)
        segment_ok = torch.cat([band_ok, extra_ok], dim=-1)
        extra_local = (extra_abs - pattern.key_offset).clamp(0, max(pattern.key_length - 1, 0))
    else:
        key_abs, segment_ok, extra_local = band_abs[None], None, None

    q_abs = block_start[:, None] + torch.arange(b, device=device)  # (N, b)
    bidx = torch.arange(batch, device=device)[:, None, None, None]
    allowed = pattern.allowed(bidx, q_abs[None, :, :, None], key_abs[:, :, None, :])  # (B, N, b, L)
    # Rows that only pad the blocks (before the first or after the last query) see nothing.
    real_row = (q_abs >= pattern.query_offset) & (q_abs < pattern.query_offset + pattern.query_length)
    allowed = allowed & real_row[None, :, :, None]
    if segment_ok is not None:
        allowed = allowed & segment_ok[:, :, None, :]
    zero = torch.zeros((), dtype=dtype, device=device)
    mask = torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype, device=device))
    if pattern.bias_fn is not None:
        k_local = (key_abs - pattern.key_offset).clamp(0, pattern.key_length - 1)
        k_local = k_local.expand(batch, -1, -1)
        k_pos = torch.gather(pattern.key_pos, 1, k_local.reshape(batch, -1)).view(batch, n_blocks, 1, -1)
        q_rows = (q_abs - pattern.query_offset).clamp(0, pattern.query_length - 1)
        q_pos = pattern.query_pos[:, q_rows][..., None]  # (B, N, b, 1)
        bias = pattern.bias_fn(q_pos, k_pos).permute(0, 1, 4, 2, 3)  # (B, N, H, b, L)
        mask = mask[:, :, None] + bias.to(dtype)
    else:
        mask = mask[:, :, None]  # (B, N, 1, b, L)

    global_rows = global_mask = None
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        count = int(pattern.global_queries.sum(-1).max())
        order = torch.argsort((~pattern.global_queries).to(torch.int8), dim=-1, stable=True)[
            :, :count
        ]  # (B, R)
        present = torch.gather(pattern.global_queries, 1, order)
        global_mask = pattern.rows_additive(order, dtype).masked_fill(
            ~present[:, None, :, None], float("-inf")
        )
        global_rows = order.masked_fill(~present, -1)
    return BlockLayout(
        block=b,
        front=front,
        n_blocks=n_blocks,
        band_start=int(block_start[0]) - left - pattern.key_offset,
        band_length=band_length,
        extra_keys=extra_local,
        mask=mask,
        global_rows=global_rows,
        global_mask=global_mask,
    )


LOWERINGS["sparse"] = lower_sparse


# Query blocks handled per SDPA call without gradients: bounds the gathered keys and values (and keeps
# them in cache while the kernel reads them). Measured on a 2-core CPU; see benchmarks/attention_sparse.py.
CHUNK_BYTES = 8 * 2**20


def _padded(x: torch.Tensor, layout: BlockLayout) -> tuple[torch.Tensor, int]:
    """Keys or values padded so every block's band is in range; and where block 0's band starts."""
    n, b, band = layout.n_blocks, layout.block, layout.band_length
    pad_front = max(0, -layout.band_start)
    pad_back = max(0, layout.band_start + (n - 1) * b + band - x.shape[2])
    return F.pad(x, (0, 0, pad_front, pad_back)), layout.band_start + pad_front


def _gather_keys(
    padded: torch.Tensor, start: int, x: torch.Tensor, layout: BlockLayout, blocks: range
) -> torch.Tensor:
    """Keys of `blocks`: (B, n, K, L, D), each block's band (a strided view of `padded`) then its
    extra keys (gathered from `x`, (B, K, S, D))."""
    batch, kv_heads, _, d = x.shape
    b, band = layout.block, layout.band_length
    first = start + blocks.start * b
    bands = padded[:, :, first : first + (len(blocks) - 1) * b + band].unfold(
        2, band, b
    )  # (B, K, n, D, band)
    bands = bands.permute(0, 2, 1, 4, 3)  # (B, n, K, band, D)
    if layout.extra_keys is None:
        return bands
    idx = layout.extra_keys[:, blocks.start : blocks.stop].expand(batch, -1, -1)  # (B, n, E)
    rows = torch.arange(batch, device=x.device)[:, None]
    extra = x.transpose(1, 2)[rows, idx.reshape(batch, -1)]  # (B, n*E, K, D)
    extra = extra.view(batch, len(blocks), -1, kv_heads, d).transpose(2, 3)  # (B, n, K, E, D)
    return torch.cat([bands, extra], dim=3)


def sparse_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Block-sparse attention with the AttentionInterface signature (see module docstring)."""
    if not isinstance(attention_mask, BlockLayout):  # a full layer: dense SDPA with the sdpa mask
        return _sdpa(module, query, key, value, attention_mask, scaling, dropout), None
    layout = attention_mask
    batch, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    n, b = layout.n_blocks, layout.block
    q = F.pad(query, (0, 0, layout.front, n * b - layout.front - t))  # (B, H, N*b, D)
    # The G query heads that share a kv head become rows of the same block: (B, N, K, G, b, D).
    q = q.view(batch, kv_heads, groups, n, b, d).permute(0, 3, 1, 2, 4, 5)
    k_pad, k_start = _padded(key, layout)
    v_pad, v_start = _padded(value, layout)
    width = layout.band_length + (layout.extra_keys.shape[-1] if layout.extra_keys is not None else 0)
    per_chunk = max(1, CHUNK_BYTES // (2 * batch * kv_heads * width * d * key.element_size()))
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        # Backward keeps every chunk's gathered keys anyway, and slicing the padded keys per chunk
        # would make each chunk's backward allocate a full-size gradient: one call for all blocks.
        per_chunk = n
    outs = []
    for j in range(0, n, per_chunk):
        blocks = range(j, min(j + per_chunk, n))
        m = len(blocks)
        k = _gather_keys(k_pad, k_start, key, layout, blocks).reshape(batch * m, kv_heads, -1, d)
        v = _gather_keys(v_pad, v_start, value, layout, blocks).reshape(batch * m, kv_heads, -1, d)
        mask = layout.mask[:, j : j + m]  # (B, m, 1 or H, b, L)
        mask = mask.expand(batch, m, mask.shape[2], b, width)
        if mask.shape[2] == 1:
            mask = mask.expand(batch, m, groups, b, width).reshape(batch * m, 1, groups * b, width)
        else:
            mask = mask.reshape(batch * m, kv_heads, groups * b, width)
        q_chunk = q[:, j : j + m].reshape(batch * m, kv_heads, groups * b, d)
        out = F.scaled_dot_product_attention(q_chunk, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        outs.append(out.view(batch, m, kv_heads, groups, b, d))
    out = torch.cat(outs, dim=1).permute(0, 2, 3, 1, 4, 5).reshape(batch, heads, n * b, d)
    out = out[:, :, layout.front : layout.front + t]  # (B, H, T, D)
    if layout.global_rows is not None:
        rows = layout.global_rows.clamp(min=0)  # (B, R)
        index = rows[:, None, :, None].expand(-1, heads, -1, d)
        dense = _sdpa(
            module,
            torch.gather(query, 2, index),
            key,
            value,
            layout.global_mask,
            scaling,
            dropout,
            transpose=False,
        )
        keep = (layout.global_rows >= 0)[:, None, :, None]
        out = out.scatter(2, index, torch.where(keep, dense, torch.gather(out, 2, index)))
    return out.transpose(1, 2).contiguous(), None


def _sdpa(module, query, key, value, mask, scaling, dropout, transpose=True):
    """SDPA with GQA folded into the query rows; returns (B, T, H, D) or (B, H, T, D)."""
    batch, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    is_causal = mask is None and module.is_causal and t > 1
    if groups > 1 and not is_causal:
        q = query.reshape(batch, kv_heads, groups * t, d)
        if mask is not None and mask.shape[1] != 1:
            mask = mask.reshape(batch, kv_heads, groups * t, -1)
        elif mask is not None:
            mask = mask.expand(batch, 1, t, mask.shape[-1]).repeat(1, 1, groups, 1)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
        out = out.view(batch, heads, t, d)
    else:
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1)
            value = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )
    return out.transpose(1, 2).contiguous() if transpose else out
