"""transformers' generate() for swapformer's generating heads: the decoding weight copies (a CPU route,
cpu/weight_copies.py) around the call, and swapformer's cache layers in a cache generate() builds."""

from __future__ import annotations

from transformers import GenerationMixin

from ..caches.cache import fresh_cache
from ..cpu import copies_for_generate


class SwapformerGenerationMixin(GenerationMixin):
    """transformers' generate(), decoding on input-major copies of the CPU weights (cpu.DecodingWeights)."""

    decoding_copies: str = "auto"  # or "all", "lm_head", "none": see cpu.DecodingWeights

    def generate(self, *args, **kwargs):
        with copies_for_generate(self, args, kwargs):
            return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' hook that builds the cache of a generate() call; a cache it builds here (not
        the caller's) gets swapformer's layer objects before its first use (cache.fresh_cache)."""
        given = model_kwargs.get("cache") is not None
        result = super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if not given and model_kwargs.get("cache") is not None:
            fresh_cache(model_kwargs["cache"])
        return result


__all__ = ["SwapformerGenerationMixin"]
