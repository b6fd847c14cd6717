"""The vocabulary of key maps: rename rules with optional tensor transforms (each with an exact
inverse), and the errors conversion raises.

A family file (bert.py, llama.py, bart.py, ...) lists `Rule`s from source keys to swapformer keys per
source class (family.py's `Architecture`); engine.py applies them strictly in both directions, so a
converted checkpoint goes back bit for bit.

Source tensors the swapformer model has no use for (the offset rows of BART's and RoBERTa's position
tables) are renamed to `ASIDE + name`: kept beside the model, never silently dropped, and given back
by the reverse conversion.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

ASIDE = "aside."


@dataclass(frozen=True)
class Transform:
    """A tensor operation with its exact inverse. `forward` may return a tuple (one tensor per target
    of a splitting rule); `inverse` then takes them in the same order."""

    name: str
    forward: Callable
    inverse: Callable

    def __call__(self, *tensors):
        return self.forward(*tensors)


@dataclass(frozen=True)
class Rule:
    """Source keys matching `pattern` (a full-match regex) become `replacement` (with \\1 groups).

    `transform` changes the tensor on the way, e.g. `transpose` for GPT-2's Conv1D weights. A tuple of
    replacements splits one fused tensor into several: `transform` then returns one tensor per
    replacement (GPT-2's c_attn into q, k and v).
    """

    pattern: str
    replacement: str | tuple[str, ...]
    transform: Transform | None = None

    def apply(self, key: str) -> tuple[str, ...] | None:
        match = re.fullmatch(self.pattern, key)
        if not match:
            return None
        replacements = self.replacement if isinstance(self.replacement, tuple) else (self.replacement,)
        return tuple(match.expand(r) for r in replacements)

    def tensors(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.transform.forward(tensor) if self.transform else tensor
        return out if isinstance(self.replacement, tuple) else (out,)

    def inverse(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The source tensor back from the target tensors (in replacement order)."""
        if self.transform is None:
            return tensors[0]
        return self.transform.inverse(*tensors)

    def prefixed(self, source_prefix: str, target_prefix: str) -> Rule:
        """The same rule for a model that nests the base model under a prefix (`bert.`, `model.`).
        Targets set aside keep their `aside.` marker in front."""

        def target(r: str) -> str:
            if r.startswith(ASIDE):
                return ASIDE + target_prefix + r[len(ASIDE) :]
            return target_prefix + r

        replacement = (
            target(self.replacement)
            if isinstance(self.replacement, str)
            else tuple(target(r) for r in self.replacement)
        )
        return Rule(re.escape(source_prefix) + self.pattern, replacement, self.transform)


def renames(source: str, target: str, names: str, params: str = r"(weight|bias)") -> list[Rule]:
    """One rule per module of `names` ("old=new" dotted names, or "name" kept as it is): the keys
    `source + old + "." + params` become `target + new + "." + params`. `source` is a regex prefix
    (with groups, e.g. the layer index) that `target` refers to as \\1, \\2, ..."""
    last = re.compile(source).groups + 1  # the group of `params`
    rules = []
    for item in names.split():
        old, _, new = item.partition("=")
        pattern = source + re.escape(old) + r"\." + params
        rules.append(Rule(pattern, f"{target}{new or old}.\\{last}"))
    return rules


def prefixed(rules: Iterable[Rule], source_prefix: str, target_prefix: str) -> list[Rule]:
    return [r.prefixed(source_prefix, target_prefix) for r in rules]


def split_rows(n: int) -> Transform:
    """(first n rows set aside, the rest): BART's learned positions start at row 2, RoBERTa's at
    padding_idx + 1. Returns (rest, first n) to match replacements (table, aside)."""
    return Transform(
        f"split_rows({n})",
        lambda t: (t[n:].clone(), t[:n].clone()),
        lambda rest, first: torch.cat([first, rest]),
    )


def _t(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


# GPT-2's Conv1D stores weights as (in, out); nn.Linear as (out, in).
transpose = Transform("transpose", _t, _t)


def split_last(parts: int, transposed: bool) -> Transform:
    """Split a fused projection into `parts` equal pieces along its output dimension (the last of a
    Conv1D weight or of a bias), transposing weights to nn.Linear's layout when `transposed`."""

    def forward(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_t(p) if transposed else p.contiguous() for p in t.chunk(parts, dim=-1))

    def inverse(*pieces: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.t() if transposed else p for p in pieces], dim=-1).contiguous()

    return Transform(f"split_last({parts})", forward, inverse)


class ConversionError(ValueError):
    """A checkpoint that cannot be converted completely; the message lists the keys."""


def json_list(text: str, item: type, what: str, fix: str, not_a_list: str) -> list:
    """`text` read as a JSON list of `item`s. Raises ConversionError "`what` (the parser's error); `fix`"
    for text that is not JSON, `not_a_list` for JSON of another shape."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConversionError(f"{what} ({e}); {fix}") from e
    if not isinstance(value, list) or not all(isinstance(v, item) for v in value):
        raise ConversionError(not_a_list)
    return value


def key_listing(keys: Iterable[str], limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def first_match(rules: Iterable[Rule], key: str) -> tuple[Rule, tuple[str, ...]] | None:
    """The first rule that maps `key`, with the target keys it gives; None when no rule does."""
    for rule in rules:
        targets = rule.apply(key)
        if targets is not None:
            return rule, targets
    return None
