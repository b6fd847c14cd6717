"""Token shards on disk: each split of a run tokenized once, in parallel, into a memory-mapped array.

A split's rows (doc_table.split_rows) are tokenized by `Dataset.map(batched=True, num_proc=...)`, chunk by
chunk, and each chunk's ids (each document followed by `</s>`) are appended to `tokens.bin` (uint16 when
the vocabulary fits, else uint32) under a folder named by (documents, rows, limits, tokenizer): a second
run with the same data and tokenizer finds the folder and calls no tokenizer (`token_shard`). The blocks a
run reads are a view of that file (`TokenBlocks`): only the rows asked for are read, so memory does not
grow with the corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import time
from dataclasses import dataclass

import numpy as np
import torch

from .doc_table import FORMAT, _digest, datasets_bars_off, read_texts, text_spans

CHUNK_CHARS = 20_000_000  # characters per Dataset.map call (one progress-bar update): bounds its memory
HASH_TOKENS = 1 << 22  # tokens hashed at a time by `fingerprint`


def cache_dir(given: str | None) -> pathlib.Path:
    """--cache-dir, else `$SWAPFORMER_CACHE_DIR/tokens` (swapformer's one cache folder, which also holds
    attn_implementation="auto"'s measurements), else beside `datasets`' own cache (HF_DATASETS_CACHE)."""
    if given:
        return pathlib.Path(given)
    if os.environ.get("SWAPFORMER_CACHE_DIR"):
        return pathlib.Path(os.environ["SWAPFORMER_CACHE_DIR"]) / "tokens"
    import datasets.config

    return pathlib.Path(datasets.config.HF_DATASETS_CACHE) / "swapformer-tokens"


def _encode(batch: dict, tokenizer, eos: int, files: list[str]) -> dict:
    """Token ids (each document followed by `eos`) of a batch of spans, each text cut at its limit (-1: none)."""
    spans = np.stack([batch["file"], batch["start"], batch["end"]], axis=1)
    texts = [t if n < 0 else t[:n] for t, n in zip(read_texts(files, spans), batch["limit"])]
    return {"input_ids": [ids + [eos] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]}


def tokenizer_key(tokenizer) -> str:
    return _digest(tokenizer.backend_tokenizer.to_str(), tokenizer.eos_token_id, len(tokenizer))


@dataclass
class Shard:
    """A split's tokens on disk: `tokens.bin` and what meta.json says of it."""

    folder: pathlib.Path
    meta: dict

    def blocks(self, seq_len: int) -> TokenBlocks:
        return TokenBlocks(self.folder / "tokens.bin", self.meta["dtype"], self.meta["tokens"], seq_len)


def token_shard(
    table, table_key: str, rows, limits, tokenizer, cache: pathlib.Path, *, num_proc, bar
) -> Shard:
    """The tokens of one split, from the cache when a folder for the same documents, rows, limits and
    tokenizer exists, else tokenized now under the progress bar `bar()` makes (written to a folder of this
    process, renamed into place when complete, so a kill mid-way leaves nothing a later run would read)."""
    key = _digest(
        FORMAT,
        table_key,
        rows.tobytes(),
        None if limits is None else limits.tobytes(),
        tokenizer_key(tokenizer),
    )
    final = cache / "tokens" / key
    if (final / "meta.json").is_file():
        return Shard(final, json.loads((final / "meta.json").read_text()))
    tmp = final.with_name(f"{key}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dtype = "uint16" if len(tokenizer) <= 1 << 16 else "uint32"
    with bar() as shown:
        count = _write_tokens(table, rows, limits, tokenizer, tmp, dtype, num_proc, shown)
    meta = {"format": FORMAT, "dtype": dtype, "tokens": count, "documents": len(rows), "fingerprints": {}}
    (tmp / "meta.json").write_text(json.dumps(meta))
    if (final / "meta.json").is_file():  # another process finished the same shard first
        shutil.rmtree(tmp)
    else:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    return Shard(final, json.loads((final / "meta.json").read_text()))


def _chunks(table, rows: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of runs of `rows` holding about CHUNK_CHARS characters each (at least one row)."""
    ends = np.cumsum(table.data.column("chars").to_numpy()[rows])
    bounds = [0]
    while bounds[-1] < len(rows):
        done = ends[bounds[-1] - 1] if bounds[-1] else 0
        bounds.append(max(bounds[-1] + 1, int(np.searchsorted(ends, done + CHUNK_CHARS, side="right"))))
    return list(zip(bounds[:-1], bounds[1:]))


def _write_tokens(table, rows, limits, tokenizer, folder: pathlib.Path, dtype, num_proc, bar) -> int:
    """Tokenize `rows` chunk by chunk with Dataset.map, appending each chunk's ids to tokens.bin. The map
    runs over an in-memory table of byte spans; each worker reads its texts from the files (text_spans)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets import Dataset

    files, spans = text_spans(table) if len(rows) else ([], None)
    count, start_time = 0, time.perf_counter()
    with open(folder / "tokens.bin", "wb") as out, datasets_bars_off():
        for start, end in _chunks(table, rows):
            picked = spans[rows[start:end]]
            cut = np.full(end - start, -1, dtype=np.int64) if limits is None else limits[start:end]
            part = Dataset.from_dict(
                {"file": picked[:, 0], "start": picked[:, 1], "end": picked[:, 2], "limit": cut}
            )
            encoded = part.map(
                _encode,
                batched=True,
                batch_size=64,
                writer_batch_size=64,  # rows held as Python lists before a write: bounds a worker's memory
                remove_columns=part.column_names,
                fn_kwargs=dict(tokenizer=tokenizer, eos=tokenizer.eos_token_id, files=files),
                num_proc=min(num_proc, len(part)) if num_proc > 1 else None,
                cache_file_name=str(folder / "chunk.arrow"),
                load_from_cache_file=False,
            )
            for batch in encoded.with_format("arrow").iter(batch_size=1000):
                ids = pc.list_flatten(batch.column("input_ids")).to_numpy().astype(dtype)
                out.write(ids.tobytes())
                count += len(ids)
            del encoded, part
            pa.default_memory_pool().release_unused()  # what pyarrow's pool kept from this chunk
            for spent in folder.glob("chunk*.arrow"):
                spent.unlink()
            bar.update(end - start)
            bar.set_postfix(tok_s=f"{count / max(time.perf_counter() - start_time, 1e-9):,.0f}")
    return count


def fingerprint(shard: Shard, seq_len: int) -> str:
    """A short hash of the training blocks, the int64 bytes data.fingerprint hashed (so checkpoints made
    before the shards still resume); computed once per block length and kept in meta.json."""
    saved = shard.meta["fingerprints"].get(str(seq_len))
    if saved:
        return saved
    h, blocks = hashlib.sha1(), shard.blocks(seq_len)
    step = max(1, HASH_TOKENS // seq_len)
    for start in range(0, len(blocks), step):
        h.update(blocks[start : start + step].numpy().tobytes())
    shard.meta["fingerprints"][str(seq_len)] = h.hexdigest()[:16]
    with contextlib.suppress(OSError):  # a read-only cache still works; the hash is recomputed next time
        (shard.folder / "meta.json").write_text(json.dumps(shard.meta))
    return shard.meta["fingerprints"][str(seq_len)]


class TokenBlocks:
    """(N, seq_len) token blocks of a token file: indexing maps the file, reads only the rows asked for
    (int64 ids, as a tensor of blocks would hold) and unmaps it, so pages read for one batch do not stay in
    the resident set (nanoGPT maps its token file afresh per batch for the same reason)."""

    def __init__(self, path: pathlib.Path, dtype: str, tokens: int, seq_len: int):
        self.path, self.dtype = path, dtype
        self.shape = (tokens // seq_len, seq_len)

    def __len__(self) -> int:
        return self.shape[0]

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def memmap(self) -> np.ndarray:
        """The (N, seq_len) blocks as a read-only view of the file."""
        if not self.numel():
            return np.zeros(self.shape, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        return torch.from_numpy(np.asarray(self.memmap()[index], dtype=np.int64))
