"""The block-sparse attention backend (`attn_implementation="sparse"`), in plain PyTorch.

Each query block attends to the keys its `BlockLayout` (sparse_layout.py) gathers for it: its band
(a strided view of the keys, never copied) plus its random keys, in one fused-kernel call per chunk of
blocks. The global keys are the same for every block: on CPU (fp32/fp64, no dropout, no learned bias)
their scores for all queries are one matmul and the two segments are merged per row by log-sum-exp
(`_merge`, `_MergedSegments`), so no band is ever copied; otherwise they are copied behind each
block's band and the block runs one `F.scaled_dot_product_attention` call. Queries that are themselves
global attend to all keys in a second, dense-rows call whose result replaces theirs
(`_global_query_rows`; skipped when the layout has no `global_rows`).

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

from .attention import sdpa_attention
from .sparse_layout import BlockLayout

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


@dataclass
class _Globals:
    """The global keys and values of a forward (B, K, Gk, D), gathered once. When merged beside the
    bands (`_merge_segments`): their scaled, masked scores for every query (B, N, K, G, b, Gk), the row
    maxima, and whether gradients are recorded."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor | None = None
    score_max: torch.Tensor | None = None
    scale: float = 1.0
    grad: bool = False


def _gather_globals(
    query, key, value, q_padded, layout: BlockLayout, scaling, dropout, grad
) -> _Globals | None:
    if layout.global_keys is None:
        return None
    rows = torch.arange(key.shape[0], device=key.device)[:, None]
    k_glob = key.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)  # (B, K, Gk, D)
    v_glob = value.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)
    glob = _Globals(k_glob, v_glob)
    if _merge_segments(query, layout, layout.mask, dropout):
        glob.scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        groups = query.shape[1] // key.shape[1]
        glob.scores = _global_scores(q_padded, k_glob, layout.global_key_mask, glob.scale, groups)
        glob.score_max = glob.scores.detach().amax(-1)
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
    copied = (width - layout.band_length) + (
        0 if glob is None or glob.scores is not None else glob.keys.shape[2]
    )
    # the bands alone are views of `key`, so the budget counts them 1/4 (fewer, larger kernel calls)
    per_block = 2 * batch * kv_heads * (copied + layout.band_length / 4) * d * key.element_size()
    per_chunk = max(1, int(CHUNK_BYTES // per_block))
    if grad:
        per_chunk = n  # backward keeps every block's gathered keys anyway: one call
    out = query.new_empty(batch, n * b, kv_heads, groups, d)  # written chunk by chunk, in the final layout
    for j in range(0, n, per_chunk):
        blocks = range(j, min(j + per_chunk, n))
        m = len(blocks)
        k = _gather_keys(key, layout, blocks).reshape(batch * m, kv_heads, width, d)
        v = _gather_keys(value, layout, blocks).reshape(batch * m, kv_heads, width, d)
        q_chunk = q[:, j : j + m].reshape(batch * m, kv_heads, groups * b, d)
        o = _attend_blocks(q_chunk, k, v, layout, glob, blocks, groups, scaling, dropout)
        target = out[:, j * b : (j + m) * b].view(batch, m, b, kv_heads, groups, d).permute(0, 1, 3, 4, 2, 5)
        target.copy_(o.view(batch, m, kv_heads, groups, b, d))
    out = out[:, layout.front : layout.front + t].reshape(batch, t, heads, d).contiguous()  # (B, T, H, D)
    if layout.global_rows is not None:
        out = _global_query_rows(module, query, key, value, out, layout, scaling, dropout)
    return out, None


def _attend_blocks(
    q, k, v, layout: BlockLayout, glob: _Globals | None, blocks: range, groups, scaling, dropout
):
    """Query blocks `blocks` (q: (B*m, K, G*b, D)) over their gathered keys and values (B*m, K, L, D)
    and the global segment: (B*m, K, G*b, D)."""
    j, m = blocks.start, len(blocks)
    batch_m, kv_heads, rows, d = q.shape
    batch = batch_m // m
    mask = _block_mask(layout.mask, j, m, groups, kv_heads)
    if glob is not None and glob.scores is not None:
        n_glob = glob.keys.shape[2]
        s2 = glob.scores[:, j : j + m].reshape(batch_m, kv_heads, rows, n_glob)
        v2 = glob.values[:, None].expand(batch, m, kv_heads, n_glob, d).reshape(batch_m, kv_heads, n_glob, d)
        dead = (
            layout.dead[:, j : j + m, None, None]
            .expand(batch, m, 1, groups, layout.block)
            .reshape(batch_m, 1, rows)
        )
        s2_max = glob.score_max[:, j : j + m].reshape(batch_m, kv_heads, rows)
        merged = _MergedSegments.apply if glob.grad else lambda *args: _merge(*args)[0]
        return merged(q, k, v, s2, s2_max, v2, mask, dead, glob.scale)
    if glob is not None:  # the global keys copied behind every block's keys
        n_glob = glob.keys.shape[2]
        k = torch.cat([k, glob.keys[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
        v = torch.cat([v, glob.values[:, None].expand(batch, m, kv_heads, n_glob, d).flatten(0, 1)], 2)
        mask = torch.cat([mask, _block_mask(layout.global_key_mask, j, m, groups, kv_heads)], -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)


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
    dense = sdpa_attention(module, q_rows, key, value, layout.global_mask, scaling, dropout)  # (B, R, H, D)
    batch_idx, slot = (layout.global_rows >= 0).nonzero(as_tuple=True)
    index = (batch_idx, layout.global_rows[batch_idx, slot])
    if out.requires_grad:
        return out.index_put(index, dense[batch_idx, slot])
    out[index] = dense[batch_idx, slot]
    return out
