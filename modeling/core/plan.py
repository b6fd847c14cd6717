"""The plan of one forward: every fact about masks, backends, positions and the cache, made once.

Shape legend: B batch, T new tokens, S keys handed to attention, D head dim.

`ForwardPlan.build` runs once per stack forward, after the inputs are checked and their positions
found (inputs.py) and embedded: it makes one `AttentionPattern` per layer type (and one
for cross-attention), checks the batch against each backend's capabilities, resolves each backend's
attention function and lowers each pattern for it. The blocks read their `LayerPlan` and compute
nothing about masks, backends or cache geometry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...configuration.backends import (
    AUTO_BACKEND,
    COMPILES_ON,
    LAYER_TYPE_PATTERN,
    PER_LAYER_BACKEND,
    check_batch_feature,
)
from ...configuration.configuration_swapformer import GLOBAL_KINDS
from ..attention.auto_backend import resolve as resolve_auto
from ..attention.custom_masks import custom_mask_at_keys, refuse_custom_mask_backends
from ..attention.functions import eager_attention_forward, run_uncompiled
from ..attention.lowering import LOWERINGS
from ..attention.masks import (
    AttentionPattern,
    KernelMask,
    cross_attention_pattern,
    global_tokens,
    is_padded,
)
from ..attention.packing import PackedSequences
from ..caches.cache import CacheView
from ..caches.cache_layers import plan_global_window
from ..compat.hf_compat import ALL_ATTENTION_FUNCTIONS
from ..sparse.bigbird import random_blocks
from ..variants.global_rows import pattern_for_backend
from ..variants.linformer import LinformerProjections
from ..variants.streaming import sink_shift
from .inputs import Positions, new_columns
from .layers import check_backend_for_batch


@dataclass(frozen=True)
class LayerPlan:
    """How the layers of one layer type attend in this forward (self- or cross-attention).

    Attributes:
        pattern: which keys each query may see; also read to recompute weights for `output_attentions`
            and by Longformer's global rows (global_rows.py).
        backend: the backend that runs these layers, and `attention_fn` its function in transformers'
            `ALL_ATTENTION_FUNCTIONS` (eager's when none is registered under the name).
        kernel_kwargs: what the backend's kernel takes beside the mask (flash-attention's varlen
            boundaries of packed rows). The mask itself is `ForwardPlan.masks[layer_type]`, handed to the
            blocks as their `attention_mask` argument (layers.Block.forward says why).
        rope: the (cos, sin) pair (B, T, R) queries and keys are rotated by (the first R of D dims per
            head; `stack.rotary_emb` made it), or None.
        cache: the cache the layers append their keys to (cross-attention: keep the encoder's in).
        linformer: the stack's Linformer projections (linformer.py) when `config.linformer_k` is set; the
            layers project their keys and values with them, and no mask is lowered (`mask` is None).
        sink_shift: the rotation of the kept leading keys of a window + global cache to StreamingLLM's
            positions within the cache (`streaming_positions="cache"`, streaming.py), or None.
    """

    layer_type: str
    pattern: AttentionPattern
    backend: str
    attention_fn: Callable
    kernel_kwargs: dict
    rope: tuple[torch.Tensor, torch.Tensor] | None
    cache: CacheView
    linformer: LinformerProjections | None = None
    sink_shift: tuple[torch.Tensor, torch.Tensor] | None = None  # streaming positions (streaming.py)

    @classmethod
    def make(
        cls, layer_type, pattern, lowered_from, backend, dtype, rope, cache, linformer=None, shift=None
    ) -> tuple[LayerPlan, object]:
        """The plan of `pattern` on `backend` and its mask, lowered from `lowered_from`: `pattern`, or
        `pattern` less the rows the layer computes itself (`pattern_for_backend`). With `linformer` the
        backend attends to projected rows that need no mask, and none is lowered."""
        mask = None if linformer is not None else lower_mask(lowered_from, backend, dtype)
        kernel_kwargs = {}
        if isinstance(mask, KernelMask):
            mask, kernel_kwargs = mask.mask, mask.kwargs
        attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)
        plan = cls(layer_type, pattern, backend, attention_fn, kernel_kwargs, rope, cache, linformer, shift)
        return plan, mask


@dataclass(frozen=True)
class ForwardPlan:
    """One forward of a stack: its positions, the RoPE pair, and per layer type a `LayerPlan` and the
    lowered mask for self-attention (`layers`, `masks`) and for cross-attention (`cross`,
    `cross_masks`, empty without encoder states)."""

    positions: Positions
    rope: tuple[torch.Tensor, torch.Tensor] | None
    layers: dict[str, LayerPlan]
    cross: dict[str, LayerPlan]
    masks: dict[str, object]
    cross_masks: dict[str, object]

    @classmethod
    def build(
        cls,
        stack,
        positions: Positions,
        cache: CacheView,
        dtype: torch.dtype,
        *,
        global_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_packing: PackedSequences | None = None,
    ) -> ForwardPlan:
        """The plan of `stack` (a `StackMixin`) for inputs at `positions` with `cache`; masks and the
        RoPE pair in `dtype`, the dtype of the embedded inputs."""
        config = stack.config
        rotary = stack.rotary_emb
        rope = rotary(positions.query, dtype) if rotary is not None else None
        patterns = {
            lt: self_attention_pattern(stack, lt, positions, cache, global_mask)
            for lt in dict.fromkeys(stack.layer_types)
        }
        backends = layer_backends(config, patterns)
        if AUTO_BACKEND in backends.values():  # issue 30: measured choices (attention/auto_backend.py)
            backends = resolve_auto(stack, patterns, backends, dtype)
        if positions.packing is not None or encoder_packing is not None:
            for backend in sorted(set(backends.values())):
                check_batch_feature(
                    backend, "packing", "packed sequences (restarting position_ids, cu_seq_lens_* or seq_idx)"
                )
        if positions.custom is not None:
            refuse_custom_mask_backends(stack, backends.values())
        for lt, pattern in patterns.items():
            check_backend_for_batch(backends[lt], pattern.kind, stack, positions.device)
        linformer = getattr(stack, "linformer", None)
        streaming = config.streaming_positions == "cache"
        layers = {
            lt: LayerPlan.make(
                lt,
                p,
                p if p.global_queries is None else pattern_for_backend(stack, lt, p),
                backends[lt],
                dtype,
                rope,
                cache,
                linformer,
                sink_shift(p, dtype, rotary) if streaming else None,
            )
            for lt, p in patterns.items()
        }
        cross = {}
        if encoder_hidden_states is not None:
            pattern = cross_attention_pattern(
                positions, encoder_hidden_states, encoder_attention_mask, encoder_packing
            )
            cross = {
                lt: LayerPlan.make(lt, pattern, pattern, backends[lt], dtype, None, cache) for lt in patterns
            }
        (layers, masks), (cross, cross_masks) = _unzip(layers), _unzip(cross)
        return cls(positions, rope, layers, cross, masks, cross_masks)


def lower_mask(pattern: AttentionPattern, backend: str, dtype):
    """The lowering of `pattern` for `backend` (`lowering.LOWERINGS`), run outside torch.compile where
    `backend` does not compile on the pattern's device (torch inductor miscompiles flex's BlockMask
    construction on CPU; sparse sizes its layout from data)."""
    lower = LOWERINGS[backend]
    if (backend, pattern.kind, pattern.device.type) in COMPILES_ON:
        return lower(pattern, dtype)
    return run_uncompiled(lower, pattern, dtype)


# The lowerings of the plain path; the kernels' are lowering.py's, in one table (`LOWERINGS`) ----------


def is_trivial(pattern: AttentionPattern) -> bool:
    """True when nothing is masked beyond what `is_causal` (or no mask) expresses, and no bias.
    False when the answer would depend on data: a static cache's token count held in a tensor."""
    if pattern.kind != "full" or pattern.bias_fn is not None or pattern.key_valid is not None:
        return False
    if pattern.query_packing is not None or pattern.custom_mask is not None:
        return False
    if torch.is_tensor(pattern.query_offset) or torch.is_tensor(pattern.total_length):
        return False
    if pattern.key_offset != 0 or pattern.key_prefix or pattern.key_length != pattern.total_length:
        return False
    return not pattern.causal or pattern.query_length == 1 or pattern.query_offset == 0


