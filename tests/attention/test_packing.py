"""Packed (padding-free) sequences: a row holding several sequences gives every sequence exactly the
outputs and gradients it has when run alone, on every backend, position scheme and layer type.

The rows come from transformers' own `DataCollatorWithFlattening` (restarting `position_ids`,
`cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`); the reference is each sequence run alone.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

import swapformer
from swapformer.configuration.configuration_swapformer import LAYER_TYPES
from swapformer.modeling.attention import packing as packing_module

from conftest import BASE_CLASSES, ROOT, build, exact_sgd_args, max_diff
from conftest import pattern_config as patterns_config
from flash_reference import on_flash
from training_runs import losses, tiny_args

POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "relative_bias"]
# 40 tokens: sequences shorter and longer than a block (8) and the window (5); the second and third
# start inside a block, so bigbird's per-sequence random layout is not the packed row's
LENGTHS = (13, 5, 22)
TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def pattern_config(arch, layer_type, position="rope", **overrides):
    """test_patterns' tiny config (window 5, blocks of 8, 2 global tokens, 1 random block) with
    `position` embeddings."""
    return patterns_config(arch, layer_type, position_embedding_type=position, **overrides)


def sequences(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (n,), generator=g) for n in lengths]


def collate(seqs, **options):
    """The packing keys of one row, exactly as transformers' collator makes them (the tokens are
    `torch.cat(seqs)`; labels dropped, the base models take none)."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True, **options)
    batch = collator([{"input_ids": s.tolist()} for s in seqs])
    assert torch.equal(batch.pop("input_ids")[0], torch.cat(seqs))
    batch.pop("labels")
    return batch


def probes(seqs, width, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, len(s), width, generator=g) for s in seqs]


def run(model, embeds, probe, total, **inputs):
    """Output, input-embedding gradient and weight gradients of a loss summed over tokens against a
    fixed random probe (so the packed loss is exactly the sum of the sequences' losses)."""
    embeds = embeds.detach().requires_grad_()
    out = model(inputs_embeds=embeds, **inputs).last_hidden_state
    ((out * probe).sum() / total).backward()
    return out.detach(), embeds.grad


def weight_grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def alone_and_packed(model, seqs, packed_inputs, grads=True):
    """(alone, packed) results: outputs (1, T, E) of the packed row and of the sequences run alone,
    concatenated, with the input gradients and weight gradients when `grads`."""
    embed = model.get_input_embeddings()
    total = sum(len(s) for s in seqs)
    probe = probes(seqs, model.config.hidden_size)
    context = torch.enable_grad() if grads else torch.no_grad()
    model.zero_grad()
    with context:
        alone = [
            run(model, embed(s[None]), p, total) if grads else (model(s[None]).last_hidden_state, None)
            for s, p in zip(seqs, probe)
        ]
        alone_w = weight_grads(model) if grads else {}
        row = torch.cat(seqs)[None]
        if grads:
            packed = run(model, embed(row), torch.cat(probe, 1), total, **packed_inputs)
        else:
            packed = (model(row, **packed_inputs).last_hidden_state, None)
        packed_w = weight_grads(model) if grads else {}
    out_alone = torch.cat([a[0] for a in alone], 1)
    grad_alone = torch.cat([a[1] for a in alone], 1) if grads else None
    return (out_alone, grad_alone, alone_w), (packed[0], packed[1], packed_w)


def worst(alone, packed):
    """Largest difference over outputs, input gradients and weight gradients."""
    diffs = [max_diff(alone[0], packed[0])]
    if alone[1] is not None:
        diffs.append(max_diff(alone[1], packed[1]))
        assert alone[2].keys() == packed[2].keys()
        diffs += [max_diff(alone[2][n], packed[2][n]) for n in alone[2]]
    return max(diffs)


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_packed_row_equals_each_sequence_alone(arch, layer_type, position, attn):
    model = build(BASE_CLASSES[arch], pattern_config(arch, layer_type, position), attn=attn).train()
    seqs = sequences()
    alone, packed = alone_and_packed(model, seqs, collate(seqs))
    assert worst(alone, packed) <= TOL


