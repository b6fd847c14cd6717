"""A cache passed to generate() keeps the sequence it was filled with (issue 28). generate() expects the
inputs to continue that sequence; inputs no longer than what the cache holds are refused before the first
step, with the cache's length and the fix, the same way for an Int8Cache and a DynamicCache."""

from __future__ import annotations

import pytest
import torch
import transformers

import swapformer

from conftest import build, generate_steps, tiny_config

CACHES = {
    "Int8Cache": lambda config: swapformer.Int8Cache(config),
    "DynamicCache": lambda config: transformers.DynamicCache(config=config),
}


def decoder():
    return build(swapformer.DecoderForCausalLM, tiny_config("decoder", position_embedding_type="rope"))


def counting(model) -> list:
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", CACHES)
@pytest.mark.parametrize("prompt_tokens", [3, 10])  # the empty-input error (3) and a silently wrong run (10)
def test_a_filled_cache_with_a_new_prompt_is_refused_before_the_first_step(kind, prompt_tokens):
    model = decoder()
    ids = torch.randint(3, 97, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
    cache = CACHES[kind](model.config)
    generate_steps(model, ids, 7, cache=cache)
    held = prompt_tokens + 7 - 1
    assert cache.get_seq_length() == held
    calls = counting(model)
    with pytest.raises(ValueError) as error:
        generate_steps(model, ids, 7, cache=cache)
    assert calls == []
    message = str(error.value)
    assert f"The {kind} passed to generate() already holds {held} tokens" in message
    assert f"input_ids has {prompt_tokens}" in message
    assert f"{kind}(" in message  # how to start a new one
    assert "\n" not in message


@pytest.mark.parametrize("kind", CACHES)
def test_continuing_the_cached_sequence_still_works(kind):
    """The inputs transformers documents for a filled cache: the whole sequence, cached tokens first; the
    result equals generating the whole sequence without the earlier call."""
    model = decoder()
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = CACHES[kind](model.config)
    first = generate_steps(model, ids, 4, cache=cache).sequences
    more = torch.cat([first, torch.tensor([[5, 6]])], dim=1)
    continued = generate_steps(model, more, 3, cache=cache).sequences
    fresh = generate_steps(model, more, 3, cache=CACHES[kind](model.config)).sequences
    assert torch.equal(continued, fresh)
