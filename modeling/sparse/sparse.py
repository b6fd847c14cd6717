"""The block-sparse attention backend (`attn_implementation="sparse"`), in plain PyTorch; fp32 CPU calls
without gradients run the native kernels of sparse_native.py instead, where they apply (its docstring).

Each query block attends to the keys its `BlockLayout` (sparse_layout.py) gathers for it: its band
(a strided view of the keys, never copied) plus its random keys, in one fused-kernel call per chunk of
blocks. The global keys are the same for every block: on CPU (fp32/fp64, no dropout, no learned bias)
each chunk's scores against them are one matmul and the two segments are merged per row by log-sum-exp
(sparse_globals.py: `merge`, `MergedSegments`), so no band is ever copied; otherwise they are copied
behind each block's band and the block runs one `F.scaled_dot_product_attention` call. Queries that are
themselves global attend to all keys, and their result replaces the rows the blocks gave them: without
gradients piece by piece beside the chunks (`RowsByPieces`), otherwise in one dense-rows call
(`global_query_rows`); skipped when the layout has no `global_rows`.

Cost: time and memory O(T * (window + globals + random)), forward and backward (autograd through
gather, SDPA's fused CPU/CUDA kernel and scatter), no torch.compile. Shape legend: B batch, H query
heads, K kv heads, G = H / K, T queries, S keys, D head dim, N query blocks, b block size, L keys
gathered per block, Gk global keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.functions import sdpa_attention
from ..cpu import sparse_native_applies, sparse_native_attend
from .sparse_globals import (
    MergedSegments,
    RowsByPieces,
    global_keys_and_values,
    global_query_rows,
    global_scores,
    merge,
    put_rows,
    softmax_and_lse,
)
from .sparse_layout import BlockLayout, dead_rows

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


def _merge_segments(query, dropout, *masks) -> bool:
    """Whether a segment can run beside the bands and be merged by log-sum-exp (the global keys:
    `MergedSegments`; the global query rows, piece by piece: `RowsByPieces`) rather than copied into
    every block's keys or run in one dense call: CPU, fp32 or fp64 (the merge does its arithmetic in
    the input dtype), no dropout, no gradient for any of `masks` (a learned position bias)."""
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.float64)
        and dropout == 0.0
        and not (torch.is_grad_enabled() and any(m is not None and m.requires_grad for m in masks))
    )


@dataclass
class _Globals:
    """The global keys and values of a forward (B, K, Gk, D), gathered once. When merged beside the
    bands (`_merge_segments`, `merged`): the keys already multiplied by the softmax scale `scale`, the
    padded queries (B, H, N*b, D) whose scores against them each chunk computes (`global_scores`),
    whether each of the N blocks' global-key mask masks anything (a list, read once per forward), the
    rows (B, N, b) that see no key of the band + random segment (`dead_band`) and those that see no
    key at all (`no_key`, zeroed at the end), None where there are none, and whether gradients are
    recorded."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None = None
    masked_blocks: list[bool] | None = None
    dead_band: torch.Tensor | None = None
    no_key: torch.Tensor | None = None
    scale: float = 1.0
    grad: bool = False

    @property
    def merged(self) -> bool:
        return self.queries is not None


