"""The field table of the configurations: each field's kind, range or choices, owning feature and fix.

A config class declares each field once, as an annotated class attribute whose default is made by one
of the constructors below (`integer`, `number`, `probability`, `choice`, `flag`, `token_id`, `free`).
They return a `dataclasses.field` carrying a `Rule` in its metadata, so the dataclass that
transformers builds from the class keeps its fields, defaults, `to_dict`, diff-to-default saving and
IDE-visible attributes, and `check_fields` validates every field from the same declaration, the way
the capability table drives the backend checks. Rules between fields are in `config_rules.py`.

Torch-free, like the rest of `configuration/`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The metadata key of a field's rule (transformers' strict dataclasses read "validator": not used here)
RULE = "swapformer_rule"


@dataclass(frozen=True)
class Rule:
    """How one field is checked.

    Attributes:
        kind: "int", "number", "choice", "bool", "token_id" or "free" (checked by a cross-field rule).
        feature: the feature that owns the field (sizes, positions, rope, dropout, patterns, ...).
        minimum, maximum, above: the range of an int or number (`above`: strictly greater than `minimum`).
        choices: the accepted values of a choice.
        optional: `None` is accepted (and means what the class doc says).
        fix: what to do, appended to the message when the value is wrong.
    """

    kind: str
    feature: str
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False
    choices: tuple = ()
    optional: bool = False
    fix: str = ""


def _field(default, rule: Rule) -> Any:
    # Any: to type checkers and IDEs the attribute has its annotation's type, not Field's
    return dataclasses.field(default=default, metadata={RULE: rule})


def integer(default, *, minimum: int, feature: str, optional: bool = False) -> Any:
    """An int >= `minimum`; a `None` default that `__post_init__` derives is not `optional`."""
    return _field(default, Rule("int", feature, minimum=minimum, optional=optional))


def number(
    default, *, minimum: float, feature: str, fix: str, above: bool = False, optional: bool = False
) -> Any:
    return _field(default, Rule("number", feature, minimum=minimum, above=above, optional=optional, fix=fix))


DROPOUT_FIX = "it is a dropout probability (0.1 is usual, 0 turns it off)"


def probability(default, *, feature: str = "dropout", optional: bool = False) -> Any:
    return _field(
        default, Rule("number", feature, minimum=0.0, maximum=1.0, optional=optional, fix=DROPOUT_FIX)
    )


def choice(default, choices: tuple, *, feature: str) -> Any:
    return _field(default, Rule("choice", feature, choices=tuple(choices)))


def flag(default: bool, *, feature: str) -> Any:
    return _field(default, Rule("bool", feature))


def token_id(default=None, *, feature: str = "token ids") -> Any:
    """None, a token id in [0, vocab_size), or a list of them (eos)."""
    return _field(default, Rule("token_id", feature, optional=True))


def free(default, *, feature: str) -> Any:
    """A field whose shape is checked by the cross-field rules of its feature (dicts, layer lists)."""
    return _field(default, Rule("free", feature, optional=True))


# The checks of each kind ----------------------------------------------------------------------------


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")


def check_number(
    name: str, value, *, minimum: float, maximum: float | None = None, above: bool = False, fix: str
):
    """A finite real number >= `minimum` (> when `above`) and <= `maximum`. Only what cannot work is
    refused: values transformers' own configs and tests use (eps 1.0, initializer_range 0) pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}); {fix}")
    low_ok = value > minimum if above else value >= minimum
    if not (math.isfinite(value) and low_ok and (maximum is None or value <= maximum)):
        if maximum is not None:
            bound = f"lie in [{minimum:g}, {maximum:g}]"
        else:
            bound = f"be a finite number {'>' if above else '>='} {minimum:g}"
        raise ValueError(f"{name} must {bound}, got {name}={value!r}; {fix}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; choose one of {', '.join(map(repr, choices))}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def check_token_id(name: str, value, vocab_size: int) -> None:
    for v in value if isinstance(value, list) else [value]:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size):
            raise ValueError(f"{name}={value!r} must be None or a token id in [0, vocab_size={vocab_size})")


KIND_CHECKS: dict[str, Callable] = {
    "int": lambda name, value, rule, config: check_int(name, value, rule.minimum),
    "number": lambda name, value, rule, config: check_number(
        name, value, minimum=rule.minimum, maximum=rule.maximum, above=rule.above, fix=rule.fix
    ),
    "choice": lambda name, value, rule, config: check_choice(name, value, rule.choices),
    "bool": lambda name, value, rule, config: check_bool(name, value),
    "token_id": lambda name, value, rule, config: check_token_id(name, value, config.vocab_size),
    "free": lambda name, value, rule, config: None,
}


def rules_of(config_or_class) -> dict[str, Rule]:
    """{field name: rule} of every field declared with a rule, in declaration order."""
    return {f.name: f.metadata[RULE] for f in dataclasses.fields(config_or_class) if RULE in f.metadata}


def check_fields(config) -> None:
    """Check every field against its own rule (kinds, ranges, choices), in declaration order; token ids
    last, so that they are compared with a checked vocab_size."""
    rules = sorted(rules_of(config).items(), key=lambda item: item[1].kind == "token_id")
    for name, rule in rules:
        value = getattr(config, name)
        if value is None and rule.optional:
            continue
        KIND_CHECKS[rule.kind](name, value, rule, config)
