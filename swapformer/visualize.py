"""Attention maps people can look at: heatmaps of a model's attention on a text, pictures of what each
layer type of a config lets a token see, and the inputs bertviz's views take.

The maps come from the models' own `output_attentions=True` path, which every backend supports (fast
kernels recompute the probabilities of the layer they run), so a picture shows the backend the model
is on. matplotlib is imported when a picture is drawn, bertviz never (the helper only shapes tensors).

    fig = plot_attention(model, tokenizer, "The cat sat on the mat", layers=[0, 1], heads="all")
    fig.savefig("map.png")
    plot_pattern(config, 512).savefig("pattern.png")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .visualize_draw import (  # noqa: F401  block_average and block_labels are public here
    DEFAULT_MAX_TOKENS,
    block_average,
    block_labels,
    chunked,
    draw_grid,
    grid_columns,
    token_labels,
)


def _encode(
    model, tokenizer, text: str, decoder_text: str | None
) -> tuple[dict, list[str], list[str] | None]:
    """Model inputs for one text, its token labels, and the decoder's labels for an encoder-decoder."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"text must be a non-empty string, got {text!r}")
    enc = tokenizer(text, return_tensors="pt")
    inputs = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    tokens = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    decoder_tokens = None
    if model.config.is_encoder_decoder:
        if decoder_text is None:
            start = model.config.decoder_start_token_id
            decoder_ids = torch.tensor([[start if start is not None else model.config.pad_token_id]])
        else:
            decoder_ids = tokenizer(decoder_text, return_tensors="pt")["input_ids"]
        inputs["decoder_input_ids"] = decoder_ids
        decoder_tokens = tokenizer.convert_ids_to_tokens(decoder_ids[0])
    elif decoder_text is not None:
        raise ValueError("decoder_text is for encoder-decoder models; this model reads `text` only")
    return {k: v.to(model.device) for k, v in inputs.items()}, tokens, decoder_tokens


def _run(model, inputs: dict):
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return model(**inputs, output_attentions=True, return_dict=True)
    finally:
        model.train(was_training)


def attention_maps(model, tokenizer, text: str, *, decoder_text: str | None = None):
    """(maps, tokens): the self-attention probabilities of every layer on `text`, a list of (H, T, T)
    float tensors (query rows, key columns) on the CPU, and the T token labels (`token_labels`: each
    token as the tokenizer decodes it). An encoder-decoder shows its encoder's self-attention."""
    inputs, _, _ = _encode(model, tokenizer, text, decoder_text)
    out = _run(model, inputs)
    maps = out.encoder_attentions if model.config.is_encoder_decoder else out.attentions
    if not maps or any(m is None for m in maps):
        backend = getattr(model.config, "_attn_implementation", None)
        raise ValueError(
            f"{type(model).__name__} returned no attention maps on {backend!r} with output_attentions=True; "
            "load it with attn_implementation='eager' (swapformer attention --backend eager)"
        )
    return [m[0].float().cpu() for m in maps], token_labels(tokenizer, inputs["input_ids"][0].tolist())


def bertviz_inputs(model, tokenizer, text: str, *, decoder_text: str | None = None) -> dict:
    """Keyword arguments for `bertviz.head_view(**kw)` / `bertviz.model_view(**kw)`: `attention` and
    `tokens` for an encoder or a decoder; for an encoder-decoder the encoder, decoder and cross maps
    with both token lists (the decoder reads `decoder_text`, or its start token alone)."""
    inputs, tokens, decoder_tokens = _encode(model, tokenizer, text, decoder_text)
    out = _run(model, inputs)
    cpu = lambda maps: tuple(m.float().cpu() for m in maps)  # noqa: E731  bertviz wants (1, H, T, S) each
    if not model.config.is_encoder_decoder:
        return {"attention": cpu(out.attentions), "tokens": tokens}
    return {
        "encoder_attention": cpu(out.encoder_attentions),
        "decoder_attention": cpu(out.decoder_attentions),
        "cross_attention": cpu(out.cross_attentions),
        "encoder_tokens": tokens,
        "decoder_tokens": decoder_tokens,
    }


def _pick(name: str, chosen, count: int) -> list[int]:
    if chosen is None:
        return list(range(count))
    picked = [chosen] if isinstance(chosen, int) else list(chosen)
    bad = [i for i in picked if not isinstance(i, int) or not -count <= i < count]
    if bad or not picked:
        raise ValueError(
            f"{name}={chosen!r} is out of range: the model has {count} {name} (0 to {count - 1})"
        )
    return [i % count for i in picked]


