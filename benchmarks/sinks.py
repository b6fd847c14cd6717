"""Streaming generation with attention sinks (StreamingLLM) against full attention, to 32k tokens.

    python benchmarks/sinks.py                       # 32k tokens, window 1024, 4 sink tokens
    python benchmarks/sinks.py --tokens 4096         # shorter

Two tiny decoders with the same weights (RoPE, max_position_embeddings=2048: generation runs 16x past
it), token by token with a cache, greedy, batch 1, both in one process, decoding in turn (64 tokens streaming,
then 64 full, ...) so they share the machine's load:

- streaming: every layer `sliding_global_attention` with global_tokens=k (the sink tokens) and
  sliding_window=w; its cache (GlobalWindowLayer) keeps the first k tokens and the last w - 1;
- full: every layer `full_attention`; transformers' DynamicCache keeps every token.

At each length in the table: mean time per token over the steps since the previous row, and the bytes
the cache holds (counted from its tensors), with the resident set of the process. Streaming should be
flat once the window is full; full grows. `--sinks` also gives both models learned per-head sinks
(`attention_sinks=True`). The CPU and the load average are printed before and after: the machine may be
shared, so compare the two columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from measure import add_size_arguments, machine, status_kib
from transformers import DynamicCache

import swapformer

# Each model decodes this many tokens in turn: short enough that both see the same load, long enough
# that one model's cache (full attention copies its whole cache at every step) does not slow the
# other's steps (stepped one token each in turn, streaming's steps slowed as full's cache grew; alone
# they stay flat).
BLOCK = 64


def build(kind: str, args) -> swapformer.DecoderForCausalLM:
    layer = "sliding_global_attention" if kind == "streaming" else "full_attention"
    config = swapformer.DecoderConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=2 * args.hidden,
        position_embedding_type="rope",
        max_position_embeddings=args.max_positions,
        layer_types=[layer] * args.layers,
        sliding_window=args.window if kind == "streaming" else None,
        global_tokens=args.sink_tokens if kind == "streaming" else 0,
        attention_sinks=args.sinks,
        hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    return swapformer.DecoderForCausalLM._from_config(config, attn_implementation=args.attn).eval()


def cache_mib(cache) -> float:
    return (
        sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        / 2**20
    )


class Stream:
    """One model decoding token by token; times its steps."""

    def __init__(self, model, prompt):
        self.model, self.cache = model, DynamicCache(config=model.config)
        self.seconds, self.steps = 0.0, 0
        with torch.no_grad():
            logits = model(prompt, cache=self.cache, use_cache=True).logits
        self.next = logits[:, -1:].argmax(-1)

    def step(self):
        start = time.perf_counter()
        with torch.no_grad():
            logits = self.model(self.next, cache=self.cache, use_cache=True).logits
        self.next = logits[:, -1:].argmax(-1)
        self.seconds += time.perf_counter() - start
        self.steps += 1

    def interval(self) -> float:
        """Mean ms per token since the last call."""
        ms = 1000 * self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return ms


def run(args) -> list[dict]:
    prompt = torch.randint(3, 256, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    streams = {kind: Stream(build(kind, args), prompt) for kind in ("streaming", "full")}
    marks = sorted({m for m in args.marks if args.prompt < m <= args.tokens} | {args.tokens})
    rows, length = [], args.prompt
    for mark in marks:
        while length < mark:
            steps = min(BLOCK, mark - length)
            for stream in streams.values():
                for _ in range(steps):
                    stream.step()
            length += steps
        row = {"tokens": length, "rss_mib": status_kib("VmRSS") / 1024, "load": os.getloadavg()[0]}
        for kind, stream in streams.items():
            row[kind] = {"ms": stream.interval(), "cache_mib": cache_mib(stream.cache)}
        rows.append(row)
        print(table_row(row), flush=True)
    return rows


HEADER = (
    "| tokens | streaming ms/token | full ms/token | full / streaming | streaming cache MiB | full cache MiB "
    "| process RSS MiB | load (1 min) |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: dict) -> str:
    s, f = r["streaming"], r["full"]
    return (
        f"| {r['tokens']} | {s['ms']:.2f} | {f['ms']:.2f} | {f['ms'] / s['ms']:.2f}x | "
        f"{s['cache_mib']:.2f} | {f['cache_mib']:.2f} | {r['rss_mib']:.0f} | {r['load']:.1f} |"
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32768, help="generate up to this many tokens in all")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--sink-tokens", type=int, default=4)
    parser.add_argument(
        "--sinks", action="store_true", help="learned per-head sinks too (attention_sinks=True)"
    )
    parser.add_argument("--max-positions", type=int, default=2048)
    add_size_arguments(parser, layers=2, hidden=64, heads=4)
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument(
        "--marks", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768], help="table rows"
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine()}")
    print(
        f"tiny decoder: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, RoPE, max_position_embeddings="
        f"{args.max_positions}, attn={args.attn}, learned sinks={args.sinks}; streaming: {args.sink_tokens} sink "
        f"tokens + window {args.window}; prompt {args.prompt}, greedy, batch 1"
    )
    print(HEADER, flush=True)  # rows print as they are measured
    rows = run(args)
    print(f"after: {machine()}")
    return rows


if __name__ == "__main__":
    main()
