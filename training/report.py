"""What a finished run leaves beside the weights: the loss-curve PNG and the model card."""

from __future__ import annotations

import platform

import torch

from ..hub_cards.render import render_model_card
from .args import TrainArgs, attn_backends

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


def write_model_card(path: str, *, args: TrainArgs, model, metrics: dict, corpus_name: str, corpus_text: str):
    """Render hub_cards/model_card.md with the run's real figures into `path` (README.md)."""
    cfg = model.config
    arch_text, objective, pipeline_tag, auto_class = ARCH_TEXT[args.arch]
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
        model_class=type(model).__name__,
        model_type=cfg.model_type,
        num_parameters=f"{metrics['num_parameters']:,}",
        layers=cfg.num_hidden_layers
        if not cfg.is_encoder_decoder
        else f"{cfg.num_hidden_layers}+{cfg.decoder_layers}",
        hidden_size=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        positions=cfg.position_embedding_type,
        norm=cfg.norm_type,
        mlp=f"{cfg.mlp_type} ({cfg.hidden_act})",
        attn=args.attn,
        vocab_size=cfg.vocab_size,
        seq_len=args.seq_len,
        dataset_description=corpus_text,
        hyperparameters="\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in hyper.items())]),
        auto_class=auto_class,
        repo_hint="path/or/repo-id",
        usage=USAGE[args.arch],
    )
    card.save(path)
    return card
