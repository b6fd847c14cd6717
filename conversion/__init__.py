"""swapformer.conversion: checkpoint key maps (as data) and the strict converter."""

from __future__ import annotations

import copy

from . import bart, bert, gpt2, llama
from .rules import ConversionError, Rule, convert_state_dict, expected_target_keys

FAMILIES = {"bert": bert, "gpt2": gpt2, "llama": llama, "bart": bart}


def from_hf_model(hf_model, target_class, family: str | None = None):
    """Build a swapformer `target_class` holding the weights of transformers model `hf_model`.

    Args:
        family: key of `FAMILIES`; by default `hf_model.config.model_type`.
    Raises:
        ValueError: unsupported family. ConversionError: keys that do not line up (listed).
    """
    family = family or hf_model.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"No conversion for model_type={family!r}; supported: {', '.join(sorted(FAMILIES))}")
    module = FAMILIES[family]
    config = module.config_from_hf(hf_model.config)
    model = target_class(copy.deepcopy(config))
    # Tied copies in the source (e.g. lm_head.weight of a tied Llama) are not separate data.
    tied_in_source = set(getattr(hf_model, "all_tied_weights_keys", {}) or {})
    source = {k: v for k, v in hf_model.state_dict().items() if k not in tied_in_source}
    state = convert_state_dict(
        source, module.RULES, expected_keys=expected_target_keys(model), drop=module.DROP
    )
    result = model.load_state_dict(state, strict=False)  # tied copies are absent on purpose
    if set(result.missing_keys) - set(model.all_tied_weights_keys) or result.unexpected_keys:
        raise ConversionError(f"load_state_dict disagreed with the key check: {result}")
    model.tie_weights()
    return model.to(hf_model.dtype).eval()


__all__ = [
    "FAMILIES",
    "ConversionError",
    "Rule",
    "convert_state_dict",
    "expected_target_keys",
    "from_hf_model",
]
