"""swapformer train's AdamW runs the kernel transformers' Trainer picks by default (torch's fused AdamW,
about a third of the foreach kernel's time on CPU at the `small` preset's size; see docs/benchmarks.md),
and one step of it moves the weights exactly as Trainer's optimizer does, the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from swapformer.training.args import TrainArgs
from swapformer.training.model import build_model, model_options
from swapformer.training.step import make_optimizer

TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


class Tokenizer:  # what build_model reads of a tokenizer
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __len__(self):
        return 300


def one_step(model, optimizer, batch) -> dict:
    model(**batch).loss.backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_one_adamw_step_moves_the_weights_exactly_as_trainers_default_optimizer(tmp_path):
    args = TrainArgs(set=TINY_MODEL, lr=1e-2).resolved()
    options = model_options(args)
    ours, theirs = (build_model(args, options, Tokenizer()) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    same = {name: getattr(args, name) for name in ("weight_decay", "adam_beta1", "adam_beta2")}
    settings = TrainingArguments(
        str(tmp_path), report_to=[], use_cpu=True, learning_rate=args.lr, adam_epsilon=args.adam_eps, **same
    )
    trainer = Trainer(model=theirs, args=settings)
    reference = trainer.create_optimizer()
    optimizer = make_optimizer(ours, args)
    assert optimizer.defaults["fused"] == reference.defaults["fused"], (
        f"swapformer's AdamW fused={optimizer.defaults['fused']}, Trainer's default fused="
        f"{reference.defaults['fused']}"
    )
    ids = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    after_ours, after_theirs = one_step(ours, optimizer, batch), one_step(theirs, reference, batch)
    moved = [k for k in after_ours if not torch.equal(after_ours[k], after_theirs[k])]
    assert not moved, moved
    before = build_model(args, options, Tokenizer()).state_dict()
    assert any(not torch.equal(before[k], after_ours[k]) for k in before)  # the step did move them


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_the_optimizer_keeps_its_decay_groups_with_the_fused_kernel(weight_decay):
    args = TrainArgs(set=TINY_MODEL, weight_decay=weight_decay).resolved()
    model = build_model(args, model_options(args), Tokenizer())
    optimizer = make_optimizer(model, args)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [weight_decay, 0.0]
    assert optimizer.defaults["fused"] is True
