"""generate() with KV caches: every step's logits equal an uncached forward over the same prefix.

Checked per step and on logits (tiny random models often pick the same tokens when a cache is
wrong), for greedy, sampling and beam search (whose cache is reordered between steps), on every
backend that decodes on this machine, with left-padded batches; plus what the caches hold (only
the kv heads, only the window) and generate()'s eos / pad / scores contract.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from swapformer.configuration.backends import BACKENDS
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.cpu import cpu_linear
from swapformer.modeling.cpu.weight_copies import DecodingWeights

from conftest import (
    LM_CLASSES,
    MIXED_LAYERS,
    POSITIONS,
    build,
    cached_step_diffs,
    generate_steps,
    max_diff,
    padded_batch,
    tiny_config,
)

# backends that decode on a CPU; flex recompiles per step shape, so it has its own (slow) test
DECODING = [n for n, c in BACKENDS.items() if c.kv_cache and "cpu" in c.devices and n != "flex_attention"]
TOLERANCE = 1e-5  # fp32 logits, the bound


def lm(arch, attn="sdpa", **overrides):
    return build(LM_CLASSES[arch], tiny_config(arch, **overrides), attn=attn)


def prompts(arch, batch=3, length=7):
    # decoder prompts are left-padded (generation appends on the right); encoder inputs right-padded
    return padded_batch(batch=batch, length=length, padding="left" if arch == "decoder" else "right")


@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_greedy_steps_equal_uncached_forward(arch, position, attn):
    """Positions continue across cache steps for every position type, on every backend."""
    model = lm(arch, attn, position_embedding_type=position, num_key_value_heads=2)
    ids, mask = prompts(arch)
    assert max(cached_step_diffs(model, ids, mask, 6)) <= TOLERANCE


@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_sampling_steps_equal_uncached_forward(arch, attn):
    model = lm(arch, attn, position_embedding_type="rope", num_key_value_heads=2)
    ids, mask = prompts(arch)
    torch.manual_seed(0)
    diffs = cached_step_diffs(model, ids, mask, 6, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    assert max(diffs) <= TOLERANCE


class UncachedReference(LogitsProcessor):
    """Sees, at every step of beam search, the running sequences (already reordered by the beams'
    parents) and the log-probabilities generate() computed from the cache; records how far those are
    from an uncached forward over the same sequences."""

    def __init__(self, model, ids, mask, beams):
        self.model, self.beams, self.diffs = model, beams, []
        self.ids, self.mask = ids.repeat_interleave(beams, 0), mask.repeat_interleave(beams, 0)

    @torch.no_grad()
    def __call__(self, input_ids, scores):
        if self.model.config.is_encoder_decoder:
            logits = self.model(
                self.ids, attention_mask=self.mask, decoder_input_ids=input_ids, use_cache=False
            ).logits
        else:
            grown = input_ids.shape[1] - self.ids.shape[1]
            mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], grown)], dim=1)
            logits = self.model(input_ids, attention_mask=mask, use_cache=False).logits
        # earlier processors (min_new_tokens) set some scores to -inf; compare the others
        finite = scores.isfinite()
        self.diffs.append(max_diff(scores[finite], logits[:, -1].log_softmax(-1)[finite]))
        return scores


def beam_search_diffs(model, ids, mask, new_tokens: int, beams: int = 3):
    """Beam search for exactly `new_tokens` steps; per-step diffs from UncachedReference, and the
    generate() output (with beam_indices and the cache)."""
    reference = UncachedReference(model, ids, mask, beams=beams)
    out = generate_steps(
        model,
        ids,
        new_tokens,
        attention_mask=mask,
        num_beams=beams,
        num_return_sequences=beams,
        logits_processor=LogitsProcessorList([reference]),
        output_scores=True,
    )
    return reference.diffs, out


@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_beam_search_steps_equal_uncached_forward(arch, attn):
    model = lm(arch, attn, position_embedding_type="alibi" if arch == "decoder" else "relative_bias")
    ids, mask = prompts(arch)
    diffs, out = beam_search_diffs(model, ids, mask, 6)
    assert len(diffs) == 6 and max(diffs) <= TOLERANCE
    # the cache was really reordered: some beam continued another beam's prefix
    parents = out.beam_indices[:, :6] % 3
    assert bool((parents[:, 1:] != parents[:, :-1]).any())


@pytest.mark.slow
def test_flex_attention_decoding_equals_uncached_forward():
    model = lm("decoder", "flex_attention", position_embedding_type="rope", num_key_value_heads=2)
    ids, mask = prompts("decoder", batch=2)
    assert max(cached_step_diffs(model, ids, mask, 3)) <= TOLERANCE


def test_left_padding_does_not_change_a_rows_generation():
    model = lm("decoder", "eager", position_embedding_type="learned")
    row = torch.tensor([[5, 6, 7, 8]])
    alone = model.generate(row, max_new_tokens=4, do_sample=False, pad_token_id=0)[:, 4:]
    batch = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (batch != 0).long()
    together = model.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(alone, together[:1, 6:])


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("attn", DECODING)
def test_left_padding_does_not_change_a_bigbird_rows_logits(attn, cache):
    """BigBird's random blocks are counted from a row's first real token, and a causal layout does not
    change as the sequence grows, so a left-padded prompt decodes with the logits of the prompt alone
    at every step (window 1 and no global token: the random blocks decide most keys)."""
    model = lm(
        "decoder",
        attn,
        layer_types=["bigbird_attention", "bigbird_attention"],
        sliding_window=1,
        global_tokens=0,
        attention_block_size=2,
        num_random_blocks=2,
        random_seed=3,
        position_embedding_type="rope",
    )
    row = torch.tensor([[5, 6, 7, 8, 9]])
    batch = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15, 16]])
    kw = dict(
        max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True
    )
    if cache == "static":
        kw["cache_implementation"] = "static"
    alone = model.generate(row, **kw)
    together = model.generate(batch, attention_mask=(batch != 0).long(), **kw)
    assert torch.equal(alone.sequences[:, 5:], together.sequences[:1, 8:])
    assert max(max_diff(a, b[:1]) for a, b in zip(alone.logits, together.logits)) <= TOLERANCE


@pytest.mark.parametrize("kv_heads", [1, 2])  # MQA, GQA (4 query heads)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_gqa_caches_hold_only_the_kv_heads(arch, kv_heads):
    model = lm(arch, position_embedding_type="rope", num_key_value_heads=kv_heads)
    ids, mask = prompts(arch)
    assert max(cached_step_diffs(model, ids, mask, 4)) <= TOLERANCE
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=3, pad_token_id=0, return_dict_in_generate=True
    )
    cache = out.cache
    caches = [cache] if arch == "decoder" else [cache.self_attention_cache, cache.cross_attention_cache]
    for c in caches:
        for layer in c.layers:
            assert layer.keys.shape[1] == kv_heads and layer.values.shape[1] == kv_heads


def test_cross_attention_keys_are_computed_once():
    model = lm("seq2seq", position_embedding_type="learned")
    ids, mask = prompts("seq2seq")
    calls = []
    k_proj = model.model.decoder.layers[0].cross_attn.k_proj
    handle = k_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape))
    model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
    handle.remove()
    assert len(calls) == 1 and calls[0][1] == ids.shape[1]


WINDOW, GLOBALS = 4, 2


@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_windowed_caches_stop_growing_past_the_window(layer_type, attn):
    """Sliding layers keep the last window - 1 keys; window + global layers also keep the leading
    tokens up to the last global one; full and BigBird layers (random blocks reach anywhere) keep all."""
    model = lm(
        "decoder",
        attn,
        layer_types=[layer_type, "full_attention"],
        sliding_window=WINDOW,
        global_tokens=GLOBALS,
        attention_block_size=4,
        position_embedding_type="rope",
        num_key_value_heads=2,
    )
    ids, mask = prompts("decoder", length=9)  # row 2 has 4 padding tokens: its globals are at 4 and 5
    new = 16
    assert max(cached_step_diffs(model, ids, mask, new)) <= TOLERANCE
    cache = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
        return_dict_in_generate=True,
    ).cache
    total = ids.shape[1] + new - 1  # the last token is generated but never fed back
    kept = {
        "full_attention": total,
        "bigbird_attention": total,
        "sliding_attention": WINDOW - 1,
        "sliding_global_attention": 6 + WINDOW - 1,
    }[layer_type]
    assert cache.layers[0].keys.shape[-2] == kept
    assert cache.layers[1].keys.shape[-2] == total


def test_prompt_global_attention_mask_in_generate():
    """A per-row global_attention_mask over the prompt grows with generation; the marked tokens stay
    in the window + global cache and visible to every later step."""
    model = lm(
        "decoder",
        "sparse",
        layer_types=["sliding_global_attention", "full_attention"],
        sliding_window=WINDOW,
        global_tokens=1,
        attention_block_size=4,
        position_embedding_type="rope",
    )
    ids, mask = prompts("decoder", length=9)
    marks = torch.zeros_like(mask)
    marks[:, 6] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        global_attention_mask=marks,
        max_new_tokens=10,
        min_new_tokens=10,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    diffs = []
    for step, logits in enumerate(out.logits):
        prefix = out.sequences[:, : ids.shape[1] + step]
        prefix_mask = torch.cat([mask, mask.new_ones(mask.shape[0], step)], dim=1)
        prefix_marks = torch.cat([marks, marks.new_zeros(marks.shape[0], step)], dim=1)
        with torch.no_grad():
            ref = model(prefix, attention_mask=prefix_mask, global_attention_mask=prefix_marks).logits[:, -1]
        diffs.append(max_diff(logits, ref))
    assert max(diffs) <= TOLERANCE
    assert out.cache.layers[0].keys.shape[-2] == 7 + WINDOW - 1  # tokens 0..6, then the window


def test_global_token_after_the_cache_dropped_keys_is_refused():
    model = lm(
        "decoder",
        layer_types=["sliding_global_attention", "full_attention"],
        sliding_window=3,
        global_tokens=1,
        position_embedding_type="rope",
    )
    cache = DynamicCache(config=model.config)
    ids = torch.randint(3, 90, (1, 8))
    model(ids, cache=cache, use_cache=True)
    marks = torch.zeros(1, 9, dtype=torch.long)
    marks[0, 8] = 1
    with pytest.raises(ValueError, match="global token at index 8.*mark global tokens within the prompt"):
        model(torch.tensor([[5]]), cache=cache, use_cache=True, global_attention_mask=marks)


@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_eos_ends_a_row_and_pads_it(arch):
    model = lm(arch, position_embedding_type="rope")
    ids, mask = prompts(arch)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    start = ids.shape[1] if arch == "decoder" else 1
    eos = int(free[0, start + 1])  # row 0's second new token becomes the eos token
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=eos
    )
    row = out[0, start:]
    first = int((row == eos).nonzero()[0])
    assert first <= 1 and bool((row[first + 1 :] == 0).all())
    # rows that never produce eos run to max_new_tokens, and their tokens are unchanged
    for r in range(ids.shape[0]):
        if eos not in free[r, start:].tolist():
            assert torch.equal(out[r], free[r])


def test_scores_and_transition_scores():
    model = lm("decoder", position_embedding_type="learned")
    ids, mask = prompts("decoder")
    out = generate_steps(model, ids, 5, attention_mask=mask, output_scores=True, output_logits=True)
    assert len(out.scores) == 5 and out.scores[0].shape == (ids.shape[0], model.config.vocab_size)
    # scores are the logits after the processors (min_new_tokens masked the eos token)
    for scores, logits in zip(out.scores, out.logits):
        finite = scores.isfinite()
        assert (~finite).sum() == ids.shape[0] and torch.equal(scores[finite], logits[finite])
    transition = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    chosen = out.sequences[:, ids.shape[1] :]
    want = torch.stack(
        [lg.log_softmax(-1).gather(1, chosen[:, i : i + 1])[:, 0] for i, lg in enumerate(out.scores)], 1
    )
    assert max_diff(transition, want) <= 1e-6


@pytest.mark.parametrize("layers", ["full", "mixed"])
@pytest.mark.parametrize("attn", DECODING)
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_static_cache_generates_what_the_dynamic_cache_does(arch, attn, layers):
    """generate(cache_implementation="static") goes through transformers' compileable-cache path,
    which asks the model for its masks (create_masks_for_generate): swapformer keeps its own. With
    window layers among full ones, the window layers keep only the window (cache.py: StaticWindowLayer)."""
    options = {}
    if layers == "mixed":
        options = (
            dict(MIXED_LAYERS, decoder_layer_types=MIXED_LAYERS["layer_types"])
            if arch == "seq2seq"
            else MIXED_LAYERS
        )
    model = lm(arch, attn, position_embedding_type="rope", num_key_value_heads=2, **options)
    ids, mask = prompts(arch)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    dynamic = model.generate(ids, **kw)
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max(max_diff(a, b) for a, b in zip(dynamic.logits, static.logits)) <= TOLERANCE
    if layers == "mixed":
        window_layer = getattr(static.cache, "self_attention_cache", static.cache).layers[1]
        assert window_layer.keys.shape[-2] == MIXED_LAYERS["sliding_window"]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_decoding_copies_are_lent_for_generate_only(arch, tied, monkeypatch):
    """generate() decodes on input-major copies of the wide and square matrices (faster
    matrix-vector products on CPU), lent to the modules for the call only: the same tokens and
    logits as decoding on the Parameters, which stay the same objects, contiguous and tied."""
    model = lm(arch, position_embedding_type="rope", tie_word_embeddings=tied)
    model.decoding_copies = "all"  # "auto" would not copy for these short, batched calls
    ids, mask = prompts(arch)
    params = {n: (p, p.data_ptr(), p.stride()) for n, p in model.named_parameters()}
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, module.weight)

        return hook

    decoder = model.model.layers[0] if arch == "decoder" else model.model.decoder.layers[0]
    watched = {
        "lm_head": model.lm_head,
        "up": decoder.mlp.up_proj,
        "q": decoder.self_attn.q_proj,
        "down": decoder.mlp.down_proj,
    }
    if arch == "seq2seq":
        watched["cross k"] = decoder.cross_attn.k_proj
        watched["encoder q"] = model.model.encoder.layers[0].self_attn.q_proj
    hooks = [m.register_forward_pre_hook(record(n)) for n, m in watched.items()]
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    options.update(output_logits=True, return_dict_in_generate=True)
    out = model.generate(ids, **options)
    for hook in hooks:
        hook.remove()
    copied = {n for n, w in seen.items() if w is not watched[n].weight}
    # wide and square matrices read at every step; not MLP down (narrow), the encoder, cross k/v
    assert copied == {"lm_head", "up", "q"}
    assert all(not seen[n].is_contiguous() and torch.equal(seen[n], watched[n].weight) for n in copied)
    assert {n: (p, p.data_ptr(), p.stride()) for n, p in model.named_parameters()} == params
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    assert "_decoding_weights" not in model.__dict__
    monkeypatch.setattr(DecodingWeights, "candidates", staticmethod(lambda model, choice=None: []))
    plain = model.generate(ids, **options)
    assert torch.equal(out.sequences, plain.sequences)
    assert max(max_diff(a, b) for a, b in zip(out.logits, plain.logits)) <= TOLERANCE


def copied_weights(model, ids, mask):
    """The names of the Linear modules whose weight generate() read from a copy."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, module.weight)

        return hook

    hooks = [m.register_forward_pre_hook(record(n)) for n, m in linears.items()]
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    for hook in hooks:
        hook.remove()
    return {n for n, w in seen.items() if w is not linears[n].weight}


