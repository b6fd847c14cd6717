"""Greedy generation speed against transformers' own models, side by side in one process.

    python benchmarks/generation_speed.py            # GPT-2 small, a small Llama, BART-base

fp32, CPU, batch 1, a 32-token prompt and exactly 128 new tokens (`min_new_tokens` keeps both models
from stopping early). Weights are copied into swapformer with the key maps in `conversion/`, so both
models compute the same function (checked: the generated tokens are identical). The two models run
in turn, several rounds, and each keeps its best time. Peak memory is the growth of the resident set
during one generate() call, measured in a child process of this run with MALLOC_MMAP_THRESHOLD_=65536
so that freed buffers go back to the system at once.

Also printed: the bytes of weights read per new token (every matrix is read once per token; the
input embedding only for one row, unless tied to the output layer) and this machine's memory
bandwidth (a large tensor summed), so the table shows how close decoding is to the bandwidth limit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from measure import interleaved, peak_extra_mib
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

import swapformer
from swapformer.conversion import from_hf_model

PROMPT, NEW = 32, 128


def families():
    return {
        "GPT-2 small (124M)": (
            lambda: GPT2LMHeadModel(GPT2Config(attn_implementation="sdpa")),
            swapformer.DecoderForCausalLM,
        ),
        "Llama (8 layers, 512 wide, 8 heads, 2 kv heads)": (
            lambda: LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=32000,
                    hidden_size=512,
                    intermediate_size=1408,
                    num_hidden_layers=8,
                    num_attention_heads=8,
                    num_key_value_heads=2,
                    attn_implementation="sdpa",
                )
            ),
            swapformer.DecoderForCausalLM,
        ),
        "BART-base": (
            lambda: BartForConditionalGeneration(
                BartConfig(
                    d_model=768,
                    encoder_layers=6,
                    decoder_layers=6,
                    encoder_attention_heads=12,
                    decoder_attention_heads=12,
                    encoder_ffn_dim=3072,
                    decoder_ffn_dim=3072,
                    attn_implementation="sdpa",
                )
            ),
            swapformer.Seq2SeqForConditionalGeneration,
        ),
    }


def build(name):
    torch.manual_seed(0)
    make_hf, ours_class = families()[name]
    hf = make_hf().eval()
    # BART forces EOS as the last token; the same decoding rule for both (an in-memory copy of the
    # weights carries no generation settings; folder conversion copies generation_config.json).
    hf.generation_config.forced_eos_token_id = None
    ours = from_hf_model(hf, ours_class)
    ours.set_attn_implementation("sdpa")
    return hf, ours


def generate(model, prompt):
    with torch.no_grad():
        return model.generate(
            prompt,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            num_beams=1,
            pad_token_id=model.config.pad_token_id or 0,
        )


def weight_bytes_per_token(model) -> int:
    """Bytes of parameters read to produce one token: all of them (the decoder's, for a seq2seq: the
    encoder runs once per prompt), but one row of an embedding table that is not also the output
    layer (learned positions: one row too)."""
    out = model.get_output_embeddings().weight
    total = 0
    for name, p in model.named_parameters():  # named_parameters() lists a tied tensor once
        if ".encoder." in f".{name}":
            continue
        if p.dim() == 2 and "embed" in name and p is not out:
            total += p.shape[1] * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def memory_bandwidth_gbs() -> float:
    x = torch.ones(256 * 2**20 // 4)  # 256 MiB
    x.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def memory_child() -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run(
        [sys.executable, __file__, "--memory-child"], env=env, capture_output=True, text=True, timeout=3600
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_memory():
    out = {}
    for name in families():
        hf, ours = build(name)
        prompt = torch.randint(5, 1000, (1, PROMPT))
        for label, model in (("transformers", hf), ("swapformer", ours)):
            generate(model, prompt)
            out[f"{name}|{label}"] = peak_extra_mib(lambda m=model, p=prompt: generate(m, p))
    print(json.dumps(out))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return measure_memory()
    memory = memory_child()
    bandwidth = memory_bandwidth_gbs()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; memory bandwidth (sum of 256 MiB): "
        f"{bandwidth:.1f} GB/s\n"
    )
    print(
        "| model | transformers tok/s | swapformer tok/s | ratio | peak extra MiB (transformers / swapformer) "
        "| weights read per token | swapformer at bandwidth limit |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in families():
        hf, ours = build(name)
        prompt = torch.randint(5, 1000, (1, PROMPT))
        same = torch.equal(generate(hf, prompt), generate(ours, prompt))
        best = interleaved(
            {
                "transformers": lambda m=hf, p=prompt: generate(m, p),
                "swapformer": lambda m=ours, p=prompt: generate(m, p),
            },
            args.rounds,
        )
        tok = {k: NEW / v for k, v in best.items()}
        per_token = weight_bytes_per_token(ours)
        limit = bandwidth * 1e9 / per_token
        print(
            f"| {name}{'' if same else ' (tokens differ!)'} | {tok['transformers']:.1f} | {tok['swapformer']:.1f} | "
            f"{tok['swapformer'] / tok['transformers']:.2f}x | {memory[name + '|transformers']:.0f} / "
            f"{memory[name + '|swapformer']:.0f} | {per_token / 2**20:.0f} MiB | "
            f"{100 * tok['swapformer'] / limit:.0f}% of {limit:.0f} tok/s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
