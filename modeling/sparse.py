"""The block-sparse attention backend (`attn_implementation="sparse"`), in plain PyTorch.

Queries are cut into blocks of `attention_block_size` rows aligned to absolute positions. Each query
block gathers only the keys its rows may need, in three segments:

    band     the contiguous run of keys covering every row's window (a strided view, no copy)
    globals  the global keys (per batch row)
    random   the block's random key blocks (bigbird)

and each pair (query, key) the pattern allows is counted in exactly one segment, with additive masks
built from the *same predicate* the dense backends use (masks.AttentionPattern); blocks where only the
window decides share one template band mask. The band (plus random keys) of a chunk of blocks is one
fused-kernel call. The global keys are the same for every block: on CPU (fp32/fp64, no dropout, no
learned bias) their scores for all queries are one matmul and the two segments are merged per row
by log-sum-exp (`_merge`, `_MergedSegments`), so no band is ever copied; otherwise they are copied
behind each block's band and the block runs one `F.scaled_dot_product_attention` call. Queries that
are themselves global attend to all keys in a second, dense-rows call whose result replaces theirs
(`_global_query_rows`; skipped when the layout has no `global_rows`).

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


def lower_sparse(pattern: AttentionPattern, dtype):
    """Full layers run dense (sdpa form); windowed kinds get a BlockLayout. So do the steps of a
    window + global cache that dropped keys (`key_prefix`): it hands over only the kept leading
    tokens and the window, already O(window + globals) keys per query."""
    if pattern.kind == "full" or pattern.key_prefix:
        return lower_sdpa(pattern, dtype)
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

    # Global keys: one segment shared by every query block, each key counted unless the block's band
    # already holds it.
    global_keys = global_key_mask = None
    if pattern.global_keys is not None:
        order, present = _first_true(pattern.global_keys)  # (B, Gk)
        if order.shape[1]:
            glob_abs = (order + pattern.key_offset)[:, None, :]  # (B, 1, Gk)
            in_band = (glob_abs >= band_abs[None, :, :1]) & (glob_abs <= band_abs[None, :, -1:])  # (B, N, Gk)
            glob_counted = (present[:, None, :] & ~in_band)[:, :, None, :]  # (B, N, 1, Gk)
            global_key_mask = _additive_blocks(
                pattern, q_abs, glob_abs.expand(-1, n_blocks, -1), glob_counted, real_row, dtype
            )
            global_keys = order.clamp(0, max(pattern.key_length - 1, 0))

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
        global_keys=global_keys,
        global_key_mask=global_key_mask,
        dead=None if global_key_mask is None else _dead_rows(mask, None if only is None else only[1]),
        global_rows=global_rows,
        global_mask=global_mask,
    )


def _regular_blocks(pattern: AttentionPattern, q_abs: torch.Tensor, band_abs: torch.Tensor, dtype):
    """For a window or window + global pattern: the band mask every query block shares when nothing
    but the window decides within it, (b, band) additive, and the blocks where something else does
    (a row beyond the queries, a band key beyond the keys or the tokens seen, a padding key, a global
    key or query): those evaluate the predicate. None for packed rows and bigbird (every block
    evaluates it)."""
    if pattern.query_packing is not None or pattern.random_table is not None or pattern.key_prefix:
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


def _dead_rows(mask: torch.Tensor, blocks: torch.Tensor | None) -> torch.Tensor:
    """(B, N, b): rows without any allowed key in `mask` (B, N, 1 or H, b, L). Only `blocks` can hold
    such rows when given (the others have the window's template, where every row sees itself)."""
    if blocks is None:
        return ~(mask[:, :, 0] > float("-inf")).any(-1)
    dead = torch.zeros(mask.shape[0], mask.shape[1], mask.shape[3], dtype=torch.bool, device=mask.device)
    dead[:, blocks] = ~(mask[:, blocks, 0] > float("-inf")).any(-1)
    return dead


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


def _merge(q, k1, v1, s2, s2_max, v2, mask1, dead1, scale):
    """Softmax attention of `q` (B, K, G*b, D) over segment 1 (keys `k1`, values `v1`, additive `mask1`)
    and segment 2 (scores `s2` (B, K, G*b, Gk) already scaled and masked, their row maxima `s2_max`,
    values `v2` (B, K, Gk, D)), merged by log-sum-exp. Segment 1 runs torch's fused CPU kernel, which
    also returns each row's log-sum-exp l1; with m = max(l1, max s2) the merged row is

        (e^(l1 - m) o1 + sum_j e^(s2_j - m) v2_j) / (e^(l1 - m) + sum_j e^(s2_j - m)).

    Segment 1 holds no key for a row where `dead1` (B, 1, G*b) is True (the kernel then returns 0 and
    a meaningless l1, replaced by -inf); rows without any key come out 0 with a very negative (finite)
    log-sum-exp. Returns (output, log-sum-exp)."""
    o1, l1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k1, v1, attn_mask=mask1, scale=scale
    )
    l1 = l1.masked_fill_(dead1, float("-inf"))  # (B, K, G*b)
    top = torch.maximum(l1, s2_max).clamp_min_(torch.finfo(l1.dtype).min)
    p2 = torch.exp(s2 - top[..., None])
    w1 = torch.exp(l1.sub_(top))
    total = p2.sum(-1).add_(w1).clamp_min_(torch.finfo(l1.dtype).tiny)
    o1.mul_(w1.div_(total)[..., None]).add_(torch.matmul(p2.div_(total[..., None]), v2))
    return o1, total.log_().add_(top)


