"""Assisted and prompt-lookup decoding (issue 26): generate() drafts tokens (with an assistant model, or
from the n-grams of the text so far), verifies them in one forward and crops the rejected ones off
every cache layer (`Cache.crop`). Each layer type's cache, the int8 cache's included, must crop back
to what the next step sees, so the tokens and logits are those of plain greedy decoding on the same
model (the live reference), and a step after a crop gives the logits of an uncached forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.caches.cache import SlidingWindowLayer, dynamic_cache, static_cache
from swapformer.modeling.caches.int8_cache import Int8Cache
from swapformer.modeling.compat.hf_compat import DynamicSlidingWindowLayer

from conftest import LM_CLASSES, build, generate_steps, max_diff, padded_batch, tiny_config

WINDOW = 3
# Repeated n-grams, so that prompt lookup finds drafts; the tiny models soon repeat themselves too.
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
NEW = 24
TOLERANCE = 1e-5  # fp32 logits, as in test_generate.py
INT8_RTOL = 1e-2  # relative L2 of logits: a verified draft attends the drafts before it at full precision,
# plain decoding reads them back from int8 (test_int8.py: CACHE_RTOL)


def lm(layer_types, window=WINDOW, noise=0.0):
    """A tiny decoder with `layer_types`; the weights depend only on the seed, so two models with other layer
    types or windows share them, and `noise` perturbs them (an assistant that sometimes disagrees)."""
    config = tiny_config(
        "decoder",
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=window,
        global_tokens=2,
        attention_block_size=2,
        num_random_blocks=1,
        position_embedding_type="rope",
        num_key_value_heads=2,
    )
    model = build(LM_CLASSES["decoder"], config, attn="sdpa")
    if noise:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn(p.shape, generator=g))
    return model


def new_cache(model, kind):
    """A cache as a user builds it: transformers' `DynamicCache(config=...)` (its layers read as they
    are), swapformer's own ("swapformer", what generate() builds), or the int8 one."""
    if kind == "swapformer":
        return dynamic_cache(model.config)
    return DynamicCache(config=model.config) if kind == "dynamic" else Int8Cache(model.config)


def greedy(model, kind, monkeypatch=None, **options):
    """generate() for NEW tokens with a fresh cache of `kind` ("static": the one generate() builds, whose
    crops `monkeypatch` records on the class); the output, the number of forwards of `model`, and the
    tokens each crop of its cache removed."""
    removed, forwards = [], []
    if kind == "static":
        crop = StaticCache.crop
        monkeypatch.setattr(StaticCache, "crop", lambda cache, n: (removed.append(-n), crop(cache, n))[1])
        options.update(cache_implementation="static", max_cache_len=PROMPT.shape[1] + NEW + 3)
    else:
        cache = options["cache"] = new_cache(model, kind)
        crop = cache.crop
        cache.crop = lambda n: (removed.append(-n), crop(n))[1]
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        out = generate_steps(model, PROMPT, NEW, output_logits=True, **options)
    finally:
        hook.remove()
    return out, len(forwards), removed


def assert_same_decoding(drafted, plain, kind):
    assert torch.equal(drafted.sequences, plain.sequences)
    assert len(drafted.logits) == len(plain.logits) == NEW
    for got, want in zip(drafted.logits, plain.logits):
        if kind == "dynamic":
            assert max_diff(got, want) <= TOLERANCE
        else:
            assert float((got - want).norm() / want.norm()) <= INT8_RTOL


def stored(layer) -> int:
    return layer._stored() if hasattr(layer, "_stored") else layer.keys.shape[-2]


DRAFTS = ["prompt_lookup", "assistant", "assistant_other_layer_types"]


def draft_options(drafts: str, layer_type: str) -> dict:
    if drafts == "prompt_lookup":
        return dict(prompt_lookup_num_tokens=3)
    # the main model's weights, perturbed: its drafts are accepted at some steps, rejected at others
    types = [layer_type, "full_attention"]
    if drafts == "assistant_other_layer_types":
        types = ["sliding_global_attention", "sliding_attention"]
    assistant = lm(types, window=2, noise=0.3)
    return dict(assistant_model=assistant, num_assistant_tokens=3, num_assistant_tokens_schedule="constant")


