"""Longformer's global projections (`global_projections`) on every backend, and Longformer and BigBird
checkpoints as outside oracles: transformers' LongformerModel computes window + global attention with
code of its own, and the converted swapformer model must give its outputs at 4096 tokens."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swapformer
from swapformer.cli import main
from swapformer.conversion import ConversionError, convert, from_hf_model

from conftest import HF_SIZE, build, max_diff, padded_batch, pattern_config, scramble_

LENGTH = 40  # five blocks of 8: windows, global tokens and random blocks all matter
GLOBAL_TYPES = ["sliding_global_attention", "bigbird_attention"]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.one_thread


def global_config(arch="encoder", layer_type="sliding_global_attention", **overrides):
    """test_patterns' config with one global token, 2 kv heads and Longformer's separate global
    projections; an encoder-decoder's decoder keeps its default (full) layers."""
    if arch == "seq2seq":
        overrides.setdefault("decoder_layer_types", None)
    options = dict(global_tokens=1, num_key_value_heads=2, global_projections=True)
    return pattern_config(arch, layer_type, **{**options, **overrides})


def marks_for(ids):
    """A global_attention_mask with a different number of marked tokens per row (row 2 none)."""
    marks = torch.zeros_like(ids)
    marks[0, [3, 17]] = 1
    marks[1, 30] = 1
    return marks


def forward_backward(model, ids, mask, marks, attn, **kw):
    model.set_attn_implementation(attn)
    model.zero_grad()
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    if model.config.is_encoder_decoder:
        kw.update(decoder_input_ids=ids[:, :6], decoder_attention_mask=mask[:, :6])
    out = model(inputs_embeds=embeds, attention_mask=mask, global_attention_mask=marks, **kw)
    h = out.encoder_last_hidden_state if model.config.is_encoder_decoder else out.last_hidden_state
    valid = mask.bool()[..., None]
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(3))
    ((h * probe * valid).sum() / valid.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return h.detach(), embeds.grad.clone(), grads


# The option on every backend ---------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("layer_type", GLOBAL_TYPES)
@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_global_projections_every_backend_equals_eager(attn, layer_type, padding):
    """Outputs, input gradients and the gradients of every weight (the global projections' included)."""
    model = build(swapformer.EncoderModel, global_config(layer_type=layer_type)).train()
    ids, mask = padded_batch(length=LENGTH, padding=padding)
    marks = marks_for(ids)
    ref = forward_backward(model, ids, mask, marks, "eager")
    got = forward_backward(model, ids, mask, marks, attn)
    assert max_diff(got[0], ref[0]) <= 1e-5 and max_diff(got[1], ref[1]) <= 1e-4
    assert got[2].keys() == ref[2].keys()
    own = {"layers.0.self_attn.q_global_proj.weight", "layers.0.self_attn.k_global_proj.weight"}
    assert own <= got[2].keys()
    assert max(max_diff(got[2][n], ref[2][n]) for n in ref[2]) <= 1e-4


def test_seq2seq_encoder_takes_global_projections():
    model = build(swapformer.Seq2SeqModel, global_config("seq2seq", global_tokens=2)).train()
    ids, mask = padded_batch(length=LENGTH, padding="right")
    ref = forward_backward(model, ids, mask, marks_for(ids), "eager")
    got = forward_backward(model, ids, mask, marks_for(ids), "sparse")
    assert max_diff(got[0], ref[0]) <= 1e-5 and max(max_diff(got[2][n], ref[2][n]) for n in ref[2]) <= 1e-4
    assert not hasattr(model.decoder.layers[0].self_attn, "q_global_proj")  # the causal decoder has none


def test_the_sparse_backend_skips_the_rows_it_would_throw_away(monkeypatch):
    """With global projections the sparse backend gets a layout without its dense global-row pass (those
    rows are replaced); without them it has one."""
    from swapformer.modeling.attention import lowering as masks_module

    layouts = []
    lower_sparse = masks_module.LOWERINGS["sparse"]
    monkeypatch.setitem(
        masks_module.LOWERINGS, "sparse", lambda *a: layouts.append(lower_sparse(*a)) or layouts[-1]
    )
    ids, mask = padded_batch(length=LENGTH, padding="right")
    for option in (True, False):
        model = build(swapformer.EncoderModel, global_config(global_projections=option), attn="sparse")
        with torch.no_grad():
            model(ids, attention_mask=mask, global_attention_mask=marks_for(ids))
    with_option, without = [x for x in layouts if hasattr(x, "global_rows")]
    assert with_option.global_rows is None and with_option.global_mask is None
    assert without.global_rows is not None


@pytest.mark.parametrize("attn", ["eager", "sdpa", "sparse"])
def test_packed_row_equals_each_sequence_alone(attn):
    """Restarting position_ids pack three sequences in one row; the first two tokens of each are global,
    and their global rows see only their own sequence."""
    model = build(swapformer.EncoderModel, global_config(global_tokens=2), attn=attn)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 90, (n,), generator=g) for n in (13, 5, 22)]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        alone = torch.cat([model(s[None]).last_hidden_state for s in seqs], 1)
        packed = model(torch.cat(seqs)[None], position_ids=positions).last_hidden_state
        unpacked = model(torch.cat(seqs)[None]).last_hidden_state
    assert max_diff(packed, alone) <= 1e-5
    assert max_diff(unpacked, alone) > 1e-3  # negative control: without the markers they mix


