"""The report stage: what a run tells as it goes (metrics.jsonl and the tracker) and the Hub-ready
folder it leaves (weights and remote code, tokenizer, metrics.json, the loss-curve PNG, the model card).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import platform
import time

import torch

from ..hub_cards.render import model_values, render_model_card
from .args import TrainArgs, attn_backends
from .data import RunData, step_generator
from .evaluation import perplexity, target_counts, unigram_log_probs
from .hub import HUB_IGNORE

ARCH_TEXT = {
    "decoder": ("A causal decoder", "causal language modelling", "text-generation", "AutoModelForCausalLM"),
    "encoder": (
        "A bidirectional encoder",
        "masked language modelling",
        "fill-mask",
        "AutoModelForMaskedLM",
    ),
    "encoder-decoder": (
        "An encoder-decoder",
        "T5-style span corruption",
        "text2text-generation",
        "AutoModelForSeq2SeqLM",
    ),
}
USAGE = {
    "decoder": 'ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids\n'
    "print(tokenizer.decode(model.generate(ids, max_new_tokens=40, do_sample=False)[0]))",
    "encoder": 'batch = tokenizer("import <mask>", return_tensors="pt")\n'
    "logits = model(**batch).logits  # (1, T, vocab): a distribution over each position",
    "encoder-decoder": 'ids = tokenizer("def <extra_id_0>(self):", return_tensors="pt").input_ids\n'
    "print(tokenizer.decode(model.generate(ids, max_new_tokens=20)[0]))",
}


def plot_loss_curve(history: list[dict], evals: list[dict], path: str) -> None:
    """Training loss per step and validation loss at each evaluation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1, label="train loss")
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    threads = torch.get_num_threads()
    return f"CPU ({platform.processor() or platform.machine()}, {threads} thread{'s' if threads > 1 else ''})"


def hyperparameter_table(args: TrainArgs, metrics: dict) -> str:
    """The model card's table of training hyperparameters (Markdown)."""
    hyper = {
        "steps": args.max_steps,
        "global batch (sequences)": metrics["global_batch"],
        "sequence length": args.seq_len,
        "optimizer": f"AdamW (betas {args.adam_beta1}, {args.adam_beta2}; weight decay {args.weight_decay}, "
        "none on norms and biases)",
        "learning rate": f"{args.lr} peak, {args.warmup_steps} warm-up steps, cosine to {args.min_lr_ratio} x peak",
        "gradient clipping": args.max_grad_norm,
        "gradient accumulation": args.grad_accum,
        "processes": metrics["num_processes"],
        "mixed precision": args.mixed_precision,
        "seed": args.seed,
    }
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in hyper.items())])


def write_model_card(path: str, *, args: TrainArgs, model, metrics: dict, corpus_name: str, corpus_text: str):
    """Render hub_cards/model_card.md with the run's real figures into `path` (README.md)."""
    cfg = model.config
    arch_text, objective, pipeline_tag, auto_class = ARCH_TEXT[args.arch]
    card = render_model_card(
        model_name=f"swapformer-{args.arch}-{args.preset}",
        dataset_name=corpus_name,
        task_type=pipeline_tag,
        pipeline_tag=pipeline_tag,
        tags=[
            "swapformer",
            args.arch,
            "custom_code",
            *(f"attn-{b}" for b in sorted(attn_backends(args.attn))),
        ],
        results={"perplexity": metrics["val_perplexity"]},
        arch_description=arch_text,
        objective=objective,
        num_val_tokens=metrics["val_tokens"],
        val_perplexity=metrics["val_perplexity"],
        unigram_perplexity=metrics["unigram_perplexity"],
        test_perplexity=metrics.get("test_perplexity"),
        test_unigram_perplexity=metrics.get("test_unigram_perplexity"),
        num_test_tokens=metrics.get("test_tokens"),
        final_train_loss=metrics["final_train_loss"],
        steps=metrics["steps"],
        tokens_seen=f"{metrics['tokens_seen']:,}",
        epochs=metrics["epochs"],
        train_seconds=metrics["train_seconds"],
        hardware=metrics["hardware"],
        **model_values(model),
        num_parameters=f"{metrics['num_parameters']:,}",
        layers=cfg.num_hidden_layers
        if not cfg.is_encoder_decoder
        else f"{cfg.num_hidden_layers}+{cfg.decoder_layers}",
        attn=args.attn,
        seq_len=args.seq_len,
        dataset_description=corpus_text,
        hyperparameters=hyperparameter_table(args, metrics),
        auto_class=auto_class,
        repo_hint="path/or/repo-id",
        usage=USAGE[args.arch],
    )
    card.save(path)
    return card


class MetricsLog:
    """metrics.jsonl (and the tracker, where tensorboard is installed): the main process writes, the
    others only take part in the tracker's start and end."""

    def __init__(self, accelerator, path: pathlib.Path, state: dict, args: TrainArgs):
        self.accelerator, self.path = accelerator, path
        self.tracker = bool(accelerator.log_with)
        # the log holds exactly the steps the state knows (a resume drops those redone)
        if accelerator.is_main_process:
            path.write_text("".join(json.dumps(r) + "\n" for r in log_records(state)))
            if self.tracker:
                accelerator.init_trackers("runs", config={k: str(v) for k, v in args.to_json().items()})

    def __call__(self, record: dict) -> None:
        """Append `record` to metrics.jsonl and the tracker."""
        if not self.accelerator.is_main_process:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.tracker:
            self.accelerator.end_training()


