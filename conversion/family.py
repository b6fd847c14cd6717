"""What conversion knows about one transformers family, as data: a `Family`, registered under its
`model_type`.

A family file (bert.py, roberta.py, gpt2.py, ...) defines one `Family` and calls `register` on it;
the engine (engine.py), the verification (verify.py) and the folder conversion (checkpoint.py) read
these fields and never name a family. Adding a family is one file (plus its name in the import line of
`__init__.py`, which loads the files).

Tied weights are not declared here: transformers declares them on its classes
(`all_tied_weights_keys`), and the engine reads them there, on both sides.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .rules import ConversionError, Rule


@dataclass(frozen=True)
class Architecture:
    """One source model class of a family: the swapformer class it becomes, the rules of its keys,
    and the swapformer config values the class implies (RoBERTa's base model has a pooler, its
    classifier does not); the reverse conversion picks the class whose values the config has."""

    target: str
    rules: list[Rule]
    config: dict = field(default_factory=dict)
    # Called with the transformers config, both ways; raises ConversionError naming a tensor that
    # cannot carry the same function into the other class, and why.
    check: Callable | None = None


@dataclass(frozen=True)
class Fields:
    """Config fields that carry over as they are, {swapformer name: transformers name}."""

    names: Mapping[str, str]

    @classmethod
    def parse(cls, spec: str) -> Fields:
        """`"vocab_size hidden_size=d_model ..."`: a bare name is the same on both sides,
        `ours=theirs` renames."""
        pairs = (item.partition("=") for item in spec.split())
        return cls({ours: theirs or ours for ours, _, theirs in pairs})

    def from_hf(self, hf) -> dict:
        return {ours: getattr(hf, theirs) for ours, theirs in self.names.items()}

    def to_hf(self, cfg) -> dict:
        return {theirs: getattr(cfg, ours) for ours, theirs in self.names.items()}


def label_fields(config) -> dict:
    """What classification heads read from a config (either side): labels and problem type."""
    return {
        "id2label": dict(config.id2label),
        "label2id": dict(config.label2id),
        "problem_type": config.problem_type,
    }


@dataclass(frozen=True)
class Family:
    """A transformers family and how its checkpoints map to swapformer's, both ways.

    Attributes:
        model_type: transformers' `model_type` (config.json), the key of `FAMILIES`.
        architectures: transformers class name -> `Architecture` (swapformer class, key rules per
            head, implied config, checks), the base model first. Tensors set aside (`ASIDE` targets
            of the rules) are named and explained where the rules are.
        config_from_hf / config_to_hf: the config mapping; raise ValueError naming what cannot map.
        drop: full-match regexes of source keys not carried over on purpose (buffers transformers
            rebuilds, views of a shared tensor), in either direction.
        architectures_for_config: for families whose rules depend on the config (RoBERTa's position
            table starts at pad_token_id + 1): the classes of that config.
        stretchable: its learned position table can be copied to make a long model (stretch.py).
        long_refusal: why `stretch` refuses the family and what to do instead (None: a generic line).
        verify_window_limit: windows up to this many tokens are cut by the verification batch.
        verification_inputs: `(config, inputs) -> inputs`, adding what the family reads besides tokens
            and padding (Longformer's `global_attention_mask`).
    """

    model_type: str
    architectures: Mapping[str, Architecture]
    config_from_hf: Callable
    config_to_hf: Callable
    drop: tuple[str, ...] = ()
    architectures_for_config: Callable[..., Mapping[str, Architecture]] | None = None
    stretchable: bool = False
    long_refusal: str | None = None
    verify_window_limit: int = 64
    verification_inputs: Callable[[object, dict], dict] | None = None

    @property
    def DROP(self) -> tuple[str, ...]:  # noqa: N802 (the name family modules exported before Family)
        return self.drop

    def classes(self, hf_config) -> Mapping[str, Architecture]:
        """The source classes this family converts, for `hf_config`."""
        if self.architectures_for_config is None:
            return self.architectures
        return self.architectures_for_config(hf_config)

    def architecture(self, class_name: str, hf_config, where: str = "") -> Architecture:
        """The `Architecture` of source class `class_name`; ConversionError listing the others."""
        classes = self.classes(hf_config)
        if class_name not in classes:
            raise ConversionError(
                f"{class_name}{where} has no swapformer counterpart; {self.model_type} converts: {', '.join(classes)}"
            )
        return classes[class_name]


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` known to the conversion under its model_type (a second one is refused)."""
    if family.model_type in FAMILIES:
        raise ValueError(f"A conversion family for model_type={family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


def family_for(model_type: str | None) -> Family:
    """The registered family of `model_type`; ConversionError naming the supported ones."""
    if model_type not in FAMILIES:
        raise ConversionError(
            f"No conversion for model_type={model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def architectures_for(family: Family, hf_config) -> Mapping[str, Architecture]:
    """The source classes `family` converts, for this config (RoBERTa's rules depend on padding_idx)."""
    return family.classes(hf_config)
