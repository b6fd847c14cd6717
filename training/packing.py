"""Blocks from documents: `pack` (documents joined by `</s>`, cut into blocks of `seq_len`), and `--packing`'s
objective wrapper, which keeps the documents of a block apart. Shared by the token shards' path (data.py) and
the streaming path (streaming.py)."""

from __future__ import annotations

import numpy as np
import torch

from .corpus import Document


def pack(tokenizer, docs: list[Document], seq_len: int) -> torch.Tensor:
    """Token ids of the documents, each followed by `</s>`, cut into (N, seq_len) blocks."""
    if not docs:  # the tokenizer fails on an empty batch
        return torch.empty(0, seq_len, dtype=torch.long)
    encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    stream = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=np.int64)
    n = len(stream) // seq_len
    return torch.from_numpy(stream[: n * seq_len].copy()).view(n, seq_len)


def document_positions(blocks: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(N, T) position of each token within its document: 0 at the start of a block and after every
    `</s>` (a document ends with its `</s>`; one cut by a block boundary continues as a new sequence)."""
    starts = torch.zeros_like(blocks, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = blocks[:, :-1] == eos_id
    index = torch.arange(blocks.shape[1]).expand_as(blocks)
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


class DocumentPacking:
    """`--packing`: an objective whose batches keep documents apart. The blocks are the same, and so is
    everything drawn from the generator; the batch gains `position_ids` restarting at every document
    (what the models read as packed sequences), and a causal LM takes no loss on a document's first
    token (which would be predicted from the previous document, as DataCollatorWithFlattening's
    labels also leave out). A pure function of the blocks: batches stay a function of (seed, step)."""

    def __init__(self, objective, eos_id: int):
        self.objective = objective
        self.eos_id = eos_id
        self.shift = objective.shift

    def __call__(self, blocks: torch.Tensor, generator: torch.Generator) -> dict[str, torch.Tensor]:
        batch = self.objective(blocks, generator)
        positions = document_positions(blocks, self.eos_id)
        batch["position_ids"] = positions
        if self.shift:
            batch["labels"] = batch["labels"].masked_fill(positions == 0, -100)
        return batch

    def num_targets(self, batch: dict[str, torch.Tensor]) -> int:
        return self.objective.num_targets(batch)