def test_decoding_copies_can_be_limited_and_fit_in_memory(monkeypatch, caplog):
    from transformers.utils import logging as hf_logging

    model = lm("decoder", tie_word_embeddings=False)
    model.decoding_copies = "all"
    ids, mask = prompts("decoder")
    everything = copied_weights(model, ids, mask)
    assert "lm_head" in everything and len(everything) > 1
    model.decoding_copies = "lm_head"
    assert copied_weights(model, ids, mask) == {"lm_head"}
    model.decoding_copies = "none"
    assert copied_weights(model, ids, mask) == set()
    model.decoding_copies = "some"
    with pytest.raises(ValueError, match="decoding_copies='some'.*'all', 'lm_head', 'none'"):
        model.generate(ids, attention_mask=mask, max_new_tokens=1)
    # copies that would take over half of the available memory: the head only, with a warning
    model.decoding_copies = "all"
    head = 97 * 32 * 4
    monkeypatch.setattr("swapformer.modeling.cpu.weight_copies.available_memory_bytes", lambda: 3 * head)
    hf_logging.get_logger("swapformer").warning_once.cache_clear()
    with caplog.at_level("WARNING"):
        assert copied_weights(model, ids, mask) == {"lm_head"}
    assert "only the LM head is copied" in caplog.text
    monkeypatch.setattr("swapformer.modeling.cpu.weight_copies.available_memory_bytes", lambda: head)
    assert copied_weights(model, ids, mask) == set()


