"""Checkpoint conversion as data: rename rules with optional tensor transforms, applied strictly.

A family module (bert.py, llama.py, bart.py, ...) lists `Rule`s from source keys to swapformer keys,
the source keys it drops on purpose (`DROP`), and a function from the source config to a swapformer
config. `convert_state_dict` applies one family and refuses to return anything when a source key is
left unmapped, a target key is missing, or a target key is produced twice, listing the keys.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rule:
    """Source keys matching `pattern` (a full-match regex) become `replacement` (with \\1 groups).

    `transform` changes the tensor on the way, e.g. `drop_rows(2)` for BART's position offset. A
    tuple of replacements splits one fused tensor into several: `transform` then returns one tensor
    per replacement (GPT-2's c_attn into q, k and v).
    """

    pattern: str
    replacement: str | tuple[str, ...]
    transform: Callable | None = None

    def apply(self, key: str) -> tuple[str, ...] | None:
        match = re.fullmatch(self.pattern, key)
        if not match:
            return None
        replacements = self.replacement if isinstance(self.replacement, tuple) else (self.replacement,)
        return tuple(match.expand(r) for r in replacements)

    def tensors(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.transform(tensor) if self.transform else tensor
        return out if isinstance(self.replacement, tuple) else (out,)


def drop_rows(n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Remove the first n rows (BART's learned positions start at index 2)."""

    def transform(t: torch.Tensor) -> torch.Tensor:
        return t[n:].clone()

    transform.__name__ = f"drop_rows({n})"
    return transform


def transpose(t: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D stores weights as (in, out); nn.Linear as (out, in)."""
    return t.t().contiguous()


def split_last(parts: int, transposed: bool) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """Split a fused projection into `parts` equal pieces along its output dimension (the last of a
    Conv1D weight or of a bias), transposing weights to nn.Linear's layout when `transposed`."""

    def transform(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pieces = t.chunk(parts, dim=-1)
        return tuple(p.t().contiguous() if transposed else p.contiguous() for p in pieces)

    transform.__name__ = f"split_last({parts})"
    return transform


class ConversionError(ValueError):
    """A checkpoint that cannot be converted completely; the message lists the keys."""


def _listing(keys: Iterable[str], limit: int = 20) -> str:
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
        expected_keys: the keys the target model needs (its state dict minus tied copies).
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
        problems.append(f"source keys no rule maps: {_listing(unmapped)}")
    if duplicated:
        problems.append(f"target keys produced twice: {_listing(duplicated)}")
    if missing := expected - out.keys():
        problems.append(f"target keys no source key fills: {_listing(missing)}")
    if unexpected := out.keys() - expected:
        problems.append(f"target keys the model does not have: {_listing(unexpected)}")
    if problems:
        raise ConversionError("Conversion refused; " + "; ".join(problems))
    return out


def expected_target_keys(model: torch.nn.Module) -> set[str]:
    """Keys a swapformer model loads: its state dict minus the copies of tied weights."""
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    return {k for k in model.state_dict() if k not in tied}
