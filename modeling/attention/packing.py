"""Packed (padding-free) sequences: several sequences in one row, kept apart on every backend.

Shape legend: B batch, T tokens per row.

transformers marks packed sequences three ways, all produced by `DataCollatorWithFlattening`:
`position_ids` that do not grow by exactly 1 from one token to the next (a new sequence starts there,
as `masking_utils.find_packed_sequence_indices` reads them), the flash-attention boundaries
`cu_seq_lens_q/k` (cumulative lengths over the flattened batch) with `max_length_q/k`, and `seq_idx`
(the sequence number of each token). Any of them may come alone; when several come they must agree.
With a padding mask, only real tokens count: a sequence starts at a real token whose position is not
the previous real token's plus one, so the left-padded `position_ids` generate() makes (1 at
padding) are one sequence, as they should be.

The result is a `PackedSequences` value (per token: its sequence's number, first real token and
real length) that is found once per forward (inputs.py) and put into every attention pattern
(masks.py), so every backend keeps the sequences apart by construction. A cache cannot continue packed
rows (which sequence would a new token extend?): packing needs an empty cache, and a cache filled from
packed rows refuses to be extended (cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedSequences:
    """Which packed sequence each token of a (B, T) batch belongs to.

    Attributes:
        ids: (B, T) sequence number within the row: 0, 0, 1, 1, 1, 2, ... (padding before a row's
            first sequence belongs to it, padding after a sequence to that sequence).
        starts: (B, T) index of the first real token of the token's sequence.
        lengths: (B, T) real tokens in the token's sequence.
    """

    ids: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def from_starts(cls, flags: torch.Tensor, valid: torch.Tensor) -> PackedSequences:
        """From (B, T) bool flags of the tokens that start a sequence (a row start always does) and the
        padding mask `valid` (B, T): a sequence run alone has neither the padding nor its neighbours,
        so its start and length count its real tokens only."""
        flags = flags.clone()
        flags[:, 0] = True
        ids = flags.long().cumsum(dim=1) - 1
        b, t = ids.shape
        index = torch.arange(t, device=ids.device).expand(b, t)
        # one slot per possible sequence (at most t): no size read from the data
        first = torch.full((b, t), t - 1, dtype=torch.long, device=ids.device)
        first.scatter_reduce_(1, ids, torch.where(valid, index, t - 1), reduce="amin")
        length = torch.zeros(b, t, dtype=torch.long, device=ids.device).scatter_add_(1, ids, valid.long())
        return cls(ids=ids, starts=torch.gather(first, 1, ids), lengths=torch.gather(length, 1, ids))

    def counts(self) -> torch.Tensor:
        """(B,) number of sequences in each row."""
        return self.ids[:, -1] + 1

    def positions(self, key_valid: torch.Tensor | None) -> torch.Tensor:
        """(B, T) position of each token within its sequence, counted over real tokens."""
        if key_valid is None:
            return torch.arange(self.ids.shape[1], device=self.ids.device) - self.starts
        real = key_valid.long().cumsum(dim=1)  # real tokens up to and including each index
        before = torch.gather(real - key_valid.long(), 1, self.starts)  # real tokens before the sequence
        return (real - before - 1).clamp(min=0)

    def flash_boundaries(self) -> tuple[torch.Tensor, int]:
        """(cu_seq_lens, max_length) over the flattened batch, as flash-attention's varlen kernels take
        them: int32 (number of sequences + 1,) cumulative lengths, and the longest sequence."""
        b, t = self.ids.shape
        first = torch.ones(b, t, dtype=torch.bool, device=self.ids.device)
        first[:, 1:] = self.ids[:, 1:] != self.ids[:, :-1]
        starts = first.reshape(-1).nonzero().view(-1)
        cu = torch.cat([starts, starts.new_full((1,), b * t)]).to(torch.int32)
        return cu, int(cu.diff().max())


def _previous_real(key_valid: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the last real token before each index, -1 where there is none."""
    index = torch.arange(key_valid.shape[1], device=key_valid.device).expand_as(key_valid)
    last = torch.where(key_valid, index, torch.full_like(index, -1)).cummax(dim=1).values
    return torch.cat([last.new_full((last.shape[0], 1), -1), last[:, :-1]], dim=1)


