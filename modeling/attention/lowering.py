"""Lowering: the mask each backend consumes, made from an `AttentionPattern` (masks.py) once per
forward per attention kind. eager's and sdpa's forms are made in core/plan.py (the plain path, which adds
them to the table); the kernels' here; `LOWERINGS` is the table of all of them, which `plan.lower_mask`
reads.

Lowered forms (B batch, H heads, T queries, S keys):
    eager   additive float (B, 1 or H, T, S): 0 allowed, -inf not, plus position bias; or None
    sdpa    bool (B, 1, T, S), additive float with a bias, or None when `is_causal` (or nothing) says it
    sparse  a `BlockLayout` (sparse_layout.py); full layers, and the steps of a window + global cache
            that dropped keys (already O(window + globals) keys per query), take the sdpa form
    flex_attention     a BlockMask built from the same predicate
    flash_attention_2  a (B, S) padding mask or None; the window goes to the kernel as `sliding_window`;
                       packed rows: a `KernelMask` carrying transformers' varlen arguments
                       (`cu_seq_lens_q/k`, `max_length_q/k`), which the attention layer passes on
    sdpa_fa            None only (the kernel can apply no mask but `is_causal`)

What a backend cannot compute was refused when it was chosen (configuration/backends.py); the refusals
here are for what only the batch reveals, worded and answered from the same capability table.
"""

from __future__ import annotations

from collections.abc import Callable

from ...configuration.backends import BACKENDS, capable, require
from ..sparse.sparse_layout import lower_sparse
from .masks import AttentionPattern, KernelMask


def lower_sparse_backend(pattern: AttentionPattern, dtype):
    """Full layers run dense (sdpa form, `Capabilities.full_layers_as`); windowed kinds get a BlockLayout.
    So do the steps of a window + global cache that dropped keys (`key_prefix`): it hands over only the
    kept leading tokens and the window, already O(window + globals) keys per query."""
    if pattern.kind == "full" or pattern.key_prefix:
        return LOWERINGS[BACKENDS["sparse"].full_layers_as](pattern, dtype)
    return lower_sparse(pattern, dtype)


def lower_flex(pattern: AttentionPattern, dtype):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(
        pattern.mask_mod(),
        pattern.batch,
        None,
        pattern.query_length,
        pattern.key_length,
        device=pattern.device,
    )


def lower_flash(pattern: AttentionPattern, dtype):
    """flash-attn takes a key padding mask; causality and the window are kernel arguments."""
    _require_pattern("flash_attention_2", pattern)
    if pattern.query_packing is not None:
        if pattern.key_valid is not None:
            both = capable(lambda c: c.padding and c.packing, pattern.device.type)
            raise ValueError(
                "flash_attention_2 cannot combine a padding mask with packed sequences (transformers' flash path "
                "then unpads by the mask and drops the sequence boundaries); pack without padding, as "
                f"DataCollatorWithFlattening does, or use one of {', '.join(map(repr, both))}"
            )
        # transformers' flash path runs the varlen kernel over the flattened batch with these
        cu_q, max_q = pattern.query_packing.flash_boundaries()
        cu_k, max_k = pattern.key_packing.flash_boundaries()
        varlen = dict(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q, max_length_k=max_k)
        return KernelMask(None, varlen)
    if pattern.key_valid is None:
        return None
    return pattern.key_valid.long()


def lower_sdpa_fa(pattern: AttentionPattern, dtype):
    """None, or the table's refusal of what the batch needs. Beyond the table's columns: a chunk of
    several queries after cached tokens needs an offset causal mask, which `is_causal` cannot express."""
    _require_pattern("sdpa_fa", pattern)
    if LOWERINGS["sdpa"](pattern, dtype) is not None:  # plain causality (or none) is all it can do
        chunk = pattern.query_offset > 0 and pattern.query_length > 1
        masked = capable(lambda c: c.padding, pattern.device.type)
        raise ValueError(
            "attn_implementation='sdpa_fa' (SDPA pinned to its FlashAttention kernel) can apply no mask but plain "
            f"causality, and this batch needs one (pattern={pattern.kind!r}, padding={pattern.key_valid is not None}, "
            f"position bias={pattern.bias_fn is not None}, packed sequences={pattern.query_packing is not None}, "
            f"cached chunk={chunk}); use one of {', '.join(map(repr, masked))}"
        )
    return None


def _require_pattern(backend: str, pattern: AttentionPattern) -> None:
    """The capability table's refusal of the pattern kind, a position bias and packed sequences."""
    require(backend, f"pattern:{pattern.kind}", f"{pattern.kind!r} attention", needed_by="this batch")
    if pattern.bias_fn is not None:
        require(backend, "position_bias", "position_bias", needed_by="this batch")
    if pattern.query_packing is not None:
        require(backend, "packing", "packed sequences", needed_by="this batch")


# eager's and sdpa's lowerings, the plain path's, are defined in core/plan.py, which adds them here
LOWERINGS: dict[str, Callable] = {
    "sparse": lower_sparse_backend,
    "flex_attention": lower_flex,
    "flash_attention_2": lower_flash,
    "sdpa_fa": lower_sdpa_fa,
}


def lower(pattern: AttentionPattern, backend: str, dtype):
    """The mask `backend` consumes for `pattern`."""
    return LOWERINGS[backend](pattern, dtype)
