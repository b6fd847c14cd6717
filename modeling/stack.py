"""A stack of blocks, from token ids to the last hidden state.

Shape legend: B batch, T new tokens, P cached tokens, S = P + T keys, E hidden size, H heads.

The base encoder and decoder models and both halves of the encoder-decoder are this one stack with
two switches (causal self-attention, cross-attention). It is a mixin so the base models keep their
parameters at HF-standard names (`embed_tokens`, `layers.0.self_attn.q_proj`) without a wrapper
level. Per forward it validates the inputs, computes positions once and builds each mask once for
the chosen backend; the blocks only consume them.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from ..configuration.backends import LAYER_TYPE_PATTERN, check_batch_feature
from ..configuration.configuration_swapformer import GLOBAL_KINDS
from .attention import check_backend_for_batch, lower_mask
from .hf_compat import DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING, DynamicSlidingWindowLayer
from .layers import Block, alibi_bias, make_norm, relative_position_bucket, rope_cos_sin, sinusoidal_embedding
from .masks import AttentionPattern, random_layouts
from .packing import (
    PackedSequences,
    check_cache_not_packed,
    check_cross_packing,
    find_packed_sequences,
    mark_cache_packed,
)


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """transformers' windowed cache (`sliding_attention`), which keeps the last `sliding_window - 1`
    tokens as `[-sliding_window + 1:]`: for a window of 1 that is `[-0:]`, every token, so the keys it
    hands over disagree with its `get_mask_sizes`. Here a window of 1 keeps none. Not registered (that
    would replace transformers' class for every model in the process): `adopt_window_of_one` gives
    this class to the window-1 layers of a cache handed to a swapformer model, before their first use."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        if self.sliding_window == 1 and not self.record_past:
            self.keys, self.values = self.keys[..., :0, :], self.values[..., :0, :]
        return keys, values


def adopt_window_of_one(cache) -> None:
    """Give `SlidingWindowLayer` to transformers' dynamic window-1 layers of `cache` (any other layer,
    and any window but 1, is left as it is); nested caches of an encoder-decoder included."""
    for part in (
        getattr(cache, "self_attention_cache", None),
        getattr(cache, "cross_attention_cache", None),
        cache,
    ):
        for layer in getattr(part, "layers", ()) or ():
            if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == 1:
                layer.__class__ = SlidingWindowLayer


class GlobalWindowLayer(DynamicLayer):
    """The dynamic cache of a window + global layer (`sliding_global_attention`).

    Later queries can see only global tokens and the last `window - 1` tokens, so this layer keeps
    the leading tokens up to the last global one (a prefix, since global tokens are the first
    `global_tokens` real tokens of each row, plus any the prompt's `global_attention_mask` marks) and
    a window-sized tail: memory stops growing at prefix + window. The stack `plan`s each forward
    (window, prefix length) before the layer is read; until every row has all its global tokens the
    layer keeps everything. Stored keys cover absolute indices [0, prefix) + [tail_start, length).
    Registered for its layer type, so `DynamicCache(config=...)` (what generate() builds) uses it.
    """

    _layer_type = "sliding_global_attention"
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.cumulative_length = 0
        self.prefix = 0  # stored leading tokens when keys were dropped after them (else 0)
        self.tail_start = 0  # absolute index of the first stored key after the prefix
        self.window: int | None = None
        self.keep: int | None = None  # leading tokens that must stay; None: keep everything

    def plan(self, window: int, keep: int | None, layer_idx: int) -> None:
        """Set the window and the leading tokens holding every global token, before a forward."""
        if keep is not None and self.tail_start > self.prefix and keep > self.prefix:
            raise ValueError(
                f"Layer {layer_idx} (sliding_global_attention) has a global token at index {keep - 1}, but its "
                f"window + global cache already dropped tokens {self.prefix}..{self.tail_start - 1}, which kept only "
                f"the first {self.prefix}; mark global tokens within the prompt (`global_tokens`, or the prompt's "
                "`global_attention_mask`), not in generated steps"
            )
        self.window, self.keep = window, keep

    @property
    def key_prefix(self) -> int:
        """Leading stored keys that are the first tokens, ahead of the tail (0 when contiguous)."""
        return self.prefix if self.tail_start > self.prefix else 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length += key_states.shape[-2]
        self.keys, self.values = keys, values
        if self.window is not None and self.keep is not None:
            self._drop_unreachable()
        return keys, values

    def _drop_unreachable(self) -> None:
        total, contiguous = self.cumulative_length, self.tail_start <= self.prefix
        prefix = min(self.keep, total) if contiguous else self.prefix
        tail_start = max(self.tail_start, prefix, total - self.window + 1)
        if tail_start <= prefix:
            return
        local_tail = tail_start if contiguous else self.prefix + tail_start - self.tail_start
        self.keys = torch.cat([self.keys[..., :prefix, :], self.keys[..., local_tail:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :prefix, :], self.values[..., local_tail:, :]], dim=-2)
        self.prefix, self.tail_start = prefix, tail_start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        stored = self.keys.shape[-2] if self.is_initialized else 0
        # The first stored key after the prefix is at `tail_start` once keys were dropped, also with no
        # prefix (no global token: the stored keys are then one range starting there).
        return stored + query_length, (self.tail_start if self.tail_start > self.prefix else 0)

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.prefix = self.tail_start = 0
        self.keep = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "The window + global cache drops tokens as it goes and cannot be cropped; generate without "
            "assisted decoding, or use full_attention layers"
        )


