"""How much of the library one forward reads: the swapformer files whose code runs during a forward
(not during import or construction), their line counts, and the lines actually executed.

    python scripts/forward_footprint.py                      # decoder, sdpa
    python scripts/forward_footprint.py --backend sparse --arch decoder

The measure issue 27 set: a decoder forward on sdpa should read in at most 6 files and about 1,500
lines (the sum of the touched files' lengths)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def build(arch: str, backend: str):
    from swapformer import DecoderConfig, DecoderForCausalLM, EncoderConfig, EncoderModel

    small = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    if backend == "sparse":
        small.update(layer_types=["sliding_global_attention"] * 2, sliding_window=8, global_tokens=2)
    if arch == "decoder":
        return DecoderForCausalLM(DecoderConfig(attn_implementation=backend, **small)).eval()
    return EncoderModel(EncoderConfig(attn_implementation=backend, **small)).eval()


def files_run_by(call) -> dict[Path, set[int]]:
    """{package file: its lines executed} while `call()` runs (tests, scripts and the venv left out)."""
    executed: dict[Path, set[int]] = {}

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        inside = ROOT in path.parents and not any(p.startswith(".venv") for p in path.parts)
        if inside and "tests" not in path.parts and "scripts" not in path.parts:
            executed.setdefault(path, set()).add(frame.f_lineno)
            return tracer
        return None

    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
    return executed


def footprint(model, length: int) -> dict[Path, set[int]]:
    """The package files one eval forward of `model` on `length` random tokens runs, with their lines."""
    ids = torch.randint(0, 64, (1, length))
    with torch.no_grad():
        model(ids)  # warm: first-call work (lazy imports, caches) is not the forward a reader follows
        return files_run_by(lambda: model(ids))


def file_lengths(executed: dict[Path, set[int]]) -> dict[Path, int]:
    """{file: its length in lines}: what a reader of those files reads."""
    return {path: len(path.read_text().splitlines()) for path in executed}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", choices=("decoder", "encoder"), default="decoder")
    parser.add_argument("--backend", default="sdpa")
    parser.add_argument("--length", type=int, default=32)
    args = parser.parse_args()
    executed = footprint(build(args.arch, args.backend), args.length)
    rows = sorted(executed.items(), key=lambda kv: str(kv[0]))
    total = 0
    print(f"{args.arch} forward on {args.backend}: files whose code runs during one forward\n")
    print("| file | lines in file | lines executed |\n|---|---|---|")
    lengths = file_lengths(executed)
    for path, lines in rows:
        n = lengths[path]
        total += n
        print(f"| {path.relative_to(ROOT)} | {n} | {len(lines)} |")
    print(f"| **{len(rows)} files** | **{total}** | **{sum(len(v) for v in executed.values())}** |")


if __name__ == "__main__":
    main()