def lower_eager(pattern: AttentionPattern, dtype):
    """eager's mask: additive float (B, 1 or H, T, S), or None where nothing is masked."""
    if is_trivial(pattern) and not pattern.causal:
        return None
    return pattern.additive(dtype)


def lower_sdpa(pattern: AttentionPattern, dtype):
    """sdpa's mask: bool (B, 1, T, S), additive float with a bias, or None where `is_causal` (or
    nothing) says it."""
    if is_trivial(pattern):
        return None
    if pattern.bias_fn is not None:
        return pattern.additive(dtype)
    return pattern.dense_allowed()


LOWERINGS.update(eager=lower_eager, sdpa=lower_sdpa)


def layer_backends(config, layer_types) -> dict[str, str]:
    """{layer type: backend}, read from the config's data (`SwapformerConfig.backend_for` says the same):
    the backend's name, or the name of the per-layer dispatcher and its mapping."""
    name = config._attn_implementation_internal or "eager"
    if name == PER_LAYER_BACKEND:
        return config._attn_layer_backends
    return dict.fromkeys(layer_types, name)


def _unzip(made: dict[str, tuple[LayerPlan, object]]) -> tuple[dict, dict]:
    """{layer type: (plan, mask)} -> ({layer type: plan}, {layer type: mask})."""
    return {lt: plan for lt, (plan, _) in made.items()}, {lt: mask for lt, (_, mask) in made.items()}


