"""Folder to folder: a Hugging Face checkpoint into a swapformer folder (or back), verified.

`convert(src, out)` reads `config.json` to find the family (family.py) and the model class
(`architectures`), loads the source with transformers, renames and reshapes its tensors with the
family's rules (engine.py; strictly: every key accounted for), writes the swapformer folder (config,
safetensors, tokenizer files, generation config, generated remote code, a card), then loads both
folders again and runs them on the same padded batch (verify.py). A max abs diff above `tolerance`
(fp32) is an error. Everything is written to a hidden sibling folder first and moved into place only
after verification (atomic.py), so a refused, failed or interrupted (Ctrl-C, SIGTERM) conversion leaves
nothing behind and never touches an existing `out`; what a SIGKILL leaves is cleaned up by the next
conversion to the same `out`.

`convert(src, out, to_hf=True)` is the reverse for folders that came from a conversion: the same
rules run backwards with exact inverse transforms, so the tensors come back bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from .atomic import Signals, clean_leftovers, discard_unfinished, finish, pause_for_tests
from .atomic import scratch as _scratch  # a module global: tests replace it to prove nothing is written
from .card import card
from .engine import build_target, invert_state_dict, on_meta, untied_state_dict
from .family import family_for
from .io import (
    UNUSED_WEIGHTS,
    auto_class,
    check_paths,
    check_weights,
    copy_side_files,
    load,
    read_set_aside,
    write_set_aside,
)
from .reverse import source_class
from .rules import ASIDE, ConversionError
from .sentence_files import sentence_transformers_files
from .stretch import LongSettings, check_source, long_config_values, stretch_converted
from .verify import SWAPFORMER_TYPES, TOLERANCE, ConversionReport, check_within, compare, verify_folders

__all__ = ["ConversionReport", "build_target", "compare", "convert"]


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    to_hf: bool = False,
    overwrite: bool = False,
    allow_unpickling: bool = False,
    tolerance: float = TOLERANCE,
    log: Callable[[str], None] = print,
    max_length: int | None = None,
    layer_types: str | list[str] | None = None,
    window: int | None = None,
    global_tokens: int | None = None,
) -> ConversionReport:
    """Convert the checkpoint folder `src` into `out`, verified; see the module docstring.

    Args:
        to_hf: `src` is a swapformer folder written by a conversion; write the transformers model back.
        overwrite: replace a non-empty `out` (only once the new folder is verified).
        allow_unpickling: read pickle weights (pytorch_model.bin), which can run code from the file.
        tolerance: largest max abs diff (fp32) accepted between source and converted outputs.
        log: where progress and the measured diffs are printed.
        max_length, layer_types, window, global_tokens: make a long model from a BERT or RoBERTa
            checkpoint (stretch.py): the position table copied up to `max_length` rows, every layer of
            `layer_types` (one name, or a list per layer), `sliding_window=window`, the first
            `global_tokens` tokens global. None keeps the source's value. Verified on inputs as long
            as the window (at most the source's positions), where the outputs must not change.
    Raises:
        ConversionError (a ValueError): bad paths, unsupported family or class, keys that do not line
            up, truncated or pickle-only weights, long-model settings that do not fit the source;
            `VerificationError` when the outputs differ. All before anything is written.
    """
    from .. import register

    register()  # the Auto classes the verification loads through
    src, out = Path(src), Path(out)
    clean_leftovers(out, log)
    check_paths(src, out, overwrite)
    long = LongSettings(max_length, layer_types, window, global_tokens)
    _check_direction(src, to_hf, long)
    sentence_transformers_files(src)  # a broken modules.json is refused before anything is written
    use_safetensors = check_weights(src, allow_unpickling)
    with Signals(out) as signals:
        tmp = _scratch(out)
        try:
            if to_hf:
                report = _to_hf(src, tmp, use_safetensors=use_safetensors, log=log)
            else:
                report = _from_hf(src, tmp, use_safetensors=use_safetensors, log=log, long=long)
            report.output = str(out)
            check_within(report, tolerance, out, log)
            pause_for_tests("verified", signals)
            direction = "back to transformers" if to_hf else "to swapformer"
            (tmp / "README.md").write_text(card(report, direction, tolerance))
            finish(tmp, out, signals)
        finally:
            discard_unfinished(tmp, out, signals)
    log(f"wrote {out} ({report.target_class}, max abs diff {report.max_diff:.3e})")
    return report


def _check_direction(src: Path, to_hf: bool, long: LongSettings) -> None:
    """The source folder's kind against the direction asked for, and the long-model settings against
    the source's config (no weights read)."""
    model_type = json.loads((src / "config.json").read_text()).get("model_type")
    if to_hf and model_type not in SWAPFORMER_TYPES:
        raise ConversionError(
            f"--to-hf converts a swapformer folder back, but {src} has model_type={model_type!r}; drop --to-hf "
            "to convert it into swapformer"
        )
    if not to_hf and model_type in SWAPFORMER_TYPES:
        raise ConversionError(
            f"{src} is already a swapformer folder (model_type={model_type!r}); pass --to-hf (to_hf=True) to "
            "convert it back to its transformers family"
        )
    if not to_hf:
        family_for(model_type)
    if not long.given():
        return
    if to_hf:
        raise ConversionError(
            f"{long.flags()} make a long swapformer model and do not apply with --to-hf (to_hf=True); "
            "drop them to convert back"
        )
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(src)
    check_source(hf_config.model_type)
    long_config_values(family_for(hf_config.model_type).config_from_hf(hf_config), long)


def _from_hf(src: Path, tmp: Path, *, use_safetensors: bool, log, long: LongSettings) -> ConversionReport:
    import transformers

    from .. import modeling

    hf_config = transformers.AutoConfig.from_pretrained(src)
    family = family_for(hf_config.model_type)
    arch = (hf_config.architectures or [None])[0]
    if arch is None:
        arch = next(iter(family.classes(hf_config)))
        log(f"config.json names no architecture; converting the base model {arch}")
    target = family.architecture(arch, hf_config, where=f" (from `architectures` in {src / 'config.json'})")
    hf_class, target_class = getattr(transformers, arch), getattr(modeling, target.target)
    log(f"converting {arch} ({hf_config.model_type}) from {src} to {target_class.__name__}")
    source_model = load(hf_class, src, use_safetensors=use_safetensors)
    model, _, aside = build_target(
        family, target, source_model.config, untied_state_dict(source_model), meta=True
    )
    model, long_values, verify_length = stretch_converted(model, long, log)
    model.config.converted_from = {"model_type": hf_config.model_type, "architecture": arch}
    if model.can_generate() and source_model.can_generate():
        model.generation_config = source_model.generation_config
    model.save_pretrained(tmp)
    write_set_aside(tmp, aside)
    copy_side_files(src, tmp, long_values.get("max_position_embeddings"))
    pad_token_id = source_model.config.pad_token_id
    del model, source_model, aside
    diffs, tokens = verify_folders(
        hf_class, src, auto_class(target_class), tmp, pad_token_id, use_safetensors, verify_length, family
    )
    return ConversionReport(
        str(src), str(tmp), hf_config.model_type, arch, target_class.__name__, diffs, tokens, long_values
    )


def _to_hf(src: Path, tmp: Path, *, use_safetensors: bool, log) -> ConversionReport:
    import transformers
    from huggingface_hub import save_torch_state_dict

    from .. import modeling

    config = transformers.AutoConfig.from_pretrained(src)
    origin = getattr(config, "converted_from", None)
    if not isinstance(origin, dict) or "model_type" not in origin:
        raise ConversionError(
            f"{src / 'config.json'} does not say which transformers family it came from (no `converted_from`); "
            "only folders written by `swapformer convert`, or models loaded from them and saved again, convert back"
        )
    family = family_for(origin["model_type"])
    ours = (config.architectures or [None])[0]
    target_class = getattr(modeling, ours or "", None)
    if target_class is None:
        raise ConversionError(
            f"{src / 'config.json'} names architectures={config.architectures}; expected a swapformer class"
        )
    hf_config = family.config_to_hf(config)
    arch = source_class(family, config, hf_config, src, origin.get("architecture"))
    hf_class = getattr(transformers, arch)
    log(f"converting {ours} from {src} back to {arch} ({origin['model_type']})")

    source_model = load(target_class, src, use_safetensors=use_safetensors)
    state = {**untied_state_dict(source_model), **read_set_aside(src)}
    hf_state = _inverted(family, family.classes(hf_config)[arch], hf_class, hf_config, state, src)
    hf_config.architectures = [arch]
    hf_config.save_pretrained(tmp)
    save_torch_state_dict({k: v.contiguous() for k, v in hf_state.items()}, tmp)
    if (src / "generation_config.json").exists():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    copy_side_files(src, tmp)

    pad_token_id = hf_config.pad_token_id
    del source_model, state, hf_state
    diffs, tokens = verify_folders(
        target_class, src, hf_class, tmp, pad_token_id, use_safetensors, family=family
    )
    return ConversionReport(str(src), str(tmp), origin["model_type"], ours, arch, diffs, tokens)


def _inverted(family, arch, hf_class, hf_config, state: dict, src: Path) -> dict:
    """The transformers state dict of `hf_class` from swapformer tensors (and those set aside)."""
    skeleton = on_meta(hf_class, hf_config)
    try:
        return invert_state_dict(
            state,
            arch.rules,
            source_keys=skeleton.state_dict().keys(),
            tied=dict(skeleton.all_tied_weights_keys),
            drop=family.drop,
        )
    except ConversionError as e:
        if ASIDE in str(e):
            raise ConversionError(
                f"{e}. The `{ASIDE}` tensors live in {UNUSED_WEIGHTS}, which `swapformer convert` wrote next to the "
                f"converted model; copy that file into {src}"
            ) from e
        raise
