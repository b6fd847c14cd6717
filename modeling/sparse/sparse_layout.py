"""The sparse backend's block layout: which keys each query block gathers, and their masks.

Queries are cut into blocks of `attention_block_size` rows aligned to absolute positions. Each query
block gathers only the keys its rows may need, in three segments:

    band     the contiguous run of keys covering every row's window (a strided view, no copy)
    globals  the global keys (per batch row), one segment shared by every block
    random   the block's random key blocks (bigbird)

and each pair (query, key) the pattern allows is counted in exactly one segment, with additive masks
built from the *same predicate* the dense backends use (masks.AttentionPattern); blocks where only the
window decides share one template band mask. Queries that are themselves global get the mask of a
dense pass over every key (`global_rows`). `lower_sparse` builds the `BlockLayout` once per forward
per layer type; sparse.py computes attention from it. Full layers never get here: lowering.py gives
them the sdpa form.

Shape legend: B batch, H heads, T queries, S keys, N query blocks, b block size, L keys gathered per
block, Gk global keys, R global query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention.masks import AttentionPattern


@dataclass
class BlockLayout:
    """What the sparse backend consumes; built once per forward per layer type."""

    block: int
    front: int  # rows added before the first query so blocks start at multiples of `block`
    n_blocks: int
    band_start: int  # local key index of the first band key of the first block (may be negative)
    band_length: int
    extra_keys: torch.Tensor | None  # (B or 1, N, E) local indices of random keys (bigbird)
    mask: torch.Tensor  # (B, N, 1 or H, b, L) additive float mask of band + random keys
    global_keys: torch.Tensor | None  # (B, Gk) local indices of the global keys, one segment for all blocks
    global_key_mask: torch.Tensor | None  # (B, N, 1 or H, b, Gk) additive float mask of that segment
    dead: torch.Tensor | None  # (B, N, b) rows without any key in the band + random segment
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


def _random_extra(pattern: AttentionPattern, band_abs: torch.Tensor, q_abs: torch.Tensor):
    """BigBird's random blocks per query block: absolute indices (B or 1, N, E) and whether each entry
    is counted in this segment for each query row (B or 1, N, b, E); (None, None) without them. A key
    inside the block's band is counted there, and a global key once, in the global segment."""
    if pattern.random_table is None:
        return None, None
    keys, counted = _random_keys(pattern, q_abs)
    if not keys.shape[-1]:
        return None, None
    in_band = (keys >= band_abs[None, :, :1]) & (keys <= band_abs[None, :, -1:])
    counted = counted & ~in_band[:, :, None, :]
    if pattern.global_keys is not None:
        local = (keys - pattern.key_offset).clamp(0, pattern.key_length - 1)
        batch = pattern.batch
        local = local.expand(batch, -1, -1)
        is_global = torch.gather(pattern.global_keys, 1, local.reshape(batch, -1)).view_as(local)
        counted = counted & ~is_global[:, :, None, :]
    return keys, counted