def log_records(state: dict) -> list[dict]:
    """Step records and evaluation records, in step order (an evaluation before its step's record)."""
    evals = {e["step"]: e for e in state["evals"]}
    out = []
    for record in state["history"]:
        if record["step"] in evals:
            out.append(evals[record["step"]])
        out.append(record)
    return out


def write_folder(out, args, model, weights, data: RunData, state, final_eval, run) -> dict:
    """The Hub-ready folder: weights and remote code, tokenizer, metrics, loss curve, model card."""
    if (
        data.stream is not None
    ):  # --streaming: the targets the run trained on (the stream has no end to count to)
        counts = data.stream.targets
    else:
        counts = target_counts(
            data.train_blocks, data.objective, len(data.tokenizer), step_generator(args.seed, -2)
        )
    baseline = perplexity(unigram_log_probs(counts, data.val_batches, data.objective.shift))
    metrics = {
        "val_perplexity": final_eval["val_perplexity"],
        "val_loss": final_eval["val_loss"],
        "unigram_perplexity": baseline["perplexity"],
        "val_tokens": final_eval["val_tokens"],
        **_test_metrics(counts, data, final_eval),
        "final_train_loss": state["history"][-1]["loss"],
        "steps": state["step"],
        "tokens_seen": state["step"] * state["global_batch"] * args.seq_len,
        "epochs": data.order.epoch(state["step"] * state["global_batch"]),
        "global_batch": state["global_batch"],
        "num_processes": run["num_processes"],
        "distributed_type": run["distributed_type"],
        "num_parameters": run["num_parameters"],
        "train_blocks": len(data.train_blocks) if data.stream is None else data.stream.stream.pass_blocks,
        "val_blocks": len(data.val_blocks),
        "train_seconds": state["train_seconds"],
        "total_seconds": time.time() - run["start_time"],
        "hardware": hardware(),
        "corpus": data.corpus_name,
        **auto_choices(model),
    }
    model.save_pretrained(out, state_dict=weights, safe_serialization=True)
    data.tokenizer.save_pretrained(out)
    # git-based uploads leave the resume states out too (push_folder passes the same patterns)
    (out / ".gitignore").write_text("".join(f"{pattern}\n" for pattern in HUB_IGNORE))
    plot_loss_curve(state["history"], state["evals"], str(out / "loss_curve.png"))
    write_model_card(
        str(out / "README.md"),
        args=args,
        model=model,
        metrics=metrics,
        corpus_name=data.corpus_name,
        corpus_text=describe_corpus(args, data),
    )
    # last: a folder with metrics.json is complete (a --resume of it has nothing left to do)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def auto_choices(model) -> dict:
    """What attn_implementation="auto" chose per layer type in this run (training steps and evaluation), with
    the measured times: {"attention_auto": {layer type: [choice, ...]}}; nothing when no layer is on auto."""
    rows = [r for r in model.attention_plan().rows if r.requested == "auto"]
    if not rows:
        return {}
    return {
        "attention_auto": {
            f"{r.stack} {r.layer_type}".strip(): [dataclasses.asdict(c) for c in r.choices] for r in rows
        }
    }


def _test_metrics(counts: torch.Tensor, data: RunData, final_eval: dict) -> dict:
    """The test split's figures (none without one), with the unigram baseline on its targets."""
    if not data.test_batches:
        return {}
    baseline = perplexity(unigram_log_probs(counts, data.test_batches, data.objective.shift))
    return {
        "test_perplexity": final_eval["test_perplexity"],
        "test_loss": final_eval["test_loss"],
        "test_unigram_perplexity": baseline["perplexity"],
        "test_tokens": final_eval["test_tokens"],
        "test_blocks": len(data.test_blocks),
    }


def describe_corpus(args: TrainArgs, data: RunData) -> str:
    """The model card's paragraph on the data: source, split, sizes, blocks."""
    source = (
        "the Python standard library that ran the training (its `.py` files, docstrings included; test "
        "suites and site-packages left out)"
        if not args.data
        else f"`{', '.join(args.data)}`"
    )
    test = (
        f"; test (the dataset's test split, scored once after training): {data.documents['test']} documents, "
        f"{data.test_blocks.numel():,} tokens"
        if data.documents["test"]
        else ""
    )
    if data.stream is not None:
        return (
            f"`{data.corpus_name}`: {source}, read as a stream (`--streaming`) in its order. Documents go to "
            f"validation by a hash of their text (fraction {args.val_fraction}; a dataset's own validation split "
            f"instead, where it has one). Validation: {data.documents['validation']} documents, "
            f"{data.val_blocks.numel():,} tokens{test} (blocks of {args.seq_len} tokens, documents joined by `</s>`)."
        )
    return (
        f"`{data.corpus_name}`: {source}. Documents go to validation by a hash of their name "
        f"(fraction {args.val_fraction}; a dataset's own validation split instead, where it has one), so the "
        f"split is deterministic. Training: {data.documents['train']} documents, {data.train_blocks.numel():,} "
        f"tokens; validation: {data.documents['validation']} documents, {data.val_blocks.numel():,} tokens{test} "
        f"(blocks of {args.seq_len} tokens, documents joined by `</s>`"
        f"{'; each document its own sequence, no attention across documents (--packing)' if args.packing else ''})."
    )
