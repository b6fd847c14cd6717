"""The race: `swapformer train` against transformers' Trainer on the same job, side by side.

    python benchmarks/train_vs_trainer.py                     # the `small` preset's decoder, 30 steps
    python benchmarks/train_vs_trainer.py --quick             # a tiny model, 3 steps: checks only
    python benchmarks/train_vs_trainer.py --profile --steps 5 # where the time goes, under cProfile

One Llama-shaped decoder (the `small` preset's shape unless --quick), one byte-level BPE tokenizer
(trained here with swapformer's trainer, or --tokenizer), one corpus (Python standard library sources,
saved as a `datasets` DatasetDict with one training and one validation document, so that both sides
concatenate the same text in the same order), AdamW with the same settings and decay groups, the same
warm-up + cosine schedule, batch, accumulation, fp32 and steps. Each side runs in its own child process,
back to back: first swapformer (`swapformer.training.loop.train`, what `swapformer train` runs), then
Trainer on `LlamaForCausalLM` with the run_clm recipe (`Dataset.map` tokenization, `group_texts`,
`DataCollatorForLanguageModeling(mlm=False)`).

What makes equal perplexity a real check, verified here (race_checks.py) and printed:
- swapformer's weights before its first update are converted to Llama (`swapformer.conversion.convert`,
  which verifies the logits of both folders), and Trainer starts from that folder;
- both runs record the input_ids of every forward (a pre-hook on the input embeddings): Trainer
  reads its run_clm blocks in the order swapformer drew them, and the two records must be equal,
  training and validation alike;
- the first step's losses, every step's learning rate and the decay groups must agree.

Timings leave out the recording (copying the initial weights, ordering Trainer's blocks). Tokens
per second count steps 2..N (the first step, with its one-off costs, is in "time to first step").
"""

from __future__ import annotations

import time

START = time.time()  # the child's own start: "time to first step" and "wall" count from here

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

from measure import json_from_child, machine  # noqa: E402
from race_checks import check_all, llama_init, read_corpus  # noqa: E402
from race_sides import SIDES  # noqa: E402