def _additive_blocks(pattern, q_abs, key_abs, counted, real_row, dtype, only=None) -> torch.Tensor:
    """The additive mask (B, N, 1 or H, b, L) of query blocks `q_abs` (N, b) over the gathered keys
    `key_abs` (B or 1, N, L): the pattern's predicate, restricted to the rows that are real and the
    entries `counted` (B or 1, N, b or 1, L) counts, plus the position bias. Evaluated a few blocks at a
    time (int32, cache-sized temporaries); with `only` = (template (b, L), blocks (n,)) just on those
    blocks, every other block taking the template (see `_regular_blocks`)."""
    device, batch = pattern.device, pattern.batch
    n_blocks, b, width = q_abs.shape[0], q_abs.shape[1], key_abs.shape[-1]
    bidx = torch.arange(batch, device=device)[:, None, None, None]
    mask = torch.empty(batch, n_blocks, 1, b, width, dtype=dtype, device=device)
    blocks = torch.arange(n_blocks, device=device)
    if only is not None:
        template, blocks = only
        mask.copy_(template)
    q32, k32 = q_abs[blocks].int(), key_abs[:, blocks].int()
    step = max(1, 2**18 // (b * max(width, 1)))
    for j in range(0, len(blocks), step):
        part = slice(j, j + step)
        allowed = pattern.allowed(bidx, q32[None, part, :, None], k32[:, part, None, :])  # (B, n, b, L)
        allowed = allowed & real_row[blocks[part]][None, :, :, None]
        if counted is not None:
            allowed = allowed & counted[:, blocks[part]]
        values = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
        if only is None:
            mask[:, part, 0] = values
        else:
            mask[:, blocks[part], 0] = values
    if pattern.bias_fn is not None:
        k_local = (key_abs - pattern.key_offset).clamp(0, pattern.key_length - 1).expand(batch, n_blocks, -1)
        k_pos = torch.gather(pattern.key_pos, 1, k_local.reshape(batch, -1)).view(batch, n_blocks, 1, -1)
        q_pos = pattern.query_pos[:, (q_abs - pattern.query_offset).clamp(0, pattern.query_length - 1)]
        bias = pattern.bias_fn(q_pos[..., None], k_pos).permute(0, 1, 4, 2, 3)  # (B, N, H, b, L)
        mask = mask + bias.to(dtype)
    return mask


def lower_sparse(pattern: AttentionPattern, dtype) -> BlockLayout:
    """The layout of a windowed pattern (sliding, sliding_global, bigbird): bands of `window` keys
    each side of a block, plus its random and global keys."""
    device, b = pattern.device, pattern.block_size
    first_block = pattern.query_offset // b
    front = pattern.query_offset - first_block * b
    n_blocks = -(-(front + pattern.query_length) // b)
    left, right = pattern.window - 1, (0 if pattern.causal else pattern.window - 1)
    band_length = b + left + right
    block_start = (torch.arange(n_blocks, device=device) + first_block) * b  # absolute first row
    band_abs = block_start[:, None] - left + torch.arange(band_length, device=device)  # (N, band)
    q_abs = block_start[:, None] + torch.arange(b, device=device)  # (N, b)
    extra_abs, counted = _random_extra(pattern, band_abs, q_abs)
    key_abs = (
        band_abs[None]
        if extra_abs is None
        else torch.cat([band_abs[None].expand(extra_abs.shape[0], -1, -1), extra_abs], -1)
    )
    real_row = (q_abs >= pattern.query_offset) & (q_abs < pattern.query_offset + pattern.query_length)
    if counted is not None:
        band_counted = torch.ones(*counted.shape[:3], band_length, dtype=torch.bool, device=device)
        counted = torch.cat([band_counted, counted], dim=-1)  # (B, N, b, L)
    only = None if counted is not None else _regular_blocks(pattern, q_abs, band_abs, dtype)
    mask = _additive_blocks(pattern, q_abs, key_abs, counted, real_row, dtype, only)
    global_keys, global_key_mask = _global_key_segment(pattern, q_abs, band_abs, real_row, dtype)
    global_rows, global_mask = _global_query_layout(pattern, dtype)
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
        global_keys=global_keys,
        global_key_mask=global_key_mask,
        dead=None if global_key_mask is None else dead_rows(mask, None if only is None else only[1]),
        global_rows=global_rows,
        global_mask=global_mask,
    )


def _global_key_segment(pattern: AttentionPattern, q_abs, band_abs, real_row, dtype):
    """The global keys as one segment shared by every query block, each key counted unless the block's
    band already holds it: their local indices (B, Gk) and mask (B, N, 1 or H, b, Gk), or (None, None)."""
    if pattern.global_keys is not None:
        order, present = _first_true(pattern.global_keys)  # (B, Gk)
        if order.shape[1]:
            glob_abs = (order + pattern.key_offset)[:, None, :]  # (B, 1, Gk)
            in_band = (glob_abs >= band_abs[None, :, :1]) & (glob_abs <= band_abs[None, :, -1:])  # (B, N, Gk)
            glob_counted = (present[:, None, :] & ~in_band)[:, :, None, :]  # (B, N, 1, Gk)
            mask = _additive_blocks(
                pattern, q_abs, glob_abs.expand(-1, q_abs.shape[0], -1), glob_counted, real_row, dtype
            )
            return order.clamp(0, max(pattern.key_length - 1, 0)), mask
    return None, None


def _global_query_layout(pattern: AttentionPattern, dtype):
    """The local rows of the global queries (B, R), -1 where a batch row has fewer, and the additive
    mask (B, 1 or H, R, S) of their dense pass over every key; (None, None) without any."""
    if pattern.global_queries is not None and bool(pattern.global_queries.any()):
        order, present = _first_true(pattern.global_queries)  # (B, R)
        mask = pattern.rows_additive(order, dtype).masked_fill(~present[:, None, :, None], float("-inf"))
        return order.masked_fill(~present, -1), mask
    return None, None


def _regular_blocks(pattern: AttentionPattern, q_abs: torch.Tensor, band_abs: torch.Tensor, dtype):
    """For a window or window + global pattern: the band mask every query block shares when nothing
    but the window decides within it, (b, band) additive, and the blocks where something else does
    (a row beyond the queries, a band key beyond the keys or the tokens seen, a padding key, a global
    key or query): those evaluate the predicate. None for packed rows, bigbird and a 4D attention_mask
    (every block evaluates it)."""
    every_block = (pattern.query_packing, pattern.random_table, pattern.custom_mask)
    if pattern.key_prefix or any(x is not None for x in every_block):
        return None
    device, b, band = pattern.device, q_abs.shape[1], band_abs.shape[1]
    left = int(q_abs[0, 0] - band_abs[0, 0])
    q_rel = torch.arange(b, device=device)[:, None]
    k_rel = torch.arange(band, device=device)[None, :] - left
    allowed = pattern.window_predicate(q_rel, k_rel)
    if pattern.causal:
        allowed = allowed & (k_rel <= q_rel)
    template = torch.zeros((), dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))

    lo_k, hi_k = band_abs[:, 0] - pattern.key_offset, band_abs[:, -1] - pattern.key_offset + 1  # (N,) local
    lo_q, hi_q = q_abs[:, 0] - pattern.query_offset, q_abs[:, -1] - pattern.query_offset + 1
    irregular = (lo_q < 0) | (hi_q > pattern.query_length) | (lo_k < 0) | (hi_k > pattern.key_length)
    irregular = irregular | (band_abs[:, -1] >= pattern.total_length)

    def any_in(flags, lo, hi):  # (B, N): a True flag at a local index in [lo, hi)
        count = F.pad(flags.int().cumsum(-1), (1, 0))
        length = flags.shape[-1]
        return count[:, hi.clamp(0, length)] > count[:, lo.clamp(0, length)]

    if pattern.key_valid is not None:
        irregular = irregular | any_in(~pattern.key_valid, lo_k, hi_k).any(0)
    if pattern.global_keys is not None:
        irregular = irregular | any_in(pattern.global_keys, lo_k, hi_k).any(0)
    if pattern.global_queries is not None:
        irregular = irregular | any_in(pattern.global_queries, lo_q, hi_q).any(0)
    return template, irregular.nonzero()[:, 0]


def dead_rows(mask: torch.Tensor, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, N, b): rows without any allowed key in `mask` (B, N, 1 or H, b, L). Only `blocks` can hold
    such rows when given (the others have the window's template, where every row sees itself)."""
    if blocks is None:
        return ~(mask[:, :, 0] > float("-inf")).any(-1)
    dead = torch.zeros(mask.shape[0], mask.shape[1], mask.shape[3], dtype=torch.bool, device=mask.device)
    dead[:, blocks] = ~(mask[:, blocks, 0] > float("-inf")).any(-1)
    return dead
