"""The sparse backend's global tokens (sparse.py runs them): the global keys as a segment beside the
bands, merged by log-sum-exp, and the rows of the global queries, which attend to every key.

Shape legend as in sparse.py; m query blocks per chunk, R global query rows.
"""

from __future__ import annotations

import torch

from ..attention.functions import fold_groups, sdpa_attention
from ..compat.torch_compat import flash_cpu, flash_cpu_backward
from .sparse_layout import BlockLayout


def merge(q, k1, v1, p2, l2, v2, mask1, dead1, scale, target=None):
    """Softmax attention of m query blocks `q` (B*m, K, G*b, D) over two segments, merged by
    log-sum-exp. Segment 1 (keys `k1`, values `v1`, additive `mask1`) runs torch's fused CPU kernel,
    which returns its output o1 and each row's log-sum-exp l1. Segment 2 is the few global keys:
    their probabilities `p2` (B, K, G, Gk, m, b) (a softmax over the keys, each key's rows contiguous)
    and log-sum-exp `l2` (B, K, G, m, b) come from `global_scores`, so o2 = p2 v2 with `v2`
    (B, K, Gk, D). The union's row is

        (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2)  =  o1 + sigmoid(l2 - l1) (o2 - o1).

    Segment 1 holds no key for a row where `dead1` (B*m, 1, G*b) is True (the kernel then returns 0
    and a meaningless l1, replaced by -inf). With a single global key `p2` may be None: every
    probability is 1 and o2 is that key's value, so the matmul and the (B*m, K, G*b, D) tensor it
    writes are skipped (`MergedSegments.backward` recomputes its probabilities from `s2`). Writes the
    output (B, m, K, G, b, D) into `target` when given (no gradients) and returns None; otherwise
    returns (output (B*m, K, G*b, D), the union's log-sum-exp (B*m, K, G*b))."""
    batch, kv_heads, groups, m, b = l2.shape
    o1, l1 = flash_cpu(q, k1, v1, attn_mask=mask1, scale=scale)
    if dead1 is not None:
        l1 = l1.masked_fill_(dead1, float("-inf"))
    l1 = l1.view(batch, m, kv_heads, groups, b).permute(0, 2, 3, 1, 4)  # (B, K, G, m, b)
    share = torch.sigmoid(l2 - l1).permute(0, 3, 1, 2, 4)[..., None]  # (B, m, K, G, b, 1)
    if p2 is None:
        o2 = v2.reshape(batch, 1, kv_heads, 1, 1, -1)  # broadcast over (m, G, b)
    else:
        o2 = torch.matmul(p2.view(batch, kv_heads, groups, v2.shape[2], -1).transpose(-1, -2), v2[:, :, None])
        o2 = o2.view(batch, kv_heads, groups, m, b, -1).permute(0, 3, 1, 2, 4, 5)  # (B, m, K, G, b, D)
    o1 = o1.view(batch, m, kv_heads, groups, b, -1)
    if target is not None:
        torch.lerp(o1, o2, share, out=target)
        return None
    out = torch.lerp(o1, o2, share).reshape(batch * m, kv_heads, groups * b, -1)
    lse = torch.logaddexp(l1, l2).permute(0, 3, 1, 2, 4).reshape(batch * m, kv_heads, groups * b)
    return out, lse


