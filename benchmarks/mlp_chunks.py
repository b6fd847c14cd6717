"""The MLP without gradients: one pass against row chunks, side by side in one process.

    python benchmarks/mlp_chunks.py                  # BERT-base MLP (768 -> 3072 -> 768), 4096 tokens
    python benchmarks/mlp_chunks.py --tokens 16384 --gated

Three ways to run the same `MLP` module (fp32, batch 1, no gradients), interleaved:

- one pass: `Seam.mlp_chunk_bytes` larger than the whole intermediate activation, so up_proj writes a
  fresh (tokens, 3072) tensor (48 MiB at 4096 tokens), which glibc maps fresh on every call;
- chunks, module calls: rows a chunk at a time through the projection modules (each call allocates
  its own output) and the chunk results copied into the output (how PEFT-wrapped or quantized
  projections run, and how every projection ran before the reused buffers);
- chunks, reused buffers: the default path for plain `nn.Linear` projections: the intermediate
  buffer is allocated once per call and every chunk's projections write into it and into the output.

For each: best time and the minor page faults of one more call (a fault is a fresh page the kernel
maps and zero-fills when first written). The CPU and load average are printed before and after.
"""

from __future__ import annotations

import argparse
import resource

import torch
from measure import interleaved, machine
from torch import nn

import swapformer
from swapformer.modeling.core import layers as layers
from swapformer.modeling.cpu import routes as chunking


class Wrapped(nn.Module):
    """A projection that is not a plain `nn.Linear` (as PEFT or a quantizer would leave it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear
        self.out_features = linear.out_features

    def forward(self, x):
        return self.linear(x)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--gated", action="store_true", help="a gated (SwiGLU) MLP instead of GELU")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; {machine()}")
    config = swapformer.EncoderConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        hidden_act="silu" if args.gated else "gelu",
        mlp_type="gated" if args.gated else "mlp",
    )
    torch.manual_seed(0)
    plain = layers.MLP(config).eval()
    wrapped = layers.MLP(config).eval()
    wrapped.load_state_dict(plain.state_dict())
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(wrapped, name) is not None:
            setattr(wrapped, name, Wrapped(getattr(wrapped, name)))
    x = torch.randn(1, args.tokens, config.hidden_size)
    chunk_bytes = chunking.Seam.mlp_chunk_bytes

    def one_pass():
        chunking.Seam.mlp_chunk_bytes = 2**62
        try:
            return plain(x)
        finally:
            chunking.Seam.mlp_chunk_bytes = chunk_bytes

    fns = {
        "one pass": one_pass,
        "chunks, module calls": lambda: wrapped(x),
        "chunks, reused buffers": lambda: plain(x),
    }
    with torch.no_grad():
        reference = one_pass()
        for name, fn in fns.items():
            assert (fn() - reference).abs().max() < 1e-4, name
        best = interleaved(fns, args.rounds)
        faults = {}
        for name, fn in fns.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            fn()
            faults[name] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    kind = "gated SiLU" if args.gated else "GELU"
    print(f"\nMLP 768 -> 3072 -> 768 ({kind}), {args.tokens} tokens, chunks of {chunk_bytes >> 20} MiB\n")
    print("| way | time (ms) | / one pass | page faults per call |")
    print("|---|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / best['one pass']:.2f} | {faults[name]} |")
    print(f"\n{machine()}")


if __name__ == "__main__":
    main()