@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens", "seq_idx"])
@pytest.mark.parametrize(
    "arch, layer_type, attn",
    [("decoder", "bigbird_attention", "sparse"), ("encoder", "sliding_global_attention", "sdpa")],
)
def test_each_packing_marker_suffices(arch, layer_type, attn, source):
    """Restarting position_ids alone, cu_seq_lens_* alone or seq_idx alone mark the sequences (without
    position_ids, positions restart by themselves)."""
    model = build(BASE_CLASSES[arch], pattern_config(arch, layer_type, "alibi"), attn=attn).train()
    seqs = sequences()
    full = collate(seqs)
    inputs = {
        "position_ids": {"position_ids": full["position_ids"]},
        "cu_seq_lens": {k: v for k, v in full.items() if k.startswith(("cu_", "max_"))},
        "seq_idx": {"seq_idx": full["seq_idx"]},
    }[source]
    alone, packed = alone_and_packed(model, seqs, inputs)
    assert worst(alone, packed) <= TOL


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_negative_control_the_comparison_catches_leakage(arch, attn, monkeypatch):
    """The same comparison fails (a) on the row without packing markers and (b) with the markers but
    the sequence boundaries taken out of the masks (positions still restart): it detects attention
    across sequences, not only wrong positions."""
    model = build(BASE_CLASSES[arch], pattern_config(arch, "bigbird_attention", "relative_bias"), attn=attn)
    model.train()
    seqs = sequences()
    alone, unmarked = alone_and_packed(model, seqs, {})
    assert worst(alone, unmarked) > 1e-2
    monkeypatch.setattr("swapformer.modeling.core.inputs.find_packed_sequences", lambda **kwargs: None)
    alone, leaking = alone_and_packed(model, seqs, collate(seqs))
    assert max_diff(alone[0], leaking[0]) > 1e-2
    assert worst(alone, leaking) > 1e-2


