"""Trainer integration: gradient accumulation with num_items_in_batch equals one big batch."""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer

from conftest import LM_CLASSES, build, exact_sgd_args, max_diff, tiny_config


class Rows(torch.utils.data.Dataset):
    """Four rows with 2, 3, 4 and 10 tokens: however the sampler pairs them into two micro-batches,
    the pairs hold different numbers of labels, so averaging per-micro-batch means would be wrong."""

    def __init__(self, arch, lengths=(2, 3, 4, 10), length=10):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for n in lengths:
            ids = torch.randint(3, 90, (length,), generator=g)
            mask = torch.zeros(length, dtype=torch.long)
            mask[:n] = 1
            labels = ids.masked_fill(mask == 0, -100)
            item = dict(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask, labels=labels)
            if arch == "seq2seq":
                item["labels"] = labels[:6]
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def train_one_step(arch, tmp_path, batch, accumulation, accepts_loss_kwargs=True):
    model = build(LM_CLASSES[arch], tiny_config(arch))
    if not accepts_loss_kwargs:
        model.accepts_loss_kwargs = False  # Trainer then averages the micro-batches' mean losses
    model.train()
    args = exact_sgd_args(
        tmp_path / f"{batch}x{accumulation}{'' if accepts_loss_kwargs else '-mean'}",
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
    )
    Trainer(model=model, args=args, train_dataset=Rows(arch)).train()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["encoder", "decoder", "seq2seq"])
def test_gradient_accumulation_matches_one_big_batch(arch, tmp_path, report):
    big = train_one_step(arch, tmp_path, batch=4, accumulation=1)
    accumulated = train_one_step(arch, tmp_path, batch=2, accumulation=2)
    start = {n: p for n, p in build(LM_CLASSES[arch], tiny_config(arch)).named_parameters()}
    moved = max(max_diff(big[n], start[n]) for n in big)
    worst = max(max_diff(big[n], accumulated[n]) for n in big)
    report(f"{arch}: parameter change of the step", moved)
    report(f"{arch}: max abs diff, 4x1 vs 2x2 accumulation", worst)
    assert moved > 1e-3  # the step did something
    assert worst <= 1e-5


@pytest.mark.parametrize("arch", ["encoder", "decoder", "seq2seq"])
def test_accumulation_4x1_matches_one_batch_and_needs_num_items_in_batch(arch, tmp_path, report):
    """One row per micro-batch (2, 3, 4 and 10 tokens): the step equals one batch of four, and
    the same run without num_items_in_batch (mean of the micro-batches' means) does not."""
    big = train_one_step(arch, tmp_path, batch=4, accumulation=1)
    accumulated = train_one_step(arch, tmp_path, batch=1, accumulation=4)
    averaged = train_one_step(arch, tmp_path, batch=1, accumulation=4, accepts_loss_kwargs=False)
    worst = max(max_diff(big[n], accumulated[n]) for n in big)
    naive = max(max_diff(big[n], averaged[n]) for n in big)
    report(f"{arch}: max abs diff, 4x1 vs 1x4 accumulation", worst)
    report(f"{arch}: max abs diff, 4x1 vs 1x4 averaging micro-batch means", naive)
    assert worst <= 1e-5
    assert naive > 1e-3  # the comparison sees a loss that ignores num_items_in_batch
