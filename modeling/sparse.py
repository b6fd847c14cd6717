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


def _first_true(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the True entries of each row of `flags` (R, C), padded to the longest row, and
    which of them are real: ((R, count), (R, count))."""
    count = int(flags.sum(-1).max()) if flags.numel() else 0
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True)[:, :count]
    return order, torch.gather(flags, 1, order)


def _random_keys(pattern: AttentionPattern, q_abs: torch.Tensor):
    """BigBird's random key blocks of each query block: absolute key indices (B, N, R), and which of
    them each query row draws (B, N, b, R).

    A row draws the random blocks of its query block counted from its sequence's first real token
    (`pattern.random_start`). Rows of one block that share a draw form a run; each run's blocks are
    gathered once, and an entry counts only for the rows of its run (so a key two runs both drew is
    never counted twice for one row). A block whose rows all start at a multiple of b from their
    sequence's first token is a single run.
    """
    b = pattern.block_size
    table = pattern.random_table
    rows = (q_abs - pattern.query_offset).clamp(0, pattern.query_length - 1)  # (N, b)
    start, layout = pattern.random_start[:, rows], pattern.random_index[:, rows]  # (B, N, b)
    relative = ((q_abs - start) // b).clamp(0, table.shape[1] - 1)  # (B, N, b) query block in its sequence
    new_run = torch.ones_like(relative, dtype=torch.bool)
    new_run[..., 1:] = (
        (relative[..., 1:] != relative[..., :-1])
        | (layout[..., 1:] != layout[..., :-1])
        | (start[..., 1:] != start[..., :-1])
    )
    run_of_row = new_run.long().cumsum(-1) - 1  # (B, N, b)
    first_rows, real_run = _first_true(new_run.flatten(0, 1))  # (B*N, P)
    first_rows = first_rows.view(*new_run.shape[:2], -1)
    pick = lambda x: torch.gather(x, -1, first_rows)  # noqa: E731  (B, N, P) a run's first-row value
    draws = table[pick(layout), pick(relative)]  # (B, N, P, key blocks)
    draws = draws & real_run.view_as(first_rows)[..., None]
    chosen, present = _first_true(draws.flatten(0, 2))  # (B*N*P, r)
    chosen = chosen.view(*draws.shape[:3], -1)
    keys = pick(start)[..., None, None] + chosen[..., None] * b + torch.arange(b, device=q_abs.device)
    per_run = chosen.shape[-1] * b
    entry_run = torch.arange(first_rows.shape[-1], device=q_abs.device).repeat_interleave(per_run)
    entry_present = present.view(*chosen.shape).repeat_interleave(b, dim=-1).flatten(-2)  # (B, N, P*r*b)
    counted = (run_of_row[..., None] == entry_run) & entry_present[:, :, None, :]
    return keys.flatten(2), counted


def _extra_keys(pattern: AttentionPattern, band_abs: torch.Tensor, q_abs: torch.Tensor):
    """Global keys, then random blocks, per query block: absolute indices (B, N, E) and whether each
    entry is counted in this segment for each query row (B, N, b or 1, E); None when the pattern has
    neither."""
    batch, n_blocks = pattern.batch, band_abs.shape[0]
    parts, n_glob = [], 0
    if pattern.global_keys is not None:
        order, present = _first_true(pattern.global_keys)
        n_glob = order.shape[1]
        parts.append(((order + pattern.key_offset)[:, None, :], present[:, None, None, :]))
    if pattern.random_table is not None:
        parts.append(_random_keys(pattern, q_abs))
    parts = [(k, ok) for k, ok in parts if k.shape[-1]]
    if not parts:
        return None, None
    rows = max(ok.shape[2] for _, ok in parts)
    extra_abs = torch.cat([k.expand(batch, n_blocks, -1) for k, _ in parts], dim=-1)
    counted = torch.cat([ok.expand(batch, n_blocks, rows, -1) for _, ok in parts], dim=-1)
    # A key inside the block's band is counted there; a global key is counted once, as a global.
    in_band = (extra_abs >= band_abs[None, :, :1]) & (extra_abs <= band_abs[None, :, -1:])
    counted = counted & ~in_band[:, :, None, :]
    if n_glob and extra_abs.shape[-1] > n_glob:
        local = (extra_abs[..., n_glob:] - pattern.key_offset).clamp(0, pattern.key_length - 1)
        is_global = torch.gather(pattern.global_keys, 1, local.reshape(batch, -1)).view_as(local)
        counted[..., n_glob:] &= ~is_global[:, :, None, :]
    return extra_abs, counted


def lower_sparse(pattern: AttentionPattern, dtype):
    """Full layers run dense (sdpa form); windowed kinds get a BlockLayout. So do the steps of a
    window + global cache that dropped keys (`key_prefix`): it hands over only the kept leading
    tokens and the window, already O(window + globals) keys per query."""
    if pattern.kind == "full" or pattern.key_prefix:
        return lower_sdpa(pattern, dtype)
    device, b, batch = pattern.device, pattern.block_size, pattern.batch
    first_block = pattern.query_offset // b
    front = pattern.query_offset - first_block * b
    n_blocks = -(-(front + pattern.query_length) // b)
    left, right = pattern.window - 1, (0 if pattern.causal else pattern.window - 1)
    band_length = b + left + right
    block_start = (torch.arange(n_blocks, device=device) + first_block) * b  # absolute first row
    band_abs = block_start[:, None] - left + torch.arange(band_length, device=device)  # (N, band)
    q_abs = block_start[:, None] + torch.arange(b, device=device)  # (N, b)
    extra_abs, counted = _extra_keys(pattern, band_abs, q_abs)
    key_abs = (
        band_abs[None]
        if extra_abs is None
        else torch.cat([band_abs[None].expand(batch, -1, -1), extra_abs], -1)
    )

    # The same predicate as the dense backends, on the gathered indices, evaluated a few blocks at a
    # time (int32, cache-sized temporaries) straight into the additive mask (B, N, 1, b, L).
    real_row = (q_abs >= pattern.query_offset) & (q_abs < pattern.query_offset + pattern.query_length)
    if counted is not None:
        band_counted = torch.ones(*counted.shape[:3], band_length, dtype=torch.bool, device=device)
        counted = torch.cat([band_counted, counted], dim=-1)  # (B, N, b or 1, L)
    bidx = torch.arange(batch, device=device)[:, None, None, None]
    q32, k32 = q_abs.int(), key_abs.int()
    mask = torch.empty(batch, n_blocks, 1, b, key_abs.shape[-1], dtype=dtype, device=device)
    step = max(1, 2**18 // (b * key_abs.shape[-1]))
    for j in range(0, n_blocks, step):
        part = slice(j, j + step)
        allowed = pattern.allowed(bidx, q32[None, part, :, None], k32[:, part, None, :])  # (B, n, b, L)
        allowed = allowed & real_row[None, part, :, None]
        if counted is not None:
            allowed = allowed & counted[:, part]
        mask[:, part, 0] = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
    if pattern.bias_fn is not None:
        k_local = (key_abs - pattern.key_offset).clamp(0, pattern.key_length - 1).expand(batch, -1, -1)
        k_pos = torch.gather(pattern.key_pos, 1, k_local.reshape(batch, -1)).view(batch, n_blocks, 1, -1)
        q_pos = pattern.query_pos[:, (q_abs - pattern.query_offset).clamp(0, pattern.query_length - 1)]
        bias = pattern.bias_fn(q_pos[..., None], k_pos).permute(0, 1, 4, 2, 3)  # (B, N, H, b, L)
        mask = mask + bias.to(dtype)

    global_rows = global_mask = None
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        order, present = _first_true(pattern.global_queries)  # (B, R)
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
        extra_keys=None
        if extra_abs is None
        else (extra_abs - pattern.key_offset).clamp(0, max(pattern.key_length - 1, 0)),
        mask=mask,
        global_rows=global_rows,
        global_mask=global_mask,
    )


LOWERINGS["sparse"] = lower_sparse


# Query blocks handled per SDPA call without gradients: bounds the gathered keys and values (and keeps
# them in cache while the kernel reads them). Measured on a 2-core CPU; see benchmarks/attention_sparse.py.
CHUNK_BYTES = 4 * 2**20


def _gather_keys(x: torch.Tensor, layout: BlockLayout, blocks: range) -> torch.Tensor:
    """Keys (or values) of `blocks`: (B, n, K, L, D), each block's band, a strided view of `x`
    (B, K, S, D) where the bands lie inside it (zero rows are padded on only at the ends), then the
    block's extra keys."""
    batch, kv_heads, s, d = x.shape
    b, band = layout.block, layout.band_length
    lo = layout.band_start + blocks.start * b
    hi = lo + (len(blocks) - 1) * b + band
    region = x[:, :, max(lo, 0) : min(hi, s)]
    if lo < 0 or hi > s:
        region = F.pad(region, (0, 0, max(0, -lo), max(0, hi - s)))
    bands = region.unfold(2, band, b).permute(0, 2, 1, 4, 3)  # (B, n, K, band, D)
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
    back = n * b - layout.front - t
    q = F.pad(query, (0, 0, layout.front, back)) if layout.front or back else query  # (B, H, N*b, D)
    # The G query heads that share a kv head become rows of the same block: (B, N, K, G, b, D).
    q = q.view(batch, kv_heads, groups, n, b, d).permute(0, 3, 1, 2, 4, 5)
    width = layout.band_length + (layout.extra_keys.shape[-1] if layout.extra_keys is not None else 0)
    per_chunk = max(1, CHUNK_BYTES // (2 * batch * kv_heads * width * d * key.element_size()))
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        per_chunk = n  # backward keeps every block's gathered keys anyway: one call
    out = query.new_empty(batch, n * b, kv_heads, groups, d)  # written chunk by chunk, in the final layout
    for j in range(0, n, per_chunk):
        blocks = range(j, min(j + per_chunk, n))
        m = len(blocks)
        k = _gather_keys(key, layout, blocks).reshape(batch * m, kv_heads, width, d)
        v = _gather_keys(value, layout, blocks).reshape(batch * m, kv_heads, width, d)
        mask = layout.mask[:, j : j + m]  # (B, m, 1 or H, b, L)
        mask = mask.expand(batch, m, mask.shape[2], b, width)
        if mask.shape[2] == 1:
            mask = mask.expand(batch, m, groups, b, width).reshape(batch * m, 1, groups * b, width)
        else:
            mask = mask.reshape(batch * m, kv_heads, groups * b, width)
        q_chunk = q[:, j : j + m].reshape(batch * m, kv_heads, groups * b, d)
        o = F.scaled_dot_product_attention(q_chunk, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        o = o.view(batch, m, kv_heads, groups, b, d).permute(0, 1, 4, 2, 3, 5)  # (B, m, b, K, G, D)
        out[:, j * b : (j + m) * b] = o.reshape(batch, m * b, kv_heads, groups, d)
    out = out[:, layout.front : layout.front + t].reshape(batch, t, heads, d).contiguous()  # (B, T, H, D)
    if layout.global_rows is not None:
        rows = layout.global_rows.clamp(min=0)  # (B, R)
        q_rows = torch.gather(query, 2, rows[:, None, :, None].expand(-1, heads, -1, d))
        dense = _sdpa(module, q_rows, key, value, layout.global_mask, scaling, dropout)  # (B, R, H, D)
        # Unused slots (rows with fewer global queries than the batch's most) write to a spare row T that
        # is cut off again: each real row is written exactly once, so the scatter's backward sends every
        # output row's gradient to one place (pointing them at row 0 also sent row 0's to the slots).
        spare = layout.global_rows.masked_fill(layout.global_rows < 0, t)
        out = F.pad(out, (0, 0, 0, 0, 0, 1)).scatter(
            1, spare[:, :, None, None].expand(-1, -1, heads, d), dense
        )
        out = out[:, :t]
    return out, None


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