# BigBird layers keep every key: random blocks make any earlier block visible to a later query.
# Registering is what makes `DynamicCache(config=...)` accept the layer type.
DYNAMIC_LAYER_TYPE_MAPPING.setdefault("bigbird_attention", DynamicLayer)
for _layer_type in ("sliding_global_attention", "bigbird_attention"):
    STATIC_LAYER_TYPE_MAPPING.setdefault(_layer_type, StaticLayer)


def positions_from_mask(key_valid: torch.Tensor | None, batch: int, total: int, device) -> torch.Tensor:
    """Integer positions of all S keys, (B, S): counted over non-padding tokens when a padding mask
    is given, so a left-padded row gets the positions of the same row unpadded."""
    if key_valid is None:
        return torch.arange(total, device=device)[None].expand(batch, -1)
    return (key_valid.long().cumsum(-1) - 1).clamp(min=0)


def select_keys(x: torch.Tensor | None, index: torch.Tensor, fill) -> torch.Tensor | None:
    """(B, P + T) per-token values -> their values at the keys a cache layer hands to attention,
    whose absolute indices are `index` (S,); `fill` past the end (empty rows of a static cache).
    Always masked (no data-dependent shortcut), so compiled and exported graphs take the same path."""
    if x is None:
        return None
    picked = x[:, index.clamp(max=x.shape[1] - 1)]
    return picked.masked_fill(index >= x.shape[1], fill)


def new_columns(x: torch.Tensor, past, t: int) -> torch.Tensor:
    """Columns past .. past + t - 1 of (B, S) `x`. `past` is a 0-d tensor when a static cache counts
    its tokens under torch.compile; an index keeps that graph free of data-dependent slicing."""
    if isinstance(past, int):
        return x[:, past : past + t]
    return x.index_select(1, past + torch.arange(t, device=x.device))


def static_key_slots(cache: Cache | None) -> int | None:
    """Key slots of a static (compileable) cache whose layers all keep every token: masks may then span
    all its slots (`create_masks_for_generate` pads them so), and a compiled decoding step keeps one shape.
    None for any other cache."""
    if cache is None or not cache.is_compileable:
        return None
    layers = getattr(cache, "self_attention_cache", cache).layers
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return None
    return max(layer.max_cache_len for layer in layers)


def is_padded(valid: torch.Tensor, total, key_index: torch.Tensor | None = None) -> bool:
    """Whether the keys `valid` (B, S) at absolute indices `key_index` (default 0..S-1) hold padding
    below `total`.
    While compiling (or with a tensor count) the answer would be data-dependent: always True there,
    i.e. the mask is applied even when it masks nothing, as transformers' mask builders do."""
    if torch.compiler.is_compiling() or not isinstance(total, int):
        return True
    return not bool((valid if key_index is None else valid[:, key_index < total]).all())


