"""swapformer.conversion: checkpoint key maps (as data), the strict converter, folder-to-folder
conversion with verification (`convert`, the `swapformer convert` command), and long models made from
BERT/RoBERTa (`stretch`, or `convert(..., max_length=...)`)."""

from __future__ import annotations

from . import bart, bert, gpt2, llama, mistral, roberta, t5
from .checkpoint import (
    TOLERANCE,
    ConversionReport,
    VerificationError,
    architectures_for,
    build_target,
    convert,
)
from .rules import (
    ASIDE,
    ConversionError,
    Rule,
    convert_state_dict,
    expected_target_keys,
    invert_state_dict,
    untied_state_dict,
)
from .stretch import LongSettings, stretch

FAMILIES = {
    "bert": bert,
    "roberta": roberta,
    "gpt2": gpt2,
    "llama": llama,
    "mistral": mistral,
    "t5": t5,
    "bart": bart,
}


def from_hf_model(hf_model, target_class, family: str | None = None):
    """Build a swapformer `target_class` holding the weights of transformers model `hf_model` (in
    memory; `convert` is the folder-to-folder version with verification).

    Args:
        family: key of `FAMILIES`; by default `hf_model.config.model_type`.
    Raises:
        ValueError: unsupported family or class. ConversionError: keys that do not line up (listed).
    """
    family = family or hf_model.config.model_type
    if family not in FAMILIES:
        raise ValueError(f"No conversion for model_type={family!r}; supported: {', '.join(sorted(FAMILIES))}")
    module = FAMILIES[family]
    archs = architectures_for(module, hf_model.config)
    arch = archs.get(type(hf_model).__name__)
    if arch is None or arch.target != target_class.__name__:
        pairs = ", ".join(f"{k} -> {v.target}" for k, v in archs.items())
        raise ValueError(
            f"{type(hf_model).__name__} does not convert to {target_class.__name__}; {family} converts: {pairs}"
        )
    model, _, _ = build_target(module, arch, hf_model.config, untied_state_dict(hf_model), meta=False)
    return model.to(hf_model.dtype).eval()


__all__ = [
    "ASIDE",
    "FAMILIES",
    "TOLERANCE",
    "ConversionError",
    "ConversionReport",
    "Rule",
    "VerificationError",
    "convert",
    "convert_state_dict",
    "expected_target_keys",
    "from_hf_model",
    "invert_state_dict",
    "LongSettings",
    "stretch",
    "untied_state_dict",
]
