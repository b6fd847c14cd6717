"""Checkpoint conversion as data: rename rules with optional tensor transforms, applied strictly.

A family module (bert.py, llama.py, bart.py, ...) lists `Rule`s from source keys to swapformer keys,
the source keys it drops on purpose (`DROP`, only buffers transformers rebuilds), and functions between
the source config and a swapformer config. `convert_state_dict` applies one family and refuses to
return anything when a source key is left unmapped, a target key is missing, or a target key is
produced twice, listing the keys. `invert_state_dict` runs the same rules backwards (every transform
has an exact inverse), so a converted checkpoint goes back bit for bit.

Source tensors the swapformer model has no use for (the offset rows of BART's and RoBERTa's position
tables) are renamed to `ASIDE + name`: kept beside the model, never silently dropped, and given back
by the reverse conversion.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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


class ConversionError(ValueError):
    """A checkpoint that cannot be converted completely; the message lists the keys."""


def key_listing(keys: Iterable[str], limit: int = 20) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def convert_state_dict(
    state_dict: dict[str, torch.Tensor],
    rules: Iterable[Rule],
    *,
    expected_keys: Iterable[str],
    drop: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """Rename `state_dict` by `rules`; exactly `expected_keys` must come out.

    Args:
        rules: tried in order; the first that matches a key wins.
        expected_keys: the keys the target model needs (its state dict minus tied copies); keys
            starting with `ASIDE` come out as well, for the caller to keep beside the model.
        drop: full-match regexes of source keys intentionally not carried over.
    Raises:
        ConversionError: naming unmapped source keys, missing or duplicated target keys.
    """
    rules, drop = list(rules), [re.compile(p) for p in drop]
    expected = set(expected_keys)
    out: dict[str, torch.Tensor] = {}
    unmapped, duplicated = [], []
    for key, tensor in state_dict.items():
        for rule in rules:
            targets = rule.apply(key)
            if targets is not None:
                break
        else:
            if not any(p.fullmatch(key) for p in drop):
                unmapped.append(key)
            continue
        for target, piece in zip(targets, rule.tensors(tensor)):
            if target in out:
                duplicated.append(target)
            out[target] = piece
    problems = []
    if unmapped:
        problems.append(f"source keys no rule maps: {key_listing(unmapped)}")
    if duplicated:
        problems.append(f"target keys produced twice: {key_listing(duplicated)}")
    if missing := expected - out.keys():
        problems.append(f"target keys no source key fills: {key_listing(missing)}")
    if unexpected := {k for k in out.keys() - expected if not k.startswith(ASIDE)}:
        problems.append(f"target keys the model does not have: {key_listing(unexpected)}")
    if problems:
        raise ConversionError("Conversion refused; " + "; ".join(problems))
    return out


def expected_target_keys(model: torch.nn.Module) -> set[str]:
    """Keys a swapformer model loads: its state dict minus the copies of tied weights."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return {k for k in model.state_dict() if k not in tied}


def untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the copies of tied weights: a key the model declares tied is left out
    only when it really shares its tensor with the key it is tied to (transformers keeps a T5 v1.1
    `lm_head` separate when the checkpoint holds a different one, whatever the declaration says)."""
    state = model.state_dict()
    tied = getattr(model, "all_tied_weights_keys", {}) or {}
    return {
        k: v
        for k, v in state.items()
        if not (k in tied and tied[k] in state and state[tied[k]].data_ptr() == v.data_ptr())
    }


def invert_state_dict(
    state_dict: dict[str, torch.Tensor],
    rules: Iterable[Rule],
    *,
    source_keys: Iterable[str],
    tied: dict[str, str],
    drop: Iterable[str] = (),
) -> dict[str, torch.Tensor]:
    """The reverse of `convert_state_dict`: rebuild the source checkpoint from converted tensors.

    Each source key is sent through the forward rules to find the target keys it became; their
    tensors go through the rule's inverse transform.

    Args:
        state_dict: swapformer tensors (without tied copies), plus `ASIDE` tensors.
        source_keys: the keys of the source model class (its full state dict).
        tied: the source class's tied keys {copy: original}; a copy is left out when it would hold
            the same converted tensor as its original (the source model re-ties it on loading), or
            when the swapformer model ties the tensor it would come from.
        drop: source keys not to produce (buffers the source model rebuilds).
    Raises:
        ConversionError: source keys no rule maps, source keys whose tensors are missing, and
            converted tensors no source key takes, listed.
    """
    rules, drop = list(rules), [re.compile(p) for p in drop]
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, tuple[str, ...]] = {}
    unmapped, missing = [], []
    for key in source_keys:
        if any(p.fullmatch(key) for p in drop):
            continue
        for rule in rules:
            targets = rule.apply(key)
            if targets is not None:
                break
        else:
            unmapped.append(key)
            continue
        absent = [t for t in targets if t not in state_dict]
        if absent:
            if key not in tied:
                missing.extend(absent)
            continue
        out[key] = rule.inverse(tuple(state_dict[t] for t in targets))
        origin[key] = targets
    for copy_key, original in tied.items():
        if copy_key in out and origin.get(original) == origin[copy_key]:
            del out[copy_key]
    problems = []
    if unmapped:
        problems.append(f"source keys no rule maps: {key_listing(unmapped)}")
    if missing:
        problems.append(f"converted keys that are missing: {key_listing(missing)}")
    if unused := state_dict.keys() - {t for targets in origin.values() for t in targets}:
        problems.append(f"converted keys no source key takes: {key_listing(unused)}")
    if problems:
        raise ConversionError("Reverse conversion refused; " + "; ".join(problems))
    return out