def cache_layer(cache: Cache, idx: int):
    """The self-attention cache layer `idx` (of an EncoderDecoderCache's decoder part), or None."""
    layers = getattr(cache, "self_attention_cache", cache).layers
    return layers[idx] if idx < len(layers) else None


class StackMixin:
    """Mixed into an `nn.Module` whose `config` is a `SwapformerConfig`."""

    def init_stack(
        self,
        config,
        *,
        num_layers: int,
        causal: bool,
        cross_attention: bool,
        layer_types: list[str],
        embed_tokens: nn.Embedding | None = None,
        token_types: bool = False,
    ) -> None:
        self.causal = causal
        self.layer_types = list(layer_types)
        self.embed_tokens = (
            embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size, config.hidden_size)
        )
        self.embed_scale = config.hidden_size**0.5 if config.scale_embeddings else 1.0
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size)
            if token_types and config.type_vocab_size > 0
            else None
        )
        self.embed_positions = (
            nn.Embedding(config.max_position_embeddings, config.hidden_size)
            if config.position_embedding_type == "learned"
            else None
        )
        self.relative_attention_bias = (
            nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
            if config.position_embedding_type == "relative_bias"
            else None
        )
        self.embed_norm = make_norm(config) if config.embedding_norm else None
        p = config.hidden_dropout if config.embedding_dropout is None else config.embedding_dropout
        self.embed_dropout = nn.Dropout(p)
        self.layers = nn.ModuleList(
            [
                Block(config, i, is_causal=causal, cross_attention=cross_attention, layer_type=layer_types[i])
                for i in range(num_layers)
            ]
        )
        self.norm = make_norm(config) if config.pre_norm else None

    # Pieces computed once per forward -----------------------------------------------------------

    def embed(self, input_ids, inputs_embeds, token_type_ids, position_ids) -> torch.Tensor:
        # Like transformers, user-given inputs_embeds replace the (scaled) token embedding.
        h = self.embed_tokens(input_ids) * self.embed_scale if inputs_embeds is None else inputs_embeds
        if token_type_ids is not None:
            if self.token_type_embeddings is None:
                if not torch.compiler.is_compiling() and bool(token_type_ids.any()):
                    raise ValueError(
                        "token_type_ids has non-zero entries but this model has no token type embeddings "
                        "(type_vocab_size=0); drop token_type_ids or build the model with type_vocab_size > 0"
                    )
            else:
                h = h + self.token_type_embeddings(token_type_ids)
        elif self.token_type_embeddings is not None:
            h = h + self.token_type_embeddings.weight[0]
        if self.embed_positions is not None:
            h = h + self.embed_positions(position_ids)
        elif self.config.position_embedding_type == "sinusoidal":
            h = h + sinusoidal_embedding(position_ids, self.config.hidden_size, h.dtype)
        if self.config.embedding_dropout_first:  # BigBird
            h = self.embed_dropout(h)
        if self.embed_norm is not None:
            h = self.embed_norm(h)
        return h if self.config.embedding_dropout_first else self.embed_dropout(h)

    def pair_bias(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Additive score bias (..., H) for broadcastable query and key positions (ALiBi, T5)."""
        if self.config.position_embedding_type == "alibi":
            return alibi_bias(query_pos, key_pos, self.config.num_attention_heads, self.causal)
        buckets = relative_position_bucket(
            key_pos - query_pos,
            bidirectional=not self.causal,
            num_buckets=self.config.relative_attention_num_buckets,
            max_distance=self.config.relative_attention_max_distance,
        )
        return self.relative_attention_bias(buckets)

    def self_attention_patterns(
        self, *, batch, t, past, span, cache, key_valid, key_pos, query_pos, global_mask, packing, device
    ):
        """One `AttentionPattern` per layer type of this stack, sized by the cache layer it reads.
        `span` (int) counts the absolute key indices the per-token inputs cover: past + t, or every slot
        of a static cache (where `past` may be a 0-d tensor under compile). With packed rows (`packing`,
        no cache content), `key_pos` restarts per sequence, so global tokens are the first
        `global_tokens` of each sequence."""
        cfg = self.config
        total = past + t
        has_bias = cfg.position_embedding_type in ("alibi", "relative_bias")
        patterns = {}
        for layer_type in dict.fromkeys(self.layer_types):
            kind = LAYER_TYPE_PATTERN[layer_type]
            is_global = None
            if kind in ("sliding_global", "bigbird"):
                is_global = key_pos < cfg.global_tokens  # (B, total)
                if global_mask is not None:
                    is_global = is_global | global_mask.bool()
                if key_valid is not None:
                    is_global = is_global & key_valid
            kv_length, kv_offset, key_prefix = total, 0, 0
            if cache is not None:
                layer_idx = self.layer_types.index(layer_type)
                if kind == "sliding_global":
                    self.plan_global_window_layers(cache, layer_type, is_global, key_valid)
                kv_length, kv_offset = cache.get_mask_sizes(t, layer_idx)
                key_prefix = getattr(cache_layer(cache, layer_idx), "key_prefix", 0)
            pattern = AttentionPattern(
                kind=kind,
                causal=self.causal,
                batch=batch,
                query_offset=past,
                query_length=t,
                key_offset=kv_offset,
                key_length=kv_length,
                key_prefix=key_prefix,
                total_length=total,
                device=device,
                window=cfg.sliding_window,
                block_size=cfg.attention_block_size,
                bias_fn=self.pair_bias if has_bias else None,
                query_pos=query_pos,
            )
            key_index = pattern.key_indices()  # absolute index of each key the cache hands over
            valid = select_keys(key_valid, key_index, False)
            if valid is not None and is_padded(valid, total, key_index):
                pattern.key_valid = valid
            pattern.key_pos = select_keys(key_pos, key_index, 0)
            if is_global is not None:
                pattern.global_keys = select_keys(is_global, key_index, False)
                pattern.global_queries = new_columns(is_global, past, t)
            if packing is not None:
                pattern.query_packing = packing
                pattern.key_packing = PackedSequences(
                    *(select_keys(x, key_index, -1) for x in (packing.ids, packing.starts, packing.lengths))
                )
            if kind == "bigbird":
                self.random_blocks_of(pattern, packing, key_valid, past, t, span)
            patterns[layer_type] = pattern
        return patterns

    def random_blocks_of(self, pattern, packing, key_valid, past, t, span) -> None:
        """Give a BigBird pattern its random blocks: every query's blocks are counted from the first real
        token of its sequence (its row's, or its packed sequence's), in the layout that sequence has
        alone, so padding and the rest of the batch change nothing (DESIGN_NOTES item 7). A row holds
        one sequence unless packed: its start and real length come from the padding mask over all
        P + T tokens, cached ones included, so a left-padded prompt keeps its start while it grows."""
        cfg, bs, total = self.config, self.config.attention_block_size, pattern.total_length
        if packing is not None:
            starts, lengths = packing.starts, packing.lengths
        elif key_valid is not None:
            alone = PackedSequences.from_starts(torch.zeros_like(key_valid), key_valid)
            starts, lengths = new_columns(alone.starts, past, t), new_columns(alone.lengths, past, t)
        else:
            starts = torch.zeros(pattern.batch, t, dtype=torch.long, device=pattern.device)
            lengths = starts + total
        # A tensor count (static cache, compiled) sizes the tables by the cache's slots instead: rows
        # past the tokens are never read.
        seen = total if isinstance(total, int) else span
        n_blocks = -(-max(seen, pattern.key_offset + pattern.key_length) // bs)
        pattern.random_table, pattern.random_index = random_layouts(
            cfg.random_seed, lengths, n_blocks, bs, cfg.num_random_blocks, self.causal
        )
        pattern.random_start = starts

    def positions_and_packing(
        self, *, batch, length, past, span, device, key_valid, position_ids, cache, packing_inputs, prefix
    ):
        """Query positions (B, T), key positions (B, P + T) and the packed sequences of this forward
        (None when each row holds one). Packed rows restart their positions, for keys too (ALiBi and
        T5 distances, global tokens); a cache that receives them is marked so it is never extended.

        Under torch.compile every row with `position_ids` counts as packed (whether it is would depend
        on the data), so there the cache is neither marked nor checked: generate() passes position_ids
        at every step of a compiled model. A compiled generate() from really packed prompts is the one
        case this cannot refuse (README: packed sequences)."""
        tracing = torch.compiler.is_compiling()
        if cache is not None and not tracing:
            check_cache_not_packed(cache, past, prefix)
        packing = find_packed_sequences(
            batch=batch,
            length=length,
            device=device,
            key_valid=new_columns(key_valid, past, length) if key_valid is not None else None,
            position_ids=position_ids,
            past=past,
            prefix=prefix,
            **packing_inputs,
        )
        key_pos = positions_from_mask(key_valid, batch, span, device)  # (B, S)
        if position_ids is None:
            position_ids = (
                new_columns(key_pos, past, length) if packing is None else packing.positions(key_valid)
            )
        else:
            position_ids = position_ids.view(-1, length).expand(batch, length).to(device)
        if (key_valid is None and isinstance(past, int) and past == 0) or packing is not None:
            key_pos = position_ids
        if packing is not None and cache is not None and not tracing:
            mark_cache_packed(cache)
        return position_ids, key_pos, packing

    def plan_global_window_layers(self, cache, layer_type, is_global, key_valid) -> None:
        """Tell each window + global cache layer of `layer_type` which leading tokens to keep. Under
        compile they keep everything (`keep=None`): dropping keys is a data-dependent decision, and
        keeping them is always correct."""
        layers = [
            (i, layer)
            for i, other in enumerate(self.layer_types)
            if other == layer_type and isinstance(layer := cache_layer(cache, i), GlobalWindowLayer)
        ]
        if not layers:
            return
        keep = None
        if not torch.compiler.is_compiling():
            keep = leading_tokens_to_keep(is_global, key_valid, self.config.global_tokens)
        for i, layer in layers:
            layer.plan(self.config.sliding_window, keep, i)

    # Forward ------------------------------------------------------------------------------------

    def forward_stack(
        self,
        *,
        input_ids: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        global_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        input_prefix: str = "",
        packing_inputs: dict | None = None,
        encoder_packing: PackedSequences | None = None,
    ):
        """Run the stack.

        Args:
            input_ids: (B, T) token ids, or `inputs_embeds` (B, T, E).
            attention_mask: (B, P + T), 1 for tokens and 0 for padding.
            position_ids: (B, T) or (1, T); by default counted over non-padding tokens.
            global_attention_mask: (B, P + T), 1 for tokens that attend to all and are attended by
                all in `sliding_global_attention` and `bigbird_attention` layers.
            encoder_hidden_states: (B, S_enc, E) for cross-attention, with its padding mask
                `encoder_attention_mask` (B, S_enc).
            input_prefix: "decoder_" when this is the decoder half of a seq2seq (for error messages).
            packing_inputs: the forward's cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k and
                seq_idx (`packing.packing_kwargs`): packed-sequence boundaries as
                `DataCollatorWithFlattening` gives them, checked against `position_ids` (restarting
                `position_ids` alone mark packed sequences too).
            encoder_packing: the packed sequences of the encoder input, for cross-attention.
        Returns:
            (last hidden state, all hidden states or None, self-attention weights or None,
            cross-attention weights or None).
        """
        config = self.config
        if cache is not None and not torch.compiler.is_compiling():
            adopt_window_of_one(cache)
        past = cache.get_seq_length() if cache is not None else 0
        if torch.is_tensor(past) and not torch.compiler.is_compiling():
            past = int(past)  # a static cache counts in a tensor; outside compile, read it once
        span = validate_inputs(
            config,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_length=past,
            key_slots=static_key_slots(cache),
            prefix=input_prefix,
        )
        ref = input_ids if input_ids is not None else inputs_embeds
        b, t = ref.shape[:2]
        device = ref.device
        global_attention_mask = self.check_global_mask(global_attention_mask, b, past, t, span, input_prefix)
        key_valid = attention_mask.bool() if attention_mask is not None else None
        position_ids, key_pos, packing = self.positions_and_packing(
            batch=b,
            length=t,
            past=past,
            span=span,
            device=device,
            key_valid=key_valid,
            position_ids=position_ids,
            cache=cache,
            packing_inputs=packing_inputs or {},
            prefix=input_prefix,
        )

        h = self.embed(input_ids, inputs_embeds, token_type_ids, position_ids)
        rope = None
        if config.position_embedding_type == "rope":
            rope = rope_cos_sin(position_ids, config, h.dtype)
        patterns = self.self_attention_patterns(
            batch=b,
            t=t,
            past=past,
            span=span,
            cache=cache,
            key_valid=key_valid,
            key_pos=key_pos,
            query_pos=position_ids,
            global_mask=global_attention_mask,
            packing=packing,
            device=device,
        )
        backends = {lt: config.backend_for(lt) for lt in patterns}
        if packing is not None or encoder_packing is not None:
            for backend in sorted(set(backends.values())):
                check_batch_feature(
                    backend, "packing", "packed sequences (restarting position_ids, cu_seq_lens_* or seq_idx)"
                )
        for lt, pattern in patterns.items():
            check_backend_for_batch(backends[lt], pattern.kind, self, device)
        masks = {
            lt: lower_mask(self.backend_pattern(lt, p), backends[lt], h.dtype) for lt, p in patterns.items()
        }
        cross_pattern, cross_masks = None, {}
        if encoder_hidden_states is not None:
            s_enc = encoder_hidden_states.shape[1]
            enc_valid = encoder_attention_mask.bool() if encoder_attention_mask is not None else None
            cross_pattern = AttentionPattern(
                kind="full",
                causal=False,
                batch=b,
                query_offset=past,
                query_length=t,
                key_offset=0,
                key_length=s_enc,
                total_length=s_enc,
                device=device,
                key_valid=enc_valid if enc_valid is not None and is_padded(enc_valid, s_enc) else None,
            )
            check_cross_packing(packing, encoder_packing, b)
            if packing is not None:
                cross_pattern.query_packing, cross_pattern.key_packing = packing, encoder_packing
            for lt in patterns:
                cross_masks[lt] = lower_mask(cross_pattern, config.backend_for(lt), h.dtype)

        all_hidden = [] if output_hidden_states else None
        self_attns = [] if output_attentions else None
        cross_attns = [] if output_attentions and encoder_hidden_states is not None else None
        for block in self.layers:
            if all_hidden is not None:
                all_hidden.append(h)
            lt = block.layer_type
            # tensors positionally, so activation checkpointing tracks their gradients
            h, self_w, cross_w = block(
                h,
                masks[lt],
                rope,
                encoder_hidden_states,
                cross_masks.get(lt),
                pattern=patterns[lt],
                cross_pattern=cross_pattern,
                cache=cache,
                output_attentions=output_attentions,
            )
            if self_attns is not None:
                self_attns.append(self_w)
            if cross_attns is not None:
                cross_attns.append(cross_w)
        if self.norm is not None:
            h = self.norm(h)
        if config.final_dropout:  # T5 drops out the normed output of each stack
            h = nn.functional.dropout(h, config.hidden_dropout, self.training)
        if all_hidden is not None:
            all_hidden.append(h)
        as_tuple = lambda xs: tuple(xs) if xs is not None else None  # noqa: E731
        return h, as_tuple(all_hidden), as_tuple(self_attns), as_tuple(cross_attns)

    def backend_pattern(self, layer_type: str, pattern: AttentionPattern) -> AttentionPattern:
        """The pattern the backend's mask is lowered from: with `global_projections`, the global query
        rows are left out (their every-key rows would be computed and thrown away), since the layers
        replace those rows by attention through the global projections (layers.Attention._global_rows)."""
        if not self.config.global_projections or self.causal or pattern.global_queries is None:
            return pattern
        if LAYER_TYPE_PATTERN[layer_type] not in GLOBAL_KINDS:
            return pattern
        return dataclasses.replace(pattern, global_queries=None)

    @staticmethod
    def check_global_mask(marks, b, past, t, span, prefix):
        """`global_attention_mask` (B, past + t), padded with zeros to a static cache's `span` slots."""
        if marks is None:
            return None
        widths = {span} | ({past + t} if isinstance(past, int) else set())
        if marks.dim() != 2 or marks.shape[0] != b or marks.shape[1] not in widths:
            raise ValueError(
                f"{prefix}global_attention_mask has shape {tuple(marks.shape)}; it needs (batch={b}, "
                f"length={' or '.join(map(str, sorted(widths)))}), one entry per cached and new token"
            )
        return nn.functional.pad(marks, (0, span - marks.shape[1]))


def leading_tokens_to_keep(is_global: torch.Tensor, key_valid: torch.Tensor | None, global_tokens: int):
    """How many leading tokens hold every global token (B, S) of every row, or None while some row
    has fewer than `global_tokens` real tokens (its next tokens will be global too)."""
    real = (
        key_valid.sum(-1) if key_valid is not None else torch.full((is_global.shape[0],), is_global.shape[1])
    )
    if int(real.min()) < global_tokens:
        return None
    index = torch.arange(1, is_global.shape[1] + 1, device=is_global.device)
    return int((is_global * index).max()) if is_global.numel() else 0


def validate_inputs(
    config,
    *,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    past_length,
    position_ids: torch.Tensor | None = None,
    key_slots: int | None = None,
    prefix: str = "",
) -> int:
    """Check the inputs of one stack; return the key span the per-token inputs cover (past + length, or a
    static cache's `key_slots` when the attention mask spans them). `prefix` is "decoder_" for the decoder
    half of a seq2seq.

    Shapes are checked always. Checks of values (token ids in the vocabulary, positions in the learned
    table) read the data, so they run in eager mode only: a compiled or exported graph cannot branch on
    values, and runs them nowhere (run a batch eagerly once to have it checked)."""
    ids, embeds = f"{prefix}input_ids", f"{prefix}inputs_embeds"
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(
            f"Pass exactly one of {ids} and {embeds} (got {'both' if input_ids is not None else 'neither'})"
        )
    if input_ids is not None:
        _check_ids(config, input_ids, ids)
        given, batch, length = ids, *input_ids.shape
    else:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
            raise ValueError(
                f"{embeds} must have shape (batch, sequence, hidden_size={config.hidden_size}), got "
                f"{tuple(inputs_embeds.shape)}"
            )
        given, (batch, length) = embeds, inputs_embeds.shape[:2]
    shape = tuple((input_ids if input_ids is not None else inputs_embeds).shape)
    # transformers' models stop on a RuntimeError deep in attention here; swapformer says what is wrong.
    if length == 0:
        raise ValueError(f"{given} has shape {shape}: every sequence needs at least one token")
    if batch == 0:
        raise ValueError(f"{given} has shape {shape}: the batch needs at least one sequence")
    span = _check_attention_mask(attention_mask, batch, length, past_length, key_slots, prefix)
    if position_ids is not None and position_ids.shape[-1] != length:
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; its last dimension must be {length}"
        )
    if config.position_embedding_type == "learned" and not torch.compiler.is_compiling():
        longest = past_length + length if position_ids is None else int(position_ids.max()) + 1
        if longest > config.max_position_embeddings:
            raise ValueError(
                f"Sequence of {longest} positions exceeds max_position_embeddings={config.max_position_embeddings} "
                f"of the learned position table; truncate the inputs or use rope/alibi/relative_bias positions"
            )
    return span