OPTIMIZER = ("weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "max_grad_norm", "min_lr_ratio")
QUICK = dict(layers=2, hidden=64, heads=2, intermediate=128, vocab=600, seq_len=32, batch=4, steps=3)


def parse(argv):
    from swapformer.training.args import PRESETS

    small = PRESETS["small"]
    shape = small["model"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny model and 3 steps (the test's size)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=small["batch_size"])
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=small["seq_len"])
    p.add_argument("--lr", type=float, default=small["lr"])
    p.add_argument("--warmup", type=int, help="warm-up steps (default: a tenth of --steps)")
    p.add_argument("--layers", type=int, default=shape["num_hidden_layers"])
    p.add_argument("--hidden", type=int, default=shape["hidden_size"])
    p.add_argument("--heads", type=int, default=shape["num_attention_heads"])
    p.add_argument("--intermediate", type=int, default=shape["intermediate_size"])
    p.add_argument("--vocab", type=int, default=small["vocab_size"])
    p.add_argument("--val-blocks", type=int, default=32, help="validation blocks (about)")
    p.add_argument("--tokenizer", help="a saved tokenizer folder to use instead of training one")
    p.add_argument("--work", help="folder for the corpus, tokenizer and both runs (default: a temporary one)")
    p.add_argument("--profile", action="store_true", help="run each side under cProfile; print the breakdown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rounds", type=int, default=1, help="run both sides this many times; keep each one's best"
    )
    args = p.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if f"--{name.replace('_', '-')}" not in (argv or []):
                setattr(args, name, value)
    if args.steps < 2:
        p.error(f"--steps {args.steps}: the race needs at least 2 (tokens per second counts steps 2..N)")
    if args.warmup is None:
        args.warmup = max(1, args.steps // 10)
    return args


def plan(args, work: pathlib.Path) -> dict:
    """What both sides read: the corpus and tokenizer (made here), the model shape and the optimisation."""
    from swapformer.training.args import TrainArgs

    corpus, tokenizer = read_corpus(args, work)
    return {
        "work": str(work),
        "corpus": str(corpus),
        "tokenizer": str(tokenizer),
        "profile": args.profile,
        "shape": {
            "num_hidden_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": args.heads,
            "intermediate_size": args.intermediate,
        },
        **{k: getattr(args, k) for k in ("steps", "batch", "grad_accum", "seq_len", "lr", "warmup", "seed")},
        "optimizer": {k: getattr(TrainArgs(), k) for k in OPTIMIZER},  # swapformer's defaults, for both
    }


def run_side(name: str, spec_path: pathlib.Path) -> dict:
    """One side in a fresh interpreter; its JSON result with the load average before and after."""
    import os

    before = os.getloadavg()[0]
    # no allocator settings of our own: each side runs as its users run it
    result = json_from_child(__file__, "--side", name, "--spec", str(spec_path), env={})
    return {**result, "load": (before, os.getloadavg()[0])}


def main(argv=None) -> dict:
    if argv and "--side" in argv:
        return child(argv)
    args = parse(argv)
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="race-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    spec = plan(args, work)
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    results = {"swapformer": run_side("swapformer", spec_path)}
    spec["llama_init"], conversion_diff = llama_init(spec, work)
    spec_path.write_text(json.dumps(spec, indent=1))
    rounds = {"swapformer": [results["swapformer"]], "Trainer": [run_side("Trainer", spec_path)]}
    for r in range(1, args.rounds):  # every other round Trainer goes first: drift of the load falls on both
        for side in ("Trainer", "swapformer") if r % 2 else ("swapformer", "Trainer"):
            rounds[side].append(run_side(side, spec_path))
    results = {side: max(runs, key=lambda x: x["tokens_per_s"]) for side, runs in rounds.items()}
    checks = check_all(work, results, conversion_diff)
    print_table(args, results, checks)
    if args.rounds > 1:
        each = "; ".join(
            f"{s} " + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in runs) for s, runs in rounds.items()
        )
        print(f"tokens/s of each round (the table shows each side's best round): {each}")
    if args.profile:
        print_profile(results)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return {"results": results, "checks": checks}


ROWS = (
    ("wall time (s)", "wall_s", "{:.1f}"),
    ("training tokens/s (steps 2..N)", "tokens_per_s", "{:,.0f}"),
    ("time to first step (s)", "first_step_s", "{:.1f}"),
    ("peak RSS (MiB)", "peak_rss_mib", "{:,.0f}"),
    ("final validation perplexity", "val_perplexity", "{:.4f}"),
)


def print_table(args, results: dict, checks: dict) -> None:
    sf, tr = results["swapformer"], results["Trainer"]
    shape = f"{args.layers} layers x {args.hidden}, {args.heads} heads, MLP {args.intermediate}, vocab {args.vocab}"
    job = f"batch {args.batch} x {args.grad_accum} x {args.seq_len} tokens, {args.steps} steps, fp32"
    print(f"\nthe race: {shape}; {job}{' (under cProfile)' if args.profile else ''}\n")
    print("| | swapformer | Trainer | swapformer / Trainer |")
    print("|---|---|---|---|")
    for label, key, fmt in ROWS:
        ratio = sf[key] / tr[key] if tr[key] else math.nan
        print(f"| {label} | {fmt.format(sf[key])} | {fmt.format(tr[key])} | {ratio:.3f} |")
    loads = " / ".join(f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}" for r in (sf, tr))
    print(f"| load average (1 min) before -> after | {loads.replace(' / ', ' | ', 1)} | |")
    print("\nchecks:")
    for name, (ok, detail) in checks.items():
        print(f"- {name}: {'yes' if ok else 'NO'} ({detail})")
    speed = sf["tokens_per_s"] / tr["tokens_per_s"]
    gap = abs(sf["val_perplexity"] / tr["val_perplexity"] - 1)
    print(f"\ngoal (>= 1.1x tokens/s at perplexity within 1%): {speed:.2f}x at {gap:.2%}")


def print_profile(results: dict) -> None:
    print("\nwhere the time goes (cProfile, seconds of the whole child process):\n")
    names = list(dict.fromkeys(k for r in results.values() for k in r["profile"]))
    print("| | swapformer | Trainer |")
    print("|---|---|---|")
    for name in names:
        cells = [results[s]["profile"].get(name) for s in ("swapformer", "Trainer")]
        print(f"| {name} | " + " | ".join("n/a" if c is None else f"{c:.2f}" for c in cells) + " |")
    for side, r in results.items():
        print(f"\n{side}: functions with the most own time\n")
        for line in r["top"]:
            print(f"    {line}")


def child(argv) -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--spec", required=True)
    ns = p.parse_args(argv)
    spec = json.loads(pathlib.Path(ns.spec).read_text())
    result = SIDES[ns.side](spec, START)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