@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_packed_rows_with_padding(arch, attn, padding):
    """A padding mask combines with packing: two rows of packed sequences, padded to one length."""
    model = build(BASE_CLASSES[arch], pattern_config(arch, "bigbird_attention", "alibi"), attn=attn)
    rows = [sequences((9, 14, 6), seed=1), sequences((11, 3), seed=2)]
    length = 32
    ids = torch.zeros(2, length, dtype=torch.long)
    mask = torch.zeros(2, length, dtype=torch.long)
    positions = torch.zeros(2, length, dtype=torch.long)
    for r, seqs in enumerate(rows):
        n = sum(len(s) for s in seqs)
        cols = slice(0, n) if padding == "right" else slice(length - n, length)
        ids[r, cols] = torch.cat(seqs)
        mask[r, cols] = 1
        positions[r, cols] = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        packed = model(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        for r, seqs in enumerate(rows):
            alone = torch.cat([model(s[None]).last_hidden_state[0] for s in seqs])
            assert max_diff(packed[r][mask[r].bool()], alone) <= TOL


def seq2seq_alone_and_packed(model, sources, targets):
    """Encoder and decoder outputs of each (source, target) pair alone, and of both packed."""
    embed = model.get_input_embeddings()
    total = sum(len(t) for t in targets)
    probe = probes(targets, model.config.hidden_size)
    results = []
    for pairs, inputs in (
        ([(s[None], t[None], p) for s, t, p in zip(sources, targets, probe)], {}),
        (
            [(torch.cat(sources)[None], torch.cat(targets)[None], torch.cat(probe, 1))],
            dict(
                position_ids=collate(sources)["position_ids"],
                decoder_position_ids=collate(targets)["position_ids"],
            ),
        ),
    ):
        model.zero_grad()
        enc_outs, dec_outs = [], []
        for src, tgt, p in pairs:
            out = model(inputs_embeds=embed(src), decoder_inputs_embeds=embed(tgt), **inputs)
            ((out.last_hidden_state * p).sum() / total).backward()
            enc_outs.append(out.encoder_last_hidden_state.detach())
            dec_outs.append(out.last_hidden_state.detach())
        results.append((torch.cat(enc_outs, 1), torch.cat(dec_outs, 1), weight_grads(model)))
    return results


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
@pytest.mark.parametrize("layer_type", ["sliding_attention", "bigbird_attention"])
@pytest.mark.parametrize("position", ["rope", "relative_bias"])
def test_seq2seq_packed_on_both_sides(position, layer_type, attn):
    """The n-th decoder sequence of a packed row cross-attends only the n-th encoder sequence."""
    config = pattern_config("seq2seq", layer_type, position)
    model = build(swapformer.Seq2SeqModel, config, attn=attn).train()
    sources, targets = sequences(seed=4), sequences((6, 9, 4), seed=5)
    (enc_a, dec_a, grads_a), (enc_p, dec_p, grads_p) = seq2seq_alone_and_packed(model, sources, targets)
    assert max_diff(enc_a, enc_p) <= TOL and max_diff(dec_a, dec_p) <= TOL
    assert grads_a.keys() == grads_p.keys()
    assert max(max_diff(grads_a[n], grads_p[n]) for n in grads_a) <= TOL


def test_seq2seq_sides_must_pack_alike():
    model = build(swapformer.Seq2SeqModel, pattern_config("seq2seq", "full_attention"))
    sources, targets = sequences(seed=4), sequences((6, 9, 4), seed=5)
    packed_src = dict(input_ids=torch.cat(sources)[None], position_ids=collate(sources)["position_ids"])
    with pytest.raises(ValueError, match=r"Rows hold \[1\] decoder sequences but \[3\] encoder sequences"):
        model(**packed_src, decoder_input_ids=torch.cat(targets)[None])
    two = collate(targets[:2])["position_ids"]
    with pytest.raises(ValueError, match=r"Rows hold \[2\] decoder sequences but \[3\] encoder sequences"):
        model(**packed_src, decoder_input_ids=torch.cat(targets[:2])[None], decoder_position_ids=two)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(1, 19), min_size=1, max_size=5),
    arch=st.sampled_from(["decoder", "encoder"]),
    layer_type=st.sampled_from(LAYER_TYPES[1:]),
    attn=st.sampled_from(["sdpa", "sparse"]),
    seed=st.integers(0, 2**16),
)
def test_any_partition_of_a_row_equals_its_sequences_alone(lengths, arch, layer_type, attn, seed):
    """Sequences of any lengths (shorter than a block, a window, a global prefix; unaligned starts)."""
    config = pattern_config(arch, layer_type, "alibi", num_key_value_heads=2, random_seed=seed % 7)
    model = build(BASE_CLASSES[arch], config, attn=attn)
    seqs = sequences(lengths, seed=seed)
    alone, packed = alone_and_packed(model, seqs, collate(seqs), grads=False)
    assert worst(alone, packed) <= TOL


@pytest.mark.parametrize("layer_type", LAYER_TYPES[1:])
def test_attention_maps_of_a_packed_row_are_block_diagonal(layer_type):
    model = build(swapformer.DecoderModel, pattern_config("decoder", layer_type), attn="sparse")
    seqs = sequences()
    with torch.no_grad():
        maps = model(torch.cat(seqs)[None], output_attentions=True, **collate(seqs)).attentions
        alone = [model(s[None], output_attentions=True).attentions for s in seqs]
    ids = torch.cat([torch.full((len(s),), i) for i, s in enumerate(seqs)])
    across = ids[:, None] != ids[None, :]
    for layer, weights in enumerate(maps):
        assert torch.all(weights[..., across] == 0)
        offset = 0
        for s, own in zip(seqs, alone):
            block = weights[..., offset : offset + len(s), offset : offset + len(s)]
            assert max_diff(block, own[layer]) <= TOL
            offset += len(s)


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, layer_types",
    [
        ("decoder", ["bigbird_attention", "sliding_attention"]),
        ("encoder", ["sliding_global_attention", "bigbird_attention"]),
    ],
)
def test_flex_packed_row_equals_each_sequence_alone(arch, layer_types):
    """flex compiles per shape on CPU (slow) and has no CPU backward: forward only, one packed shape,
    against each sequence alone under eager (the oracle)."""
    config = pattern_config(arch, layer_types[0], "rope", layer_types=layer_types, num_key_value_heads=2)
    model = build(BASE_CLASSES[arch], config, attn="eager")
    seqs = sequences()
    try:
        with torch.no_grad():
            alone = torch.cat([model(s[None]).last_hidden_state for s in seqs], 1)
            model.set_attn_implementation("flex_attention")
            packed = model(torch.cat(seqs)[None], **collate(seqs)).last_hidden_state
    finally:
        # A second shape would make torch.compile recompile flex with dynamic shapes, whose CPU
        # template inductor (torch 2.13) fails to build: leave no compiled state to later tests.
        torch._dynamo.reset()
    assert max_diff(alone, packed) <= TOL


