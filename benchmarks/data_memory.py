"""Peak memory of `swapformer train` as the corpus grows (issue 29): the documents go to Arrow and the tokens
to memory-mapped shards on disk, so the resident set should not grow with the corpus.

The corpora are generated: seeded Zipf-distributed words (exponent 1.1) drawn from a fixed vocabulary of
20,000 made-up words of 2-12 letters, 8-16 words a line, written as files of at most 64 MB (each file is cut
into documents of about 20,000 characters by `swapformer train`). Each size runs in its own child process:
`swapformer train --data FOLDER --tokenizer SAVED --max-steps 2` with the tiny preset's model, every training
document tokenized (--max-train-chars 0), a validation budget of 200,000 characters. The child's peak RSS
(its own and its descendants', `os.wait4`), the time of its reading and tokenizing stages and the token
count are printed per size, then the ratio of the peak RSS at the largest size to the smallest.

    python benchmarks/data_memory.py                        # 0.1, 1 and 5 GB (about 6 GB of disk per GB)
    python benchmarks/data_memory.py --sizes 0.02 0.1       # a smaller grid
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from measure import machine

WORDS, ZIPF, FILE_BYTES = 20_000, 1.1, 64 << 20


def vocabulary(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    lengths = rng.integers(2, 13, WORDS)
    return np.array([letters[rng.integers(0, 26, n)].tobytes() for n in lengths], dtype=object)


def _spelling(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each word's letters in a row padded to 13 bytes, each word's length): a chunk is cut from these
    rows with array operations, not word by word."""
    lengths = np.array([len(w) for w in words])
    rows = np.zeros((len(words), int(lengths.max()) + 1), dtype=np.uint8)
    for i, w in enumerate(words):
        rows[i, : len(w)] = np.frombuffer(w, dtype=np.uint8)
    return rows, lengths


def _chunk(rng: np.random.Generator, rows: np.ndarray, lengths: np.ndarray) -> bytes:
    """200,000 words: Zipf-drawn ids, each word followed by a space or, at the drawn line ends, a newline."""
    ids = np.minimum(rng.zipf(ZIPF, 200_000), WORDS) - 1
    ends = np.cumsum(rng.integers(8, 17, 20_000))
    picked, n = rows[ids], lengths[ids]
    picked[np.arange(len(ids)), n] = ord(" ")
    newline = ends[ends < len(ids)]
    picked[newline, n[newline]] = ord("\n")
    return picked[np.arange(picked.shape[1]) <= n[:, None]].tobytes()


def generate(folder: pathlib.Path, gigabytes: float, seed: int = 0) -> None:
    """`gigabytes` of text in `folder` (kept: a later run with the same size reuses it)."""
    if (folder / "done").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (rows, lengths), rng = _spelling(vocabulary()), np.random.default_rng(seed)
    total, target, index = 0, int(gigabytes * 1e9), 0
    while total < target:
        with open(folder / f"part{index:04d}.txt", "wb") as f:
            written = 0
            while written < min(FILE_BYTES, target - total):
                chunk = _chunk(rng, rows, lengths)
                f.write(chunk)
                written += len(chunk)
        total, index = total + written, index + 1
    (folder / "done").write_text(str(total))


def save_tokenizer(corpus: pathlib.Path, folder: pathlib.Path) -> None:
    """A byte-level BPE of 4,096 tokens trained on the first 5 MB of `corpus` (the same for every size)."""
    from swapformer.training.tokenizer import train_tokenizer

    text = (sorted(corpus.glob("*.txt"))[0]).read_bytes()[: 5 << 20].decode()
    train_tokenizer(text.splitlines(), 4096).save_pretrained(folder)


def run_size(corpus: pathlib.Path, tokenizer: pathlib.Path, work: pathlib.Path, steps: int) -> dict:
    """One `swapformer train` child on `corpus`: its peak RSS, stage times and token count."""
    out, cache = work / "run", work / "cache"
    for path in (out, cache):
        shutil.rmtree(path, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "swapformer",
        "train",
        "--data",
        str(corpus),
        "--tokenizer",
        str(tokenizer),
    ]
    command += ["--output-dir", str(out), "--cache-dir", str(cache), "--max-steps", str(steps)]
    command += ["--save-every", str(steps), "--eval-every", str(steps), "--max-train-chars", "0"]
    command += ["--max-val-chars", "200000"]
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
        _, status, usage = os.wait4(proc.pid, 0)
        err.seek(0)
        said = err.read()
    if status != 0:
        raise RuntimeError(said[-3000:])
    metrics = json.loads((out / "metrics.json").read_text())

    def stage_seconds(name: str) -> float:
        return float(re.search(rf"{name}: done in ([0-9.]+) s", said).group(1))

    return {
        "tokens": (metrics["train_blocks"] + metrics["val_blocks"]) * 128,
        "read_s": stage_seconds("reading documents"),
        "tokenize_s": stage_seconds("tokenizing"),
        "total_s": time.perf_counter() - start,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1.0, 5.0], help="corpus sizes in GB")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "swapformer-data-memory"))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    work = pathlib.Path(args.workdir)
    sizes = sorted(args.sizes)
    corpora = {size: work / f"corpus-{size:g}GB" for size in sizes}
    for size, folder in corpora.items():
        generate(folder, size)
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").is_file():
        save_tokenizer(corpora[sizes[0]], tokenizer)
    print(f"machine: {machine()}")
    print("| corpus | tokens | reading documents | tokenizing | whole run | peak RSS |")
    print("| --- | --- | --- | --- | --- | --- |")
    results = {}
    for size, folder in corpora.items():
        r = results[size] = run_size(folder, tokenizer, work / "runs", args.steps)
        print(
            f"| {size:g} GB | {r['tokens']:,} | {r['read_s']:.1f} s | {r['tokenize_s']:.1f} s | "
            f"{r['total_s']:.0f} s | {r['peak_rss_mib']:,.0f} MiB |",
            flush=True,
        )
    ratio = results[sizes[-1]]["peak_rss_mib"] / results[sizes[0]]["peak_rss_mib"]
    print(f"peak RSS at {sizes[-1]:g} GB / at {sizes[0]:g} GB: {ratio:.2f} (goal: under 1.2)")
    return results


if __name__ == "__main__":
    main()
