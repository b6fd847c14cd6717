"""The GPU check issue 13 asks for, as one prepared script: parity and speed of flash_attention_2,
sdpa_fa, sdpa and sparse in bf16, multi-head latent attention decoding, and bitsandbytes int8 weights.

    python benchmarks/gpu_check.py                 # on a CUDA machine, a few minutes
    python benchmarks/gpu_check.py --device cpu    # the same code paths where CPU can run them (a dry run)

Without a CUDA device (and without --device cpu) it prints "skipped: no CUDA device" and exits 0.
Parity is against eager in fp32 on the same weights; a backend the machine lacks (flash-attn not
installed, bitsandbytes not installed) is reported as skipped with the reason, never silently dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import machine  # noqa: E402

import swapformer  # noqa: E402
from swapformer.configuration.backends import BACKENDS, LAYER_TYPE_PATTERN  # noqa: E402

LAYER_TYPES = tuple(LAYER_TYPE_PATTERN)


def config_for(layer_type: str, length: int, **overrides):
    options = dict(
        vocab_size=1000,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=max(length, 128),
        position_embedding_type="rope",
        layer_types=[layer_type] * 2,
        sliding_window=64,
        global_tokens=1,
        attention_block_size=64,
        num_random_blocks=1,
        hidden_dropout=0.0,
    )
    options.update(overrides)
    return swapformer.DecoderConfig(**options)


def backends_here(device: str) -> dict[str, str | None]:
    """{backend: None if it can run here, else the reason it is skipped}."""
    cuda = device == "cuda"
    return {
        "sdpa": None,
        "sparse": None,
        "flash_attention_2": None
        if cuda and importlib.util.find_spec("flash_attn")
        else "needs CUDA and the flash-attn package",
        "sdpa_fa": None if cuda else "needs CUDA",
    }


def supports(backend: str, layer_type: str) -> bool:
    """The capability table's word on `layer_type` layers (sdpa_fa also takes no padding: none here)."""
    return LAYER_TYPE_PATTERN[layer_type] in BACKENDS[backend].patterns


def parity(device: str, dtype: torch.dtype, length: int) -> list[str]:
    lines = ["| layer type | backend | max abs diff vs eager fp32 | ms per forward |", "|---|---|---|---|"]
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (2, length), device=device)
    for layer_type in LAYER_TYPES:
        reference = swapformer.DecoderForCausalLM(config_for(layer_type, length)).eval().to(device)
        reference.set_attn_implementation("eager")
        with torch.no_grad():
            want = reference(ids).logits.float()
        model = reference.to(dtype)
        for backend, skipped in backends_here(device).items():
            if skipped or not supports(backend, layer_type):
                reason = skipped or f"{layer_type} is not in its capability row"
                lines.append(f"| {layer_type} | {backend} | skipped: {reason} | |")
                continue
            model.set_attn_implementation(backend)
            with torch.no_grad():
                got = model(ids).logits.float()
                elapsed = timed(lambda m=model: m(ids), device)
            lines.append(
                f"| {layer_type} | {backend} | {(got - want).abs().max().item():.2e} | {elapsed * 1e3:.1f} |"
            )
        model.to(torch.float32)
    return lines


def timed(fn, device: str, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def mla_decode(device: str, dtype: torch.dtype, context: int) -> list[str]:
    """Absorbed against decompressed decoding after `context` cached tokens: logits and ms per token."""
    lines = ["| MLA decode | ms per token | max abs diff vs decompressed |", "|---|---|---|"]
    torch.manual_seed(0)
    config = config_for(
        "full_attention",
        context + 8,
        kv_lora_rank=128,
        q_lora_rank=192,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_key_value_heads=4,
    )
    model = swapformer.DecoderForCausalLM(config).eval().to(device, dtype)
    prompt = torch.randint(5, 1000, (1, context), device=device)
    results = {}
    for mode in ("decompressed", "absorbed"):
        model.config.mla_decode = mode
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            step = out.logits[:, -1:].argmax(-1)
            cache = out.past_key_values
            logits = model(step, past_key_values=cache, use_cache=True).logits.float()
            cache.crop(-1)
            elapsed = timed(
                lambda s=step, c=cache: (model(s, past_key_values=c, use_cache=True), c.crop(-1)), device
            )
        results[mode] = (logits, elapsed)
    diff = (results["absorbed"][0] - results["decompressed"][0]).abs().max().item()
    for mode, (_, elapsed) in results.items():
        lines.append(
            f"| {mode} at {context} tokens | {elapsed * 1e3:.2f} | {diff if mode == 'absorbed' else 0.0:.2e} |"
        )
    return lines


def int8_weights(device: str) -> list[str]:
    if device != "cuda" or importlib.util.find_spec("bitsandbytes") is None:
        return ["bitsandbytes int8: skipped (needs CUDA and the bitsandbytes package)"]
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    model = swapformer.DecoderForCausalLM(config_for("full_attention", 256)).eval()
    ids = torch.randint(5, 1000, (1, 64))
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        quant = BitsAndBytesConfig(load_in_8bit=True)
        int8 = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=quant, device_map="cuda"
        ).eval()
        with torch.no_grad():
            want = model.to("cuda")(ids.cuda()).logits.float()
            got = int8(ids.cuda()).logits.float()
            fp32_time = timed(
                lambda: model.generate(ids.cuda(), max_new_tokens=32, do_sample=False), "cuda", 1
            )
            int8_time = timed(
                lambda: int8.generate(ids.cuda(), max_new_tokens=32, do_sample=False), "cuda", 1
            )
    relative = ((got - want).norm() / want.norm()).item()
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return [
        f"bitsandbytes int8: relative logit error {relative:.3f}, top-1 agreement {top1:.3f}, "
        f"generate 32 tokens {int8_time:.2f} s vs fp32 {fp32_time:.2f} s"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--length", type=int, default=2048, help="tokens per row in the parity forwards")
    parser.add_argument("--context", type=int, default=4096, help="cached tokens before the MLA decode step")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return 0
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    print(f"{name}; {machine()}; bf16")
    for line in parity(args.device, dtype, args.length):
        print(line)
    print()
    for line in mla_decode(args.device, dtype, args.context):
        print(line)
    print()
    for line in int8_weights(args.device):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
