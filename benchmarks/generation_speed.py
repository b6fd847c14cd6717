"""Greedy generation speed against transformers' own models, side by side in one process.

    python benchmarks/generation_speed.py            # GPT-2 small, a small Llama, BART-base

fp32, CPU, batch 1, a 32-token prompt and exactly 128 new tokens (`min_new_tokens` keeps both models
from stopping early). Weights are copied into swapformer with the key maps in `conversion/`, so both
models compute the same function (checked: the generated tokens are identical). The two models run
in turn, several rounds, and each keeps its best time. Peak memory is the growth of the resident set
during one generate() call, measured in a child process of this run with MALLOC_MMAP_THRESHOLD_=65536
so that freed buffers go back to the system at once.

"swapformer" is the model as it comes: its linear layers on its CPU linear route (modeling/cpu/linear.py:
oneDNN on AMD CPUs with AVX-512, torch's MKL elsewhere; the route in force is printed) and `model.decoding_copies="auto"`.
On torch's own route (MKL) swapformer decodes faster on input-major copies of its wide and square
matrices, lent to the modules for the generate() call (`DecodingWeights`, docs/architecture.md, decision 9), which
"auto" makes there; so the table also times torch's route with the copies, with a copy of the LM head
only and with none, and gives the copies' size, the memory that speed costs while generate() runs.
A second table times single decoding steps (best of many, interleaved; steadier than whole calls on a
busy machine) and the copying paid once per call.

Also printed: the bytes of weights read per new token (every matrix is read once per token; the
input embedding only for one row, unless tied to the output layer), this machine's memory bandwidth
(a large tensor summed), so the table shows how close decoding is to the bandwidth limit, and the
CPU model and load average before and after (the ratios are measured side by side, but a busy
machine still makes them noisy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
from measure import interleaved, json_from_child, machine, peak_extra_mib, timed
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
from swapformer.modeling.cpu.weight_copies import DecodingWeights

PROMPT, NEW = 32, 128
# (CPU linear route or None for swapformer's default, model.decoding_copies)
VARIANTS = {
    "swapformer": (None, "auto"),
    "torch route, copies": ("torch", "all"),
    "torch route, head copy": ("torch", "lm_head"),
    "torch route, no copies": ("torch", "none"),
}


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


def generate(model, prompt, variant=VARIANTS["swapformer"]):
    route, decoding_copies = variant
    if isinstance(model, swapformer.SwapformerPreTrainedModel):
        model.decoding_copies = decoding_copies
    with torch.no_grad(), swapformer.cpu_linear(route) if route else contextlib.nullcontext():
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


def copied_mib(model, choice: str) -> float:
    """What generate() copies input-major under `decoding_copies=choice` (each tensor once)."""
    return DecodingWeights.size(DecodingWeights.candidates(model, choice)) / 2**20


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
    return json_from_child(__file__, "--memory-child")


def measure_memory():
    out = {}
    for name in families():
        hf, ours = build(name)
        prompt = torch.randint(5, 1000, (1, PROMPT))
        for label, model in (("transformers", hf), ("swapformer", ours)):
            generate(model, prompt)
            out[f"{name}|{label}"] = peak_extra_mib(lambda m=model, p=prompt: generate(m, p))
    print(json.dumps(out))


def generation_table(memory: dict, bandwidth: float, rounds: int) -> None:
    print(
        "| model | transformers tok/s | swapformer tok/s (ratio) | torch route, copies | torch route, head copy "
        "| torch route, no copies | copies held during generate (all / head) "
        "| peak extra MiB (transformers / swapformer) "
        "| weights read per token | swapformer at bandwidth limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in families():
        hf, ours = build(name)
        prompt = torch.randint(5, 1000, (1, PROMPT))
        same = all(torch.equal(generate(hf, prompt), generate(ours, prompt, v)) for v in VARIANTS.values())
        runs = {"transformers": lambda m=hf, p=prompt: generate(m, p)}
        for label, variant in VARIANTS.items():
            runs[label] = lambda m=ours, p=prompt, v=variant: generate(m, p, v)
        tok = {k: NEW / v for k, v in interleaved(runs, rounds).items()}
        ratio = {k: f"{v:.1f} ({v / tok['transformers']:.2f}x)" for k, v in tok.items()}
        per_token = weight_bytes_per_token(ours)
        limit = bandwidth * 1e9 / per_token
        print(
            f"| {name}{'' if same else ' (tokens differ!)'} | {tok['transformers']:.1f} | {ratio['swapformer']} | "
            f"{ratio['torch route, copies']} | {ratio['torch route, head copy']} | {ratio['torch route, no copies']} | "
            f"{copied_mib(ours, 'all'):.0f} / "
            f"{copied_mib(ours, 'lm_head'):.0f} MiB | {memory[name + '|transformers']:.0f} / "
            f"{memory[name + '|swapformer']:.0f} | {per_token / 2**20:.0f} MiB | "
            f"{100 * tok['swapformer'] / limit:.0f}% of {limit:.0f} tok/s |",
            flush=True,
        )


def decoding_step(model, cache_length: int = 48):
    """One decoding step (one token after `cache_length` cached ones), repeatable: the cache is
    cropped back after each call. For an encoder-decoder, the encoder output is computed once."""
    prompt = torch.randint(5, 1000, (1, cache_length))
    extra = {}
    with torch.no_grad():
        if model.config.is_encoder_decoder:
            out = model(input_ids=prompt, decoder_input_ids=prompt[:, :16], use_cache=True)
            extra = dict(
                encoder_outputs=(out.encoder_last_hidden_state,), attention_mask=torch.ones_like(prompt)
            )
        else:
            out = model(prompt, use_cache=True)
    cache, token = out.cache, torch.tensor([[7]])

    def step():
        with torch.no_grad():
            if model.config.is_encoder_decoder:
                model(decoder_input_ids=token, cache=cache, **extra)
            else:
                model(token, cache=cache)
        cache.crop(-1)

    return step


def step_table(reps: int) -> None:
    """Per decoding step, best of `reps` interleaved: short runs are less disturbed by other processes
    than whole generate() calls. The copying time is paid once per generate() call."""
    print(
        "\n| model | transformers ms/step | swapformer ms/step (ratio) | torch route, copies | torch route, head copy "
        "| torch route, no copies | copying per generate() call (all / head) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in families():
        hf, ours = build(name)
        runs = {"transformers": (hf, None, None, decoding_step(hf))}
        for label, (route, choice) in VARIANTS.items():
            if choice == "auto":  # what generate() resolves it to for one row and NEW tokens
                with swapformer.cpu_linear(route) if route else contextlib.nullcontext():
                    choice = "all" if DecodingWeights.worth_copying(1, NEW, model=ours) else "none"
            runs[label] = (ours, route, choice, decoding_step(ours))
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(reps):
            for label, (model, route, choice, step) in runs.items():
                with contextlib.ExitStack() as lent:
                    if route is not None:
                        lent.enter_context(swapformer.cpu_linear(route))
                    if choice is not None:
                        model.decoding_copies = choice
                        lent.enter_context(DecodingWeights.during(model))
                    start = time.perf_counter()
                    step()
                    best[label] = min(best[label], time.perf_counter() - start)
        copying = {c: timed(lambda c=c, m=ours: lend_once(m, c), 3) for c in ("all", "lm_head")}
        ms = {k: f"{v * 1e3:.1f} ({best['transformers'] / v:.2f}x)" for k, v in best.items()}
        print(
            f"| {name} | {best['transformers'] * 1e3:.1f} | {ms['swapformer']} | {ms['torch route, copies']} | "
            f"{ms['torch route, head copy']} | {ms['torch route, no copies']} | {copying['all'] * 1e3:.0f} / "
            f"{copying['lm_head'] * 1e3:.0f} ms |",
            flush=True,
        )


def lend_once(model, choice: str) -> None:
    model.decoding_copies = choice
    with DecodingWeights.during(model):
        pass


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="whole generate() calls per model")
    parser.add_argument("--steps", type=int, default=40, help="single decoding steps per model")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        return measure_memory()
    memory = memory_child()
    bandwidth = memory_bandwidth_gbs()
    print(f"{machine()}")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; memory bandwidth (sum of 256 MiB): "
        f"{bandwidth:.1f} GB/s; swapformer's CPU linear route: {swapformer.cpu_linear_route()}\n"
    )
    generation_table(memory, bandwidth, args.rounds)
    step_table(args.steps)
    print(f"\nafter: {machine()}")


if __name__ == "__main__":
    main()