# Patterns ----------------------------------------------------------------------------------------------


def self_attention_pattern(stack, layer_type: str, pos: Positions, cache: CacheView, global_mask):
    """The self-attention pattern of the layers of `layer_type`, sized by the keys their cache layer
    hands over. With packed rows (no cache content) key positions restart per sequence, so global
    tokens are the first `global_tokens` of each sequence."""
    config = stack.config
    kind = LAYER_TYPE_PATTERN[layer_type]
    is_global = global_tokens(config, kind, pos, global_mask) if kind in GLOBAL_KINDS else None
    if kind == "sliding_global":
        indices = [i for i, other in enumerate(stack.layer_types) if other == layer_type]
        plan_global_window(
            cache, indices, config.sliding_window, config.global_tokens, is_global, pos.key_valid
        )
    keys = cache.key_geometry(stack.layer_types.index(layer_type), pos.length)
    index = torch.arange(keys.length, device=pos.device)
    # absolute key indices; a window + global cache hands over its kept leading tokens first
    index = AttentionPattern.keys_at(index, keys.offset, keys.prefix) if keys.prefix else index + keys.offset
    valid = select_keys(pos.key_valid, index, False)
    extra = {}
    if is_global is not None:
        extra.update(
            global_keys=select_keys(is_global, index, False),
            global_queries=new_columns(is_global, pos.past, pos.length),
        )
    if pos.packing is not None:
        packed = (pos.packing.ids, pos.packing.starts, pos.packing.lengths)
        extra.update(
            query_packing=pos.packing,
            key_packing=PackedSequences(*(select_keys(x, index, -1) for x in packed)),
        )
    if kind == "bigbird":
        extra.update(random_blocks(config, stack.causal, pos, keys))
    if pos.custom is not None:
        extra.update(custom_mask=custom_mask_at_keys(pos.custom, index))
    has_bias = config.position_embedding_type in ("alibi", "relative_bias")
    return AttentionPattern(
        kind=kind,
        causal=stack.causal,
        batch=pos.batch,
        query_offset=pos.past,
        query_length=pos.length,
        key_offset=keys.offset,
        key_length=keys.length,
        key_prefix=keys.prefix,
        total_length=pos.total,
        device=pos.device,
        key_valid=valid if valid is not None and is_padded(valid, pos.total, index) else None,
        window=config.sliding_window,
        block_size=config.attention_block_size,
        bias_fn=stack.pair_bias if has_bias else None,
        query_pos=pos.query,
        key_pos=select_keys(pos.keys, index, 0),
        **extra,
    )


# Per-token values at the keys ----------------------------------------------------------------------------


def select_keys(x: torch.Tensor | None, index: torch.Tensor, fill) -> torch.Tensor | None:
    """(B, P + T) per-token values -> their values at the keys a cache layer hands to attention,
    whose absolute indices are `index` (S,); `fill` outside 0..P+T-1 (empty slots of a static cache).
    Always masked (no data-dependent shortcut), so compiled and exported graphs take the same path."""
    if x is None:
        return None
    picked = x[:, index.clamp(0, x.shape[1] - 1)]
    return picked.masked_fill((index < 0) | (index >= x.shape[1]), fill)
