"""Training speed with packed documents against padded rows, side by side in one process.

    python benchmarks/packing_speed.py                    # swapformer train's defaults (tiny preset)
    python benchmarks/packing_speed.py --max-train-chars 200000 --steps 2 --rounds 1   # a smoke run

Both sides train the same model (the `tiny` preset decoder) on the same documents (the training split
of `swapformer train`'s default corpus, the Python standard library, with its character budget), with
the same rows of `--seq-len` tokens and the same batch size:

- packed (`swapformer train --packing`): the documents joined by `</s>` and cut into rows of
  `--seq-len`, every token real, position ids restarting at each document;
- padded: each document alone, cut into rows of at most `--seq-len`, the last one padded (attention
  mask 0, no loss there): one document per row, the usual way without packing.

The standard library's files are long (most fill many rows, so padding is only the tail of each);
a second table cuts every document to its first `--doc-chars` characters (default 400), the shape of
corpora of short samples, where padded rows are mostly padding.

A step is forward, backward and AdamW on one batch. The two sides run in turn for several rounds and
each keeps its best round. Real tokens/s counts only non-padding tokens; the time for one pass over the
corpus follows from it. CPU model and load are printed: on a busy machine the ratio is what to read.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from swapformer.modeling.cpu.route_choice import cpu_info
from swapformer.training import data as data_mod
from swapformer.training.args import TrainArgs
from swapformer.training.model import build_model, model_options
from swapformer.training.objectives import CausalLM
from swapformer.training.step import make_optimizer
from swapformer.training.tokenizer import train_tokenizer


def cpu_model() -> str:
    return cpu_info("model name") or platform.processor() or platform.machine()


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def padded_rows(tokenizer, docs, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each document (with its `</s>`) cut into rows of at most `seq_len` tokens, right-padded."""
    encoded = tokenizer([d.text for d in docs], add_special_tokens=False)["input_ids"]
    rows = []
    for ids in encoded:
        ids = [*ids, tokenizer.eos_token_id]
        rows += [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)]
    tokens = torch.full((len(rows), seq_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return tokens, mask


def batches(args, tokenizer, docs):
    """The first `--steps` batches of each side, the rows each needs for all of `docs`, and the real
    tokens of those rows."""
    train_args = TrainArgs(seq_len=args.seq_len)
    packed = data_mod.DocumentPacking(CausalLM(tokenizer, train_args), tokenizer.eos_token_id)
    blocks = data_mod.pack(tokenizer, docs, args.seq_len)
    tokens, mask = padded_rows(tokenizer, docs, args.seq_len)
    b = args.batch_size
    sides = {
        "packed": [packed(blocks[i : i + b], torch.Generator()) for i in range(0, b * args.steps, b)],
        "padded": [
            {
                "input_ids": tokens[i : i + b],
                "attention_mask": mask[i : i + b],
                "labels": tokens[i : i + b].masked_fill(mask[i : i + b] == 0, -100),
            }
            for i in range(0, b * args.steps, b)
        ],
    }
    rows = {"packed": len(blocks), "padded": len(tokens)}
    real = {"packed": blocks.numel(), "padded": int(mask.sum())}
    return sides, rows, real


def measure(args, tokenizer, docs, model, optimizer) -> tuple[dict, dict, dict]:
    """Best step time of each side, the rows each needs for `docs`, and their real tokens."""
    sides, rows, real = batches(args, tokenizer, docs)

    def step(batch):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for side in sides.values():  # warm-up
        step(side[0])
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(args.rounds):
        for name, side in sides.items():
            start = time.perf_counter()
            for batch in side:
                step(batch)
            best[name] = min(best[name], (time.perf_counter() - start) / len(side))
    return best, rows, real


def print_table(args, title: str, best: dict, rows: dict, real: dict) -> None:
    print(f"\n{title}\n")
    print(
        "| rows | rows for the split | real tokens per row | step | real tokens/s | one pass over the split |"
    )
    print("|---|---|---|---|---|---|")
    speed = {}
    for name in best:
        per_row = real[name] / rows[name]
        speed[name] = per_row * args.batch_size / best[name]
        print(
            f"| {name} | {rows[name]:,} | {per_row:.1f} of {args.seq_len} | {best[name] * 1000:.0f} ms | "
            f"{speed[name]:,.0f} | {real['packed'] / speed[name] / 60:.1f} min |"
        )
    print(f"\npacked / padded: {speed['packed'] / speed['padded']:.2f}x real tokens/s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-train-chars", type=int, default=2_000_000, help="the tiny preset's budget")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--doc-chars", type=int, default=400, help="second table: documents cut to this")
    parser.add_argument("--steps", type=int, default=4, help="steps per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    print(
        f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads; load average {load()}"
    )
    docs, corpus = data_mod.load_documents([], "text")
    train_docs, _ = data_mod.split_documents(docs, 0.05, args.max_train_chars, 0)
    tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    run = TrainArgs(seq_len=args.seq_len, attn=args.attn).resolved()
    model = build_model(run, model_options(run), tokenizer)
    optimizer = make_optimizer(model, run)
    print(
        f"corpus {corpus} (swapformer train's default): {len(train_docs)} training documents; tiny preset "
        f"decoder, attn={args.attn}, rows of {args.seq_len}, batch {args.batch_size}, fp32; best of "
        f"{args.rounds} rounds of {args.steps} steps (forward, backward, AdamW)"
    )
    scenarios = [("whole documents", train_docs)]
    if args.doc_chars:
        short = [data_mod.Document(d.name, d.text[: args.doc_chars]) for d in train_docs]
        scenarios.append((f"each document cut to its first {args.doc_chars} characters", short))
    for title, chosen in scenarios:
        print_table(args, title, *measure(args, tokenizer, chosen, model, optimizer))
    print(f"\nload average after the run {load()}; {time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