def test_attention_maps_hold_the_global_rows():
    """output_attentions: the rows of global tokens are the global projections' probabilities (they sum
    to one over every real key), equal under sdpa and sparse to eager's."""
    model = build(swapformer.EncoderModel, global_config())
    ids, mask = padded_batch(length=LENGTH, padding="right")
    marks = marks_for(ids)
    maps = {}
    for attn in ("eager", "sdpa", "sparse"):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            maps[attn] = model(ids, attention_mask=mask, global_attention_mask=marks, output_attentions=True)
    for attn in ("sdpa", "sparse"):
        assert max_diff(maps[attn].attentions[0], maps["eager"].attentions[0]) <= 1e-5
    weights = maps["eager"].attentions[0]  # (B, H, T, S)
    row = weights[0, :, 17]  # a global token: every real key
    assert torch.all(row > 0) and torch.allclose(row.sum(-1), torch.ones(row.shape[0]))
    assert torch.all(weights[0, :, 10, 20:] == 0)  # an ordinary token: its window and the global keys only


def test_global_projections_replace_only_the_global_rows():
    """With copies of the ordinary projections the option changes nothing; with its own weights it
    changes exactly the global tokens' rows of a one-layer model."""
    config = global_config(layer_types=["sliding_global_attention"], num_hidden_layers=1)
    plain_config = copy.deepcopy(config)
    plain_config.global_projections = False
    model = build(swapformer.EncoderModel, config)
    plain = build(swapformer.EncoderModel, plain_config)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "_global_" not in k})
    ids, mask = padded_batch(length=LENGTH, padding="right")
    marks = marks_for(ids)
    with torch.no_grad():
        own = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
        ref = plain(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
        attn = model.layers[0].self_attn
        for name in ("q", "k", "v"):
            getattr(attn, f"{name}_global_proj").load_state_dict(getattr(attn, f"{name}_proj").state_dict())
        copied = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
    assert max_diff(copied, ref) <= 1e-5
    is_global = (marks.bool() | (torch.arange(LENGTH) == 0)) & mask.bool()
    assert max_diff(own[~is_global], ref[~is_global]) <= 1e-5
    assert (own - ref).abs().amax(-1)[is_global].min() > 1e-3


@pytest.mark.slow
def test_flex_equals_eager_forward():
    """flex compiles on first use (~20 s on CPU): one shape, forward only (no CPU backward)."""
    model = build(swapformer.EncoderModel, global_config(layer_types=GLOBAL_TYPES))
    ids, mask = padded_batch(length=LENGTH, padding="right")
    marks = marks_for(ids)
    with torch.no_grad():
        want = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
        model.set_attn_implementation("flex_attention")
        got = model(ids, attention_mask=mask, global_attention_mask=marks).last_hidden_state
    assert max_diff(got, want) <= 1e-5


def test_save_and_load_keep_the_global_projections(tmp_path):
    model = build(swapformer.EncoderForMaskedLM, global_config())
    ids, mask = padded_batch(length=LENGTH, padding="right")
    marks = marks_for(ids)
    model.save_pretrained(tmp_path)
    loaded = T.AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="sparse").eval()
    assert loaded.config.global_projections is True
    with torch.no_grad():
        a = model(ids, attention_mask=mask, global_attention_mask=marks).logits
        b = loaded(ids, attention_mask=mask, global_attention_mask=marks).logits
    assert max_diff(a, b, mask) <= 1e-5


