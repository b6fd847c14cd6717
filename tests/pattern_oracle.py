"""An independent oracle for the attention patterns: may query q attend key k?

Written from the definitions only (the `layer_types` ... `random_seed` entries of the config docstring
in configuration/configuration_base.py, the module docstring of modeling/attention/masks.py, docs/architecture.md
items 3, 7 and 15), in plain Python over one batch row at a time, with no import from `modeling/`: the
backends all evaluate the same predicate (masks.AttentionPattern.allowed), so checking them against
each other cannot find a mistake in that predicate; checking them against this can. Readability over
speed: sizes in the tests are tiny.

Indices are absolute: with P tokens cached, the queries of a step are P, ..., P + T - 1 and the keys
0, ..., P + T - 1 (whatever a cache keeps, the oracle says which of all keys a query may see).

The rules, in the order they are checked:

1. padding   a key that is padding (attention_mask 0) is never attended.
2. causal    (decoders) a key after the query is never attended: k <= q.
3. packing   in packed rows (position_ids restarting at 0 inside a row) a query sees only keys of its
             own sequence.
4. structure the layer's pattern:
             full            every key
             sliding         window(q, k)
             sliding_global  window(q, k) or global(k) or global(q)
             bigbird         window(q, k) or global(k) or global(q) or random_block(q, k)
   window(q, k):  0 <= q - k < w (causal), |q - k| < w (bidirectional), w = `sliding_window`.
   global(i):     token i is real and either its position (counted over the real tokens of its
                  sequence, from 0) is < `global_tokens`, or `global_attention_mask` marks it.
   random_block:  ((q - s) // b, (k - s) // b) is a pair of `random_block_table`, counted from the first
                  real token s of q's sequence, in the layout that sequence has alone: see
                  `RowLayout.random_origin` and `in_random_block`.

Outputs at padding queries are not specified (they reach no real token), so `allowed_rows` gives
None for them and the tests compare real queries only.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class PatternSpec:
    """One attention layer's pattern, as the config gives it."""

    kind: str  # "full", "sliding", "sliding_global" or "bigbird"
    causal: bool
    window: int | None = None  # sliding_window
    global_tokens: int = 0
    block_size: int = 64  # attention_block_size
    num_random_blocks: int = 0
    random_seed: int = 0

    def config_options(self) -> dict:
        """The config fields this pattern's sizes come from (the same for every layer type)."""
        return dict(
            sliding_window=self.window, global_tokens=self.global_tokens, attention_block_size=self.block_size,
            num_random_blocks=self.num_random_blocks, random_seed=self.random_seed,
        )  # fmt: skip


KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "sliding_global_attention": "sliding_global",
    "bigbird_attention": "bigbird",
}


@dataclass(frozen=True)
class RowLayout:
    """One batch row of P + T tokens.

    real:       per token, False for padding (attention_mask 0).
    sequence:   per token, the number of its packed sequence (all 0 for a row holding one sequence);
                a padding token may carry any number, it is never attended.
    marked:     per token, True where `global_attention_mask` is 1.
    packed:     whether the batch is packed (some row holds several sequences); it changes no rule
                (every sequence, packed or not, counts its random blocks alone, see `random_origin`).
    """

    real: tuple[bool, ...]
    sequence: tuple[int, ...]
    marked: tuple[bool, ...]
    packed: bool = False

    def __len__(self) -> int:
        return len(self.real)

    def same_sequence_real_tokens(self, i: int) -> list[int]:
        """The real tokens of token i's sequence, in order."""
        return [j for j in range(len(self)) if self.real[j] and self.sequence[j] == self.sequence[i]]

    def position(self, i: int) -> int:
        """Position of real token i in its sequence, counted over real tokens from 0."""
        return self.same_sequence_real_tokens(i).index(i)

    def random_origin(self, i: int) -> tuple[int, int]:
        """(first index, length) of the token range whose blocks BigBird counts for token i's sequence.

        masks.py: random blocks are counted from the first real token of the query's sequence (its row's,
        or its packed sequence's), "the layout the sequence has alone, whatever padding surrounds it":
        start = its first real token, length = its real tokens (cached ones included).
        """
        tokens = self.same_sequence_real_tokens(i)
        return tokens[0], len(tokens)


@functools.cache  # the same small tables are asked for once per (query, key) pair
def random_block_table(seed: int, n_query_blocks: int, n_key_blocks: int, per_block: int, causal: bool):
    """BigBird's random key blocks as a set of (query block, key block) pairs.

    The documented draw: query block j draws `per_block` distinct key blocks (all of them if there are
    fewer) from blocks 0..j when causal, 0..n_key_blocks-1 otherwise, with
    `random.Random(seed * 1_000_003 + j * 8_191 + (0 if causal else n_key_blocks)).sample(choices, r)`.
    """
    pairs = set()
    for j in range(n_query_blocks):
        choices = list(range(min(j + 1, n_key_blocks))) if causal else list(range(n_key_blocks))
        rng = random.Random(seed * 1_000_003 + j * 8_191 + (0 if causal else n_key_blocks))
        for key_block in rng.sample(choices, min(per_block, len(choices))):
            pairs.add((j, key_block))
    return frozenset(pairs)


def in_window(spec: PatternSpec, q: int, k: int) -> bool:
    if spec.causal:
        return 0 <= q - k < spec.window
    return abs(q - k) < spec.window


def is_global(spec: PatternSpec, row: RowLayout, i: int) -> bool:
    if not row.real[i]:
        return False
    return row.position(i) < spec.global_tokens or row.marked[i]


def in_random_block(spec: PatternSpec, row: RowLayout, q: int, k: int) -> bool:
    """Bidirectional: the table of the sequence's n = ceil(length / b) blocks. Causal: query block j's
    draw does not depend on the length, so the smallest table holding row j (n = j + 1) says it."""
    start, length = row.random_origin(q)
    query_block = (q - start) // spec.block_size
    n_blocks = query_block + 1 if spec.causal else math.ceil(length / spec.block_size)
    table = random_block_table(spec.random_seed, n_blocks, n_blocks, spec.num_random_blocks, spec.causal)
    return ((q - start) // spec.block_size, (k - start) // spec.block_size) in table


def may_attend(spec: PatternSpec, row: RowLayout, q: int, k: int) -> bool:
    """Whether query q may attend key k (absolute indices within `row`)."""
    if not row.real[k]:
        return False
    if spec.causal and k > q:
        return False
    if row.sequence[q] != row.sequence[k]:
        return False
    if spec.kind == "full":
        return True
    if in_window(spec, q, k):
        return True
    if spec.kind in ("sliding_global", "bigbird") and (is_global(spec, row, k) or is_global(spec, row, q)):
        return True
    return spec.kind == "bigbird" and in_random_block(spec, row, q, k)


def allowed_rows(spec: PatternSpec, row: RowLayout, past: int = 0) -> list[list[bool] | None]:
    """For the queries past, ..., len(row) - 1: the keys 0..len(row)-1 each may attend, or None for a
    padding query (unspecified)."""
    return [
        [may_attend(spec, row, q, k) for k in range(len(row))] if row.real[q] else None
        for q in range(past, len(row))
    ]
