"""Measurement helpers shared by the benchmarks: best-of timing, peak resident memory (in a child process),
the machine."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time

# The BERT-base shape in the argument names BertConfig, LongformerConfig and swapformer's EncoderConfig
# share, and the post-norm layout swapformer's encoder needs to be BERT (norms after each residual, one
# on the embeddings).
BERT_BASE = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
}
POST_NORM = {"pre_norm": False, "embedding_norm": True}
# freed buffers go back to the system at once, so `peak_extra_mib` sees each new one
EAGER_FREE = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (VmRSS: resident now, VmHWM: high-water mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def peak_extra_mib(fn) -> float:
    """Growth of the resident set above what the process held before `fn()` ran, in MiB. The kernel's
    high-water mark is reset through /proc/self/clear_refs first. Run it where freed memory goes back
    to the system at once (MALLOC_MMAP_THRESHOLD_=65536), or earlier buffers hide new ones."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status_kib("VmRSS")
    result = fn()
    peak = status_kib("VmHWM")
    del result
    # the kernel's resident-set counters lag by a few pages, so a run that allocates nothing can read
    # a few KiB below `before`; growth is never negative
    return max(0.0, (peak - before) / 1024)


def json_from_child(script: str, *args: str, env: dict | None = None, timeout: float = 3600):
    """Run `python script *args` in a child process whose environment adds `env` (default EAGER_FREE) and
    return what the child printed as JSON on its last line. Raises RuntimeError with the end of the
    child's stderr when it fails."""
    extra = EAGER_FREE if env is None else env
    done = subprocess.run(
        [sys.executable, script, *args],
        env={**os.environ, **extra},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(fn, repeats: int, budget: float) -> float:
    """Best time of `repeats` calls of `fn`, or of more while they fit in `budget` s (at most 20)."""
    times = []
    while len(times) < repeats or (sum(times) < budget and len(times) < 20):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def timed(fn, repeats: int, budget: float = 3.0) -> float:
    """Best of `repeats` runs after a warm-up, or of more while they fit in `budget` s (at most 20)."""
    fn()  # warm-up (and, for compiled kernels, compilation)
    return best_of(fn, repeats, budget)


def interleaved(fns: dict, rounds: int = 10, times: dict | None = None, round_s: float = 0.0) -> dict:
    """Best time of each function, the functions run in turn so they share the machine's state, in the
    given order in even rounds and reversed in odd ones (A B C, C B A, ...): whatever a function gains or
    loses from the one run just before it falls on both sides of each pair. (With one order throughout,
    benchmarks/auto_backend.py's `auto` always ran right after the backend it runs, the same code, and
    timed 3-7% below it at 8k tokens.) Every round's times are appended to `times[name]` when a dict is
    given (for per-round ratios).

    With `round_s` > 0 each function's turn in a round repeats its call until `round_s` seconds have
    passed (at most 20 calls) and counts the best of them. Beside neighbours that take seconds (dense
    SDPA, compiled flex) a call of 0.1 s otherwise gets only one sample per round, and a best of 3 is
    whatever the host did in those three moments."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            turn = best_of(fn, 1, round_s)
            best[name] = min(best[name], turn)
            if times is not None:
                times.setdefault(name, []).append(turn)
    return best


def add_size_arguments(parser, **defaults: int) -> None:
    """The model-size options a benchmark takes, `--name` for each of `defaults` (layers, hidden, heads,
    intermediate, vocab), integers with the benchmark's own defaults."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name}", type=int, default=default)


def machine() -> str:
    """The CPU model, core count and load average (1 / 5 / 15 min), printed with every table."""
    from swapformer.modeling.cpu.route_choice import (
        cpu_info,  # here: the timing helpers above stay import-light
    )

    cpu = cpu_info("model name") or "unknown CPU"
    load = os.getloadavg()
    return f"{cpu}, {os.cpu_count()} cores, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