class TestConfigRefuses:
    def test_a_causal_decoder(self):
        with pytest.raises(ValueError, match="needs bidirectional self-attention.*causal.*EncoderConfig"):
            global_config("decoder")

    def test_layers_without_global_tokens(self):
        with pytest.raises(ValueError, match="needs layers with global tokens.*'sliding_global_attention'"):
            global_config(layer_types=["sliding_attention", "full_attention"])

    def test_global_decoder_layers_of_a_seq2seq(self):
        with pytest.raises(ValueError, match="decoder_layer_types has 'bigbird_attention' layers.*causal"):
            global_config("seq2seq", decoder_layer_types=["bigbird_attention", "full_attention"])

    def test_not_a_bool(self):
        with pytest.raises(TypeError, match="global_projections must be True or False"):
            global_config(global_projections=1)


# Longformer as the outside oracle --------------------------------------------------------------

LONG = 4096


def longformer_config(**kw):
    options = dict(
        vocab_size=101,
        **HF_SIZE,
        max_position_embeddings=LONG + 2,  # RoBERTa's offset: positions start at pad_token_id + 1
        type_vocab_size=1,
        pad_token_id=1,
        attention_window=16,  # 8 keys each side: swapformer's sliding_window 9
    )
    options.update(kw)
    return T.LongformerConfig(**options)


