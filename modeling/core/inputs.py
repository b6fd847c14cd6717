"""A stack's inputs: the keyword inputs of every base model (`BaseModelKwargs`, input_values.py), their
checks, made before anything is computed from them, and their `Positions`.

Shape legend: B batch, T new tokens, P cached tokens, S = P + T keys (or a static cache's slots).

`checked_positions` runs once per forward: it checks the inputs against the config and the cache, then
finds the query positions (B, T), the key positions (B, S) and the packed sequences (packing.py).
Shapes are checked always. Checks of values (token ids in the vocabulary, positions in the learned
table) read the data, so they run in eager mode only: a compiled or exported graph cannot branch on
values, and runs them nowhere (run a batch eagerly once to have it checked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..attention.custom_masks import check_custom_mask, custom_allowed, refuse_packing_with_custom_mask
from ..attention.packing import PackedSequences, find_packed_sequences
from .input_values import PACKING_INPUTS, BaseModelKwargs, check_global_mask, check_mask_values


def check_base_inputs(module: nn.Module, kwargs: dict) -> None:
    """A keyword argument that is neither a parameter of the forward that got it (a head's or the base
    model's) nor a `BaseModelKwargs` name is a TypeError, as for any plain function."""
    unknown = sorted(set(kwargs) - BaseModelKwargs.__optional_keys__)
    if unknown:
        raise TypeError(
            f"{type(module).__name__}.forward() (or the task head that called it) got unexpected keyword "
            f"argument(s) {unknown}: neither its parameters nor a BaseModelKwargs input "
            f"{sorted(BaseModelKwargs.__optional_keys__)}; check the spelling"
        )


def stack_inputs(module: nn.Module, global_attention_mask: torch.Tensor | None, kwargs: dict) -> dict:
    """`forward_stack`'s keyword arguments for a base model's `global_attention_mask` and
    `BaseModelKwargs` (output flags defaulting to the config's); any other name is a TypeError."""
    check_base_inputs(module, kwargs)
    config = module.config

    def flag(name):
        value = kwargs.get(name)
        return getattr(config, name) if value is None else value

    return dict(
        global_attention_mask=global_attention_mask,
        output_attentions=flag("output_attentions"),
        output_hidden_states=flag("output_hidden_states"),
        packing_inputs={name: kwargs.get(name) for name in PACKING_INPUTS},
    )


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
    half of a seq2seq. Value checks run in eager mode only (see the module docstring)."""
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
    if attention_mask.dim() == 4:
        check_custom_mask(attention_mask, batch, length, spans, past, prefix)
        return attention_mask.shape[-1]
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] not in spans:
        # the words are built here only: under torch.compile `past` may be symbolic, and dynamo cannot
        # format a symbolic int into a string
        keys = " or ".join(map(str, sorted(spans))) or "every cache slot"
        cached = f" ({past} cached + {length} new)" if isinstance(past, int) and past else ""
        raise ValueError(
            f"{prefix}attention_mask has shape {tuple(attention_mask.shape)} but the inputs need (batch={batch}, "
            f"length={keys}){cached}: one entry per token, 1 for tokens and 0 for padding (or a 4D mask "
            f"(batch, 1, query={length}, key={keys}))"
        )
    if attention_mask.dtype != torch.bool and not torch.compiler.is_compiling():
        check_mask_values(attention_mask, prefix)
    return attention_mask.shape[1]


def checked_positions(
    config,
    cache,
    *,
    input_ids,
    inputs_embeds,
    attention_mask,
    position_ids,
    global_attention_mask,
    packing_inputs,
    prefix,
) -> tuple[Positions, torch.Tensor | None]:
    """Check the inputs against the config and the cache; return their `Positions` and the
    `global_attention_mask` padded to the key span. A cache that receives packed rows is marked so
    that it is never extended."""
    span = validate_inputs(
        config,
        input_ids=input_ids,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_length=cache.past,
        key_slots=cache.key_slots,
        prefix=prefix,
    )
    ref = input_ids if input_ids is not None else inputs_embeds
    batch, length = ref.shape[:2]
    global_mask = None
    if global_attention_mask is not None:
        global_mask = check_global_mask(global_attention_mask, batch, cache.past, length, span, prefix)
    cache.refuse_if_packed(prefix)
    positions = Positions.of(
        batch=batch,
        length=length,
        past=cache.past,
        span=span,
        device=ref.device,
        attention_mask=attention_mask,
        position_ids=position_ids,
        packing_inputs=packing_inputs,
        prefix=prefix,
    )
    if positions.packing is not None:
        cache.mark_packed()
    return positions, global_mask


# Token positions of a forward ------------------------------------------------------------------------


def positions_from_mask(key_valid: torch.Tensor | None, batch: int, total: int, device) -> torch.Tensor:
    """Integer positions of all S keys, (B, S): counted over non-padding tokens when a padding mask
    is given, so a left-padded row gets the positions of the same row unpadded."""
    if key_valid is None:
        return torch.arange(total, device=device)[None].expand(batch, -1)
    return (key_valid.long().cumsum(-1) - 1).clamp(min=0)


def new_columns(x: torch.Tensor, past, t: int) -> torch.Tensor:
    """Columns past .. past + t - 1 of (B, S) `x`. `past` is a 0-d tensor when a static cache counts
    its tokens under torch.compile; an index keeps that graph free of data-dependent slicing."""
    if isinstance(past, int):
        return x[:, past : past + t]
    return x.index_select(1, past + torch.arange(t, device=x.device))


@dataclass(frozen=True)
class Positions:
    """The positions of one forward of `batch` rows of `length` new tokens after `past` cached ones.

    Attributes:
        span: absolute key indices the per-token inputs cover (past + length, or a static cache's slots).
        key_valid: (B, span) False for padding, or None.
        query: (B, T) position of each new token (the `position_ids`).
        keys: (B, span) position of each key; packed rows restart them per sequence.
        packing: the packed sequences of the new tokens, or None when each row holds one.
        custom: (B, T, span) bool, a 4D attention_mask (True where a new token may attend a key), or None.
            With one there is no padding mask and no packing: the mask says which keys each query sees,
            and positions default to past .. past + T - 1, as LlamaModel's do.
    """

    batch: int
    length: int
    past: int | torch.Tensor
    span: int
    device: torch.device
    key_valid: torch.Tensor | None
    query: torch.Tensor
    keys: torch.Tensor
    packing: PackedSequences | None
    custom: torch.Tensor | None = None

    @classmethod
    def of(cls, *, batch, length, past, span, device, attention_mask, position_ids, packing_inputs, prefix):
        """Packed rows restart their positions, for keys too (ALiBi and T5 distances, global tokens).

        Under torch.compile every row with `position_ids` counts as packed (whether it is would depend
        on the data); generate() passes position_ids at every step of a compiled model."""
        custom = None
        if attention_mask is not None and attention_mask.dim() == 4:
            refuse_packing_with_custom_mask(packing_inputs, prefix)
            custom, attention_mask = custom_allowed(attention_mask, batch), None
        key_valid = attention_mask.bool() if attention_mask is not None else None
        packing = None
        # only inputs that can mark packed rows are read (packing.py); a plain batch never goes there
        may_pack = position_ids is not None or any(v is not None for v in packing_inputs.values())
        if custom is None and may_pack:
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
        return cls(batch, length, past, span, device, key_valid, position_ids, key_pos, packing, custom)

    @property
    def total(self):
        """Tokens seen after this forward, P + T (a 0-d tensor when `past` is one)."""
        return self.past + self.length
