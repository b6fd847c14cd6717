"""A converted Longformer against transformers' LongformerModel, side by side in one process.

    python benchmarks/longformer_conversion.py             # base-sized, 4096 tokens
    python benchmarks/longformer_conversion.py --quick     # 4 layers

A randomly initialised LongformerModel of longformer-base's shape (12 layers, 768 wide, 12 heads,
attention_window=512, i.e. 256 keys on each side) is converted with `from_hf_model` (what
`swapformer convert` does in memory) and both run on one row of 4096 tokens in fp32 with the first
token and `--globals` - 1 more marked in `global_attention_mask`. Prints the max abs diff of the last
hidden state and the best forward time of each (runs interleaved: the machines are shared).
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from measure import BERT_BASE, interleaved
from transformers import LongformerConfig, LongformerModel

import swapformer
from swapformer.conversion import from_hf_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4 layers instead of 12")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--globals", type=int, default=8, help="global tokens (the first, then spread)")
    args = parser.parse_args()
    layers = 4 if args.quick else 12
    torch.manual_seed(0)
    shape = {**BERT_BASE, "num_hidden_layers": layers}
    config = LongformerConfig(
        **shape,
        vocab_size=50265,
        max_position_embeddings=4098,
        type_vocab_size=1,
        pad_token_id=1,
        attention_window=512,
    )
    hf = LongformerModel(config).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, config.vocab_size, (1, args.tokens), generator=g)
    marks = torch.zeros_like(ids)
    marks[0, torch.linspace(0, args.tokens - 1, args.globals).long()] = 1
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), global_attention_mask=marks)

    def run(model):
        def fn():
            with torch.no_grad():
                return model(**batch).last_hidden_state

        return fn

    fns = {"LongformerModel": run(hf)}
    for attn in ("sparse", "sdpa"):
        model = from_hf_model(hf, swapformer.EncoderModel)
        model.set_attn_implementation(attn)
        fns[f"swapformer {attn}"] = run(model)
    want = fns["LongformerModel"]()
    diffs = {name: float((fn() - want).abs().max()) for name, fn in fns.items() if name != "LongformerModel"}
    best = interleaved(fns, rounds=3)
    print(
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}"
    )
    print(
        f"{layers} layers x 768, window 512, {args.tokens} tokens, {args.globals} global tokens, fp32, batch 1"
    )
    print("| model | forward s | vs LongformerModel | max abs diff |")
    print("|---|---|---|---|")
    base = best["LongformerModel"]
    for name, seconds in best.items():
        diff = f"{diffs[name]:.1e}" if name in diffs else "-"
        print(f"| {name} | {seconds:.2f} | {seconds / base:.2f}x | {diff} |")


if __name__ == "__main__":
    main()
