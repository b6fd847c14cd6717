"""Packed (padding-free) sequences: a row holding several sequences gives every sequence exactly the
outputs and gradients it has when run alone, on every backend, position scheme and layer type.

The rows come from transformers' own `DataCollatorWithFlattening` (restarting `position_ids`,
`cu_seq_lens_q/k`, `max_length_q/k`, `seq_idx`); the reference is each sequence run alone.
"""

from __future__ import annotations

import pytest
import torch
from test_patterns import pattern_config as patterns_config
from transformers import DataCollatorWithFlattening

import swapformer

from conftest import BASE_CLASSES, build, max_diff

LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_global_attention", "bigbird_attention"]
POSITIONS = ["learned", "sinusoidal", "rope", "alibi", "relative_bias"]
# 40 tokens: sequences shorter and longer than a block (8) and the window (5); the second and third
# start inside a block, so bigbird's per-sequence random layout is not the packed row's
LENGTHS = (13, 5, 22)
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine OpenMP threads spin-wait
    for each other (a backward took 25x longer with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
        alone = [run(model, embed(s[None]), p, total) if grads else
                 (model(s[None]).last_hidden_state, None) for s, p in zip(seqs, probe)]
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
    monkeypatch.setattr("swapformer.modeling.stack.find_packed_sequences", lambda **kwargs: None)
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
            dict(position_ids=collate(sources)["position_ids"], decoder_position_ids=collate(targets)["position_ids"]),
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
