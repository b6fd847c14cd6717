"""The sentence-transformers files of a checkpoint folder, carried through a conversion.

A sentence-transformers model folder (e.g. all-MiniLM-L6-v2) is a transformers checkpoint at its root
plus `modules.json` (the pipeline: the transformer at path "", then pooling, normalisation, dense
layers in their own sub-folders), `sentence_bert_config.json` (the transformer module's settings,
`max_seq_length` among them) and `config_sentence_transformers.json`. The conversion rewrites the
root checkpoint and copies the rest unchanged, so `SentenceTransformer(out, trust_remote_code=True)`
runs the same pipeline on the converted model. A long model (stretch.py) gets `max_seq_length` set to
its new length: sentence-transformers truncates every input to it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .rules import ConversionError, json_list

MODULES = "modules.json"
# The names sentence-transformers reads the transformer module's settings from (the first it finds).
MODULE_CONFIGS = (
    "sentence_bert_config.json",
    "sentence_roberta_config.json",
    "sentence_distilbert_config.json",
    "sentence_camembert_config.json",
    "sentence_albert_config.json",
    "sentence_xlm-roberta_config.json",
    "sentence_xlnet_config.json",
)
ROOT_FILES = (MODULES, "config_sentence_transformers.json", *MODULE_CONFIGS)


def sentence_transformers_files(src: Path) -> list[str]:
    """The files and module folders (relative to `src`) to carry; empty when `src` has no modules.json.

    Raises:
        ConversionError: an unreadable modules.json, a module path outside `src`, or the transformer
            module in a sub-folder (then the root checkpoint is not the pipeline's model).
    """
    modules = src / MODULES
    if not modules.is_file():
        return []
    entries = json_list(
        modules.read_text(),
        dict,
        f"{modules} is not valid JSON",
        "repair it, or remove it to convert the model without its sentence-transformers pipeline",
        f"{modules} must be a JSON list of modules ({{'path': ..., 'type': ...}})",
    )
    names = [name for name in ROOT_FILES if (src / name).is_file()]
    for name in names:
        try:
            json.loads((src / name).read_text())
        except ValueError as e:
            raise ConversionError(f"{src / name} is not valid JSON ({e}); repair it") from e
    for entry in entries:
        path = entry.get("path") or ""
        if not path:
            continue  # the module at the root: the checkpoint being converted
        parts = Path(path).parts
        if Path(path).is_absolute() or ".." in parts or not parts:
            raise ConversionError(
                f"{modules} names the module path {path!r}, which is not a folder inside {src}; fix modules.json"
            )
        if str(entry.get("type", "")).endswith(".Transformer"):
            raise ConversionError(
                f"{modules} puts the transformer module in {src / path}, not at the root of {src}; convert "
                f"that folder ({src / path}) instead"
            )
        if (src / path).exists():  # modules without files (Normalize) may have no folder
            names.append(path)
    return names


def copy_sentence_transformers_files(
    src: Path, dst: Path, names: list[str], max_seq_length: int | None = None
) -> None:
    """Copy `names` (from `sentence_transformers_files`) from `src` into `dst`, refusing to replace a
    file the conversion wrote; with `max_seq_length`, set it in the transformer module's settings."""
    for name in names:
        if (dst / name).exists():
            raise ConversionError(
                f"{src / name} (listed in {src / MODULES}) has the name of a file the conversion writes; rename "
                "that module's folder in modules.json"
            )
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        else:
            shutil.copy2(src / name, dst / name)
    if max_seq_length is None:
        return
    for name in MODULE_CONFIGS:
        path = dst / name
        if path.is_file():
            settings = json.loads(path.read_text())  # checked by sentence_transformers_files
            if isinstance(settings, dict) and "max_seq_length" in settings:
                settings["max_seq_length"] = max_seq_length
                path.write_text(json.dumps(settings, indent=2) + "\n")
            break