# flash_attention_2 -------------------------------------------------------------------------------
# The CUDA kernel cannot run here. What is tested: the arguments swapformer hands to transformers'
# flash path, and that transformers' own routing (integrations/flash_attention.py and
# modeling_flash_attention_utils._flash_attention_forward) then runs the varlen kernel on them, with
# the kernel replaced by a plain-torch implementation of flash_attn_varlen_func's contract
# (tests/flash_reference.py).


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_flash_gets_the_collators_boundaries_and_keeps_sequences_apart(arch, layer_type, reference_flash):
    model = on_flash(build(BASE_CLASSES[arch], pattern_config(arch, layer_type, num_key_value_heads=2)))
    seqs = sequences()
    full = collate(seqs)
    for inputs in (full, {"position_ids": full["position_ids"]}):  # the collator's keys, or positions alone
        reference_flash.clear()
        alone, packed = alone_and_packed(model, seqs, inputs)
        assert worst(alone, packed) <= TOL
        assert len(reference_flash) == 2  # one varlen call per layer (the alone runs take flash_attn_func)
        for call in reference_flash:
            assert torch.equal(call["cu_seqlens_q"], full["cu_seq_lens_q"])
            assert torch.equal(call["cu_seqlens_k"], full["cu_seq_lens_k"])
            assert call["max_seqlen_q"] == call["max_seqlen_k"] == full["max_length_q"]


def test_flash_cross_attention_pairs_packed_decoder_and_encoder_sequences(reference_flash):
    """Cross-attention gets the decoder's boundaries for queries and the encoder's for keys."""
    config = pattern_config("seq2seq", "full_attention", "rope", num_key_value_heads=2)
    model = on_flash(build(swapformer.Seq2SeqModel, config)).train()
    sources, targets = sequences(seed=4), sequences((6, 9, 4), seed=5)
    (enc_a, dec_a, grads_a), (enc_p, dec_p, grads_p) = seq2seq_alone_and_packed(model, sources, targets)
    assert max_diff(enc_a, enc_p) <= TOL and max_diff(dec_a, dec_p) <= TOL
    assert max(max_diff(grads_a[n], grads_p[n]) for n in grads_a) <= TOL
    cross = [c for c in reference_flash if not torch.equal(c["cu_seqlens_q"], c["cu_seqlens_k"])]
    assert len(cross) == 2  # one cross-attention call per decoder layer
    assert cross[0]["cu_seqlens_q"].tolist() == [0, 6, 15, 19]
    assert cross[0]["cu_seqlens_k"].tolist() == [0, 13, 18, 40]


def test_flash_boundaries_over_several_rows():
    """Rows are flattened one after another, as transformers' varlen path reshapes them."""
    flags = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    packed = packing_module.PackedSequences.from_starts(flags, torch.ones_like(flags))
    cu, longest = packed.flash_boundaries()
    assert cu.tolist() == [0, 3, 5, 7, 9, 10] and cu.dtype == torch.int32 and longest == 3


def test_flash_refuses_padding_together_with_packing():
    model = on_flash(build(swapformer.DecoderModel, pattern_config("decoder", "full_attention")))
    ids = torch.tensor([[5, 6, 7, 8, 9, 0]])
    with pytest.raises(
        ValueError, match="flash_attention_2 cannot combine a padding mask with packed sequences"
    ):
        model(
            ids,
            attention_mask=torch.tensor([[1, 1, 1, 1, 1, 0]]),
            position_ids=torch.tensor([[0, 1, 0, 1, 2, 0]]),
        )


