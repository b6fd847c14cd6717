"""attn_implementation="auto" against every single backend, cell by cell (issue 30).

    python benchmarks/auto_backend.py --quick       # 256 and 1k tokens (a few minutes)
    python benchmarks/auto_backend.py               # 256, 1k, 4k and 8k tokens (long: dense 8k training)

A cell is (architecture, layer kind, tokens, inference or training): a model whose layers are all of that
kind (2 layers, 12 heads x 64, hidden 768, MLP 3072, RoPE, batch 1; windows of 257 keys, 2 global tokens,
BigBird's 3 random blocks of 64). Every backend the capability table accepts for the cell runs it, and so
does `auto` (after its first call, which measures: its cost is printed apart), in turn (the order reversed
every other round), several rounds, each keeping its best time, so a busy machine's drift falls on all of
them. Inference is a forward under no_grad; training a forward and backward. eager is skipped above
`--eager-max` tokens (its score matrices need gigabytes), flex_attention unless `--with-flex` (on CPU it
compiles for about 15 s per shape and auto does not measure it there: configuration/capability_table.py
says why).

Printed per cell: each backend's time, auto's time and what it ran, auto / best single backend, ran / best
(the time of the backend auto ran, in its own column, over the best: the choice itself, free of the noise
between two timings of the same code that auto / best carries), and the default / auto: the default is
what `from_pretrained` picks for this config without `attn_implementation` (sdpa, as transformers picks
sdpa where flash-attn is not installed, whatever the layer kind). The last column is the largest
difference between auto's output (inference) or gradients (training) and eager's (sdpa's where eager is
skipped, marked "(sdpa)", unless `--eager-reference`, which runs eager once, untimed, with activation
checkpointing in training so that one layer's scores are held at a time): auto only chooses among backends
that compute eager's function. The CPU model and the load average are printed before and after. No figure
here is asserted by a test.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from measure import add_size_arguments, interleaved, machine

import swapformer
from swapformer.modeling.attention import auto_backend

KINDS = {
    "full": "full_attention",
    "sliding": "sliding_attention",
    "sliding_global": "sliding_global_attention",
    "bigbird": "bigbird_attention",
}
LENGTHS = (256, 1024, 4096, 8192)
QUICK = (256, 1024)
MODES = ("inference", "training")
ARCHS = {"decoder": (swapformer.DecoderConfig, swapformer.DecoderModel)}
ARCHS["encoder"] = (swapformer.EncoderConfig, swapformer.EncoderModel)
DEFAULT = "sdpa"  # what loading without attn_implementation gives (transformers' choice without flash-attn)
TINY = dict(layers=1, hidden=32, heads=4, intermediate=32, vocab=64, window=9, block=8)


def model_for(arch: str, kind: str, length: int, args):
    config_class, model_class = ARCHS[arch]
    config = config_class(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=args.intermediate,
        layer_types=[KINDS[kind]] * args.layers,
        sliding_window=args.window,
        global_tokens=2 if kind in ("sliding_global", "bigbird") else 0,
        attention_block_size=args.block,
        num_random_blocks=3,
        position_embedding_type="rope",
        max_position_embeddings=length,
        hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    return model_class._from_config(config, attn_implementation="eager")


def step(model, ids, training: bool):
    """One measured call: a forward (inference), or a forward and backward whose gradients it returns."""
    if not training:
        with torch.no_grad():
            return model.eval()(ids).last_hidden_state
    model.train().zero_grad(set_to_none=True)
    model(ids).last_hidden_state.square().mean().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def cell(arch: str, kind: str, length: int, mode: str, args) -> dict:
    model = model_for(arch, kind, length, args)
    training = mode == "training"
    ids = torch.randint(3, args.vocab, (1, length), generator=torch.Generator().manual_seed(length))
    found = auto_backend.candidates(
        model.config,
        kind,
        "cpu",
        torch.float32,
        grad=training,
        padded=False,
        packed=False,
        custom=False,
        compiling=False,
    )
    if args.with_flex and not training:
        found.append("flex_attention")
    skipped = {"eager": f"over {args.eager_max} tokens"} if length > args.eager_max else {}
    backends = [b for b in found if b not in skipped]

    def on(name):
        def run():
            model.set_attn_implementation(name)
            return step(model, ids, training)

        return run

    reference_name = "eager" if "eager" in backends or args.eager_reference else "sdpa"
    # Above --eager-max, eager's reference gradients are taken with activation checkpointing: the same
    # ops run again in the backward, so the gradients are eager's, while only one layer's score matrices
    # are alive at a time (8k tokens, BigBird: 14 GB instead of over 23 GB).
    lean = training and reference_name == "eager" and "eager" not in backends
    if lean:
        model.activation_checkpointing_enable()
    reference = on(reference_name)()
    if lean:
        model.activation_checkpointing_disable()
    model.set_attn_implementation("auto")
    start = time.perf_counter()
    got = step(model, ids, training)  # the first call measures what auto has not seen
    first = time.perf_counter() - start
    best = interleaved({name: on(name) for name in [*backends, "auto"]}, rounds=args.rounds)
    model.set_attn_implementation("auto")  # the plan shows auto's choices only while the model is on auto
    chosen = sorted({c.backend for c in model.attention_plan().row(KINDS[kind]).choices
                     if c.situation["grad"] == training and c.situation["bucket"] == max(auto_backend.FLOOR, 1 << (length - 1).bit_length())})  # fmt: skip
    single = min(best[b] for b in backends)
    ran = [best[b] for b in chosen if b in best]  # eager, where auto chose it above --eager-max: not timed
    return {
        "seconds": best,
        "skipped": skipped,
        "auto_ran": chosen,
        "auto_first_call": first,
        "auto_over_best": best["auto"] / single,
        "ran_over_best": max(ran) / single if ran else float("nan"),
        "default_over_auto": best[DEFAULT] / best["auto"],
        "max_diff": float((got.float() - reference.float()).abs().max()),
        "reference": reference_name,
    }


def header(names: list[str]) -> str:
    head = ["arch", "kind", "tokens", "mode", *(f"{n} (ms)" for n in names), "auto (ms)", "auto ran"]
    head += ["auto / best", "ran / best", f"{DEFAULT} (default) / auto", "auto's 1st call (ms)"]
    head += ["max diff vs eager"]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)])


def line(key: tuple, r: dict, names: list[str]) -> str:
    """One cell's row: each backend's best time (or why it did not run), auto's, and the ratios."""
    times = [
        f"{r['seconds'][n] * 1e3:.1f}" if n in r["seconds"] else r["skipped"].get(n, "not a candidate")
        for n in names
    ]
    auto = [f"{r['seconds']['auto'] * 1e3:.1f}", ", ".join(r["auto_ran"]), f"{r['auto_over_best']:.3f}"]
    auto += [f"{r['ran_over_best']:.3f}"]
    diff = f"{r['max_diff']:.1e}" + ("" if r["reference"] == "eager" else f" ({r['reference']})")
    auto += [f"{r['default_over_auto']:.2f}x", f"{r['auto_first_call'] * 1e3:.0f}", diff]
    return "| " + " | ".join([*map(str, key), *times, *auto]) + " |"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"tokens {QUICK} only")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (the test runs it)")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"tokens (default {LENGTHS})")
    parser.add_argument("--kinds", nargs="+", choices=tuple(KINDS), default=list(KINDS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--archs", nargs="+", choices=tuple(ARCHS), default=list(ARCHS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager-max", type=int, default=4096, help="tokens above which eager is not timed")
    parser.add_argument(
        "--eager-reference",
        action="store_true",
        help="compare auto with eager's outputs above --eager-max too (one untimed run; its scores' memory)",
    )
    parser.add_argument(
        "--with-flex", action="store_true", help="also flex_attention (inference; compiles per shape)"
    )
    parser.add_argument(
        "--cache-dir", help="auto's cache folder (default: a fresh temporary one, so auto measures)"
    )
    add_size_arguments(
        parser, layers=2, hidden=768, heads=12, intermediate=3072, vocab=1000, window=257, block=64
    )
    args = parser.parse_args(argv)
    if args.tiny:
        vars(args).update(TINY)
    lengths = args.lengths or (QUICK if args.quick else LENGTHS)
    os.environ["SWAPFORMER_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="swapformer-auto-")
    os.environ.pop(auto_backend.ENV, None)
    auto_backend.forget()
    print(
        f"{machine()}; {torch.get_num_threads()} threads; torch {torch.__version__}; cache {os.environ['SWAPFORMER_CACHE_DIR']}"
    )
    names = ["eager", "sdpa", "sparse", *(["flex_attention"] if args.with_flex else [])]
    print(header(names), flush=True)
    results = {}
    for arch in args.archs:
        for kind in args.kinds:
            for length in lengths:
                for mode in args.modes:
                    key = (arch, kind, length, mode)
                    results[key] = cell(arch, kind, length, mode, args)
                    print(line(key, results[key], names), flush=True)
    print(f"after: {machine()}")
    return results


if __name__ == "__main__":
    main()
