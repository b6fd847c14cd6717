"""transformers' generate() for swapformer's generating heads: the decoding weight copies (a CPU route,
cpu/weight_copies.py) around the call, swapformer's cache layers in a cache generate() builds, and the
refusals of a call that could only fail or go wrong part-way (generation_checks.py), made before the
first step."""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin

from ..caches.cache import fresh_cache
from ..cpu import copies_for_generate
from .generation_checks import (
    PastTheTable,
    prompt_of,
    refuse_filled_cache,
    refuse_length_past_table,
    refuse_prompt_past_table,
)
from .peft_generation import refuse_peft_prompt_learning


class SwapformerGenerationMixin(GenerationMixin):
    """transformers' generate(), decoding on input-major copies of the CPU weights (cpu.DecodingWeights)."""

    decoding_copies: str = "auto"  # or "all", "lm_head", "none": see cpu.DecodingWeights

    def generate(self, *args, **kwargs):
        refuse_peft_prompt_learning(self)
        prompt = prompt_of(self.config, args, kwargs)
        refuse_filled_cache(kwargs.get("cache", kwargs.get("past_key_values")), prompt)
        refuse_prompt_past_table(self.config, prompt, kwargs.get("max_new_tokens"))
        try:
            with copies_for_generate(self, args, kwargs):
                return super().generate(*args, **kwargs)
        except PastTheTable as refusal:
            raise ValueError(*refusal.args) from None  # raised by the hook below, before the first step

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
    ):
        """transformers' hook that builds the cache of a generate() call, called once the lengths are
        final and before the first forward: a call that would run past a learned position table is
        refused here, and a cache built here (not the caller's) gets swapformer's layer objects before
        its first use (cache.fresh_cache)."""
        refuse_length_past_table(self.config, generation_config, model_kwargs, max_cache_length)
        given = model_kwargs.get("cache") is not None
        result = super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length, *args, **kwargs
        )
        if not given and model_kwargs.get("cache") is not None:
            fresh_cache(model_kwargs["cache"])
        return result


class DecoderGenerationMixin(SwapformerGenerationMixin):
    """The decoder's generate(): a prompt's `global_attention_mask` is a decoder input that grows."""

    def _update_model_kwargs_for_generation(
        self, outputs, model_kwargs, is_encoder_decoder: bool = False, num_new_tokens: int = 1
    ):
        """generate() grows the attention mask per step; a prompt's `global_attention_mask` grows
        with it (generated tokens are not global unless `global_tokens` says so)."""
        model_kwargs = super()._update_model_kwargs_for_generation(
            outputs, model_kwargs, is_encoder_decoder=is_encoder_decoder, num_new_tokens=num_new_tokens
        )
        marks = model_kwargs.get("global_attention_mask")
        if marks is not None:
            model_kwargs["global_attention_mask"] = nn.functional.pad(marks, (0, num_new_tokens), value=0)
        return model_kwargs


__all__ = ["DecoderGenerationMixin", "SwapformerGenerationMixin"]