class _MergedSegments(torch.autograd.Function):
    """`_merge` with gradients. Backward runs the fused kernel's backward for segment 1 with the
    *merged* output and log-sum-exp (its recomputed probabilities are then the union's, so it returns
    the exact gradients of segment 1's keys and values and its share of the query's), and the same
    formulas by hand for segment 2's scores and values. Rows without any key get zero gradients."""

    @staticmethod
    def forward(ctx, q, k1, v1, s2, s2_max, v2, mask1, dead1, scale):
        out, lse = _merge(q, k1, v1, s2, s2_max, v2, mask1, dead1, scale)
        ctx.save_for_backward(q, k1, v1, s2, v2, mask1, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k1, v1, s2, v2, mask1, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk1, dv1 = back(grad, q, k1, v1, out, lse, 0.0, False, attn_mask=mask1, scale=ctx.scale)
        p2 = torch.exp(s2 - lse[..., None])  # the union's probabilities of the global keys
        dv2 = torch.matmul(p2.transpose(-1, -2), grad)
        ds2 = p2 * (torch.matmul(grad, v2.transpose(-1, -2)) - (grad * out).sum(-1, keepdim=True))
        return dq, dk1, dv1, ds2, None, dv2, None, None, None


def _global_scores(q, k_glob, mask, scale, groups):
    """Scaled, masked scores of every query (B, H, N*b, D) against the global keys (B, K, Gk, D), once
    for all blocks: (B, N, K, G, b, Gk), with the layout's global-key mask (B, N, 1 or H, b, Gk)."""
    batch, heads, rows, d = q.shape
    kv_heads, n_glob = k_glob.shape[1], k_glob.shape[2]
    n, b = mask.shape[1], mask.shape[3]
    q = q.view(batch, kv_heads, groups, rows, d)
    s = torch.matmul(q, k_glob[:, :, None].transpose(-1, -2))  # (B, K, G, N*b, Gk)
    s = s.view(batch, kv_heads, groups, n, b, n_glob).permute(0, 3, 1, 2, 4, 5)  # (B, N, K, G, b, Gk)
    mask = (
        mask.view(batch, n, -1, 1, b, n_glob)
        if mask.shape[2] == 1
        else mask.view(batch, n, kv_heads, groups, b, n_glob)
    )
    return torch.addcmul(mask, s, torch.tensor(scale, dtype=s.dtype, device=s.device))


def _merge_segments(query, layout, mask, dropout) -> bool:
    """Whether the global segment can run beside the band (`_MergedSegments`) rather than copied into
    every block's keys: CPU, fp32 or fp64 (the merge does its arithmetic in the input dtype), no
    dropout, no gradient for the mask (a learned position bias)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64)
        and dropout == 0.0
        and not (torch.is_grad_enabled() and (mask.requires_grad or layout.global_key_mask.requires_grad))
    )


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
    q_padded = F.pad(query, (0, 0, layout.front, back)) if layout.front or back else query  # (B, H, N*b, D)
    # The G query heads that share a kv head become rows of the same block: (B, N, K, G, b, D).
    q = q_padded.view(batch, kv_heads, groups, n, b, d).permute(0, 3, 1, 2, 4, 5)
    width = layout.band_length + (layout.extra_keys.shape[-1] if layout.extra_keys is not None else 0)
    n_glob = 0 if layout.global_keys is None else layout.global_keys.shape[1]
    merge = n_glob > 0 and _merge_segments(query, layout, layout.mask, dropout)
    if n_glob:
        rows = torch.arange(batch, device=key.device)[:, None]
        k_glob = key.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)  # (B, K, Gk, D)
        v_glob = value.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)
    if merge:
        scale = d**-0.5 if scaling is None else scaling
        s_glob = _global_scores(
            q_padded, k_glob, layout.global_key_mask, scale, groups
        )  # (B, N, K, G, b, Gk)
        s_glob_max = s_glob.detach().amax(-1)
        grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    # keys and values copied per block: gathered random keys, or global keys behind every band
    copied = (width - layout.band_length) + (0 if merge else n_glob)
    # the bands alone are views of `key`, so the budget counts them 1/4 (fewer, larger kernel calls)
    per_block = 2 * batch * kv_heads * (copied + layout.band_length / 4) * d * key.element_size()
    per_chunk = max(1, int(CHUNK_BYTES // per_block))
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        per_chunk = n  # backward keeps every block's gathered keys anyway: one call
    out = query.new_empty(batch, n * b, kv_heads, groups, d)  # written chunk by chunk, in the final layout
    for j in range(0, n, per_chunk):
        blocks = range(j, min(j + per_chunk, n))
        m = len(blocks)
        k = _gather_keys(key, layout, blocks).reshape(batch * m, kv_heads, width, d)
        v = _gather_keys(value, layout, blocks).reshape(batch * m, kv_heads, width, d)
        mask = _block_mask(layout.mask, j, m, groups, kv_heads)
        q_chunk = q[:, j : j + m].reshape(batch * m, kv_heads, groups * b, d)
        target = out[:, j * b : (j + m) * b].view(batch, m, b, kv_heads, groups, d).permute(0, 1, 3, 4, 2, 5)
        if merge:
            s2 = s_glob[:, j : j + m].reshape(batch * m, kv_heads, groups * b, n_glob)
            v2 = v_glob[:, None].expand(batch, m, kv_heads, n_glob, d).reshape(batch * m, kv_heads, n_glob, d)
            dead = (
                layout.dead[:, j : j + m, None, None]
                .expand(batch, m, 1, groups, b)
                .reshape(batch * m, 1, groups * b)
            )
            s2_max = s_glob_max[:, j : j + m].reshape(batch * m, kv_heads, groups * b)
            merged = _MergedSegments.apply if grad else lambda *args: _merge(*args)[0]
            o = merged(q_chunk, k, v, s2, s2_max, v2, mask, dead, scale)
        else:
            if n_glob:  # the global keys copied behind every block's keys
                k = torch.cat([k, k_glob[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
                v = torch.cat([v, v_glob[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
                mask = torch.cat([mask, _block_mask(layout.global_key_mask, j, m, groups, kv_heads)], -1)
            o = F.scaled_dot_product_attention(
                q_chunk, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling
            )
        target.copy_(o.view(batch, m, kv_heads, groups, b, d))
    out = out[:, layout.front : layout.front + t].reshape(batch, t, heads, d).contiguous()  # (B, T, H, D)
    if layout.global_rows is not None:
        out = _global_query_rows(module, query, key, value, out, layout, scaling, dropout)
    return out, None


def _block_mask(mask: torch.Tensor, j: int, m: int, groups: int, kv_heads: int) -> torch.Tensor:
    """Blocks j..j+m of a layout mask (B, N, 1 or H, b, L) as SDPA's (B*m, 1 or K, G*b, L)."""
    batch, _, heads, b, width = mask.shape
    mask = mask[:, j : j + m]
    if heads == 1:
        if groups == 1:
            return mask.reshape(batch * m, 1, b, width)
        return mask.expand(batch, m, groups, b, width).reshape(batch * m, 1, groups * b, width)
    return mask.reshape(batch * m, kv_heads, groups * b, width)


def _global_query_rows(module, query, key, value, out, layout: BlockLayout, scaling, dropout) -> torch.Tensor:
    """`out` (B, T, H, D), the backend's own buffer, with the rows of the global queries replaced (in
    place without autograd) by their attention to every key they may see (one dense-rows SDPA call).
    Batch rows with fewer global queries than others pad `global_rows` with -1; those entries are
    left out (scattering them too would write the same row twice, in an undefined order)."""
    heads, d = query.shape[1], query.shape[3]
    rows = layout.global_rows.clamp(min=0)  # (B, R)
    q_rows = torch.gather(query, 2, rows[:, None, :, None].expand(-1, heads, -1, d))
    dense = _sdpa(module, q_rows, key, value, layout.global_mask, scaling, dropout)  # (B, R, H, D)
    batch_idx, slot = (layout.global_rows >= 0).nonzero(as_tuple=True)
    index = (batch_idx, layout.global_rows[batch_idx, slot])
    if out.requires_grad:
        return out.index_put(index, dense[batch_idx, slot])
    out[index] = dense[batch_idx, slot]
    return out


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