class MergedSegments(torch.autograd.Function):
    """`merge` with gradients. Backward runs the fused kernel's backward for segment 1 with the
    *merged* output and log-sum-exp (its recomputed probabilities are then the union's, so it returns
    the exact gradients of segment 1's keys and values and its share of the query's), and the same
    formulas by hand for segment 2's scores and values. Rows without any key get zero gradients."""

    @staticmethod
    def forward(ctx, q, k1, v1, s2, p2, l2, v2, mask1, dead1, scale):
        """s2: the global keys' scores (B, K, G, Gk, m, b), from which p2 and l2 (see `merge`) come."""
        out, lse = merge(q, k1, v1, p2, l2, v2, mask1, dead1, scale)
        ctx.save_for_backward(q, k1, v1, s2, v2, mask1, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k1, v1, s2, v2, mask1, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        back = flash_cpu_backward
        dq, dk1, dv1 = back(grad, q, k1, v1, out, lse, 0.0, False, attn_mask=mask1, scale=ctx.scale)
        batch, kv_heads, groups, n_glob, m, b = s2.shape

        def rows_by_kv_head(x):  # (B*m, K, G*b, ...) -> (B, K, G, m, b, ...)
            return x.view(batch, m, kv_heads, groups, b, *x.shape[3:]).transpose(1, 2).transpose(2, 3)

        # the union's probabilities of the global keys
        p2 = torch.exp(s2 - rows_by_kv_head(lse)[:, :, :, None])
        g = rows_by_kv_head(grad).reshape(batch, kv_heads, groups, m * b, -1)
        p2_rows = p2.reshape(batch, kv_heads, groups, n_glob, m * b)
        dv2 = torch.matmul(p2_rows, g).sum(2)  # (B, K, Gk, D)
        row_dot = (grad * out).sum(-1)  # (B*m, K, G*b)
        dp2 = torch.matmul(v2[:, :, None], g.transpose(-1, -2)).view_as(p2)
        ds2 = p2.mul_(dp2.sub_(rows_by_kv_head(row_dot)[:, :, :, None]))
        return dq, dk1, dv1, ds2, None, None, dv2, None, None, None


def global_scores(q_rows, k_glob, key_mask, block):
    """Masked scores of the query rows of m blocks of b = `block` rows (B, H, m*b, D) against the
    global keys (B, K, Gk, D), already multiplied by the softmax scale: (B, K, G, Gk, m, b), with the
    blocks' global-key mask
    (B, m, 1 or H, b, Gk), or None where it masks nothing. Computed chunk by chunk, just before the
    fused kernel reads the same queries, so no (B, H, Gk, T) score tensor is ever held. Masked
    scores are the lowest float rather than -inf, so that a row seeing none of the global keys gets a
    finite log-sum-exp (and weight 0 in the merge)."""
    batch, heads, rows, d = q_rows.shape
    kv_heads, n_glob = k_glob.shape[1], k_glob.shape[2]
    groups = heads // kv_heads
    q = q_rows.view(batch, kv_heads, groups, rows, d)
    s = torch.matmul(k_glob[:, :, None], q.transpose(-1, -2))  # (B, K, G, Gk, m*b)
    m, b = rows // block, block
    s = s.view(batch, kv_heads, groups, n_glob, m, b)
    if key_mask is None:
        return s
    mask = key_mask.permute(0, 2, 4, 1, 3)  # (B, 1 or H, Gk, m, b)
    mask = mask[:, :, None] if mask.shape[1] == 1 else mask.view(batch, kv_heads, groups, n_glob, m, b)
    return s.add_(mask).clamp_min_(torch.finfo(s.dtype).min)  # in place: keeps the matmul's layout


def softmax_and_lse(scores: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scores) and logsumexp(scores) over `dim`, sharing their passes (about half the time of
    torch.softmax and torch.logsumexp called apart, on a short `dim` that is not the last)."""
    top = scores.amax(dim, keepdim=True)
    e = torch.sub(scores, top).exp_()
    total = e.sum(dim, keepdim=True)
    return e.div_(total), total.log_().add_(top).squeeze(dim)


def global_keys_and_values(key, value, layout: BlockLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The global keys and values of `layout` (B, K, Gk, D), gathered from `key` and `value` (B, K, S, D)."""
    rows = torch.arange(key.shape[0], device=key.device)[:, None]
    k_glob = key.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)
    v_glob = value.transpose(1, 2)[rows, layout.global_keys].transpose(1, 2)
    return k_glob, v_glob


def global_query_rows(module, query, key, value, out, layout: BlockLayout, scaling, dropout) -> torch.Tensor:
    """`out` (B, T, H, D) with the rows of the global queries replaced by their attention to every key
    they may see, in one dense-rows SDPA call (see `put_rows`)."""
    dense = sdpa_attention(
        module, query_rows(query, layout), key, value, layout.global_mask, scaling, dropout
    )
    return put_rows(out, layout, dense)


def query_rows(query: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
    """The global query rows (B, H, R, D) of `query` (B, H, T, D)."""
    heads, d = query.shape[1], query.shape[3]
    rows = layout.global_rows.clamp(min=0)  # (B, R)
    return torch.gather(query, 2, rows[:, None, :, None].expand(-1, heads, -1, d))


def put_rows(out: torch.Tensor, layout: BlockLayout, dense: torch.Tensor) -> torch.Tensor:
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


class RowsByPieces:
    """The global query rows' attention to every key, without gradients, computed piece by piece
    beside the query chunks: the keys are cut into as many consecutive pieces as there are chunks, and
    piece c is attended right after chunk c, while the band of that chunk (which covers about the same
    keys) is still in cache. Pieces are merged by log-sum-exp; a row that sees no key of a piece gets
    the lowest float as that piece's log-sum-exp, so it takes no weight (and a row without any key
    stays 0, as one kernel call gives it)."""

    def __init__(self, query, layout: BlockLayout, pieces: int, scaling, kv_heads: int):
        q = query_rows(query, layout)  # (B, H, R, D)
        self.shape = q.shape
        # GQA: the G query heads of a kv head become rows of one call, as in `sdpa_attention`
        self.q, self.mask = fold_groups(q, layout.global_mask, kv_heads)
        self.scale = q.shape[-1] ** -0.5 if scaling is None else scaling
        length = self.mask.shape[-1]
        self.mask = self.mask if bool(self.mask.ne(0).any()) else None  # None: every key is seen
        self.bounds = [length * c // pieces for c in range(pieces + 1)]
        self.done = 0
        self.out = self.lse = None

    def attend(self, key, value) -> None:
        lo, hi = self.bounds[self.done], self.bounds[self.done + 1]
        self.done += 1
        if hi == lo:
            return
        mask = None if self.mask is None else self.mask[..., lo:hi]
        out, lse = flash_cpu(self.q, key[:, :, lo:hi], value[:, :, lo:hi], attn_mask=mask, scale=self.scale)
        if mask is not None:
            lse = lse.masked_fill_(~(mask > float("-inf")).any(-1), torch.finfo(lse.dtype).min)
        if self.out is None:
            self.out, self.lse = out, lse
        else:
            self.out = self.out.lerp_(out, torch.sigmoid(lse - self.lse)[..., None])
            self.lse = torch.logaddexp(self.lse, lse)

    def result(self) -> torch.Tensor:
        """(B, R, H, D), once every piece is attended."""
        return self.out.reshape(self.shape).transpose(1, 2)