def _gather_globals(
    query, key, value, q_padded, layout: BlockLayout, scaling, dropout, grad
) -> _Globals | None:
    if layout.global_keys is None:
        return None
    glob = _Globals(*global_keys_and_values(key, value, layout))
    if _merge_segments(query, dropout, layout.mask, layout.global_key_mask):
        glob.queries = q_padded
        glob.scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        glob.keys = glob.keys * glob.scale
        glob.masked_blocks = layout.global_key_mask.ne(0).flatten(2).any(-1).any(0).tolist()  # N flags
        if bool(layout.dead.any()):
            glob.dead_band = layout.dead
            no_key = layout.dead & dead_rows(layout.global_key_mask)  # (B, N, b)
            glob.no_key = no_key if bool(no_key.any()) else None
        glob.grad = grad
    return glob


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
        return sdpa_attention(module, query, key, value, attention_mask, scaling, dropout), None
    layout = attention_mask
    if sparse_native_applies(query, key, value, layout, dropout):  # fp32 CPU inference: native kernels
        return sparse_native_attend(query, key, value, layout, scaling), None
    batch, heads, t, d = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    n, b = layout.n_blocks, layout.block
    back = n * b - layout.front - t
    q_padded = F.pad(query, (0, 0, layout.front, back)) if layout.front or back else query  # (B, H, N*b, D)
    # The G query heads that share a kv head become rows of the same block: (B, N, K, G, b, D).
    q = q_padded.view(batch, kv_heads, groups, n, b, d).permute(0, 3, 1, 2, 4, 5)
    width = layout.band_length + (layout.extra_keys.shape[-1] if layout.extra_keys is not None else 0)
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    glob = _gather_globals(query, key, value, q_padded, layout, scaling, dropout, grad)
    # keys and values copied per block: gathered random keys, or global keys behind every band
    copied = (width - layout.band_length) + (0 if glob is None or glob.merged else glob.keys.shape[2])
    # the bands alone are views of `key`, so the budget counts them 1/4 (fewer, larger kernel calls)
    per_block = 2 * batch * kv_heads * (copied + layout.band_length / 4) * d * key.element_size()
    per_chunk = max(1, int(CHUNK_BYTES // per_block))
    if grad:
        per_chunk = n  # backward keeps every block's gathered keys anyway: one call
    out = query.new_empty(batch, n * b, kv_heads, groups, d)  # written chunk by chunk, in the final layout
    starts = range(0, n, per_chunk)
    rows = None
    if layout.global_rows is not None and not grad and _merge_segments(query, dropout, layout.global_mask):
        rows = RowsByPieces(query, layout, len(starts), scaling, kv_heads)
    for j in starts:
        blocks = range(j, min(j + per_chunk, n))
        m = len(blocks)
        k = _gather_keys(key, layout, blocks).reshape(batch * m, kv_heads, width, d)
        v = _gather_keys(value, layout, blocks).reshape(batch * m, kv_heads, width, d)
        q_chunk = q[:, j : j + m].reshape(batch * m, kv_heads, groups * b, d)
        target = out[:, j * b : (j + m) * b].view(batch, m, b, kv_heads, groups, d).permute(0, 1, 3, 4, 2, 5)
        _attend_blocks(q_chunk, k, v, layout, glob, blocks, groups, scaling, dropout, target)
        if rows is not None:  # the global query rows over this chunk's share of the keys, still in cache
            rows.attend(key, value)
    if glob is not None and glob.no_key is not None:  # the merge gave them the global values' mean
        no_key = glob.no_key.view(batch, n * b, 1, 1, 1)
        out = out.masked_fill(no_key, 0.0) if grad else out.masked_fill_(no_key, 0.0)
    out = out[:, layout.front : layout.front + t].reshape(batch, t, heads, d).contiguous()  # (B, T, H, D)
    if rows is not None:
        out = put_rows(out, layout, rows.result())
    elif layout.global_rows is not None:
        out = global_query_rows(module, query, key, value, out, layout, scaling, dropout)
    return out, None


def _attend_blocks(
    q, k, v, layout: BlockLayout, glob: _Globals | None, blocks: range, groups, scaling, dropout, target
) -> None:
    """Query blocks `blocks` (q: (B*m, K, G*b, D)) over their gathered keys and values (B*m, K, L, D)
    and the global segment, written into `target` (B, m, K, G, b, D)."""
    j, m = blocks.start, len(blocks)
    batch_m, kv_heads, rows, d = q.shape
    batch = batch_m // m
    mask = _block_mask(layout.mask, j, m, groups, kv_heads)
    if glob is not None and glob.merged:
        key_mask = layout.global_key_mask[:, j : j + m] if any(glob.masked_blocks[j : j + m]) else None
        q_rows = glob.queries[:, :, j * layout.block : (j + m) * layout.block]
        s2 = global_scores(q_rows, glob.keys, key_mask, layout.block)  # (B, K, G, Gk, m, b)
        if s2.shape[3] == 1:  # one global key: probability 1, log-sum-exp its score
            p2, l2 = None, s2.detach()[:, :, :, 0]
        else:
            p2, l2 = softmax_and_lse(s2.detach(), dim=3)
        dead = None
        if glob.dead_band is not None:
            dead = glob.dead_band[:, j : j + m, None, None].expand(batch, m, 1, groups, layout.block)
            dead = dead.reshape(batch_m, 1, rows)
        if not glob.grad:
            merge(q, k, v, p2, l2, glob.values, mask, dead, glob.scale, target=target)
            return
        o = MergedSegments.apply(q, k, v, s2, p2, l2, glob.values, mask, dead, glob.scale)
    else:
        if glob is not None:  # the global keys copied behind every block's keys
            n_glob = glob.keys.shape[2]
            k = torch.cat([k, glob.keys[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
            v = torch.cat([v, glob.values[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
            mask = torch.cat([mask, _block_mask(layout.global_key_mask, j, m, groups, kv_heads)], -1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
    target.copy_(o.view(batch, m, kv_heads, groups, layout.block, d))


def _block_mask(mask: torch.Tensor, j: int, m: int, groups: int, kv_heads: int) -> torch.Tensor:
    """Blocks j..j+m of a layout mask (B, N, 1 or H, b, L) as SDPA's (B*m, 1 or K, G*b, L)."""
    batch, _, heads, b, width = mask.shape
    mask = mask[:, j : j + m]
    if heads == 1:
        if groups == 1:
            return mask.reshape(batch * m, 1, b, width)
        return mask.expand(batch, m, groups, b, width).reshape(batch * m, 1, groups * b, width)
    return mask.reshape(batch * m, kv_heads, groups * b, width)
