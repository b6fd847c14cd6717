"""fp32 linear layers on CPU: torch's route (MKL sgemm) against the oneDNN route of swapformer's
projections (`project`, modeling/cpu/routes.py and linear.py), side by side in one process.

    python benchmarks/cpu_linear.py            # about 3 minutes on 2 cores
    python benchmarks/cpu_linear.py --quick    # small shapes and models only (a smoke run)

Table 1: single products (rows x in -> out) at BERT-base and LM-head shapes, from one row (a decoding
step) to 4096 (a long document), best of interleaved runs, GFLOP/s and the ratio. Table 2: whole
forwards of swapformer models on the two routes: BERT-base at 512 tokens (batch 8, SDPA), the BERT-base
sparse encoder at 4096 tokens of benchmarks/attention_sparse.py, and one GPT-2-small decoding step
(torch's route with generate()'s input-major weight copies, the "auto" choice there, against the
oneDNN route without them, its "auto" choice). Printed with the CPU, torch's CPU capability and load.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from measure import BERT_BASE, POST_NORM, interleaved, machine

import swapformer
from swapformer.modeling.cpu.routes import linear
from swapformer.modeling.cpu.weight_copies import DecodingWeights

SHAPES = {  # (in, out)
    "768 -> 768 (attention q/k/v/o)": (768, 768),
    "768 -> 3072 (MLP up)": (768, 3072),
    "3072 -> 768 (MLP down)": (3072, 768),
    "768 -> 30522 (BERT's LM head)": (768, 30522),
}


def on_route(route: str, fn):
    def run():
        with swapformer.cpu_linear(route), torch.no_grad():
            return fn()

    return run


def product_table(rows_list, shapes, rounds: int) -> None:
    print("| product | rows | torch route (ms) | GFLOP/s | oneDNN route (ms) | GFLOP/s | torch / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for label, (n_in, n_out) in shapes.items():
        torch.manual_seed(0)
        weight, bias = torch.randn(n_out, n_in) / n_in**0.5, torch.randn(n_out)
        for rows in rows_list:
            x = torch.randn(rows, n_in)
            with torch.no_grad():
                with swapformer.cpu_linear("onednn"):
                    fast = linear(x, weight, bias)
                diff = (fast - F.linear(x, weight, bias)).abs().max().item()
            assert diff <= 1e-4, f"{label}, {rows} rows: the routes differ by {diff}"
            best = interleaved(
                {r: on_route(r, lambda x=x, w=weight, b=bias: linear(x, w, b)) for r in ("torch", "onednn")},
                rounds,
            )
            flops = 2 * rows * n_in * n_out
            t, o = best["torch"], best["onednn"]
            print(
                f"| {label} | {rows} | {t * 1e3:.3f} | {flops / t / 1e9:.0f} | {o * 1e3:.3f} | "
                f"{flops / o / 1e9:.0f} | {t / o:.2f}x |",
                flush=True,
            )


def bert_base(**overrides):
    options = dict(vocab_size=30522, max_position_embeddings=512, **BERT_BASE, **POST_NORM)
    return swapformer.EncoderModel(swapformer.EncoderConfig(**{**options, **overrides})).eval()


def gpt2_small_step(quick: bool):
    """One decoding step of GPT-2 small after 48 cached tokens, repeatable (the cache is cropped)."""
    size = dict(n_layer=2, n_embd=256, n_head=4) if quick else {}
    model = swapformer.DecoderForCausalLM(
        swapformer.DecoderConfig(
            vocab_size=50257,
            hidden_size=size.get("n_embd", 768),
            num_hidden_layers=size.get("n_layer", 12),
            num_attention_heads=size.get("n_head", 12),
            intermediate_size=4 * size.get("n_embd", 768),
            max_position_embeddings=1024,
            pre_norm=True,
            tie_word_embeddings=True,
        )
    ).eval()
    with torch.no_grad():
        out = model(torch.randint(5, 1000, (1, 48)), use_cache=True)
    cache, token = out.cache, torch.tensor([[7]])

    def step():
        model(token, cache=cache)
        cache.crop(-1)

    return model, step


def model_table(quick: bool, rounds: int) -> None:
    from attention_sparse import encoders

    print("\n| forward | torch route (ms) | oneDNN route (ms) | torch / oneDNN |")
    print("|---|---|---|---|")
    torch.manual_seed(0)
    tokens, batch = (128, 2) if quick else (512, 8)
    bert = bert_base(num_hidden_layers=2) if quick else bert_base()
    ids = torch.randint(5, 1000, (batch, tokens))
    rows = {f"BERT-base{' (2 layers)' if quick else ''}, {batch} x {tokens} tokens, SDPA": lambda: bert(ids)}
    if not quick:
        _, sparse, long_ids, _ = encoders()
        rows["BERT-base sparse encoder, 4096 tokens (attention_sparse.py)"] = lambda: sparse(long_ids)
    for label, fn in rows.items():
        best = interleaved({r: on_route(r, fn) for r in ("torch", "onednn")}, rounds)
        t, o = best["torch"], best["onednn"]
        print(f"| {label} | {t * 1e3:.1f} | {o * 1e3:.1f} | {t / o:.2f}x |", flush=True)
    gpt2, step = gpt2_small_step(quick)

    # the input-major copies made once (as generate() does once per call), swapped in for each step
    lease = DecodingWeights(gpt2, "all")
    lease.lend()
    swaps = [(module, module.weight, weight) for module, weight in lease.lent]
    lease.hand_back()

    def torch_with_copies():
        for module, copy, _ in swaps:
            module.weight = copy
        try:
            step()
        finally:
            for module, _, weight in swaps:
                module.weight = weight

    best = interleaved(
        {"torch": on_route("torch", torch_with_copies), "onednn": on_route("onednn", step)}, rounds * 4
    )
    t, o = best["torch"], best["onednn"]
    label = "GPT-2 small (2 layers, 256 wide)" if quick else "GPT-2 small"
    print(
        f"| {label} decoding step, 48 cached tokens (torch route with input-major copies; oneDNN without) "
        f"| {t * 1e3:.2f} | {o * 1e3:.2f} | {t / o:.2f}x |"
    )


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small shapes and models only")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(machine())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; swapformer's 'auto' route here: {swapformer.cpu_linear_route()}\n"
    )
    if args.quick:
        product_table((1, 64), {"768 -> 768 (attention q/k/v/o)": (768, 768)}, args.rounds)
    else:
        product_table((1, 4, 64, 512, 4096), SHAPES, args.rounds)
    model_table(args.quick, args.rounds)
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
