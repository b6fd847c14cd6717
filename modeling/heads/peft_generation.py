"""generate() under PEFT's prompt learning, refused before the first step.

PEFT 0.21 generates with a prompt-learning adapter (prefix tuning, prompt tuning, P-tuning, CPT) by
putting its own `prepare_inputs_for_generation` on the base model for the call. That hook passes a prefix
as `past_key_values` and reads the cache under that name, while transformers 5.24 and later hand the cache
to the model as `cache`: the prefix arrives beside generate()'s own cache, and the virtual tokens of
prompt tuning are cached without the attention mask ever covering them. transformers' own models then
decode with the prefix ignored or drift from the second token; refusing beats a wrong answer. An
encoder-decoder's prompt and P-tuning only prepend embeddings to the encoder input, outside the hook's
cache logic, and decode correctly (tests/heads/test_peft_prefix.py compares them with step-by-step
decoding).
"""

from __future__ import annotations

import sys

import transformers

# PEFT's prompt-learning types whose encoder-decoder generation goes through the cache (PeftType values)
CACHE_PREFIX_TYPES = ("PREFIX_TUNING", "CARTRIDGE")


def peft_prompt_learning(model) -> str | None:
    """The PEFT type of a prompt-learning adapter whose generation hook is on `model` for this generate()
    call and would decode wrongly, or None."""
    hook = model.__dict__.get("prepare_inputs_for_generation")
    config = getattr(getattr(hook, "__self__", None), "active_peft_config", None)
    if not getattr(config, "is_prompt_learning", False):
        return None
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if model.config.is_encoder_decoder and kind not in CACHE_PREFIX_TYPES:
        return None
    return kind


def refuse_peft_prompt_learning(model) -> None:
    kind = peft_prompt_learning(model)
    if kind is None:
        return
    peft = getattr(sys.modules.get("peft"), "__version__", "?")
    raise ValueError(
        f"generate() with PEFT's prompt learning ({kind}) does not work with transformers "
        f"{transformers.__version__} and peft {peft}: PEFT passes the virtual tokens through the cache under "
        "its old name `past_key_values`, so generation would ignore them or drift from the second token. "
        "Decode with the PEFT model's forward instead, without a cache: repeat `next_id = "
        "peft_model(input_ids=ids, attention_mask=mask).logits[:, -1].argmax(-1)` and append it to ids (and 1 "
        "to mask; an encoder-decoder grows decoder_input_ids). An encoder-decoder's prompt or P-tuning adapter "
        "generates as it is; prompt-learning adapters cannot be merged into the model"
    )