def _check_ids(config, input_ids: torch.Tensor, name: str) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"{name} must have shape (batch, sequence), got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.dtype.is_complex:
        raise ValueError(f"{name} must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.numel() and not torch.compiler.is_compiling():
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"{name} holds token ids in [{low}, {high}] but vocab_size={config.vocab_size}; the tokenizer "
                f"and the model disagree (resize_token_embeddings, or fix the tokenizer)"
            )


def _check_attention_mask(
    attention_mask, batch: int, length: int, past, key_slots: int | None, prefix: str
) -> int:
    """The mask covers every cached and new token (B, past + length), or every slot of a static cache."""
    spans = set() if key_slots is None else {key_slots}
    if isinstance(past, int):
        spans.add(past + length)
    if attention_mask is None:
        if not spans:
            raise ValueError(
                "A compiled forward with this cache needs an attention_mask covering every cache slot; "
                "pass one, or use a static cache with full-attention layers only"
            )
        return max(spans)
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in spans:
        cached = f" ({past} cached + {length} new)" if isinstance(past, int) and past else ""
        raise ValueError(
            f"{prefix}attention_mask has shape {tuple(attention_mask.shape)} but the inputs need (batch={batch}, "
            f"length={' or '.join(map(str, sorted(spans))) or 'every cache slot'}){cached}: one entry per token, "
            "1 for tokens and 0 for padding"
        )
    return attention_mask.shape[1]