# Wrong or contradictory packing inputs -----------------------------------------------------------


def decoder():
    return build(swapformer.DecoderForCausalLM, pattern_config("decoder", "full_attention"))


ROW = torch.arange(3, 13)[None]  # 10 tokens
POSITIONS_3_7 = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])


@pytest.mark.parametrize(
    "inputs, message",
    [
        (
            dict(
                position_ids=POSITIONS_3_7,
                cu_seq_lens_q=torch.tensor([0, 4, 10]),
                cu_seq_lens_k=torch.tensor([0, 4, 10]),
            ),
            r"cu_seq_lens_q and position_ids mark different sequence boundaries \(first difference at row 0, token 3\)",
        ),
        (
            dict(position_ids=POSITIONS_3_7, seq_idx=torch.tensor([[0] * 10])),
            "seq_idx and position_ids mark different sequence boundaries",
        ),
        (
            dict(cu_seq_lens_q=torch.tensor([0, 3, 10]), cu_seq_lens_k=torch.tensor([0, 4, 10])),
            r"cu_seq_lens_q=\[0, 3, 10\] and cu_seq_lens_k=\[0, 4, 10\] differ",
        ),
        (dict(cu_seq_lens_q=torch.tensor([0, 3, 10])), "cu_seq_lens_q was given alone"),
        (
            dict(cu_seq_lens_q=torch.tensor([0, 3, 9]), cu_seq_lens_k=torch.tensor([0, 3, 9])),
            r"must run from 0 to the number of tokens of the flattened batch, 1 x 10 = 10",
        ),
        (
            dict(cu_seq_lens_q=torch.tensor([0, 3, 3, 10]), cu_seq_lens_k=torch.tensor([0, 3, 3, 10])),
            "must increase strictly",
        ),
        (
            dict(cu_seq_lens_q=[0, 3, 10], cu_seq_lens_k=[0, 3, 10], max_length_q=3, max_length_k=7),
            "max_length_q=3 but the longest sequence of cu_seq_lens_q has 7 tokens",
        ),
        (dict(max_length_q=7), "max_length_q=7 was given without cu_seq_lens_q"),
        (
            dict(seq_idx=torch.zeros(1, 9, dtype=torch.int32)),
            r"seq_idx has shape \(1, 9\); it needs \(batch=1, length=10\)",
        ),
    ],
    ids=[
        "cu-vs-positions",
        "seq_idx-vs-positions",
        "q-vs-k",
        "q-alone",
        "total",
        "empty",
        "max-length",
        "max-alone",
        "seq_idx-shape",
    ],
)
def test_contradictory_or_malformed_packing_inputs_are_refused(inputs, message):
    with pytest.raises(ValueError, match=message):
        decoder()(ROW, **inputs)


def test_a_sequence_may_not_run_across_rows():
    ids = torch.arange(3, 13).view(2, 5)
    cu = torch.tensor([0, 3, 7, 10])
    with pytest.raises(
        ValueError, match="has a sequence running across the end of a row .no boundary at token 5"
    ):
        decoder()(ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu)


def test_packed_rows_cannot_extend_a_cache_nor_be_extended():
    model = decoder()
    out = model(ROW, position_ids=POSITIONS_3_7, use_cache=True)
    with pytest.raises(ValueError, match=r"This cache was filled from packed rows .* \(pad them\)"):
        model(torch.tensor([[20]]), cache=out.cache)
    plain = model(ROW[:, :4], use_cache=True).cache
    with pytest.raises(
        ValueError,
        match="position_ids put several sequences into one row .* holds 4 tokens and packed rows cannot",
    ):
        model(ROW[:, 4:], position_ids=torch.tensor([[4, 5, 0, 1, 2, 3]]), cache=plain)