def long_batch(length=LONG):
    """Two rows, the second right-padded; global tokens at the first token and a few more per row."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 101, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length * 3 // 4 :] = 0
    ids[mask == 0] = 1
    marks = torch.zeros_like(ids)
    marks[:, 0] = 1
    marks[0, [length // 4, length - 1]] = 1
    marks[1, 5] = 1
    return dict(input_ids=ids, attention_mask=mask, global_attention_mask=marks)


def source(cls, config, seed=0):
    torch.manual_seed(seed)
    model = cls(config).eval()
    scramble_(model, seed)
    return model


def output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


# The converted classes: transformers' Longformer head and swapformer's counterpart.
CLASSES = {
    "model": (T.LongformerModel, swapformer.EncoderModel),
    "mlm": (T.LongformerForMaskedLM, swapformer.EncoderForMaskedLM),
    "cls": (T.LongformerForSequenceClassification, swapformer.EncoderForSequenceClassification),
}


@pytest.mark.parametrize("hf_class, ours", list(CLASSES.values()), ids=list(CLASSES))
def test_converted_longformer_equals_longformer_at_4096_tokens(hf_class, ours, report):
    hf = source(hf_class, longformer_config(num_labels=3))
    model = from_hf_model(hf, ours)
    assert model.config.sliding_window == 9 and model.config.global_projections
    batch = long_batch()
    with torch.no_grad():
        want = output(hf(**batch))
        for attn in ("sparse", "sdpa"):
            model.set_attn_implementation(attn)
            got = output(model(**batch))
            tokens = batch["attention_mask"] if got.dim() == 3 else None
            report(
                f"{attn} max abs diff against {hf_class.__name__} at {LONG} tokens",
                max_diff(got, want, tokens),
            )
            assert max_diff(got, want, tokens) <= 1e-5
    if hf_class is T.LongformerForSequenceClassification:  # it marks the first token when given no mask
        plain = {k: v for k, v in batch.items() if k != "global_attention_mask"}
        with torch.no_grad():
            assert max_diff(model(**plain).logits, hf(**plain).logits) <= 1e-5


def test_negative_controls_window_and_global_projections(monkeypatch):
    """The parity above fails with one key more per side, or without the global projections (by over
    100x the tolerance)."""
    from swapformer.modeling.variants import global_rows as global_rows

    hf = source(T.LongformerModel, longformer_config())
    batch = long_batch(256)
    with torch.no_grad():
        want = hf(**batch).last_hidden_state
        model = from_hf_model(hf, swapformer.EncoderModel)
        assert max_diff(model(**batch).last_hidden_state, want, batch["attention_mask"]) <= 1e-5
        model.config.sliding_window = 10
        assert max_diff(model(**batch).last_hidden_state, want, batch["attention_mask"]) > 1e-3
        model.config.sliding_window = 9
        monkeypatch.setattr(
            global_rows, "global_rows", lambda attn, hidden, out, weights, *rest: (out, weights)
        )
        assert max_diff(model(**batch).last_hidden_state, want, batch["attention_mask"]) > 1e-3


def test_length_that_is_not_a_multiple_of_the_window():
    """transformers pads to a multiple of the window inside its forward; swapformer needs no padding."""
    hf = source(T.LongformerForMaskedLM, longformer_config())
    model = from_hf_model(hf, swapformer.EncoderForMaskedLM)
    batch = long_batch(101)
    with torch.no_grad():
        assert max_diff(model(**batch).logits, hf(**batch).logits, batch["attention_mask"]) <= 1e-5


@st.composite
def longformer_cases(draw):
    """A tiny Longformer and a batch: window, length, heads, layers, rows of different lengths padded
    on either side, and global marks anywhere (none, a few, padding positions included).

    The classifier reads position 0, so its rows are right-padded (on a left-padded row position 0 is
    a padding token, whose output the two models compute differently) and their first token is marked
    (the converted classifier's first token is always global; Longformer's only when no mask is given
    or the mask marks it: conversion/longformer.py)."""
    head = draw(st.sampled_from(list(CLASSES)))
    length = draw(st.integers(1, 90))
    lengths = [length] + draw(st.lists(st.integers(1, length), max_size=2))
    side = "right" if head == "cls" else draw(st.sampled_from(["left", "right"]))
    mask = torch.zeros(len(lengths), length, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, slice(0, n) if side == "right" else slice(length - n, length)] = 1
    marked = draw(
        st.lists(st.tuples(st.integers(0, len(lengths) - 1), st.integers(0, length - 1)), max_size=6)
    )
    marks = torch.zeros_like(mask)
    for row, position in marked:
        marks[row, position] = 1
    if head == "cls":
        marks[:, 0] = 1
    ids = torch.randint(2, 101, mask.shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 9))))
    ids[mask == 0] = 1
    config = longformer_config(
        attention_window=2 * draw(st.integers(2, 12)),  # transformers' own code fails at a window of 2
        num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        num_hidden_layers=draw(st.integers(1, 2)),
        max_position_embeddings=length + 26,  # a table longer than the window: see TestLongformerRefuses
        num_labels=3,
    )
    return head, config, dict(input_ids=ids, attention_mask=mask, global_attention_mask=marks)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(case=longformer_cases())
def test_converted_longformer_equals_longformer_on_drawn_cases(case):
    """Beyond the fixed case at 4096 tokens: windows, lengths (shorter than a window too), padding on
    either side and global marks drawn by hypothesis; every backend gives Longformer's outputs on the
    real tokens (or its logits) within 1e-5."""
    head, config, batch = case
    hf_class, ours = CLASSES[head]
    hf = source(hf_class, config)
    model = from_hf_model(hf, ours)
    with torch.no_grad():
        want = output(hf(**batch))
        for attn in ("eager", "sdpa", "sparse"):
            model.set_attn_implementation(attn)
            got = output(model(**batch))
            tokens = batch["attention_mask"] if got.dim() == 3 else None
            assert max_diff(got, want, tokens) <= 1e-5, attn


def test_cli_converts_a_longformer_folder_and_back(tmp_path, capsys, report):
    """`swapformer convert` on a saved LongformerForMaskedLM folder, then `--to-hf`: both directions
    verified by the command, the round trip bit for bit, and all three models agree at 4096 tokens."""
    hf = source(T.LongformerForMaskedLM, longformer_config())
    hf.save_pretrained(tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "ours")]) == 0
    assert "verification: logits max abs diff" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--to-hf"]) == 0
    ours = T.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", attn_implementation="sparse").eval()
    back = T.LongformerForMaskedLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.attention_window == [16, 16]
    for name, tensor in hf.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    batch = long_batch()
    with torch.no_grad():
        want = hf(**batch).logits
        got, returned = ours(**batch).logits, back(**batch).logits
    tokens = batch["attention_mask"]
    report(f"swapformer against LongformerForMaskedLM at {LONG} tokens", max_diff(got, want, tokens))
    assert max_diff(got, want, tokens) <= 1e-5 and max_diff(returned, got, tokens) <= 1e-5


class TestLongformerRefuses:
    def test_windows_that_differ_per_layer(self, tmp_path):
        hf = source(T.LongformerModel, longformer_config(attention_window=[16, 32]))
        with pytest.raises(ConversionError, match=r"attention_window=\[16, 32\] differs per layer"):
            from_hf_model(hf, swapformer.EncoderModel)

    def test_a_dilated_window(self):
        hf = source(T.LongformerModel, longformer_config())
        hf.config.attention_dilation = [2, 2]
        with pytest.raises(ConversionError, match=r"attention_dilation=\[2, 2\] cannot map"):
            from_hf_model(hf, swapformer.EncoderModel)

    def test_a_window_that_covers_every_position(self):
        hf = source(T.LongformerModel, longformer_config(max_position_embeddings=12, attention_window=18))
        with pytest.raises(
            ConversionError,
            match=r"attention_window=18 reaches 9 .* \(10 positions .* attention_window=16 can",
        ):
            from_hf_model(hf, swapformer.EncoderModel)
        config = longformer_config(max_position_embeddings=12, attention_window=16)  # 8 each side: cuts at 10
        assert (
            from_hf_model(source(T.LongformerModel, config), swapformer.EncoderModel).config.sliding_window
            == 9
        )

    def test_a_masked_lm_head_without_gelu(self):
        hf = source(T.LongformerForMaskedLM, longformer_config(hidden_act="relu"))
        with pytest.raises(ConversionError, match="lm_head.dense cannot map.*GELU"):
            from_hf_model(hf, swapformer.EncoderForMaskedLM)

    def test_question_answering_is_not_a_converted_class(self, tmp_path):
        source(T.LongformerForQuestionAnswering, longformer_config()).save_pretrained(tmp_path / "qa")
        with pytest.raises(
            ConversionError, match="LongformerForQuestionAnswering .* no swapformer counterpart"
        ):
            convert(tmp_path / "qa", tmp_path / "out", log=lambda line: None)

    def test_back_without_global_projections(self, tmp_path):
        source(T.LongformerModel, longformer_config(attention_window=128)).save_pretrained(tmp_path / "src")
        report = convert(tmp_path / "src", tmp_path / "ours", log=lambda line: None)
        assert report.tokens == 65 + 8  # the verification batch is cut by the window (sliding_window 65)
        config = swapformer.EncoderConfig.from_pretrained(tmp_path / "ours")
        config.global_projections = False
        with pytest.raises(ConversionError, match="global_projections=True convert back to Longformer"):
            swapformer.conversion.longformer.config_to_hf(config)


# BigBird ----------------------------------------------------------------------------------------


def test_bigbird_block_sparse_is_refused_with_the_reason():
    hf = source(
        T.BigBirdModel,
        T.BigBirdConfig(
            vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=256, sep_token_id=3, attention_type="block_sparse", block_size=8,
        ),
    )  # fmt: skip
    with pytest.raises(ConversionError, match="attention_type='block_sparse' cannot map.*'original_full'"):
        from_hf_model(hf, swapformer.EncoderModel)


def test_embedding_dropout_order_must_match_the_family():
    """BigBird drops out its embeddings before their LayerNorm, BERT after: a config with the other
    order does not go back (it would train differently)."""
    from swapformer.conversion import bert, big_bird

    with pytest.raises(ConversionError, match="embedding_dropout_first=True cannot map.*after"):
        bert.config_to_hf(swapformer.EncoderConfig(embedding_dropout_first=True))
    with pytest.raises(ConversionError, match="embedding_dropout_first=False cannot map.*before"):
        big_bird.config_to_hf(swapformer.EncoderConfig())