@pytest.mark.parametrize("drafts", DRAFTS)
@pytest.mark.parametrize("kind", ["dynamic", "int8"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_drafted_decoding_generates_what_greedy_decoding_does(layer_type, kind, drafts):
    """Same tokens (and logits) as plain greedy decoding, on every layer type's cache; the window
    layers drop keys within the prompt already. Drafts were both accepted (fewer forwards than tokens)
    and rejected (a crop removed tokens), or the comparison would prove nothing."""
    model = lm([layer_type, "full_attention"])
    plain, plain_forwards, _ = greedy(model, kind)
    assert plain_forwards == NEW
    drafted, forwards, removed = greedy(model, kind, **draft_options(drafts, layer_type))
    assert_same_decoding(drafted, plain, kind)
    assert forwards < NEW and max(removed) > 0, (forwards, removed)


@pytest.mark.parametrize("kind", ["swapformer", "int8", "dynamic"])
def test_window_of_one_crops_to_no_key(kind):
    """A window of 1 keeps no key between steps (cache.py: SlidingWindowLayer), also after crops, in the
    caches swapformer builds; transformers' own layer (a user's `DynamicCache(config=...)`), which keeps
    every key ([-0:]), is read as it is and keeps its class: the same tokens and logits."""
    model = lm(["sliding_attention", "full_attention"], window=1)
    plain, _, _ = greedy(model, kind)
    drafted, forwards, removed = greedy(model, kind, prompt_lookup_num_tokens=3)
    assert_same_decoding(drafted, plain, "int8" if kind == "int8" else "dynamic")
    assert forwards < NEW and max(removed) > 0, (forwards, removed)
    if kind == "dynamic":
        assert type(drafted.cache.layers[0]) is DynamicSlidingWindowLayer
        swapformers, _, _ = greedy(model, "swapformer")
        assert_same_decoding(drafted, swapformers, "dynamic")
    else:
        assert isinstance(drafted.cache.layers[0], SlidingWindowLayer)
        assert stored(drafted.cache.layers[0]) == 0  # transformers' crop kept every drafted key ([-0:])


@pytest.mark.parametrize("kind", ["dynamic", "int8"])
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_a_step_after_a_crop_equals_the_uncached_forward(layer_type, kind):
    """Left-padded rows: a prompt, five drafted tokens verified in one forward, three of them cropped,
    then one step: its logits are those of an uncached forward over the kept tokens, and each layer
    holds what it holds without drafts (window layers: back to the window)."""
    model = lm([layer_type, "full_attention"])
    ids, mask = padded_batch(batch=2, length=9, padding="left")
    drafts, step = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(0)), ids[:, :1] + 1
    cache, reference = new_cache(model, kind), new_cache(model, kind)
    cache.activate_past_recording()
    ones = torch.ones(2, 5, dtype=mask.dtype)
    kept = torch.cat([ids, drafts[:, :2], step], dim=1)
    kept_mask = torch.cat([mask, ones[:, :3]], dim=1)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        model(drafts, attention_mask=torch.cat([mask, ones], dim=1), cache=cache)
        cache.crop(-3)
        assert cache.get_seq_length() == ids.shape[1] + 2
        got = model(step, attention_mask=kept_mask, cache=cache).logits[:, -1]
        want = model(kept, attention_mask=kept_mask, use_cache=False).logits[:, -1]
        for i in range(kept.shape[1]):  # the same tokens one by one, never drafted
            model(kept[:, i : i + 1], attention_mask=kept_mask[:, : i + 1], cache=reference)
    if kind == "dynamic":
        assert max_diff(got, want) <= TOLERANCE
    else:
        assert float((got - want).norm() / want.norm()) <= INT8_RTOL
    cache.crop(0)  # trims back, as generate() does after every verification
    assert [stored(a) for a in cache.layers] == [stored(b) for b in reference.layers]


@pytest.mark.parametrize("kind", ["dynamic", "int8"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "sliding_global_attention"])
def test_crop_refuses_tokens_the_window_already_dropped(layer_type, kind):
    """Without past recording, a window layer that dropped keys cannot give them back: a ValueError
    naming the fix, not a silently wrong cache."""
    model = lm([layer_type, "full_attention"])
    cache = new_cache(model, kind)
    with torch.no_grad():
        model(PROMPT, cache=cache)
        model(PROMPT[:, :2], cache=cache)
    # transformers' own window layer (dynamic, windows over 1) refuses with a RuntimeError naming the same fix
    with pytest.raises((ValueError, RuntimeError), match="activate_past_recording"):
        cache.crop(-2)


def test_static_window_layer_crops_only_before_it_dropped_tokens():
    """A static cache's window layer (cache.py: StaticWindowLayer, in the static caches swapformer and
    generate() build) crops while it holds every token, like transformers' static window layer; after it
    dropped one, a crop is refused."""
    model = lm(["sliding_attention", "full_attention"], window=4)
    cache = static_cache(model.config, max_cache_len=PROMPT.shape[1] + NEW)
    kept = torch.cat([PROMPT[:, :2], torch.tensor([[40]])], dim=1)  # the third token replaced
    with torch.no_grad():
        model(PROMPT[:, :2], attention_mask=torch.ones_like(PROMPT[:, :2]), cache=cache)
        model(PROMPT[:, 2:3], attention_mask=torch.ones_like(PROMPT[:, :3]), cache=cache)
        cache.crop(-1)
        mask = torch.ones_like(kept)
        got = model(kept[:, 2:], attention_mask=mask, cache=cache).logits[:, -1]
        want = model(kept, attention_mask=mask, use_cache=False).logits[:, -1]
        assert max_diff(got, want) <= TOLERANCE
        model(PROMPT[:, 3:6], attention_mask=torch.ones_like(PROMPT[:, :6]), cache=cache)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="Cannot crop 1 token.*StaticWindowLayer"):
        cache.crop(-1)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_global_attention", "bigbird_attention"])
def test_drafted_decoding_with_a_static_cache(layer_type, monkeypatch):
    """Static caches crop too: their full, window + global and BigBird layers keep every slot.
    transformers 5.24 sizes the static cache one slot short of a last verified draft (Llama's generate()
    raises the same IndexError), so `greedy` gives room with `max_cache_len`."""
    model = lm([layer_type, "full_attention"])
    plain, _, _ = greedy(model, "static", monkeypatch)
    drafted, forwards, removed = greedy(model, "static", monkeypatch, prompt_lookup_num_tokens=3)
    assert_same_decoding(drafted, plain, "dynamic")
    assert forwards < NEW and max(removed) > 0, (forwards, removed)


def test_drafted_decoding_refuses_a_static_window_layer_past_its_window(monkeypatch):
    """A static window layer that outgrew its window cannot be cropped (cache.py: StaticWindowLayer), and
    transformers refuses assisted decoding then, as it does for Gemma 2's static cache."""
    model = lm(["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="requires a cache that can be cropped"):
        greedy(model, "static", monkeypatch, prompt_lookup_num_tokens=3)
