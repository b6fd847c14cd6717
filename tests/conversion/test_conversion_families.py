"""Conversion families as data (conversion/family.py): a family is one `Family` object, registered
under its model_type, and the generic modules (engine, verification, folders) never name one.

The proof that a family is one object: XLM-RoBERTa, which swapformer does not ship, registered in a
few lines from RoBERTa's parts, converts with verification against the transformers model and comes
back bit for bit; before it is registered, the same folder is refused."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import transformers as T

import swapformer
from swapformer.conversion import FAMILIES, convert, register, roberta

from hf_models import SMALL, hf_state, refused, save_source

GENERIC = (
    "atomic.py",
    "card.py",
    "checkpoint.py",
    "engine.py",
    "family.py",
    "io.py",
    "reverse.py",
    "rules.py",
    "sentence_files.py",
    "stretch.py",
    "verify.py",
)


def xlm_roberta_family():
    """XLM-RoBERTa is RoBERTa under other class names and another model_type."""

    def architectures(offset: int):
        return {"XLM" + name: arch for name, arch in roberta.architectures(offset).items()}

    def config_to_hf(cfg):
        fields = roberta.hf_encoder_fields(cfg)
        fields["max_position_embeddings"] += cfg.pad_token_id + 1
        return T.XLMRobertaConfig(**fields)

    return roberta.offset_family(
        "xlm-roberta", architectures, roberta.config_from_hf, config_to_hf, roberta.DROP
    )


@pytest.mark.parametrize(
    "cls, target",
    [
        (T.XLMRobertaForMaskedLM, "EncoderForMaskedLM"),
        (T.XLMRobertaForSequenceClassification, "EncoderForSequenceClassification"),
    ],
)
def test_a_new_family_is_one_registered_family_object(cls, target, tmp_path):
    config = T.XLMRobertaConfig(**SMALL, max_position_embeddings=42, type_vocab_size=1, pad_token_id=1)
    config.num_labels = 3
    src = save_source(cls, config, tmp_path / "src")
    refused(src, tmp_path / "before", "No conversion for model_type='xlm-roberta'")
    family = register(xlm_roberta_family())
    try:
        with pytest.raises(ValueError, match="model_type='xlm-roberta' is already registered"):
            register(xlm_roberta_family())
        report = convert(src, tmp_path / "ours", log=lambda line: None)
        assert (report.family, report.target_class) == ("xlm-roberta", target)
        assert report.max_diff <= 1e-4 and "logits" in report.diffs
        convert(tmp_path / "ours", tmp_path / "back", to_hf=True, log=lambda line: None)
    finally:
        FAMILIES.pop(family.model_type)
    original, returned = hf_state(cls, src), hf_state(cls, tmp_path / "back")
    assert original.keys() == returned.keys()
    assert all(v.equal(returned[k]) for k, v in original.items())


def family_names_in(source: str) -> set[str]:
    """Registered model_types that `source` names as a whole string literal or imports as a module."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.ImportFrom):
            names.update([node.module or ""] + [alias.name for alias in node.names])
    return names & set(FAMILIES)


def test_the_generic_modules_name_no_family():
    """What a family is lives in its own file: a generic module that tested `model_type == "bert"`
    (as stretch.py's tuple of stretchable families once did) fails here."""
    folder = Path(swapformer.conversion.__file__).parent
    named = {name: family_names_in((folder / name).read_text()) for name in GENERIC}
    assert not {name: found for name, found in named.items() if found}
    assert family_names_in('STRETCHABLE = ("bert", "roberta")\nfrom . import t5') == {"bert", "roberta", "t5"}
