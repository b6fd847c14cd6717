"""One optimisation step: forward and backward over this process's micro-batches, clipping, the
optimizer and the learning-rate schedule.

One optimizer step reads one global batch of `batch_size x grad_accum x processes` blocks
(data.step_batch). Each process takes its rows, and every micro-batch loss is normalised by the
labelled tokens of the whole global batch (`num_items_in_batch`), so gradient accumulation and data
parallelism both give the gradient of one big batch: 1 process x 2 accumulation steps and 2
processes x 1 follow the same loss curve.
"""

from __future__ import annotations

import contextlib
import math
import pathlib

import torch

from .args import TrainArgs


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


def lr_lambda(args: TrainArgs):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` x peak at `max_steps`."""

    def factor(i: int) -> float:  # i: optimizer steps taken so far
        if i < args.warmup_steps:
            return (i + 1) / args.warmup_steps
        progress = min(1.0, (i - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on norms and biases (1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.AdamW:
    """AdamW on torch's fused kernel, as transformers' Trainer picks by default: the same update in about
    a third of the foreach kernel's time on CPU (docs/benchmarks.md, the race against Trainer)."""
    return torch.optim.AdamW(
        param_groups(model, args.weight_decay),
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
        fused=True,
    )


def make_scheduler(accelerator, optimizer, args: TrainArgs) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule of the prepared `optimizer`, saved with every checkpoint. Not prepared itself: a
    prepared scheduler steps once per process per optimizer step."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    accelerator.register_for_checkpointing(scheduler)
    return scheduler


def forward_backward(accelerator, model, batch: dict, objective, args: TrainArgs) -> tuple[float, float]:
    """This process's micro-batches of the global batch, gradients accumulated; returns the mean loss
    over the global batch's labelled tokens and the clipped gradient norm."""
    world, rank, micro = accelerator.num_processes, accelerator.process_index, args.batch_size
    # DDP averages gradients over processes: each normalises by its share of the global count
    items = objective.num_targets(batch) / world
    loss_sum = torch.zeros((), device=accelerator.device)
    for i in range(args.grad_accum):
        rows = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
        inputs = {k: v[rows].to(accelerator.device) for k, v in batch.items()}
        last = i == args.grad_accum - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            loss = model(**inputs, num_items_in_batch=items).loss  # prepare() added autocast if asked
            accelerator.backward(loss)
        loss_sum += loss.detach()
    loss = float(accelerator.reduce(loss_sum, reduction="sum")) / world
    return loss, float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))


def optimizer_step(
    accelerator,
    model,
    optimizer,
    scheduler,
    batch: dict,
    objective,
    args: TrainArgs,
    *,
    step: int,
    last_checkpoint: pathlib.Path | None,
) -> tuple[float, float, float]:
    """Step `step` on its global `batch`; returns (loss, gradient norm, learning rate used).

    Raises:
        TrainingDiverged: the loss or the gradient norm is not finite (the weights are left as they
            were; the message names `last_checkpoint`)."""
    loss, grad_norm = forward_backward(accelerator, model, batch, objective, args)
    # fp16's loss scaler skips steps with infinite gradients by design; anything else non-finite stops
    fp16_skip = args.mixed_precision == "fp16" and math.isfinite(loss)
    if not math.isfinite(loss) or not (math.isfinite(grad_norm) or fp16_skip):
        raise TrainingDiverged(
            f"training stopped at step {step}: the loss is {loss} and the gradient norm {grad_norm}; "
            f"the weights were not updated. Last good checkpoint: {last_checkpoint or 'none (no checkpoint yet)'}. "
            "Lower --lr, raise --warmup-steps or use --mixed-precision no, then start again with "
            "--overwrite (or --resume with the same arguments)"
        )
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm, lr
