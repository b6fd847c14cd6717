"""Reading and writing checkpoint folders: the checks on a source folder made before anything is
loaded, loading with transformers without letting it initialise or drop weights, and the files carried
beside the weights (tokenizer, sentence-transformers pipeline, the tensors set aside).

Where the output folder is written (a hidden sibling, moved into place only once verified, so that
user files are never replaced unasked) is atomic.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..modeling.heads.weights_files import safetensors_problem
from .rules import ASIDE, ConversionError, key_listing
from .sentence_files import copy_sentence_transformers_files, sentence_transformers_files

# Source tensors the swapformer model does not use (the leading rows of BART's and RoBERTa's position
# tables), kept beside the model so that the reverse conversion gives them back.
UNUSED_WEIGHTS = "unused_source_weights.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    "chat_template.jinja",
)


# Checks on the input, made before anything is loaded --------------------------------------------


def check_safetensors(path: Path) -> None:
    """Refuse a truncated or malformed safetensors file, naming it (safetensors' own error does not); the
    check a swapformer model's loading makes too."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise ConversionError(problem)


def check_weights(folder: Path, allow_unpickling: bool) -> bool:
    """Whether the folder's weights are safetensors (True) or pickle (False, only when allowed)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        files = []
    for name in files:
        if not (folder / name).exists():
            raise ConversionError(f"{index} lists {name}, which is not in {folder}; copy the missing shard")
        check_safetensors(folder / name)
    if files:
        return True
    pickles = [p.name for p in folder.glob("pytorch_model*.bin")]
    if not pickles:
        raise ConversionError(
            f"No weights in {folder}: expected model.safetensors (or a sharded model.safetensors.index.json) "
            "next to config.json"
        )
    if not allow_unpickling:
        raise ConversionError(
            f"{folder} holds only pickle weights ({', '.join(sorted(pickles))}); unpickling can run code hidden "
            "in the file. Save the checkpoint as safetensors, or pass --allow-unpickling "
            "(allow_unpickling=True) if you trust where it came from"
        )
    return False


def check_paths(src: Path, out: Path, overwrite: bool) -> None:
    if not src.is_dir():
        raise ConversionError(f"The source {src} is not a folder; pass the folder that holds config.json")
    if not (src / "config.json").is_file():
        raise ConversionError(
            f"No config.json in {src}: point SRC at a Hugging Face model folder (config.json plus weights)"
        )
    if out.resolve() == src.resolve() or src.resolve() in out.resolve().parents:
        raise ConversionError(
            f"The output {out} is the source folder {src} or inside it; choose an output folder outside the source"
        )
    if out.exists() and not out.is_dir():
        raise ConversionError(f"The output {out} exists and is a file; choose a folder path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"The output folder {out} exists and is not empty; pass --overwrite (overwrite=True) to replace "
            "it, or choose another folder"
        )


# Loading ----------------------------------------------------------------------------------------


def load(cls, folder: Path, *, use_safetensors: bool = True, dtype="auto"):
    """`cls.from_pretrained`, refusing keys transformers would initialise randomly or drop."""
    model, info = cls.from_pretrained(
        folder, dtype=dtype, use_safetensors=use_safetensors, output_loading_info=True
    )
    problems = []
    if info["missing_keys"]:
        problems.append(
            f"weights {cls.__name__} needs that the checkpoint lacks: {key_listing(info['missing_keys'])}"
        )
    if info["unexpected_keys"]:
        problems.append(
            f"weights in the checkpoint that {cls.__name__} does not use: {key_listing(info['unexpected_keys'])}"
        )
    if info["mismatched_keys"]:
        problems.append(
            f"weights whose shapes disagree with the config: {key_listing(k for k, *_ in info['mismatched_keys'])}"
        )
    if problems:
        raise ConversionError(
            f"Loading {folder} as {cls.__name__} (from `architectures` in config.json) would "
            f"{'initialise or drop' if info['missing_keys'] else 'drop'} weights: {'; '.join(problems)}. "
            "Conversion carries every weight or none: load the checkpoint in transformers with the class whose "
            "weights you want, save_pretrained it, and convert that folder"
        )
    return model.eval()


def auto_class(model_class):
    """The transformers Auto class swapformer registered `model_class` with."""
    import transformers

    for name, cls in model_class.auto_classes.items():
        if cls is model_class:
            return getattr(transformers, name)
    raise ConversionError(f"{model_class.__name__} is not registered with an Auto class")


# The files beside the weights -------------------------------------------------------------------


def write_set_aside(folder: Path, aside: dict[str, torch.Tensor]) -> None:
    """The source tensors the swapformer model does not use, kept for the reverse conversion."""
    if aside:
        from safetensors.torch import save_file

        tensors = {k: v.contiguous() for k, v in aside.items()}
        save_file(tensors, folder / UNUSED_WEIGHTS, metadata={"format": "pt"})


def read_set_aside(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors `write_set_aside` kept, under their `ASIDE` names (none when the file is absent)."""
    path = folder / UNUSED_WEIGHTS
    if not path.exists():
        return {}
    from safetensors.torch import load_file

    check_safetensors(path)
    return {ASIDE + k: v for k, v in load_file(path).items()}


def copy_side_files(src: Path, dst: Path, max_length: int | None = None) -> None:
    """Tokenizer files, and the sentence-transformers pipeline files (sentence_files.py). For a long
    model (`max_length`), the tokenizer's `model_max_length` and sentence-transformers'
    `max_seq_length` become `max_length`: both truncate inputs to them."""
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    copy_sentence_transformers_files(src, dst, sentence_transformers_files(src), max_length)
    settings = dst / "tokenizer_config.json"
    if max_length is not None and settings.is_file():
        values = json.loads(settings.read_text())
        limit = values.get("model_max_length")
        if isinstance(limit, int) and limit < max_length:
            values["model_max_length"] = max_length
            settings.write_text(json.dumps(values, indent=2) + "\n")
