"""Linformer against full attention: one encoder block, side by side in one process.

    python benchmarks/linformer.py               # 1k, 4k and 8k tokens (about 3 minutes on 2 cores)
    python benchmarks/linformer.py --sizes 1024  # one size

Model: a one-layer BERT-base-shaped encoder (768 wide, 12 heads of 64, MLP 3072, RoPE), batch 1, fp32,
random weights, inference (torch.no_grad). "full" is ordinary attention; "linformer" projects keys and
values to linformer_k=256 rows (layerwise sharing, E = F; Wang et al. use k = 256 for n = 512..4096),
with max_position_embeddings = n, the length of E. Each backend runs both: eager builds the (n, n)
scores, sdpa on the CPU runs a blocked kernel whose memory is O(n) but whose time is O(n^2); Linformer
makes both O(n * k). Eager full attention is left out above 4096 tokens (its scores alone are
12 * n^2 * 4 bytes: 3 GiB at 8k).

Times are the best of several interleaved rounds (the machine is shared). Peak memory is the growth of
the resident set during one forward, above what the process held before it (weights and inputs
excluded), measured in a child process started with MALLOC_MMAP_THRESHOLD_=65536 so freed buffers go
back to the system at once (slower allocation: times come from this process, memory from the child).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch
from measure import interleaved, json_from_child, machine, peak_extra_mib

import swapformer

VARIANTS = ("full", "linformer")
BACKENDS = ("eager", "sdpa")
K = 256


def model_for(n: int, variant: str, backend: str, *, size: dict | None = None, k: int = K):
    """The one-block encoder of a case (`size` overrides the BERT-base shape, for the smoke test)."""
    shape = dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072) | (size or {})
    config = swapformer.EncoderConfig(
        vocab_size=1000,
        num_hidden_layers=1,
        max_position_embeddings=n,
        position_embedding_type="rope",
        hidden_dropout=0.0,
        linformer_k=k if variant == "linformer" else None,
        **shape,
    )
    torch.manual_seed(0)
    return swapformer.EncoderModel._from_config(copy.deepcopy(config), attn_implementation=backend).eval()


def cases(sizes):
    for n in sizes:
        for variant in VARIANTS:
            for backend in BACKENDS:
                if not (backend == "eager" and variant == "full" and n > 4096):
                    yield n, variant, backend


def forward_fn(model, n: int):
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.no_grad():
            return model(ids).last_hidden_state

    return run


def times(sizes, rounds: int, **build) -> dict:
    """{(n, variant, backend): best seconds}, every case of a size interleaved with the others."""
    out = {}
    for n in sizes:
        fns = {(n, v, b): forward_fn(model_for(n, v, b, **build), n) for (m, v, b) in cases([n]) if m == n}
        out.update(interleaved(fns, rounds=rounds))
    return out


def memory_child(sizes, **build) -> dict:
    """{(n, variant, backend): peak extra MiB}, measured in a child process (see the top)."""
    arg = json.dumps({"sizes": list(sizes), **build})
    rows = json_from_child(__file__, "--memory-child", arg, timeout=1800)
    return {(r[0], r[1], r[2]): r[3] for r in rows}


def measure_memory(sizes, **build) -> list:
    rows = []
    for n, variant, backend in cases(sizes):
        run = forward_fn(model_for(n, variant, backend, **build), n)
        run()  # warm-up: one-time allocations are not the forward's
        rows.append((n, variant, backend, peak_extra_mib(run)))
    return rows


def table(sizes, rounds: int = 3, **build) -> list[dict]:
    """One row per case, with the ratios to full attention on the same backend."""
    best = times(sizes, rounds, **build)
    memory = memory_child(sizes, **build)
    rows = []
    for key in cases(sizes):
        n, variant, backend = key
        full = (n, "full", backend)
        rows.append(
            dict(
                n=n,
                variant=variant,
                backend=backend,
                ms=best[key] * 1e3,
                mib=memory[key],
                time_ratio=best[key] / best[full] if full in best else None,
                mib_ratio=memory[key] / memory[full] if full in memory and memory[full] > 0 else None,
            )
        )
    return rows


def print_table(rows: list[dict], k: int = K) -> None:
    print(machine())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; linformer_k={k}, one encoder block, fp32"
    )
    print("| tokens | attention | backend | ms | vs full | peak extra MiB | vs full |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = "" if r["time_ratio"] is None else f"{r['time_ratio']:.2f}x"
        mib_ratio = "" if r["mib_ratio"] is None else f"{r['mib_ratio']:.2f}x"
        print(
            f"| {r['n']} | {r['variant']} | {r['backend']} | {r['ms']:.1f} | {ratio} | {r['mib']:.1f} | {mib_ratio} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        spec = json.loads(args.memory_child)
        print(json.dumps(measure_memory(spec.pop("sizes"), **spec)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    print_table(table(sizes, args.rounds))


if __name__ == "__main__":
    main()
