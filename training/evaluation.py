"""The evaluation stage: perplexity of the model and of a unigram baseline, both through the local
`evaluate` metric (training/perplexity.py). `evaluate` scores a split with the model being trained,
spread over the processes.

The baseline is a unigram model of the training targets (the tokens the objective asks the model to
predict, over the whole training split) with add-one (Laplace) smoothing, p(w) = (count(w) + 1) /
(N + V), scored on exactly the target tokens the model is scored on. A model
that has learned anything about context must beat it.
"""

from __future__ import annotations

import pathlib

import torch

METRIC_PATH = pathlib.Path(__file__).with_name("perplexity.py")


def load_metric():
    import evaluate

    return evaluate.load(str(METRIC_PATH), keep_in_memory=True)


def target_labels(batch: dict, shift: bool) -> torch.Tensor:
    """The labels the loss is taken on, aligned with the logits: (B, T')."""
    return batch["labels"][:, 1:] if shift else batch["labels"]


@torch.no_grad()
def model_log_probs(model, batches: list[dict], shift: bool) -> list[list[float]]:
    """For each validation row, log p(target token) under the model, over its labelled positions."""
    was_training = model.training
    model.eval()
    rows = []
    device = next(model.parameters()).device
    for batch in batches:
        # labels go in too: the seq2seq model makes its decoder inputs from them
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        if shift:
            logits = logits[:, :-1]
        labels = target_labels(batch, shift).to(device)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        for lp, lab in zip(picked, labels):
            rows.append(lp[lab != -100].tolist())
    model.train(was_training)
    return rows


def unigram_log_probs(counts: torch.Tensor, batches: list[dict], shift: bool) -> list[list[float]]:
    """log p(target token) under the add-one-smoothed unigram model with token `counts` (V,)."""
    log_p = torch.log((counts.double() + 1) / (counts.sum() + len(counts)))
    rows = []
    for batch in batches:
        for lab in target_labels(batch, shift):
            rows.append(log_p[lab[lab != -100]].tolist())
    return rows


def target_counts(train_blocks: torch.Tensor, objective, vocab_size: int, generator) -> torch.Tensor:
    """How often each token is a training target of `objective` (for span corruption the targets hold
    sentinels and `</s>` at their own rates, which raw text counts would miss)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in range(0, len(train_blocks), 256):
        labels = target_labels(objective(train_blocks[i : i + 256], generator), objective.shift)
        counts += torch.bincount(labels[labels != -100], minlength=vocab_size)
    return counts


def perplexity(rows: list[list[float]]) -> dict:
    metric = load_metric()
    metric.add_batch(log_probs=rows)
    return metric.compute()


def evaluate(accelerator, model, batches: list[dict], shift: bool, step: int, split: str) -> dict:
    """Loss and perplexity of the wrapped `model` on `batches` (the "val" or "test" split), as a
    metrics.jsonl record; {} in every process but the main one.

    Every process scores its share of the batches (each runs the same number of forwards, which FSDP
    needs; the last share is padded with batch 0), and the main process computes the metric over all
    rows in batch order."""
    from accelerate.utils import gather_object

    world, rank = accelerator.num_processes, accelerator.process_index
    per_process = -(-len(batches) // world)
    mine = list(range(rank, len(batches), world))
    padded = mine + [0] * (per_process - len(mine))
    rows = model_log_probs(model, [batches[i] for i in padded], shift)
    per_batch = [len(batches[i]["labels"]) for i in padded]
    scored = []  # (batch index, rows of that batch), padding dropped
    for k, i in enumerate(mine):
        start = sum(per_batch[:k])
        scored.append((i, rows[start : start + per_batch[k]]))
    scored = gather_object(scored) if world > 1 else scored
    if not accelerator.is_main_process:
        return {}
    result = perplexity([row for _, batch_rows in sorted(scored) for row in batch_rows])
    return {
        "step": step,
        f"{split}_loss": result["nll"],
        f"{split}_perplexity": result["perplexity"],
        f"{split}_tokens": result["num_tokens"],
    }
