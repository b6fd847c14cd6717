"""Which transformers class a swapformer model goes back to, and what refuses the way back: a config
no class of the family implies, or attention the family cannot express (a long model)."""

from __future__ import annotations

from pathlib import Path

from .engine import target_config
from .family import Architecture, Family
from .rules import ConversionError


def _implied_config_holds(config, arch: Architecture) -> bool:
    return all(getattr(config, name, None) == value for name, value in arch.config.items())


def _check_implied_config(config, ours: str, family: str, candidates: dict) -> None:
    """Refuse a model whose config no candidate class implies (a RoBERTa classifier built with BERT's
    pooler has no RoBERTa class), naming the values and what each class needs."""
    if any(_implied_config_holds(config, arch) for arch in candidates.values()):
        return
    needs = "; ".join(
        f"{name} needs " + ", ".join(f"{k}={v!r}" for k, v in arch.config.items())
        for name, arch in candidates.items()
    )
    has = ", ".join(
        f"{k}={getattr(config, k, None)!r}" for k in {k for a in candidates.values() for k in a.config}
    )
    example = ", ".join(f"{k}={v!r}" for k, v in next(iter(candidates.values())).config.items())
    raise ConversionError(
        f"{ours} with {has} has no {family} counterpart: {needs}. Build the model with those values "
        f"before fine-tuning it (from_pretrained(folder, {example})) to convert it back"
    )


def _attention_layout(config) -> tuple:
    """Which keys each layer sees: layer types, and the window and global tokens where layers read them."""
    kinds = config._all_layer_types()
    windowed = any(k != "full_attention" for k in kinds)
    patterned = any(k in ("sliding_global_attention", "bigbird_attention") for k in kinds)
    return tuple(kinds), config.sliding_window if windowed else None, config.global_tokens if patterned else 0


def _check_attention_layout(config, again, src: Path, family: str) -> None:
    """Refuse to convert back a model whose attention the family cannot express (a long model made by
    stretch.py): the family's model would attend where this one does not, and the verification batch,
    shorter than the window, would not notice."""
    if getattr(config, "linformer_k", None) is not None:
        raise ConversionError(
            f"{src} uses Linformer (linformer_k={config.linformer_k}): its keys and values are projected along the "
            f"sequence axis by weights {family} has no place for, and without them it computes another function. "
            "A Linformer model stays in swapformer's format (it loads with trust_remote_code=True where swapformer "
            "is not installed)"
        )
    ours, theirs = _attention_layout(config), _attention_layout(again)
    if ours != theirs:
        raise ConversionError(
            f"{src} has layer types {sorted(set(ours[0]))} with sliding_window={ours[1]}, global_tokens={ours[2]}, "
            f"which {family} cannot express (its layers: {sorted(set(theirs[0]))}); converting back would change "
            "what the model computes on longer inputs. Convert back only a model with the family's attention, e.g. "
            f"from_pretrained(folder, layer_types={[theirs[0][0]]} * {config.num_hidden_layers}) then save_pretrained, "
            "if that is what you want"
        )


def source_class(family: Family, config, hf_config, src: Path, converted_from: str | None) -> str:
    """The transformers class name a swapformer model (`config`, whose transformers config is
    `hf_config`) goes back to: among the family's classes with its swapformer class, one whose implied
    config values it has, preferring `converted_from` (the class it came from).

    Raises:
        ConversionError: no such class, or attention (or a class check) that cannot map back.
    """
    ours = config.architectures[0]
    archs = family.classes(hf_config)
    candidates = [a for a, arch in archs.items() if arch.target == ours]
    if not candidates:
        raise ConversionError(
            f"{ours} has no {family.model_type} counterpart; it converts back: {', '.join(archs)}"
        )
    _check_implied_config(config, ours, family.model_type, {a: archs[a] for a in candidates})
    candidates = [a for a in candidates if _implied_config_holds(config, archs[a])]
    name = converted_from if converted_from in candidates else candidates[0]
    # what the class implies (Longformer's classifier: a global first token)
    again = target_config(family, archs[name], hf_config)
    _check_attention_layout(config, again, src, family.model_type)
    if archs[name].check is not None:
        archs[name].check(hf_config)
    return name
