"""BigBird's random key blocks (https://arxiv.org/abs/2007.14062): the seeded draw, its tables per
sequence length, and the pattern fields of a `bigbird_attention` layer (`random_blocks`, called by
plan.py for those layers only). The predicate that reads them is `AttentionPattern.random_blocks`
(masks.py).

Shape legend: B batch, T new tokens, N blocks.
"""

from __future__ import annotations

import random

import torch

from ..attention.packing import PackedSequences
from ..caches.cache import KeyGeometry
from ..core.inputs import Positions, new_columns


def random_block_table(
    seed: int, n_query_blocks: int, n_key_blocks: int, per_block: int, causal: bool, device=None
) -> torch.Tensor:
    """BigBird's random key blocks: (n_query_blocks, n_key_blocks) bool.

    Query block j draws min(`per_block`, choices) distinct key blocks from the choices 0..j when
    causal, 0..n_key_blocks-1 otherwise, as `random.Random(seed * 1_000_003 + j * 8_191 + (0 if causal
    else n_key_blocks)).sample(choices, ...)`: the same layout in every process and on every backend,
    and a block's draw does not change as a causal sequence grows.
    """
    table = torch.zeros(n_query_blocks, n_key_blocks, dtype=torch.bool)
    for j in range(n_query_blocks):
        choices = range(min(j + 1, n_key_blocks)) if causal else range(n_key_blocks)
        rng = random.Random(seed * 1_000_003 + j * 8_191 + (0 if causal else n_key_blocks))
        picked = rng.sample(list(choices), min(per_block, len(choices)))
        table[j, picked] = True
    return table.to(device)


def random_layouts(
    seed: int,
    lengths: torch.Tensor,
    n_blocks: int,
    block_size: int,
    per_block: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BigBird's random blocks of queries whose sequences hold `lengths` (B, T) real tokens, each in the
    layout its sequence has alone (blocks counted from the sequence's first real token).

    Bidirectional: a sequence of n = ceil(length / b) blocks draws `random_block_table(seed, n, n, ...)`;
    causal: one table of `n_blocks` serves every length (a query block's draw does not depend on it).
    Which lengths occur is data, so while compiling or exporting the bidirectional tables cover every n
    in 1..`n_blocks` instead of those present (no data-dependent shape or branch).
    Returns the layouts, zero-padded to the longest, (layouts, N, N) bool, and each query's (B, T)
    index into them.
    """
    device = lengths.device
    if causal:
        return _layout_tables(seed, (n_blocks,), per_block, True).to(device), torch.zeros_like(lengths)
    blocks = ((lengths + block_size - 1) // block_size).clamp(1, n_blocks)
    if torch.compiler.is_compiling():  # exporting too
        sizes = tuple(range(1, n_blocks + 1))
        index = blocks - 1
    else:
        sizes = tuple(sorted(set(blocks.unique().tolist())))
        index = torch.searchsorted(torch.tensor(sizes, device=device), blocks)
    return _layout_tables(seed, sizes, per_block, False).to(device), index


@torch.compiler.assume_constant_result  # plain Python draws from ints: a constant of a traced graph
def _layout_tables(seed: int, sizes: tuple[int, ...], per_block: int, causal: bool) -> torch.Tensor:
    """`random_block_table(seed, n, n, ...)` for each n of `sizes`, zero-padded to the longest:
    (len(sizes), N, N) bool."""
    longest = max(sizes)
    tables = torch.zeros(len(sizes), longest, longest, dtype=torch.bool)
    for i, n in enumerate(sizes):
        tables[i, :n, :n] = random_block_table(seed, n, n, per_block, causal)
    return tables


def random_blocks(config, causal: bool, pos: Positions, keys: KeyGeometry) -> dict:
    """BigBird's random blocks (`random_table`, `random_index`, `random_start` of a pattern): every
    query's blocks are counted from the first real token of its sequence (its row's, or its packed
    sequence's), in the layout that sequence has alone, so padding and the rest of the batch change
    nothing (docs/architecture.md, decision 7). A row holds one sequence unless packed: its start and
    real length come from the padding mask over all P + T tokens, cached ones included, so a
    left-padded prompt keeps its start while it grows."""
    bs, total, t = config.attention_block_size, pos.total, pos.length
    if pos.packing is not None:
        starts, lengths = pos.packing.starts, pos.packing.lengths
    elif pos.key_valid is not None:
        alone = PackedSequences.from_starts(torch.zeros_like(pos.key_valid), pos.key_valid)
        starts, lengths = new_columns(alone.starts, pos.past, t), new_columns(alone.lengths, pos.past, t)
    else:
        starts = torch.zeros(pos.batch, t, dtype=torch.long, device=pos.device)
        lengths = starts + total
    # A tensor count (static cache, compiled) sizes the tables by the cache's slots instead: rows
    # past the tokens are never read.
    seen = total if isinstance(total, int) else pos.span
    n_blocks = -(-max(seen, keys.offset + keys.length) // bs)
    table, index = random_layouts(config.random_seed, lengths, n_blocks, bs, config.num_random_blocks, causal)
    return dict(random_table=table, random_index=index, random_start=starts)
