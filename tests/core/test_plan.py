"""The per-forward plan (modeling/core/plan.py) where it meets activation checkpointing: a recomputed block
must not write the cache a second time."""

import torch
from transformers import DynamicCache

from conftest import LM_CLASSES, build, padded_batch, tiny_config


def test_checkpointed_training_leaves_a_passed_cache_unwritten():
    """transformers' checkpointing layers drop a block's cache while training (the backward pass
    recomputes the block, which would append its keys again); blocks reach the cache through their
    plan here, so the stack drops it. Without that the cache would hold the batch twice."""
    model = build(LM_CLASSES["decoder"], tiny_config("decoder"), attn="sdpa")
    model.train()
    model.activation_checkpointing_enable()
    ids, mask = padded_batch()
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, labels=ids, past_key_values=cache, use_cache=False)
    out.loss.backward()
    assert cache.get_seq_length() == 0
    model.eval()  # not training: the cache is read and written as always
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == ids.shape[1]