def test_auto_copies_only_where_they_pay(monkeypatch):
    """The default "auto" on torch's linear route: copies for 1-2 rows per decoding step and at least
    MIN_NEW_TOKENS new tokens (where the measured gain repays the copying), none for batches, beams or
    short calls. (On the oneDNN route it copies nothing: test_linear.py.)"""
    model = lm("decoder", tie_word_embeddings=False)
    assert model.decoding_copies == "auto"
    ids, mask = prompts("decoder")
    lent = []
    real_during = DecodingWeights.during
    monkeypatch.setattr(
        DecodingWeights,
        "during",
        classmethod(lambda cls, m, choice=None: (lent.append(choice), real_during(m, choice))[1]),
    )
    long = DecodingWeights.MIN_NEW_TOKENS
    calls = [
        (ids[:1], dict(max_new_tokens=long), "all"),
        (ids[:2], dict(max_new_tokens=long), "all"),
        (ids[:1], dict(max_new_tokens=long - 1), "none"),
        (ids[:3], dict(max_new_tokens=long), "none"),
        (ids[:1], dict(max_new_tokens=long, num_beams=3), "none"),
        (ids[:1], dict(max_length=ids.shape[1] + long), "all"),
    ]
    with cpu_linear("torch"):
        for prompt, options, _ in calls:
            model.generate(
                prompt, attention_mask=mask[: len(prompt)], do_sample=False, pad_token_id=0, **options
            )
    assert lent == [want for _, _, want in calls]