def test_generate_from_a_packed_prompt_fails_clearly():
    with pytest.raises(ValueError, match="This cache was filled from packed rows"):
        decoder().generate(ROW, position_ids=POSITIONS_3_7, max_new_tokens=2, do_sample=False, pad_token_id=0)


def test_left_padded_generate_positions_are_not_packing():
    """generate() gives padding position 1: [1, 1, 0, 1, 2] is one sequence, not three."""
    model = decoder()
    ids, mask = torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        with_positions = model(ids, attention_mask=mask, position_ids=torch.tensor([[1, 1, 0, 1, 2]])).logits
        without = model(ids, attention_mask=mask).logits
    assert max_diff(with_positions[:, 2:], without[:, 2:]) == 0.0


def test_backends_without_packing_are_refused_at_the_forward(monkeypatch):
    """sdpa_fa (CUDA only, so put in place here without the device check) can apply no mask."""
    model = decoder()
    model.config._attn_implementation_internal = "sdpa_fa"
    with pytest.raises(
        ValueError,
        match="'sdpa_fa' does not support packed sequences .*, which this batch needs; use one of 'eager', 'sdpa'",
    ):
        model(ROW, position_ids=POSITIONS_3_7)
    assert "| packing |" in swapformer.capability_table_markdown()


# Training with the collator ----------------------------------------------------------------------


class Documents(torch.utils.data.Dataset):
    def __init__(self, lengths=(5, 17, 9, 12, 3, 20, 8, 14)):
        self.items = [{"input_ids": s.tolist()} for s in sequences(lengths, seed=7)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_collate(features):
    """The padded twin of DataCollatorWithFlattening: right padding, and labels with -100 at padding
    and at each first token, as the flattening collator sets them (so Trainer counts the same labelled
    tokens for num_items_in_batch)."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def trainer_run(tmp_path, name, collator, attn):
    from transformers import Trainer

    model = build(
        swapformer.DecoderForCausalLM, pattern_config("decoder", "sliding_attention", "rope"), attn=attn
    )
    args = exact_sgd_args(
        tmp_path / name, per_device_train_batch_size=4, max_steps=3, learning_rate=0.1, logging_steps=1
    )
    trainer = Trainer(model=model, args=args, train_dataset=Documents(), data_collator=collator)
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_trainer_with_flattening_collator_trains_like_padded_batches(attn, tmp_path, report):
    """Trainer + DataCollatorWithFlattening (all its keys) on a swapformer decoder: the same losses
    and weights, step by step, as the same documents padded into rows."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    packed_losses, packed = trainer_run(tmp_path, "packed", collator, attn)
    padded_losses, padded = trainer_run(tmp_path, "padded", pad_collate, attn)
    start = build(swapformer.DecoderForCausalLM, pattern_config("decoder", "sliding_attention")).state_dict()
    moved = max(max_diff(padded[n], start[n]) for n in padded)
    diff = max(max_diff(packed[n], padded[n]) for n in packed)
    report("weights after 3 steps, packed vs padded", diff)
    assert len(packed_losses) == 3 and moved > 1e-3
    assert max(abs(a - b) for a, b in zip(packed_losses, padded_losses)) <= 1e-4  # logged rounded
    assert diff <= TOL


# swapformer train --packing -----------------------------------------------------------------------


EOS = 2


def test_document_positions_restart_after_every_end_of_document():
    from swapformer.training.args import TrainArgs
    from swapformer.training.data import DocumentPacking, document_positions
    from swapformer.training.objectives import CausalLM

    blocks = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 4], [EOS, 3, 4, EOS, EOS, 5, 6, 7]])
    assert document_positions(blocks, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 0, 0, 1, 2]]
    batch = DocumentPacking(CausalLM(None, TrainArgs(seq_len=8)), EOS)(blocks, torch.Generator())
    assert torch.equal(batch["input_ids"], blocks)
    # no loss on a document's first token: it would be predicted from the previous document
    assert batch["labels"].eq(-100).tolist() == [
        [True, False, False, True, False, False, False, True],
        [True, True, False, False, True, True, False, False],
    ]