def _starts_from_positions(position_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Real tokens whose position is not the previous real token's position plus one."""
    prev = _previous_real(valid)
    prev_pos = torch.gather(position_ids, 1, prev.clamp(min=0))
    return valid & (prev >= 0) & (position_ids != prev_pos + 1)


def _starts_from_cu_seq_lens(cu, name: str, batch: int, length: int, device) -> torch.Tensor:
    """(B, T) flags of the sequence starts `cu` (cumulative lengths over the flattened batch) marks."""
    cu = torch.as_tensor(cu, device=device).reshape(-1).long()
    total = batch * length
    values = cu.tolist()
    if len(values) < 2 or values[0] != 0 or values[-1] != total:
        raise ValueError(
            f"{name}={values} must run from 0 to the number of tokens of the flattened batch, {batch} x {length} = "
            f"{total} (as DataCollatorWithFlattening makes it)"
        )
    if any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name}={values} must increase strictly (every sequence holds at least one token)")
    straddling = sorted(set(range(length, total, length)) - set(values))
    if straddling:
        raise ValueError(
            f"{name}={values} has a sequence running across the end of a row (no boundary at token "
            f"{straddling[0]} of the flattened batch, rows of {length}); a sequence must lie within one row"
        )
    flags = torch.zeros(total, dtype=torch.bool, device=device)
    flags[cu[:-1]] = True
    return flags.view(batch, length)


def _starts_from_cu_pair(cu_q, cu_k, max_q, max_k, batch: int, length: int, device) -> torch.Tensor:
    """The sequence starts that `cu_seq_lens_q` and `cu_seq_lens_k` (equal in self-attention) mark."""
    if cu_q is None or cu_k is None:
        given = "cu_seq_lens_q" if cu_k is None else "cu_seq_lens_k"
        raise ValueError(f"{given} was given alone; pass cu_seq_lens_q and cu_seq_lens_k together")
    q = torch.as_tensor(cu_q).reshape(-1).tolist()
    k = torch.as_tensor(cu_k).reshape(-1).tolist()
    if q != k:
        raise ValueError(
            f"cu_seq_lens_q={q} and cu_seq_lens_k={k} differ; in self-attention without a cache every "
            "sequence is its own keys, so they must be equal"
        )
    _check_max_length(max_q, "max_length_q", "cu_seq_lens_q", cu_q)
    _check_max_length(max_k, "max_length_k", "cu_seq_lens_k", cu_k)
    return _starts_from_cu_seq_lens(cu_q, "cu_seq_lens_q", batch, length, device)


