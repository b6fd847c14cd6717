"""Multi-head latent attention (MLA) against MHA and GQA of the same width, in one process, on a CPU.

    python benchmarks/mla.py                      # hidden 512, 8 heads, 2 layers; contexts 512, 4k, 16k
    python benchmarks/mla.py --contexts 64 128 --hidden 64 --heads 4 --kv-lora-rank 32   # a smoke run

Cache bytes per token: each model (random weights) runs a prompt of `--prompt` tokens into transformers'
DynamicCache; the bytes of the cache's tensors over tokens, all layers together, beside the ratio the
widths predict: MHA keeps 2 * H * D numbers per token and layer, GQA 2 * K * D, MLA kv_lora_rank +
qk_rope_head_dim (the latent and the shared RoPE key).

Decode time per token: the MLA model's cache is filled with `context` tokens of random latents (the
values do not change the work; filling them by a real prefill would time the prefill), then one token is
decoded, absorbed (`mla_decode="absorbed"`: scores and the weighted sum straight on the latents) and
decompressed (`mla_decode="decompressed"`: every cached latent up-projected to per-head keys and values,
then the sdpa backend), in turn, several rounds, each keeping its best time; after each step the cache is
cropped back to `context`. Both modes' logits of that step are compared (max abs diff, printed). The CPU
model and the load average are printed before and after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from transformers import DynamicCache

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from measure import add_size_arguments, interleaved, machine  # noqa: E402

import swapformer  # noqa: E402


def configs(args) -> dict[str, swapformer.DecoderConfig]:
    """MHA, GQA and MLA decoders of the same width, depth and heads."""
    common = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, position_embedding_type="rope", norm_type="rmsnorm",
        mlp_type="gated", hidden_act="silu", hidden_dropout=0.0, max_position_embeddings=max(args.contexts) + 8,
        attn_implementation="sdpa",
    )  # fmt: skip
    head_dim = args.hidden // args.heads
    mla = dict(
        kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_nope_head_dim=head_dim,
        qk_rope_head_dim=head_dim // 2, v_head_dim=head_dim,
    )  # fmt: skip
    return {
        "MHA": swapformer.DecoderConfig(**common),
        f"GQA ({args.gqa_heads} kv heads)": swapformer.DecoderConfig(
            **common, num_key_value_heads=args.gqa_heads
        ),
        "MLA": swapformer.DecoderConfig(**common, **mla),
    }


def numbers_per_token_and_layer(cfg) -> int:
    """What the cache should keep for one token in one layer, from the widths."""
    if cfg.kv_lora_rank is not None:
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return 2 * cfg.num_key_value_heads * cfg.head_dim


def cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def cache_table(cfgs, prompt: int) -> list[str]:
    rows, measured = [], {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        model = swapformer.DecoderForCausalLM(cfg).eval()
        cache = DynamicCache(config=cfg)
        model(torch.randint(0, cfg.vocab_size, (1, prompt)), cache=cache, use_cache=True)
        measured[name] = cache_bytes(cache) / prompt
    mla = measured["MLA"]
    expected_mla = numbers_per_token_and_layer(cfgs["MLA"])
    rows.append(f"{'attention':<22} {'cache bytes/token':>18} {'ratio to MLA':>13} {'expected ratio':>15}")
    for name, cfg in cfgs.items():
        expected = numbers_per_token_and_layer(cfg) / expected_mla
        rows.append(f"{name:<22} {measured[name]:>18.0f} {measured[name] / mla:>12.2f}x {expected:>14.2f}x")
    return rows


def fill(cache: DynamicCache, cfg, context: int) -> None:
    """`context` tokens of random latents and RoPE keys in every layer (unit RMS, as the normed latents)."""
    g = torch.Generator().manual_seed(0)
    for i in range(cfg.num_hidden_layers):
        latent = torch.randn(1, 1, context, cfg.kv_lora_rank, generator=g)
        k_rope = torch.randn(1, 1, context, cfg.qk_rope_head_dim, generator=g)
        cache.update(latent, k_rope, i)


def decode_step(model, token, cache, mode: str, logits: dict):
    """One decoding step in `mode`, its logits kept in `logits[mode]`; the cache is cropped back after it."""

    def run():
        model.config.mla_decode = mode
        logits[mode] = model(token, cache=cache, use_cache=True).logits
        cache.crop(-1)  # back to the filled context

    return run


@torch.no_grad()
def decode_table(cfg, contexts, rounds: int) -> list[str]:
    torch.manual_seed(0)
    model = swapformer.DecoderForCausalLM(cfg).eval()
    token = torch.tensor([[1]])
    rows = [
        f"{'context':>8} {'absorbed ms/token':>18} {'decompressed ms/token':>22} {'speed-up':>9} {'max |diff|':>11}"
    ]
    for context in contexts:
        cache = DynamicCache(config=cfg)
        fill(cache, cfg, context)
        logits = {}
        steps = {
            mode: decode_step(model, token, cache, mode, logits) for mode in ("absorbed", "decompressed")
        }
        best = interleaved(steps, rounds)
        diff = (logits["absorbed"] - logits["decompressed"]).abs().max().item()
        a, d = best["absorbed"] * 1e3, best["decompressed"] * 1e3
        rows.append(f"{context:>8} {a:>18.2f} {d:>22.2f} {d / a:>8.1f}x {diff:>11.1e}")
    model.config.mla_decode = "absorbed"
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_size_arguments(parser, hidden=512, heads=8, layers=2, vocab=1000)
    parser.add_argument("--gqa-heads", type=int, default=2)
    parser.add_argument("--kv-lora-rank", type=int, default=256, help="DeepSeek-V3: 4x the head width")
    parser.add_argument("--q-lora-rank", type=int, default=384)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    parser.add_argument("--prompt", type=int, default=256, help="tokens run to measure the cache bytes")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    cfgs = configs(args)
    mla = cfgs["MLA"]
    print(f"machine: {machine()}")
    print(
        f"width {args.hidden}, {args.heads} heads of {args.hidden // args.heads}, {args.layers} layers, fp32, batch 1; "
        f"MLA kv_lora_rank {mla.kv_lora_rank}, qk_rope_head_dim {mla.qk_rope_head_dim}, "
        f"qk_nope_head_dim {mla.qk_nope_head_dim}, v_head_dim {mla.v_head_dim}, q_lora_rank {mla.q_lora_rank}"
    )
    print(f"\ncache after a {args.prompt}-token prompt (all layers):")
    print("\n".join(cache_table(cfgs, args.prompt)))
    print(f"\nMLA decode, one token after `context` cached tokens, best of {args.rounds} interleaved rounds:")
    print("\n".join(decode_table(mla, args.contexts, args.rounds)))
    print(f"\nmachine: {machine()}")


if __name__ == "__main__":
    main()