def documents_of(row: torch.Tensor) -> list[slice]:
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == EOS and i + 1 < len(row)]
    bounds = [0, *ends, len(row)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_packed_training_rows_score_each_document_as_if_alone(attn):
    """With --packing no token attends across a document: the loss of every labelled token of a
    training row equals that token's loss in its document run alone, and only tokens inside a
    document are labelled."""
    from swapformer.training.args import TrainArgs
    from swapformer.training.data import DocumentPacking
    from swapformer.training.objectives import CausalLM

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(3, 90, (2, 40), generator=g)
    blocks[0, [6, 19, 20, 33]] = EOS
    blocks[1, [11, 39]] = EOS
    model = build(
        swapformer.DecoderForCausalLM,
        pattern_config("decoder", "sliding_global_attention", "alibi"),
        attn=attn,
    )
    batch = DocumentPacking(CausalLM(None, TrainArgs(seq_len=40)), EOS)(blocks, g)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        nll = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none", ignore_index=-100
        )
        for r, row in enumerate(blocks):
            labelled = 0
            for doc in documents_of(row):
                alone = model(row[None, doc]).logits[0, :-1]
                want = torch.nn.functional.cross_entropy(alone, row[doc][1:], reduction="none")
                got = nll[r, doc.start : doc.stop - 1]
                assert max_diff(got, want) <= TOL
                labelled += doc.stop - doc.start - 1
            assert int((batch["labels"][r, 1:] != -100).sum()) == labelled


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_train_with_packing_runs_and_resumes_exactly(arch, tmp_path, text_folder, report):
    """A tiny --packing run trains, and a run killed after step 5 and resumed reproduces it: its
    batches are still a function of (seed, step)."""
    from swapformer.training.loop import train

    full = train(tiny_args(tmp_path / "full", text_folder, arch=arch, packing=True))
    assert math.isfinite(full["val_loss"]) and full["steps"] == 8
    assert json.loads((tmp_path / "full" / "training_args.json").read_text())["packing"] is True
    broken = tmp_path / "broken"
    assert train(tiny_args(broken, text_folder, arch=arch, packing=True, stop_after=5)) == {"stopped_at": 5}
    train(tiny_args(broken, text_folder, arch=arch, packing=True, resume="latest"))
    diff = max(abs(x - y) for (_, x), (_, y) in zip(losses(tmp_path / "full"), losses(broken)))
    report("--packing resume: max |loss diff| over 8 steps", diff)
    assert diff <= 1e-6


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(arch="encoder-decoder"), "--packing supports --arch decoder and encoder"),
        (
            dict(attn="sdpa_fa"),
            "--packing: --attn 'sdpa_fa' cannot keep packed sequences apart; use one of 'eager'",
        ),
    ],
)
def test_train_packing_refuses_what_cannot_pack(overrides, message, tmp_path):
    from swapformer.training.args import TrainArgumentError
    from swapformer.training.preflight import validate

    args = tiny_args(tmp_path / "out", None, packing=True, **overrides).resolved()
    with pytest.raises(TrainArgumentError, match=message):
        validate(args)


# The recipe of docs/patterns.md ------------------------------------------------------------------


def test_docs_recipe_is_the_example_and_the_example_trains(tmp_path):
    example = (ROOT / "examples" / "packed_training.py").read_text()
    recipe = example.split("# docs/patterns.md: packed sequences (start)\n")[1].split(
        "# docs/patterns.md: packed sequences (end)"
    )[0]
    assert f"```python\n{recipe.strip()}\n```" in (ROOT / "docs" / "patterns.md").read_text()
    spec = importlib.util.spec_from_file_location("packed_training", ROOT / "examples" / "packed_training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main(
        ["--max-steps", "2", "--documents", "12", "--hidden-size", "32", "--output-dir", str(tmp_path)]
    )
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_a_run_saved_before_packing_existed_still_resumes():
    """training_args.json written before --packing has no such key: it counts as not packing."""
    from swapformer.training.args import TrainArgs

    saved = TrainArgs().to_json()
    del saved["packing"]
    assert TrainArgs().differences(saved) == []
    assert TrainArgs(packing=True).differences(saved) == ["packing"]
