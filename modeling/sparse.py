"""The block-sparse attention backend (`attn_implementation="sparse"`), in plain PyTorch.

Each query block attends to the keys its `BlockLayout` (sparse_layout.py) gathers for it: its band
(a strided view of the keys, never copied) plus its random keys, in one fused-kernel call per chunk of
blocks. The global keys are the same for every block: on CPU (fp32/fp64, no dropout, no learned bias)
their scores for all queries are one matmul and the two segments are merged per row by log-sum-exp
(`_merge`, `_MergedSegments`), so no band is ever copied; otherwise they are copied behind each
block's band and the block runs one `F.scaled_dot_product_attention` call. Queries that are themselves
global attend to all keys, and their result replaces the rows the blocks gave them: without gradients
piece by piece beside the chunks (`_RowsByPieces`), otherwise in one dense-rows call
(`_global_query_rows`); skipped when the layout has no `global_rows`.

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


def _merge(q, k1, v1, p2, l2, v2, mask1, dead1, scale, target=None):
    """Softmax attention of m query blocks `q` (B*m, K, G*b, D) over two segments, merged by
    log-sum-exp. Segment 1 (keys `k1`, values `v1`, additive `mask1`) runs torch's fused CPU kernel,
    which returns its output o1 and each row's log-sum-exp l1. Segment 2 is the few global keys:
    their probabilities `p2` (B, K, Gk, G, m, b) (a softmax over the keys, laid out keys first) and
    log-sum-exp `l2` (B, K, G, m, b) come from scores computed once per forward, so o2 = p2 v2 with
    `v2` (B, K, Gk, D). The union's row is

        (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2)  =  o1 + sigmoid(l2 - l1) (o2 - o1).

    Segment 1 holds no key for a row where `dead1` (B*m, 1, G*b) is True (the kernel then returns 0
    and a meaningless l1, replaced by -inf). Writes the output (B, m, K, G, b, D) into `target` when
    given (no gradients) and returns None; otherwise returns (output (B*m, K, G*b, D), the union's
    log-sum-exp (B*m, K, G*b))."""
    batch, kv_heads, n_glob, groups, m, b = p2.shape
    o1, l1 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k1, v1, attn_mask=mask1, scale=scale
    )
    if dead1 is not None:
        l1 = l1.masked_fill_(dead1, float("-inf"))
    l1 = l1.view(batch, m, kv_heads, groups, b).permute(0, 2, 3, 1, 4)  # (B, K, G, m, b)
    share = torch.sigmoid(l2 - l1).permute(0, 3, 1, 2, 4)[..., None]  # (B, m, K, G, b, 1)
    o2 = torch.matmul(p2.reshape(batch, kv_heads, n_glob, -1).transpose(-1, -2), v2)  # (B, K, G*m*b, D)
    o2 = o2.view(batch, kv_heads, groups, m, b, -1).permute(0, 3, 1, 2, 4, 5)
    o1 = o1.view(batch, m, kv_heads, groups, b, -1)
    if target is not None:
        torch.lerp(o1, o2, share, out=target)
        return None
    out = torch.lerp(o1, o2, share).reshape(batch * m, kv_heads, groups * b, -1)
    lse = torch.logaddexp(l1, l2).permute(0, 3, 1, 2, 4).reshape(batch * m, kv_heads, groups * b)
    return out, lse


class _MergedSegments(torch.autograd.Function):
    """`_merge` with gradients. Backward runs the fused kernel's backward for segment 1 with the
    *merged* output and log-sum-exp (its recomputed probabilities are then the union's, so it returns
    the exact gradients of segment 1's keys and values and its share of the query's), and the same
    formulas by hand for segment 2's scores and values. Rows without any key get zero gradients."""

    @staticmethod
    def forward(ctx, q, k1, v1, s2, p2, l2, v2, mask1, dead1, scale):
        """s2: the global keys' scores (B, K, Gk, G, m, b), from which p2 and l2 (see `_merge`) come."""
        out, lse = _merge(q, k1, v1, p2, l2, v2, mask1, dead1, scale)
        ctx.save_for_backward(q, k1, v1, s2, v2, mask1, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k1, v1, s2, v2, mask1, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        back = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        dq, dk1, dv1 = back(grad, q, k1, v1, out, lse, 0.0, False, attn_mask=mask1, scale=ctx.scale)
        batch, kv_heads, n_glob, groups, m, b = s2.shape

        def rows_by_kv_head(x):  # (B*m, K, G*b, ...) -> (B, K, G, m, b, ...)
            return x.view(batch, m, kv_heads, groups, b, *x.shape[3:]).transpose(1, 2).transpose(2, 3)

        p2 = torch.exp(s2 - rows_by_kv_head(lse)[:, :, None])  # the union's probabilities of the global keys
        g = rows_by_kv_head(grad).reshape(batch, kv_heads, groups * m * b, -1)
        p2_rows = p2.reshape(batch, kv_heads, n_glob, groups * m * b)
        dv2 = torch.matmul(p2_rows, g)
        row_dot = (grad * out).sum(-1)  # (B*m, K, G*b)
        dp2 = torch.matmul(v2, g.transpose(-1, -2)).view_as(p2)
        ds2 = p2.mul_(dp2.sub_(rows_by_kv_head(row_dot)[:, :, None]))
        return dq, dk1, dv1, ds2, None, None, dv2, None, None, None


def _global_scores(q_padded, k_glob, key_mask, scale):
    """Scaled, masked scores of every query row (B, H, N*b, D) against the global keys (B, K, Gk, D),
    once for all blocks and keys first: (B, K, Gk, G, N, b), with the layout's global-key mask
    (B, N, 1 or H, b, Gk). Masked scores are the lowest float rather than -inf, so that a row seeing
    none of the global keys gets a finite log-sum-exp (and weight 0 in the merge)."""
    batch, heads, rows, d = q_padded.shape
    kv_heads, n_glob = k_glob.shape[1], k_glob.shape[2]
    groups, n, b = heads // kv_heads, key_mask.shape[1], key_mask.shape[3]
    # (copies the queries only for GQA from a transposed projection: its G heads' rows are not adjacent)
    q_rows = q_padded.reshape(batch, kv_heads, groups * rows, d)
    s = torch.matmul(k_glob * scale, q_rows.transpose(-1, -2)).view(batch, kv_heads, n_glob, groups, n, b)
    mask = key_mask.permute(0, 2, 4, 1, 3)  # (B, 1 or H, Gk, N, b)
    if mask.shape[1] == 1:
        mask = mask[:, :, :, None]
    else:
        mask = mask.view(batch, kv_heads, groups, n_glob, n, b).transpose(2, 3)
    return s.add_(mask).clamp_min_(torch.finfo(s.dtype).min)  # in place: keeps the matmul's layout


def _softmax_and_lse(scores: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) and logsumexp(scores) over `dim`, sharing their passes (about half the time of
    torch.softmax and torch.logsumexp called apart, on a short `dim` that is not the last)."""
    top = scores.amax(dim, keepdim=True)
    e = torch.sub(scores, top).exp_()
    total = e.sum(dim, keepdim=True)
    return e.div_(total), total.log_().add_(top).squeeze(dim)


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
    bands (`_merge_segments`): their scaled, masked scores for every query (B, K, Gk, G, N, b), their
    softmax over the keys and log-sum-exp (B, K, G, N, b), the rows (B, N, b) that see no key of the
    band + random segment (`dead_band`) and those that see no key at all (`no_key`, zeroed at the
    end), None where there are none, and whether gradients are recorded."""

    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    dead_band: torch.Tensor | None = None
    no_key: torch.Tensor | None = None
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
        glob.scores = _global_scores(q_padded, k_glob, layout.global_key_mask, glob.scale)
        scores = glob.scores.detach()
        glob.probs, glob.lse = _softmax_and_lse(scores, dim=2)
        if bool(layout.dead.any()):
            glob.dead_band = layout.dead
            no_key = layout.dead & ~(layout.global_key_mask[:, :, 0] > float("-inf")).any(-1)  # (B, N, b)
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
    starts = range(0, n, per_chunk)
    rows = None
    if layout.global_rows is not None and not grad and _merge_segments(query, layout, layout.mask, dropout):
        rows = _RowsByPieces(query, layout, len(starts), scaling)
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
        out = _put_rows(out, layout, rows.result())
    elif layout.global_rows is not None:
        out = _global_query_rows(module, query, key, value, out, layout, scaling, dropout)
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
    if glob is not None and glob.scores is not None:
        p2, l2 = glob.probs[:, :, :, :, j : j + m], glob.lse[:, :, :, j : j + m]
        dead = None
        if glob.dead_band is not None:
            dead = glob.dead_band[:, j : j + m, None, None].expand(batch, m, 1, groups, layout.block)
            dead = dead.reshape(batch_m, 1, rows)
        if not glob.grad:
            _merge(q, k, v, p2, l2, glob.values, mask, dead, glob.scale, target=target)
            return
        s2 = glob.scores[:, :, :, :, j : j + m]
        o = _MergedSegments.apply(q, k, v, s2, p2, l2, glob.values, mask, dead, glob.scale)
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


def _global_query_rows(module, query, key, value, out, layout: BlockLayout, scaling, dropout) -> torch.Tensor:
    """`out` (B, T, H, D) with the rows of the global queries replaced by their attention to every key
    they may see, in one dense-rows SDPA call (see `_put_rows`)."""
    dense = sdpa_attention(
        module, _query_rows(query, layout), key, value, layout.global_mask, scaling, dropout
    )
    return _put_rows(out, layout, dense)


def _query_rows(query: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The global query rows (B, H, R, D) of `query` (B, H, T, D)."""
    heads, d = query.shape[1], query.shape[3]
    rows = layout.global_rows.clamp(min=0)  # (B, R)
    return torch.gather(query, 2, rows[:, None, :, None].expand(-1, heads, -1, d))


def _put_rows(out: torch.Tensor, layout: BlockLayout, dense: torch.Tensor) -> torch.Tensor:
    """`out` (B, T, H, D), the backend's own buffer, with the global query rows replaced (in place
    without autograd) by `dense` (B, R, H, D). Batch rows with fewer global queries than others pad
    `global_rows` with -1; those entries are left out (scattering them too would write the same row
    twice, in an undefined order)."""
    batch_idx, slot = (layout.global_rows >= 0).nonzero(as_tuple=True)
    index = (batch_idx, layout.global_rows[batch_idx, slot])
    if out.requires_grad:
        return out.index_put(index, dense[batch_idx, slot])
    out[index] = dense[batch_idx, slot]
    return out


class _RowsByPieces:
    """The global query rows' attention to every key, without gradients, computed piece by piece
    beside the query chunks: the keys are cut into as many consecutive pieces as there are chunks, and
    piece c is attended right after chunk c, while the band of that chunk (which covers about the same
    keys) is still in cache. Pieces are merged by log-sum-exp; a row that sees no key of a piece gets
    the lowest float as that piece's log-sum-exp, so it takes no weight (and a row without any key
    stays 0, as one kernel call gives it)."""

    def __init__(self, query, layout: BlockLayout, pieces: int, scaling):
        batch, heads, _, d = query.shape
        self.q = _query_rows(query, layout)  # (B, H, R, D)
        self.mask = layout.global_mask  # (B, 1 or H, R, S)
        self.scale = d**-0.5 if scaling is None else scaling
        length = self.mask.shape[-1]
        self.bounds = [length * c // pieces for c in range(pieces + 1)]
        self.done = 0
        self.out = self.lse = None

    def attend(self, key, value) -> None:
        lo, hi = self.bounds[self.done], self.bounds[self.done + 1]
        self.done += 1
        if hi == lo:
            return
        mask = self.mask[..., lo:hi]
        k, v = key[:, :, lo:hi], value[:, :, lo:hi]
        groups = self.q.shape[1] // k.shape[1]
        if groups > 1:  # GQA: kv heads repeated for these few rows
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            self.q, k, v, attn_mask=mask, scale=self.scale
        )
        lse = lse.masked_fill_(~(mask > float("-inf")).any(-1), torch.finfo(lse.dtype).min)
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out = self.out.lerp_(out, torch.sigmoid(lse - self.lse)[..., None])
            self.lse = torch.logaddexp(self.lse, lse)

    def result(self) -> torch.Tensor:
        """(B, R, H, D), once every piece is attended."""
        return self.out.transpose(1, 2)