def _starts_from_seq_idx(seq_idx: torch.Tensor, batch: int, length: int, device) -> torch.Tensor:
    """Tokens whose sequence number differs from the previous token's."""
    if seq_idx.dim() != 2 or seq_idx.shape[-1] != length or seq_idx.shape[0] not in (1, batch):
        raise ValueError(
            f"seq_idx has shape {tuple(seq_idx.shape)}; it needs (batch={batch}, length={length}): the "
            "sequence number of every token"
        )
    ids = seq_idx.to(device).expand(batch, length)
    flags = torch.zeros(batch, length, dtype=torch.bool, device=device)
    flags[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return flags


def _check_max_length(value, name: str, cu_name: str, cu) -> None:
    if value is None:
        return
    if cu is None:
        raise ValueError(f"{name}={value} was given without {cu_name}; pass both (or neither)")
    longest = int(torch.as_tensor(cu).reshape(-1).long().diff().max())
    if int(value) != longest:
        raise ValueError(f"{name}={int(value)} but the longest sequence of {cu_name} has {longest} tokens")


def _boundaries(flags: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Real tokens in another sequence than the real token before them: how two sources are compared
    (where padding sits between sequences is not a disagreement)."""
    ids = flags.long().cumsum(dim=1)
    prev = _previous_real(valid)
    return valid & (prev >= 0) & (ids != torch.gather(ids, 1, prev.clamp(min=0)))


def _agreed_boundaries(sources: dict[str, torch.Tensor], valid: torch.Tensor, prefix: str) -> torch.Tensor:
    """The boundaries (`_boundaries`) every source marks; they must agree."""
    names = list(sources)
    reference = _boundaries(sources[names[0]], valid)
    for name in names[1:]:
        other = _boundaries(sources[name], valid)
        if not torch.equal(reference, other):
            raise ValueError(
                f"{prefix}{names[0]} and {prefix}{name} mark different sequence boundaries (first difference at "
                f"{_first_disagreement(reference, other)}); pass boundaries that agree (DataCollatorWithFlattening "
                "makes them so) or only one of them"
            )
    return reference


def _first_disagreement(a: torch.Tensor, b: torch.Tensor) -> str:
    row, col = (a != b).nonzero()[0].tolist()
    return f"row {row}, token {col}"


def find_packed_sequences(
    *,
    batch: int,
    length: int,
    device,
    key_valid: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q=None,
    cu_seq_lens_k=None,
    max_length_q=None,
    max_length_k=None,
    seq_idx: torch.Tensor | None = None,
    past: int = 0,
    prefix: str = "",
) -> PackedSequences | None:
    """The packed sequences of a batch of `batch` rows of `length` new tokens, or None when every row
    holds one sequence. `key_valid` is the padding mask of the new tokens, `position_ids` (B or 1, T).

    Raises:
        ValueError: the sources disagree, are malformed, or mark packed rows while `past` tokens are cached.
    """
    if cu_seq_lens_q is None and cu_seq_lens_k is None:
        _check_max_length(max_length_q, "max_length_q", "cu_seq_lens_q", None)
        _check_max_length(max_length_k, "max_length_k", "cu_seq_lens_k", None)
    if key_valid is not None:
        valid = key_valid.to(device).bool()
    else:
        valid = torch.ones(batch, length, dtype=torch.bool, device=device)
    sources = {}
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        sources["cu_seq_lens_q"] = _starts_from_cu_pair(
            cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, batch, length, device
        )
    if seq_idx is not None:
        sources["seq_idx"] = _starts_from_seq_idx(seq_idx, batch, length, device)
    if position_ids is not None and length > 1:
        positions = position_ids.to(device).view(-1, length).expand(batch, length)
        sources["position_ids"] = _starts_from_positions(positions, valid)
    if not sources:
        return None
    names = list(sources)
    reference = _agreed_boundaries(sources, valid, prefix)
    # Under torch.compile the test below would break the graph: as transformers does while tracing,
    # rows with position_ids count as packed (one sequence is a packing too), and a cache as not.
    tracing = torch.compiler.is_compiling()
    if not tracing and not bool(reference.any()):
        return None
    cached = not isinstance(past, int) or past > 0  # a 0-d tensor: a static cache counting under compile
    if cached and tracing:
        return None
    if cached:
        raise ValueError(
            f"{prefix}{names[0]} put several sequences into one row (packed rows), but the cache already holds "
            f"{past} tokens and packed rows cannot extend a cache; pass packed rows without a cache (or with an "
            "empty one), or pad the sequences into separate rows for cached decoding"
        )
    return PackedSequences.from_starts(sources[names[0]], valid)


def check_cross_packing(queries: PackedSequences | None, keys: PackedSequences | None, batch: int) -> None:
    """Cross-attention pairs the n-th decoder sequence of a row with the n-th encoder sequence, so
    every row needs as many of each (a side that is not packed holds one per row)."""
    if queries is None and keys is None:
        return
    ones = [1] * batch
    q = queries.counts().tolist() if queries is not None else ones
    k = keys.counts().tolist() if keys is not None else ones
    if q != k:
        raise ValueError(
            f"Rows hold {q} decoder sequences but {k} encoder sequences (packed rows); cross-attention pairs the "
            "n-th decoder sequence of a row with its n-th encoder sequence, so pack both sides alike "
            "(position_ids and decoder_position_ids restarting per sequence) or neither"
        )


def packing_kwargs(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k, seq_idx) -> dict:
    """The packing arguments of a model forward, as passed down to the stack."""
    return dict(
        cu_seq_lens_q=cu_seq_lens_q,
        cu_seq_lens_k=cu_seq_lens_k,
        max_length_q=max_length_q,
        max_length_k=max_length_k,
        seq_idx=seq_idx,
    )
