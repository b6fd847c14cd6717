"""swapformer.conversion: checkpoint families as data (family.py, one file per family), the strict
engine applying their key maps both ways (engine.py), folder-to-folder conversion with verification
(`convert`, the `swapformer convert` command), and long models made from BERT/RoBERTa (`stretch`, or
`convert(..., max_length=...)`)."""

from __future__ import annotations

# Each family file registers its Family in FAMILIES when imported.
from . import (  # noqa: F401
    bart,
    bert,
    big_bird,
    deepseek_v3,
    gpt2,
    llama,
    longformer,
    mistral,
    roberta,
    stablelm,
    t5,
)
from .checkpoint import convert
from .engine import (
    build_target,
    convert_state_dict,
    expected_target_keys,
    from_hf_model,
    invert_state_dict,
    untied_state_dict,
)
from .family import FAMILIES, Architecture, Family, architectures_for, register
from .rules import ASIDE, ConversionError, Rule
from .stretch import LongSettings, stretch
from .verify import TOLERANCE, ConversionReport, VerificationError

__all__ = [
    "ASIDE",
    "FAMILIES",
    "TOLERANCE",
    "Architecture",
    "ConversionError",
    "ConversionReport",
    "Family",
    "Rule",
    "VerificationError",
    "architectures_for",
    "build_target",
    "convert",
    "convert_state_dict",
    "expected_target_keys",
    "from_hf_model",
    "invert_state_dict",
    "LongSettings",
    "register",
    "stretch",
    "untied_state_dict",
]
