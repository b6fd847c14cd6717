"""The generic engine: a family's rules applied to a state dict, both ways, strictly; and the
swapformer model built from a transformers one. It never names a family: all it knows comes from a
`Family` (family.py).

`convert_state_dict` refuses to return anything when a source key is left unmapped, a target key is
missing, or a target key is produced twice, listing the keys. `invert_state_dict` runs the same rules
backwards (every transform has an exact inverse).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch

from .family import Architecture, Family, family_for
from .rules import ASIDE, ConversionError, Rule, first_match, key_listing


def _refuse(what: str, problems: list[str]) -> None:
    if problems:
        raise ConversionError(f"{what} refused; " + "; ".join(problems))


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
        match = first_match(rules, key)
        if match is None:
            if not any(p.fullmatch(key) for p in drop):
                unmapped.append(key)
            continue
        rule, targets = match
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
    _refuse("Conversion", problems)
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
        match = first_match(rules, key)
        if match is None:
            unmapped.append(key)
            continue
        rule, targets = match
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
    _refuse("Reverse conversion", problems)
    return out


def on_meta(cls, config):
    """`cls(config)` without memory: its tensors are assigned later."""
    with torch.device("meta"):
        return cls(config)


def target_config(family: Family, arch: Architecture, hf_config):
    """The swapformer config of `hf_config` for source class `arch` (with the values it implies)."""
    config = family.config_from_hf(hf_config)
    for name, value in arch.config.items():
        setattr(config, name, value)
    return config


def build_target(
    family: Family, arch: Architecture, hf_config, source: dict[str, torch.Tensor], *, meta: bool
):
    """The swapformer model of `arch` holding the converted `source` tensors (untied state dict).

    Returns (model, its state dict, the tensors set aside). A source whose output projection is a
    tensor of its own (T5 v1.1, an untied GPT-2 or Llama) gives an untied model, whatever its config
    says. With `meta`, the model is built without memory and takes the tensors themselves.
    """
    from .. import modeling

    target_class = getattr(modeling, arch.target)
    if arch.check is not None:
        arch.check(hf_config)
    config = target_config(family, arch, hf_config)
    build = on_meta if meta else (lambda cls, c: cls(c))
    model = build(target_class, copy.deepcopy(config))
    produced = {t for key in source for t in (first_match(arch.rules, key) or (None, ()))[1]}
    if config.tie_word_embeddings and produced & set(model.all_tied_weights_keys):
        config.tie_word_embeddings = False
        model = build(target_class, copy.deepcopy(config))
    state = convert_state_dict(
        source, arch.rules, expected_keys=expected_target_keys(model), drop=family.drop
    )
    aside = {k[len(ASIDE) :]: v for k, v in state.items() if k.startswith(ASIDE)}
    state = {k: v for k, v in state.items() if not k.startswith(ASIDE)}
    result = model.load_state_dict(state, strict=False, assign=meta)
    if set(result.missing_keys) - set(model.all_tied_weights_keys) or result.unexpected_keys:
        raise ConversionError(f"load_state_dict disagreed with the key check: {result}")
    model.tie_weights()
    return model.eval(), state, aside


def from_hf_model(hf_model, target_class, family: str | None = None):
    """Build a swapformer `target_class` holding the weights of transformers model `hf_model` (in
    memory; `convert` is the folder-to-folder version with verification).

    Args:
        family: key of `FAMILIES`; by default `hf_model.config.model_type`.
    Raises:
        ValueError: unsupported family or class. ConversionError: keys that do not line up (listed).
    """
    family = family_for(family or hf_model.config.model_type)
    archs = family.classes(hf_model.config)
    arch = archs.get(type(hf_model).__name__)
    if arch is None or arch.target != target_class.__name__:
        pairs = ", ".join(f"{k} -> {v.target}" for k, v in archs.items())
        raise ValueError(
            f"{type(hf_model).__name__} does not convert to {target_class.__name__}; "
            f"{family.model_type} converts: {pairs}"
        )
    model, _, _ = build_target(family, arch, hf_model.config, untied_state_dict(hf_model), meta=False)
    return model.to(hf_model.dtype).eval()
