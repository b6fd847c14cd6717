"""INT8 weights and INT8 KV cache against fp32, side by side in one process, on a trained model.

    swapformer train --output-dir /tmp/int8-model     # the default model (tiny decoder)
    python benchmarks/int8.py /tmp/int8-model

Variants, all on a CPU:
- fp32: the model as trained, transformers' DynamicCache;
- int8 weights: `from_pretrained(..., quantization_config=TorchAoConfig(Int8DynamicActivationInt8WeightConfig()))`
  (torchao: int8 weights per output channel, activations quantised per token at run time; the LM head,
  tied to the embeddings, stays fp32 as transformers leaves it);
- int8 weights (quanto): `QuantoConfig(weights="int8")`, optimum-quanto's weight-only int8 (activations
  stay fp32);
- int8 cache: fp32 weights, `Int8Cache` (int8 keys and values, one scale per token and head);
- int8 weights + cache: torchao's int8 weights and the int8 cache.

Validation perplexity is taken on the run's own validation batches (rebuilt from training_args.json as
`swapformer train` builds them). With a cache it is measured token by token: each block's first token is
one forward, every later token a decoding step that reads all earlier keys and values back from the
cache, so every prediction but the first goes through the int8 cache (a single forward over a block
reads nothing back). The "fp32 cache, token by token" row checks that this path gives the perplexity of
a plain forward.

Generation: batch 1, a prompt of the first `--prompt` tokens of a validation block, exactly `--new`
greedy tokens; the variants run in turn, several rounds, each keeping its best time. Memory: bytes of
the weights (torchao's int8 tensors count their int8 data and scales) and bytes the cache holds at the
end of generate(), counted from the tensors. (The growth of the resident set during generate() is no
measure at this size: the default model's cache is 0.3 MiB, which the allocator serves from memory the
process already holds.) Ratios are to fp32. The CPU model and the load average are printed before and
after: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch
from measure import machine
from transformers import AutoModelForCausalLM, DynamicCache, QuantoConfig, TorchAoConfig

import swapformer  # noqa: F401  (registers the model types)
from swapformer.modeling.caches.int8_cache import Int8Cache
from swapformer.modeling.compat.torch_compat import is_traceable_wrapper_subclass


def validation_batches(folder: pathlib.Path) -> list[dict]:
    """The run's validation batches, made as `swapformer train` made them (same documents, tokenizer,
    blocks and objective)."""
    from swapformer.training.args import TrainArgs
    from swapformer.training.corpus import load_documents, split_documents
    from swapformer.training.data import _eval_batches, pack
    from swapformer.training.objectives import make_objective
    from swapformer.training.tokenizer import load_tokenizer

    args = TrainArgs.from_json(json.loads((folder / "training_args.json").read_text())).resolved()
    if args.arch != "decoder":
        raise SystemExit(f"benchmarks/int8.py measures a decoder; {folder} holds a {args.arch!r} run")
    tokenizer = load_tokenizer(str(folder), args.arch)
    docs, _ = load_documents(args.data, args.text_column)
    _, val_docs = split_documents(docs, args.val_fraction, args.max_train_chars, args.max_val_chars)
    blocks = pack(tokenizer, val_docs, args.seq_len)
    return _eval_batches(args, make_objective(tokenizer, args), blocks, -1)


def load(folder, weights: str):
    """The model with `weights` "fp32", "torchao" (int8 weights and activations) or "quanto" (int8 weights)."""
    kwargs = {"attn_implementation": "sdpa"}
    if weights == "torchao":
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig

        kwargs["quantization_config"] = TorchAoConfig(Int8DynamicActivationInt8WeightConfig())
    elif weights == "quanto":
        kwargs["quantization_config"] = QuantoConfig(weights="int8")
    return AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()


def make_cache(kind: str | None, model):
    return {
        None: None,
        "fp32": lambda: DynamicCache(config=model.config),
        "int8": lambda: Int8Cache(model.config),
    }[kind]


@torch.no_grad()
def perplexity(model, batches: list[dict], cache: str | None) -> float:
    """exp(mean negative log-likelihood of the labelled next tokens); token by token through a new
    cache of kind `cache` per batch, or one forward per batch when `cache` is None."""
    nll, count = 0.0, 0
    for batch in batches:
        ids, labels = batch["input_ids"], batch["labels"]
        if cache is None:
            logits = model(ids).logits
        else:
            c, steps = make_cache(cache, model)(), []
            for t in range(ids.shape[1]):
                steps.append(model(ids[:, t : t + 1], cache=c, use_cache=True).logits)
            logits = torch.cat(steps, dim=1)
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target = labels[:, 1:]
        keep = target != -100
        nll -= float(log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].sum())
        count += int(keep.sum())
    return math.exp(nll / count)


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a tensor subclass (torchao's int8 weights) counts its inner tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def weight_bytes(model) -> int:
    """Bytes of the weights: parameters (a tied tensor once), and the int8 weights and scales that
    optimum-quanto keeps as buffers of its QLinear modules."""
    params = sum(tensor_bytes(p) for p in model.parameters())
    return params + sum(tensor_bytes(b) for b in model.buffers())


def cache_bytes(cache) -> int:
    if isinstance(cache, Int8Cache):
        return cache.nbytes
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def generate(model, prompt, new: int, cache: str):
    c = make_cache(cache, model)()
    out = model.generate(
        prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, cache=c
    )
    return out, c


VARIANTS = {  # name: (weights, cache)
    "fp32": ("fp32", "fp32"),
    "int8 weights": ("torchao", "fp32"),
    "int8 weights (quanto)": ("quanto", "fp32"),
    "int8 cache": ("fp32", "int8"),
    "int8 weights + cache": ("torchao", "int8"),
}


def run(
    folder, batches: list[dict], prompt_len: int, new: int, rounds: int, max_batches: int | None
) -> list[dict]:
    """The table's rows: perplexities, tokens/s, memory and tokens equal to fp32's, per variant."""
    folder = pathlib.Path(folder)
    batches = batches[:max_batches] if max_batches else batches
    models = {weights: load(folder, weights) for weights in ("fp32", "torchao", "quanto")}
    prompt = batches[0]["input_ids"][:1, :prompt_len]
    rows, outputs = {}, {}
    for name, (weights, cache) in VARIANTS.items():
        model = models[weights]
        out, c = generate(model, prompt, new, cache)  # warm-up, and the tokens
        outputs[name] = out
        rows[name] = {
            "variant": name,
            "ppl": perplexity(model, batches, None if cache == "fp32" else cache),
            "weights_mib": weight_bytes(model) / 2**20,
            "cache_kib": cache_bytes(c) / 2**10,
            "same_tokens": bool(torch.equal(out, outputs["fp32"])),
            "best_s": float("inf"),
        }
    rows["fp32"]["ppl_cached"] = perplexity(models["fp32"], batches, "fp32")
    for _ in range(rounds):  # interleaved: every variant sees the same state of the machine
        for name, (weights, cache) in VARIANTS.items():
            start = time.perf_counter()
            with torch.no_grad():
                generate(models[weights], prompt, new, cache)
            rows[name]["best_s"] = min(rows[name]["best_s"], time.perf_counter() - start)
    for row in rows.values():
        row["tokens_per_s"] = new / row["best_s"]
    return list(rows.values())


def print_table(rows: list[dict], new: int, prompt_len: int) -> None:
    base = rows[0]
    print(f"batch 1, prompt {prompt_len} tokens, {new} new tokens (greedy); ratios to fp32\n")
    print(
        "| variant | val. perplexity | ratio | tokens/s | ratio | weights MiB | ratio | cache KiB | ratio "
        "| same tokens as fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['ppl']:.2f} | {r['ppl'] / base['ppl']:.4f} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f} | {r['weights_mib']:.2f} | "
            f"{r['weights_mib'] / base['weights_mib']:.2f} | {r['cache_kib']:.0f} | "
            f"{r['cache_kib'] / base['cache_kib']:.2f} | {'yes' if r['same_tokens'] else 'no'} |"
        )
    print(
        f"\nfp32 perplexity token by token through a DynamicCache: {base['ppl_cached']:.2f} "
        f"(a plain forward: {base['ppl']:.2f})"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a folder written by `swapformer train` (decoder)")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new", type=int, default=96, help="new tokens per generate() call")
    parser.add_argument("--rounds", type=int, default=5, help="generate() calls per variant")
    parser.add_argument("--max-batches", type=int, default=None, help="validation batches (default: all)")
    args = parser.parse_args(argv)
    print(machine())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {args.model}\n")
    rows = run(
        args.model,
        validation_batches(pathlib.Path(args.model)),
        args.prompt,
        args.new,
        args.rounds,
        args.max_batches,
    )
    print_table(rows, args.new, args.prompt)
    print(f"\nafter: {machine()}")


if __name__ == "__main__":
    main()
