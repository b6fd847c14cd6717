"""The optimisation step's two choices checked against transformers, the independent reference: the
learning-rate schedule (warm-up, then cosine to a floor) and which parameters get weight decay."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from swapformer.training.args import TrainArgs
from swapformer.training.model import build_model, model_options
from swapformer.training.step import lr_lambda, make_optimizer, param_groups

TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def learning_rates(scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("warmup", [0, 1, 6])
def test_the_schedule_is_transformers_cosine_with_a_floor_one_step_ahead_in_warmup(warmup):
    """After the warm-up the rates equal transformers' get_cosine_with_min_lr_schedule_with_warmup;
    during it, ours is one step ahead (its first step trains at lr / warmup, where transformers' trains
    at 0)."""
    steps = 40
    args = TrainArgs(max_steps=steps, warmup_steps=warmup, min_lr_ratio=0.1, lr=1e-3).resolved()
    ours = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1)], lr=args.lr), lr_lambda(args))
    reference = get_cosine_with_min_lr_schedule_with_warmup(
        torch.optim.SGD([torch.zeros(1)], lr=args.lr), warmup, steps, min_lr_rate=0.1
    )
    a, b = learning_rates(ours, steps + 3), learning_rates(reference, steps + 2)
    for i in range(steps + 1):
        assert a[i] == pytest.approx(b[i + 1] if i < warmup else b[i], rel=1e-12, abs=1e-15), i
    # the floor, min_lr_ratio x peak, is held past the end (where transformers' cosine climbs again)
    assert a[0] > 0 and a[steps:] == pytest.approx([1e-4] * 3, rel=1e-12) and b[steps + 1] > 1e-4


@pytest.mark.parametrize(
    "arch, options",
    [
        ("decoder", {}),  # RMSNorm, no biases, RoPE
        (
            "encoder",
            dict(
                norm_type="layernorm", attention_bias=True, mlp_bias=True, position_embedding_type="learned"
            ),
        ),
        ("encoder-decoder", dict(position_embedding_type="relative_bias")),
    ],
)
def test_weight_decay_falls_on_the_parameters_transformers_trainer_decays(arch, options, tmp_path):
    """param_groups decays every matrix and no norm or bias (it goes by shape): the same parameters as
    Trainer's get_decay_parameter_names (which goes by layer type and name), on each architecture."""

    class Tokenizer:  # what build_model reads of a tokenizer
        pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

        def __len__(self):
            return 300

    args = TrainArgs(arch=arch, set={**TINY_MODEL, **options}, weight_decay=0.1).resolved()
    model = build_model(args, model_options(args), Tokenizer())
    decayed, not_decayed = param_groups(model, args.weight_decay)
    assert (decayed["weight_decay"], not_decayed["weight_decay"]) == (0.1, 0.0)
    names = {id(p): n for n, p in model.named_parameters()}
    # Trainer lists a tied weight under each of its names (lm_head.weight and the embedding): compare tensors
    by_name = dict(model.named_parameters(remove_duplicate=False))
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))
    reference = {id(by_name[n]) for n in trainer.get_decay_parameter_names(model)}
    # one known difference: T5's bucket table `relative_attention_bias` is an embedding matrix, decayed
    # here; Trainer's name rule ("bias" in the name) leaves it out
    tables = {id(p) for n, p in by_name.items() if n.endswith("relative_attention_bias.weight")}
    assert bool(tables) == (options.get("position_embedding_type") == "relative_bias")
    reference |= tables
    assert {id(p) for p in decayed["params"]} == reference, sorted(map(names.get, reference))
    assert len(decayed["params"]) + len(not_decayed["params"]) == len(names)
    assert any(n.endswith("bias") for n in map(names.get, map(id, not_decayed["params"]))) == bool(
        options.get("mlp_bias")
    )
    # and the optimizer is built with those groups
    optimizer = make_optimizer(model, args)
    assert [len(g["params"]) for g in optimizer.param_groups] == [
        len(decayed["params"]),
        len(not_decayed["params"]),
    ]
