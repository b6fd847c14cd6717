"""Attention patterns: which keys each query may see, as predicates, lowered per backend.

A pattern is built once per forward for each attention kind (each self-attention layer type, and
cross-attention) and lowered once for the backend that runs it. Layers never build masks.

Predicates take broadcastable index tensors `(b, q, k)`: batch row, absolute query index and
absolute key index (a query of this step with P tokens cached has index P + i; a key at position j
of the key tensor handed to attention has index `key_offset + j`, which is nonzero when a
sliding-window cache dropped old keys; a window + global cache hands over its kept leading tokens
first: keys j < `key_prefix` have index j, the rest `key_offset + j - key_prefix`). They are plain
tensor expressions, so they evaluate densely (eager, sdpa), on gathered blocks (sparse) and under
vmap (flex's `mask_mod`), and every backend therefore computes the same function.

    allowed(q, k) = in_cache(k) & not_padding(k) & [k <= q if causal] & same_sequence(q, k) & structure(q, k)

    with a 4D attention_mask (the user's `custom(q, k)`, given instead of the padding mask; no packing):
    full layers      in_cache(k) & custom(q, k)      (the mask stands in for causality, as in LlamaModel)
    windowed kinds   in_cache(k) & custom(q, k) & [k <= q if causal] & structure(q, k)

    structure: full            True
               sliding         window(q, k)
               sliding_global  window(q, k) | global(k) | global(q)
               bigbird         window(q, k) | global(k) | global(q) | random_block(q, k)
    window:    0 <= q - k < w (causal), |q - k| < w (bidirectional), w = `sliding_window`
    global:    a real token whose position (counted over real tokens) is < `global_tokens`, or one
               `global_attention_mask` marks; padding is never global
    random_block: ((q - s) // b, (k - s) // b) is a pair of `bigbird.random_block_table(seed, n, n, ...)`,
               b = `attention_block_size`, s = the first real token of q's sequence (of its row, or
               for packed rows of its packed sequence; cached tokens included, so a left-padded
               row's s is its padding count at every decoding step): the layout the sequence has
               alone, whatever padding surrounds it and whatever else the batch holds.
               Bidirectional: n = ceil(L / b), L = the sequence's real tokens (cached ones included).
               Causal: query block j's draw does not depend on n (any n > j), so the layout of a
               growing sequence never changes. Blocks outside 0..n-1 hold no random keys
    same_sequence: True, or for packed rows (packing.py) the query's and the key's sequence numbers
               agree; global tokens are then the first tokens of each sequence
    custom:    the 4D mask at (row of q, k): True (bool) or 0 (float) where q may attend k. Windowed kinds
               keep their pattern because their caches and the sparse block layouts hold only the keys it
               reaches; a full layer's causality is the mask's to state (transformers uses a 4D mask as
               the whole mask), so a prefix-LM or any other mask runs as LlamaModel runs it

The mask each backend consumes is lowered from the pattern once per forward: eager's and sdpa's (the plain
path) in core/plan.py, the kernels' in lowering.py, which holds the table of all of them (`LOWERINGS`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .packing import PackedSequences, check_cross_packing

if TYPE_CHECKING:
    from ..core.inputs import Positions


@dataclass(frozen=True)
class KernelMask:
    """A lowered mask plus the keyword arguments its kernel takes beside it (flash-attention's varlen
    boundaries for packed rows); the attention layer passes `mask` as the mask and `kwargs` on."""

    mask: torch.Tensor | None
    kwargs: dict


@dataclass(frozen=True)
class AttentionPattern:
    """Everything needed to say whether query q may attend key k in one attention of one forward.
    Immutable: made whole by its constructor (plan.py makes the patterns of a forward).

    Attributes:
        kind: "full", "sliding", "sliding_global" or "bigbird".
        query_offset, query_length: absolute index of the first query, number of queries T.
        key_offset, key_length: absolute index of the first key in the key tensor, its length S.
        key_prefix: leading keys that are the first tokens (absolute 0..key_prefix-1), kept by a
            window + global cache ahead of the window; the key at `key_prefix` has index `key_offset`.
        total_length: tokens seen so far (P + T); key slots at or beyond it are empty cache rows.
        key_valid: (B, S) False for padding keys, or None.
        global_keys: (B, S) keys everyone attends; global_queries: (B, T) queries attending all.
        random_table: (layouts, N, N) bool, for bigbird (`bigbird.random_layouts`), with `random_index` (B, T)
            naming each query's layout and `random_start` (B, T) the absolute index of the first real
            token of its sequence, where its blocks are counted from.
        query_packing, key_packing: the packed sequences of the queries (B, T) and of the keys (B, S),
            or None; a query sees only keys of the sequence with its number. Only without a cache,
            so query and key indices are those of the packed tensors.
        bias_fn, query_pos, key_pos: additive position bias from positions (B, T) and (B, S);
            `bias_fn(q_pos, k_pos)` broadcasts and returns (..., H).
        custom_mask: (B, T, S) bool, the user's 4D attention_mask at the keys of the key tensor, or None;
            on full layers it replaces causality (see the module docstring).
    """

    kind: str
    causal: bool
    batch: int
    query_offset: int
    query_length: int
    key_offset: int
    key_length: int
    total_length: int
    device: torch.device
    key_valid: torch.Tensor | None = None
    key_prefix: int = 0
    window: int | None = None
    global_keys: torch.Tensor | None = None
    global_queries: torch.Tensor | None = None
    random_table: torch.Tensor | None = None
    block_size: int = 64
    bias_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    query_pos: torch.Tensor | None = None
    key_pos: torch.Tensor | None = None
    query_packing: PackedSequences | None = None
    key_packing: PackedSequences | None = None
    random_index: torch.Tensor | None = None
    random_start: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None

    # Predicates ---------------------------------------------------------------------------------

    def window_predicate(self, q, k):
        d = q - k
        return (d < self.window) if self.causal else (d.abs() < self.window)

    @staticmethod
    def keys_at(local, key_offset, key_prefix: int):
        """Absolute index of the keys at positions `local` of a key tensor whose first `key_prefix` keys
        are the first tokens and whose others start at index `key_offset`."""
        if not key_prefix:
            return local + key_offset
        return torch.where(local < key_prefix, local, local - key_prefix + key_offset)

    def key_index(self, local):
        """Absolute index of the keys at positions `local` of the key tensor."""
        return self.keys_at(local, self.key_offset, self.key_prefix)

    def key_indices(self) -> torch.Tensor:
        """(S,) absolute index of every key of the key tensor."""
        return self.key_index(torch.arange(self.key_length, device=self.device))

    def allowed(self, b, q, k) -> torch.Tensor:
        """The pattern at absolute indices; any broadcastable integer tensors."""
        if self.key_prefix:
            in_prefix = k < self.key_prefix
            local = torch.where(in_prefix, k, k - self.key_offset + self.key_prefix)
            ok = (in_prefix | ((k >= self.key_offset) & (local < self.key_length))) & (k < self.total_length)
        else:
            local = k - self.key_offset
            # a static window cache hands over empty slots before index 0 while compiled (cache.py)
            ok = (local >= 0) & (local < self.key_length) & (k >= 0) & (k < self.total_length)
        safe = local.clamp(0, self.key_length - 1)
        row = (q - self.query_offset).clamp(0, self.query_length - 1)
        if self.key_valid is not None:
            ok = ok & self.key_valid[b, safe]
        if self.custom_mask is not None:
            ok = ok & self.custom_mask[b, row, safe]
        if self.causal and (self.custom_mask is None or self.kind != "full"):
            ok = ok & (k <= q)
        if self.query_packing is not None:
            ok = ok & (self.query_packing.ids[b, row] == self.key_packing.ids[b, safe])
        if self.kind == "full":
            return ok
        structure = self.window_predicate(q, k)
        if self.global_keys is not None:
            structure = structure | self.global_keys[b, safe]
        if self.global_queries is not None:
            structure = structure | self.global_queries[b, row]
        if self.random_table is not None:
            structure = structure | self.random_blocks(b, row, q, k)
        return ok & structure

    def random_blocks(self, b, row, q, k):
        """BigBird's random blocks at absolute (q, k); `row` is q's local row. Blocks are counted from
        the first real token of q's sequence, in the layout of its sequence's length."""
        start, layout = self.random_start[b, row], self.random_index[b, row]
        n = self.random_table.shape[-1]
        qb, kb = (q - start) // self.block_size, (k - start) // self.block_size
        inside = (qb >= 0) & (qb < n) & (kb >= 0) & (kb < n)
        return inside & self.random_table[layout, qb.clamp(0, n - 1), kb.clamp(0, n - 1)]

    def mask_mod(self):
        """The predicate with flex attention's signature, on local query and key indices.

        The offsets and lengths go in as 0-d tensors: as Python ints they change every decoding step, so
        the compiled flex kernel was recompiled with them symbolic, which torch inductor's CPU flex
        template miscompiles (C++ errors, issue 10); as tensors the kernel reads them from memory."""
        fixed = {
            name: torch.as_tensor(getattr(self, name), device=self.device)
            for name in ("query_offset", "key_offset", "key_length", "total_length")
        }
        pattern = dataclasses.replace(self, **fixed)

        def mod(b, h, q_idx, kv_idx):
            return pattern.allowed(b, q_idx + pattern.query_offset, pattern.key_index(kv_idx))

        return mod

    # Dense forms --------------------------------------------------------------------------------

    def dense_allowed(self, rows: slice = slice(None)) -> torch.Tensor:
        """(B, 1, t, S) bool for the query rows `rows`."""
        q_local = torch.arange(self.query_length, device=self.device)[rows]
        b = torch.arange(self.batch, device=self.device)[:, None, None, None]
        q = (q_local + self.query_offset)[None, None, :, None]
        k = self.key_indices()[None, None, None, :]
        return self.allowed(b, q, k).expand(self.batch, 1, q.shape[2], self.key_length)

    def dense_bias(self, rows: slice = slice(None)) -> torch.Tensor | None:
        """(B, H, t, S) additive position bias for the query rows `rows`, or None."""
        if self.bias_fn is None:
            return None
        bias = self.bias_fn(self.query_pos[:, rows, None], self.key_pos[:, None, :])  # (B, t, S, H)
        return bias.permute(0, 3, 1, 2)

    def rows_additive(self, rows: torch.Tensor, dtype) -> torch.Tensor:
        """Additive mask (B, 1 or H, R, S) of the local query rows `rows` (B, R), one set per batch row."""
        b = torch.arange(self.batch, device=self.device)[:, None, None, None]
        q = (rows + self.query_offset)[:, None, :, None]
        k = self.key_indices()[None, None, None, :]
        allowed = self.allowed(b, q, k)  # (B, 1, R, S)
        neg_inf = torch.full((), float("-inf"), dtype=dtype, device=self.device)
        if self.bias_fn is None:
            return torch.where(allowed, torch.zeros((), dtype=dtype, device=self.device), neg_inf)
        q_pos = torch.gather(self.query_pos, 1, rows)[:, :, None]
        bias = self.bias_fn(q_pos, self.key_pos[:, None, :]).permute(0, 3, 1, 2)
        return torch.where(allowed, bias.to(dtype), neg_inf)

    def additive(self, dtype, rows: slice = slice(None)) -> torch.Tensor:
        """(B, 1 or H, t, S) additive float mask: bias where allowed, -inf elsewhere."""
        allowed = self.dense_allowed(rows)
        bias = self.dense_bias(rows)
        zero = torch.zeros((), dtype=dtype, device=self.device)
        neg_inf = torch.full((), float("-inf"), dtype=dtype, device=self.device)
        if bias is None:
            return torch.where(allowed, zero, neg_inf)
        return torch.where(allowed, bias.to(dtype), neg_inf)


# The pattern's inputs beyond the plain case (plan.py calls these only when a forward has them) ---------


def global_tokens(config, kind: str, pos: Positions, global_mask) -> torch.Tensor | None:
    """(B, S) tokens that attend to all and that all attend, for the kinds with global tokens: the first
    `global_tokens` real tokens of each row (or packed sequence) and those `global_mask` marks; never
    padding. None for the other kinds."""
    if kind not in ("sliding_global", "bigbird"):
        return None
    is_global = pos.keys < config.global_tokens
    if global_mask is not None:
        is_global = is_global | global_mask.bool()
    if pos.key_valid is not None:
        is_global = is_global & pos.key_valid
    return is_global


def cross_attention_pattern(pos: Positions, encoder_hidden_states, encoder_attention_mask, encoder_packing):
    """Every decoder query sees every real encoder token (of its own packed sequence, when packed)."""
    s_enc = encoder_hidden_states.shape[1]
    enc_valid = encoder_attention_mask.bool() if encoder_attention_mask is not None else None
    check_cross_packing(pos.packing, encoder_packing, pos.batch)
    packed = pos.packing is not None
    return AttentionPattern(
        kind="full",
        causal=False,
        batch=pos.batch,
        query_offset=pos.past,
        query_length=pos.length,
        key_offset=0,
        key_length=s_enc,
        total_length=s_enc,
        device=pos.device,
        key_valid=enc_valid if enc_valid is not None and is_padded(enc_valid, s_enc) else None,
        query_packing=pos.packing if packed else None,
        key_packing=encoder_packing if packed else None,
    )


def is_padded(valid: torch.Tensor, total, key_index: torch.Tensor | None = None) -> bool:
    """Whether the keys `valid` (B, S) at absolute indices `key_index` (default 0..S-1) hold padding
    below `total`.
    While compiling (or with a tensor count) the answer would be data-dependent: always True there,
    i.e. the mask is applied even when it masks nothing, as transformers' mask builders do."""
    if torch.compiler.is_compiling() or not isinstance(total, int):
        return True
    return not bool((valid if key_index is None else valid[:, key_index < total]).all())
