"""The sparse attention call on the native CPU kernels: the inputs laid out as the kernels read them.

`sparse_native.applies` decides whether a call runs here (its docstring); `sparse.py` then calls
`attend`. Outputs differ from the PyTorch path's by rounding only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..sparse.sparse_globals import global_keys_and_values, put_rows, query_rows
from ..sparse.sparse_layout import BlockLayout

_VECTOR = 16  # global keys are padded to a multiple of the widest vector (16 floats)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy where the kernels could not read it: they read a last dimension of more than one
    element as contiguous memory (one of size 1 has only offset 0, whatever its stride)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def attend(query, key, value, layout: BlockLayout, scaling: float | None) -> torch.Tensor:
    """The sparse attention of `query` (B, H, T, D) over `key`, `value` (B, K, S, D) with `layout`, on
    the native kernels: (B, T, H, D), the backend's output layout."""
    batch, heads, t, d = query.shape
    n, b = layout.n_blocks, layout.block
    scale = d**-0.5 if scaling is None else scaling
    back = n * b - layout.front - t
    q = F.pad(query, (0, 0, layout.front, back)) if layout.front or back else query
    q = _last_contiguous(q)
    # the keys the bands cover (a cached decoding step: its window only), or all of them for global rows
    lo, hi = 0, key.shape[2]
    if layout.global_rows is None:
        lo = min(max(layout.band_start, 0), hi)
        hi = max(min(layout.band_start + (n - 1) * b + layout.band_length, hi), lo)
    keys, values = key[:, :, lo:hi], _last_contiguous(value[:, :, lo:hi])
    # keys transposed (B, K, D, S): the band of a block is then a column slice brgemm reads directly.
    # A row stride of S + 16 keeps rows off power-of-two distances (cache-set conflicts at S = 8192).
    kt = key.new_empty(batch, key.shape[1], d, hi - lo + 16)[..., : hi - lo]
    kt.copy_(keys.transpose(2, 3))
    empty = key.new_empty(0)
    kgt = vg = gmask = empty
    if layout.global_keys is not None:
        kg, vg = global_keys_and_values(key, value, layout)  # (B, K, Gk, D)
        vg = vg.contiguous()
        pad = -kg.shape[2] % _VECTOR
        kgt = F.pad(kg.transpose(2, 3) * scale, (0, pad)).contiguous()  # (B, K, D, Gp)
        if layout.global_key_mask is not None:
            gmask = _last_contiguous(layout.global_key_mask)
    out = query.new_empty(batch, n * b, heads, d)
    kernels = torch.ops.swapformer_sparse_native
    band_mask = _last_contiguous(layout.mask)
    kernels.band_attention(q, kt, values, band_mask, layout.band_start - lo, kgt, vg, gmask, scale, out)
    out = out[:, layout.front : layout.front + t] if layout.front or back else out
    out = out.contiguous()
    if layout.global_rows is not None:
        q_rows = _last_contiguous(query_rows(query, layout))  # (B, H, R, D)
        rows_out = query.new_empty(batch, q_rows.shape[2], heads, d)
        rows_mask = empty if layout.global_mask is None else _last_contiguous(layout.global_mask)
        kernels.global_rows(q_rows, kt, values, rows_mask, scale, rows_out)
        out = put_rows(out, layout, rows_out)
    return out