def test_overlapping_generate_calls_share_the_copies_and_hand_back_the_parameters():
    """Serving threads generating on one model: the copies are lent once and the Parameters come
    back when the last call ends, even when the first one fails."""
    import threading

    model = lm("decoder", position_embedding_type="rope")
    model.decoding_copies = "all"
    ids, mask = prompts("decoder")
    params = {n: p for n, p in model.named_parameters()}
    options = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = model.generate(ids, **options)
    results, errors = [None] * 4, []

    def run(i):
        try:
            results[i] = model.generate(ids, **options)
        except Exception as error:  # reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and all(torch.equal(r, alone) for r in results)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "_decoding_weights" not in model.__dict__
    with pytest.raises(ValueError):
        model.generate(ids, attention_mask=mask[:, :3], max_new_tokens=2)  # a bad mask fails inside
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "_decoding_weights" not in model.__dict__


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
@pytest.mark.parametrize("arch", ["decoder", "seq2seq"])
def test_beam_search_on_the_window_and_global_cache(arch, attn):
    """Beam reordering of a cache that has dropped keys: still the uncached logits at every step."""
    options = dict(
        layer_types=["sliding_global_attention", "full_attention"],
        sliding_window=3,
        global_tokens=2,
        attention_block_size=4,
        position_embedding_type="rope",
    )
    if arch == "seq2seq":
        options["decoder_layer_types"] = options["layer_types"]
    model = lm(arch, attn, **options)
    ids, mask = prompts(arch, length=9)
    diffs, out = beam_search_diffs(model, ids, mask, 12)
    assert len(diffs) == 12 and max(diffs) <= TOLERANCE
    cache = getattr(out.cache, "self_attention_cache", out.cache)
    # decoder: leading tokens up to row 2's second real token (index 5), then the window; seq2seq: 2 + 2
    assert cache.layers[0].keys.shape[-2] == (6 + 2 if arch == "decoder" else 2 + 2)
