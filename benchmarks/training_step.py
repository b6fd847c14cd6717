"""Training-step speed against transformers' own models, side by side in one process.

    python benchmarks/training_step.py               # Llama-shaped decoder, BERT-shaped MLM encoder

A step is forward + loss + backward + AdamW (`torch.optim.AdamW`, default settings, gradients set to
None after each step), the work of one Trainer step without the data loader. Each family is built
once in transformers, with random weights, and copied into swapformer with the key maps in
`conversion/`, so both models compute the same function (checked: the first step's losses are
printed side by side). Three rows per family: fp32; bf16 autocast (weights and optimizer in fp32,
`torch.autocast("cpu", torch.bfloat16)`); fp32 with activation checkpointing on every layer. Both
models use the sdpa backend. Dropout is off (BERT's too), so both compute the same losses in training
mode; it would add the same elementwise work to both.

The two models step in turn, several rounds, and each keeps its best time, so drift of the machine
(other processes, frequency) falls on both. The CPU model and the load average before and after are
printed: the ratios are measured side by side, but a busy machine still makes them noisy. On CPUs
without native bf16 (AVX2 only) the autocast row measures emulated bf16 matmuls.
"""

from __future__ import annotations

import argparse
import time

import torch
from measure import add_size_arguments, machine
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

import swapformer
from swapformer.conversion import from_hf_model

MODES = ("fp32", "bf16 autocast", "activation checkpointing")


def families(args):
    """{name: (transformers model maker, swapformer class, batch maker)}; the two families share
    their shape (and sdpa attention), and neither has dropout."""
    shape = {"vocab_size": args.vocab, "hidden_size": args.hidden, "intermediate_size": args.intermediate}
    shape |= {
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "attn_implementation": "sdpa",
    }
    llama = {"num_key_value_heads": args.heads, "max_position_embeddings": args.length}
    bert = {
        "max_position_embeddings": args.length,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
    }
    return {
        f"Llama-shaped decoder ({args.layers} x {args.hidden})": (
            lambda: LlamaForCausalLM(LlamaConfig(**shape, **llama)),
            swapformer.DecoderForCausalLM,
            causal_batch,
        ),
        f"BERT-shaped MLM encoder ({args.layers} x {args.hidden})": (
            lambda: BertForMaskedLM(BertConfig(**shape, **bert)),
            swapformer.EncoderForMaskedLM,
            masked_batch,
        ),
    }


def causal_batch(args, g):
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False)


def masked_batch(args, g):
    """BERT's recipe in short: 15% of the tokens are predicted, and those are replaced by a mask id."""
    ids = torch.randint(1, args.vocab, (args.batch, args.length), generator=g)
    chosen = torch.rand(ids.shape, generator=g) < 0.15
    return dict(
        input_ids=ids.masked_fill(chosen, 0),
        attention_mask=torch.ones_like(ids),
        labels=ids.masked_fill(~chosen, -100),
    )


def build(name, mode, args):
    """(transformers model, swapformer model), the same weights, in training mode."""
    torch.manual_seed(0)
    make_hf, ours_class, _ = families(args)[name]
    hf = make_hf()
    ours = from_hf_model(hf, ours_class)
    ours.set_attn_implementation("sdpa")
    for model in (hf, ours):
        model.train()
        if mode == "activation checkpointing":
            model.activation_checkpointing_enable()
    return hf, ours


def stepper(model, batch, mode):
    """One training step of `model` on `batch`, as a function; returns the loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16 autocast")

    def step() -> float:
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def measure(name, mode, args) -> dict:
    hf, ours = build(name, mode, args)
    batch = families(args)[name][2](args, torch.Generator().manual_seed(0))
    steps = {"transformers": stepper(hf, batch, mode), "swapformer": stepper(ours, batch, mode)}
    first = {label: step() for label, step in steps.items()}  # also the warm-up
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(args.rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            best[label] = min(best[label], time.perf_counter() - start)
    return {"first_loss": first, "seconds": best}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_size_arguments(parser, layers=4, hidden=256, heads=4, intermediate=1024, vocab=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps per model (after one warm-up)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = parser.parse_args(argv)
    print(machine())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch} x {args.length} "
        f"tokens, vocabulary {args.vocab}, best of {args.rounds} steps, run in turn\n"
    )
    print(
        "| model | mode | transformers s/step | swapformer s/step | speed vs transformers | first loss (transformers / swapformer) |"
    )
    print("|---|---|---|---|---|---|")
    results = {}
    for name in families(args):
        for mode in args.modes:
            r = results[name, mode] = measure(name, mode, args)
            t, s = r["seconds"]["transformers"], r["seconds"]["swapformer"]
            loss = r["first_loss"]
            print(
                f"| {name} | {mode} | {t:.3f} | {s:.3f} | {t / s:.2f}x | "
                f"{loss['transformers']:.5f} / {loss['swapformer']:.5f} |",
                flush=True,
            )
    print(f"\nafter: {machine()}")
    return results


if __name__ == "__main__":
    main()