def plot_attention(
    model,
    tokenizer,
    text: str,
    *,
    layers: int | Sequence[int] | None = None,
    heads: str | int | Sequence[int] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    decoder_text: str | None = None,
):
    """A matplotlib Figure with one heatmap per (layer, head): rows are queries, columns keys, both
    labelled with the tokens as the tokenizer decodes them. `layers`: an index or list (default all);
    `heads`: None averages the heads (one panel per layer), "all" shows every head, or an index or list.
    A layer's heads form a grid (12 heads: 3 rows of 4) at most 1920 px wide at 120 dpi, with one colour
    scale for all panels. Inputs longer than `max_tokens` are block-averaged, and the block size is in
    the title."""
    maps, tokens = attention_maps(model, tokenizer, text, decoder_text=decoder_text)
    layer_ids = _pick("layers", layers, len(maps))
    n_heads = maps[0].shape[0]
    head_ids = None if heads is None else _pick("heads", None if heads == "all" else heads, n_heads)
    if head_ids is None:  # one panel per layer, all in one grid
        means = [(f"layer {layer}, mean of {n_heads} heads", maps[layer].mean(0)) for layer in layer_ids]
        rows = chunked(means, grid_columns(len(means)))
    else:  # each layer's heads in a grid of their own rows
        rows = []
        for layer in layer_ids:
            panels = [(f"layer {layer}, head {h}", maps[layer][h]) for h in head_ids]
            rows += chunked(panels, grid_columns(len(head_ids)))
    title = f"{type(model).__name__}: attention"
    return draw_grid(rows, tokens, tokens, max_tokens, cmap="viridis", title=title, scale="attention weight")


def _probe_model(config, types: list[str]):
    """A one-layer-per-type copy of `config`'s model (its encoder's, for an encoder-decoder) with one
    head of 8 dims, no dropout and random weights, on eager."""
    from .modeling import DecoderModel, EncoderModel

    small = config.to_dict()
    for key in (
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "_attn_implementation_autoset",
    ):
        small.pop(key, None)
    heads = 1
    small.update(
        num_hidden_layers=len(types),
        layer_types=types,
        hidden_size=8 * heads,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=8,
        intermediate_size=8,
        global_projections=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        embedding_dropout=None,
    )
    from .configuration import DecoderConfig, EncoderConfig

    decoder = isinstance(config, DecoderConfig)
    if config.is_encoder_decoder:  # its encoder's layer types
        small.pop("decoder_layers", None)
        small.pop("decoder_layer_types", None)
        small.pop("is_encoder_decoder", None)

    model_class, config_class = (DecoderModel, DecoderConfig) if decoder else (EncoderModel, EncoderConfig)
    small_config = config_class(**{k: v for k, v in small.items() if k in config_class.__dataclass_fields__})
    torch.manual_seed(0)
    model = model_class(small_config).eval()
    model.set_attn_implementation("eager")
    return model


def pattern_masks(config, seq_len: int, *, global_attention_mask: Sequence[int] | None = None) -> dict:
    """{layer type: (seq_len, seq_len) bool tensor}: which keys each query may see in a layer of that
    type, for one row of `seq_len` tokens without padding (the config's window, global tokens, random
    blocks and causality; `global_attention_mask` marks more global tokens as a Longformer-style input
    would). Read from a one-layer-per-type copy of the model with random weights on eager: the mask a
    model of this config really applies, not a redrawing of it."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if seq_len > config.max_position_embeddings and config.position_embedding_type == "learned":
        raise ValueError(
            f"seq_len={seq_len} exceeds max_position_embeddings={config.max_position_embeddings} of this config; "
            "use a shorter seq_len"
        )
    types = list(dict.fromkeys(config.layer_types))
    model = _probe_model(config, types)
    ids = torch.full((1, seq_len), 3 % model.config.vocab_size, dtype=torch.long)
    kwargs = {}
    if global_attention_mask is not None:
        marks = torch.as_tensor(list(global_attention_mask), dtype=torch.long)[None]
        if marks.shape[1] != seq_len:
            raise ValueError(
                f"global_attention_mask has {marks.shape[1]} entries; it needs seq_len={seq_len}"
            )
        kwargs["global_attention_mask"] = marks
    with torch.no_grad():
        maps = model(ids, output_attentions=True, **kwargs).attentions
    return {lt: maps[i][0, 0] > 0 for i, lt in enumerate(types)}


def plot_pattern(
    config, seq_len: int, *, global_attention_mask: Sequence[int] | None = None, max_tokens: int = 128
):
    """A Figure with the mask of every layer type in `config` (see `pattern_masks`): bright cells are the
    keys (columns) a query (row) may attend; block-averaged past `max_tokens`, so a cell's shade is the
    share of allowed pairs in it."""
    masks = pattern_masks(config, seq_len, global_attention_mask=global_attention_mask)
    shown = min(seq_len, max_tokens)
    panels = [[(f"{lt} ({int(m.sum())} of {seq_len * seq_len} pairs)", m.float())] for lt, m in masks.items()]
    flat = sum(panels, [])
    panels = [flat[i : i + 2] for i in range(0, len(flat), 2)]  # two layer types per row
    title = f"{config.model_type}: {seq_len} tokens"
    return draw_grid(
        panels, seq_len, seq_len, max_tokens, cmap="Greys_r", title=title, tick_every=-(-shown // 16)
    )
