"""Folder to folder: a Hugging Face checkpoint into a swapformer folder (or back), verified.

`convert(src, out)` reads `config.json` to find the family and the model class (`architectures`),
loads the source with transformers, renames and reshapes its tensors with the family's rules
(strictly: every key accounted for), writes the swapformer folder (config, safetensors, tokenizer
files, generation config, generated remote code, a card), then loads both folders again and runs
them on the same padded batch. A max abs diff above `tolerance` (fp32) is an error. Everything is
written to a hidden sibling folder first and moved into place only after verification, so a refused,
failed or interrupted (Ctrl-C, SIGTERM) conversion leaves nothing behind and never touches an
existing `out`; what a SIGKILL leaves is cleaned up by the next conversion to the same `out`.

`convert(src, out, to_hf=True)` is the reverse for folders that came from a conversion: the same
rules run backwards with exact inverse transforms, so the tensors come back bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .rules import (
    ASIDE,
    ConversionError,
    convert_state_dict,
    expected_target_keys,
    invert_state_dict,
    key_listing,
    untied_state_dict,
)
from .sentence_files import copy_sentence_transformers_files, sentence_transformers_files
from .stretch import LongSettings, check_source, long_config_values, stretch_model

TOLERANCE = 1e-4
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
SWAPFORMER_TYPES = ("swapformer_encoder", "swapformer_decoder", "swapformer_seq2seq")


class VerificationError(ConversionError):
    """The converted model does not compute what the source computes."""


@dataclass
class ConversionReport:
    """What `convert` did: the classes on both sides and the measured max abs diffs (fp32)."""

    source: str
    output: str
    family: str
    source_class: str
    target_class: str
    diffs: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    # a long model (stretch.py): the source's positions and the config values set
    long: dict = field(default_factory=dict)

    @property
    def max_diff(self) -> float:
        """The largest diff; NaN if any is NaN (Python's max would skip it depending on order)."""
        values = list(self.diffs.values())
        return float("nan") if any(v != v for v in values) else max(values, default=0.0)


# Checks on the input, made before anything is loaded --------------------------------------------


def _check_safetensors(path: Path) -> None:
    """Refuse a truncated or malformed safetensors file, naming it (safetensors' own error does not)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or 8 + length > size:
            raise ConversionError(
                f"{path} is truncated or not a safetensors file ({size} bytes, too short for its header); "
                "copy or download it again"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise ConversionError(
                f"{path} has an unreadable safetensors header ({e}); copy or download it again"
            ) from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        raise ConversionError(
            f"{path} is truncated: its header describes {8 + length + end} bytes but the file has {size}; "
            "copy or download it again"
        )


def _check_weights(folder: Path, allow_unpickling: bool) -> bool:
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
        _check_safetensors(folder / name)
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


def _check_paths(src: Path, out: Path, overwrite: bool) -> None:
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


def _family(model_type: str | None):
    from . import FAMILIES

    if model_type not in FAMILIES:
        raise ConversionError(
            f"No conversion for model_type={model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


def architectures_for(module, hf_config) -> dict:
    """The source classes a family converts, for this config (RoBERTa's rules depend on padding_idx)."""
    make = getattr(module, "architectures", None)
    return make(module.position_offset(hf_config)) if callable(make) else module.ARCHITECTURES


# Loading ----------------------------------------------------------------------------------------


def _load(cls, folder: Path, *, use_safetensors: bool = True, dtype="auto"):
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


def _auto_class(model_class):
    """The transformers Auto class swapformer registered `model_class` with."""
    import transformers

    for name, cls in model_class.auto_classes.items():
        if cls is model_class:
            return getattr(transformers, name)
    raise ConversionError(f"{model_class.__name__} is not registered with an Auto class")


def _on_meta(cls, config):
    with torch.device("meta"):
        return cls(config)


# Verification -----------------------------------------------------------------------------------


def _batch(config, pad_token_id: int | None, seq2seq: bool, length: int | None = None):
    """Inputs for both models: two rows, the second right-padded by a third, real tokens never the
    pad id (RoBERTa counts positions over non-pad ids). No padding when there is no pad id. By
    default 24 tokens, or more so that a small window cuts something."""
    if length is None:
        length = 24
        if config.position_embedding_type == "learned":
            length = min(length, config.max_position_embeddings)
        window = config.sliding_window
        if window is not None and window <= 64:
            length = max(length, window + 8)  # the window must cut something
    if pad_token_id is not None and not 0 <= pad_token_id < config.vocab_size:
        pad_token_id = None  # e.g. GPT-2 configs naming id 50256 in a smaller vocabulary
    g = torch.Generator().manual_seed(0)
    high = config.vocab_size - (pad_token_id is not None)

    def ids_and_mask(n: int):
        ids = torch.randint(0, high, (2, n), generator=g)
        mask = torch.ones(2, n, dtype=torch.long)
        if pad_token_id is not None:
            ids[ids >= pad_token_id] += 1
            mask[1, n - n // 3 :] = 0
            ids[mask == 0] = pad_token_id
        return ids, mask

    ids, mask = ids_and_mask(length)
    inputs = {"input_ids": ids, "attention_mask": mask}
    masks = {"encoder": mask}
    if seq2seq:
        dec, dec_mask = ids_and_mask(max(4, length // 2))
        inputs.update(decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        masks["decoder"] = dec_mask
    return inputs, masks


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor | None) -> float:
    """max |a - b| over real tokens (padded positions are not compared: swapformer zeroes what
    transformers leaves as an average, see DESIGN_NOTES)."""
    if a.shape != b.shape:
        raise VerificationError(f"Output shapes differ: {tuple(a.shape)} against {tuple(b.shape)}")
    d = (a.float() - b.float()).abs()
    if mask is not None and d.dim() >= 2 and tuple(d.shape[:2]) == tuple(mask.shape):
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


@torch.no_grad()
def compare(
    reference, candidate, config, pad_token_id: int | None, length: int | None = None
) -> tuple[dict[str, float], int]:
    """Run two models on the same padded batch (of `length` tokens, by default `_batch`'s); max abs
    diffs of hidden states and logits."""
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    inputs, masks = _batch(config, pad_token_id, seq2seq, length)
    a = reference(**inputs, output_hidden_states=True, return_dict=True)
    b = candidate(**inputs, output_hidden_states=True, return_dict=True)
    diffs = {}
    if seq2seq:
        diffs["encoder hidden states"] = _diff(
            a.encoder_last_hidden_state, b.encoder_last_hidden_state, masks["encoder"]
        )
        diffs["decoder hidden states"] = _diff(
            a.decoder_hidden_states[-1], b.decoder_hidden_states[-1], masks["decoder"]
        )
    else:
        base_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask")}
        ha = reference.base_model(**base_inputs, return_dict=True).last_hidden_state
        hb = candidate.base_model(**base_inputs, return_dict=True).last_hidden_state
        diffs["hidden states"] = _diff(ha, hb, masks["encoder"])
    token_mask = masks["decoder" if seq2seq else "encoder"]
    for name in ("logits", "start_logits", "end_logits"):
        if getattr(a, name, None) is not None:
            diffs[name] = _diff(getattr(a, name), getattr(b, name), token_mask)
    if getattr(a, "pooler_output", None) is not None:  # (B, E): one vector per row, no token mask
        diffs["pooler output"] = _diff(a.pooler_output, b.pooler_output, None)
    return diffs, inputs["input_ids"].shape[1]


# Writing ----------------------------------------------------------------------------------------


def _copy_side_files(src: Path, dst: Path, max_length: int | None = None) -> None:
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


def _card(report: ConversionReport, direction: str, tolerance: float) -> str:
    diffs = "\n".join(f"| {k} | {v:.3e} |" for k, v in report.diffs.items())
    name = Path(report.output).name
    if direction == "to swapformer":
        from .. import modeling

        auto = _auto_class(getattr(modeling, report.target_class)).__name__
        load = (
            "import swapformer  # registers the classes (or pass trust_remote_code=True without it)\n"
            f'from transformers import {auto}\nmodel = {auto}.from_pretrained("{name}")'
        )
    else:
        load = f'from transformers import {report.target_class}\nmodel = {report.target_class}.from_pretrained("{name}")'
    long = copied = ""
    if report.long:
        copied = ", the position table copied (below)"
        v = report.long
        kinds = sorted(set(v["layer_types"]))
        long = f"""
Made long (Longformer's recipe): the learned position table of {v["source_positions"]} rows was copied
repeatedly up to {v["max_position_embeddings"]} rows; layer types {", ".join(kinds)}
(sliding_window {v["sliding_window"]}, global_tokens {v["global_tokens"]}). Inputs no longer than
{report.tokens} tokens compute what the source computes (checked below); longer inputs read the copied
rows, which the source never trained: continue pretraining (Longformer: masked LM) before relying on them.
"""
    return f"""---
library_name: transformers
tags: [swapformer, converted]
---

# {Path(report.output).name}

`{report.source_class}` (model_type `{report.family}`) from `{report.source}`, converted {direction} as
`{report.target_class}` by `swapformer convert`. The weights are the source's, renamed and reshaped only{copied}.
{long}
Verified after writing: both folders loaded again and run in fp32 on one batch of two sequences of
{report.tokens} tokens, the second right-padded; max abs diff on real tokens (tolerance {tolerance:g}):

| output | max abs diff |
|---|---|
{diffs}

```python
{load}
```
"""


class ConversionInterrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM during `convert`. A KeyboardInterrupt, so `except Exception` in
    between does not swallow it; `signum` is the signal (exit code 128 + signum)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class _Signals:
    """While active, SIGINT and SIGTERM raise ConversionInterrupted, so that the `finally` removing the
    scratch folder runs (SIGTERM's default action would end the process on the spot and leave it).
    Inside `deferred()` a signal is only recorded, and raised when the block ends: the final renames
    and the cleanup are never cut in half. Handlers can only be set from the main thread; elsewhere
    the signals keep whatever handling they had."""

    def __init__(self, out: Path):
        self.out = out
        self.previous: dict = {}
        self.deferring = False
        self.pending: int | None = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame) -> None:
        if self.deferring:
            self.pending = signum
            return
        raise self._interrupted(signum, None)

    def _interrupted(self, signum: int, done: str | None) -> ConversionInterrupted:
        name = signal.Signals(signum).name
        if done is None:
            return ConversionInterrupted(
                signum, f"interrupted by {name}; nothing was written: {self.out} is as it was"
            )
        return ConversionInterrupted(signum, f"interrupted by {name} after {done}")

    @contextlib.contextmanager
    def deferred(self, done: str | None = None):
        """Hold signals back for the block; one that came meanwhile is raised after it, saying what
        was `done` (None: nothing was written)."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise self._interrupted(signum, done)


def _pause_for_tests(point: str, signals: _Signals) -> None:
    """Test hook: with SWAPFORMER_TEST_PAUSE_CONVERT=point, say so on stdout and wait for a signal, so
    a test can interrupt the conversion at a known place without racing it. (Polls: a signal held back
    by `deferred` may arrive before a pause() would start.)"""
    if os.environ.get("SWAPFORMER_TEST_PAUSE_CONVERT") == point:
        print(f"paused at {point}", flush=True)
        while signals.pending is None:
            time.sleep(0.01)


def _finish(
    tmp: Path, out: Path, report: ConversionReport, direction: str, tolerance: float, signals: _Signals
) -> None:
    """Move the verified folder into place: an existing `out` is renamed aside, the new one renamed
    in, the old one removed; signals wait until all three are done."""
    (tmp / "README.md").write_text(_card(report, direction, tolerance))
    with signals.deferred(done=f"{out} was written completely"):
        _pause_for_tests("swap", signals)
        if out.exists():
            old = _sibling(out, "old")
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)


def _sibling(out: Path, kind: str, pid: int | None = None) -> Path:
    """The hidden folder beside `out` that this process (or `pid`) writes to ("partial") or parks the
    replaced `out` in ("old")."""
    return out.parent / f".{out.name}.{kind}-{os.getpid() if pid is None else pid}"


def _alive(pid: int) -> bool:
    if os.name != "posix":  # no cheap liveness probe elsewhere: treat as alive, touch nothing
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_leftovers(out: Path, log) -> None:
    """What a conversion killed outright (SIGKILL, power loss) left beside `out`: its partial folder
    is removed; a replaced `out` parked aside is put back if `out` is missing, else removed."""
    if not out.parent.is_dir():
        return
    for kind in ("partial", "old"):
        for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
            pid = path.name.rsplit("-", 1)[1]
            if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
                continue
            if kind == "old" and not out.exists():
                os.replace(path, out)
                log(
                    f"restored {out} from {path.name}, left by a conversion that was killed while replacing it"
                )
            else:
                shutil.rmtree(path)
                log(f"removed {path}, left by a conversion that was killed (process {pid})")


def _scratch(out: Path) -> Path:
    tmp = _sibling(out, "partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


# The two directions -----------------------------------------------------------------------------


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
    _clean_leftovers(out, log)
    _check_paths(src, out, overwrite)
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
        _family(model_type)
    long = LongSettings(max_length, layer_types, window, global_tokens)
    if long.given():
        if to_hf:
            raise ConversionError(
                f"{long.flags()} make a long swapformer model and do not apply with --to-hf (to_hf=True); "
                "drop them to convert back"
            )
        _check_long(src, long)
    sentence_transformers_files(src)  # a broken modules.json is refused before anything is written
    use_safetensors = _check_weights(src, allow_unpickling)
    with _Signals(out) as signals:
        tmp = _scratch(out)
        try:
            if to_hf:
                report = _to_hf(src, tmp, use_safetensors=use_safetensors, log=log)
            else:
                report = _from_hf(src, tmp, use_safetensors=use_safetensors, log=log, long=long)
            report.output = str(out)
            for name, value in report.diffs.items():
                log(f"verification: {name} max abs diff {value:.3e}")
            if not report.max_diff <= tolerance:
                raise VerificationError(
                    f"Verification failed: max abs diff {report.max_diff:.3e} > tolerance {tolerance:g} "
                    f"({report.source_class} against {report.target_class}: {report.diffs}); nothing was written to {out}"
                )
            _pause_for_tests("verified", signals)
            _finish(
                tmp, out, report, "back to transformers" if to_hf else "to swapformer", tolerance, signals
            )
        finally:
            finished = not tmp.exists()
            with signals.deferred(done=f"{out} was written completely" if finished else None):
                if not finished:
                    shutil.rmtree(tmp)
    log(f"wrote {out} ({report.target_class}, max abs diff {report.max_diff:.3e})")
    return report


def _check_long(src: Path, long: LongSettings) -> None:
    """The long-model settings against the source's config (no weights read)."""
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(src)
    check_source(hf_config.model_type)
    long_config_values(_family(hf_config.model_type).config_from_hf(hf_config), long)


def _from_hf(
    src: Path, tmp: Path, *, use_safetensors: bool, log, long: LongSettings | None = None
) -> ConversionReport:
    import transformers

    from .. import modeling

    hf_config = transformers.AutoConfig.from_pretrained(src)
    module = _family(hf_config.model_type)
    archs = architectures_for(module, hf_config)
    arch = (hf_config.architectures or [None])[0]
    if arch is None:
        arch = next(iter(archs))
        log(f"config.json names no architecture; converting the base model {arch}")
    if arch not in archs:
        raise ConversionError(
            f"{arch} (from `architectures` in {src / 'config.json'}) has no swapformer counterpart; "
            f"{hf_config.model_type} converts: {', '.join(archs)}"
        )
    hf_class = getattr(transformers, arch)
    target_class = getattr(modeling, archs[arch].target)
    log(f"converting {arch} ({hf_config.model_type}) from {src} to {target_class.__name__}")
    source_model = _load(hf_class, src, use_safetensors=use_safetensors)
    source = untied_state_dict(source_model)

    model, state, aside = build_target(module, archs[arch], source_model.config, source, meta=True)
    long_values, verify_length = {}, None
    if long is not None and long.given():
        source_positions = model.config.max_position_embeddings
        model = stretch_model(model, long, share=True)
        config = model.config
        long_values = {
            "source_positions": source_positions,
            **{
                k: getattr(config, k)
                for k in ("max_position_embeddings", "layer_types", "sliding_window", "global_tokens")
            },
        }
        windowed = any(t != "full_attention" for t in config.layer_types)
        # the longest input on which the long model must compute what the source computes
        verify_length = min(source_positions, config.sliding_window) if windowed else source_positions
        log(
            f"long model: positions {source_positions} -> {config.max_position_embeddings} (copied), "
            f"layer types {', '.join(sorted(set(config.layer_types)))}, sliding_window {config.sliding_window}, "
            f"global_tokens {config.global_tokens}; verifying on {verify_length} tokens"
        )
    model.config.converted_from = {"model_type": hf_config.model_type, "architecture": arch}
    if model.can_generate() and source_model.can_generate():
        model.generation_config = source_model.generation_config
    model.save_pretrained(tmp)
    if aside:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in aside.items()}, tmp / UNUSED_WEIGHTS, metadata={"format": "pt"}
        )
    _copy_side_files(src, tmp, long_values.get("max_position_embeddings"))
    pad_token_id = source_model.config.pad_token_id
    del model, source_model, source, state, aside
    diffs, tokens = _verify(
        hf_class, src, _auto_class(target_class), tmp, pad_token_id, use_safetensors, verify_length
    )
    return ConversionReport(
        str(src), str(tmp), hf_config.model_type, arch, target_class.__name__, diffs, tokens, long_values
    )


def _verify(
    source_class, src: Path, target_class, tmp: Path, pad_token_id, use_safetensors: bool, length=None
):
    """Both folders loaded afresh from disk in fp32 (nothing shared with the tensors just written),
    run on the same batch; the batch is sized by the swapformer side's config, or `length` tokens."""
    reference = _load(source_class, src, dtype=torch.float32, use_safetensors=use_safetensors)
    candidate = _load(target_class, tmp, dtype=torch.float32)
    swapformer_side = candidate if candidate.config.model_type in SWAPFORMER_TYPES else reference
    return compare(reference, candidate, swapformer_side.config, pad_token_id, length)


def _targets(rules, key: str) -> tuple[str, ...]:
    for rule in rules:
        targets = rule.apply(key)
        if targets is not None:
            return targets
    return ()


def build_target(module, arch, hf_config, source: dict[str, torch.Tensor], *, meta: bool):
    """The swapformer model of `arch` holding the converted `source` tensors (untied state dict).

    Returns (model, its state dict, the tensors set aside). A source whose output projection is a
    tensor of its own (T5 v1.1, an untied GPT-2 or Llama) gives an untied model, whatever its config
    says. With `meta`, the model is built without memory and takes the tensors themselves.
    """
    from .. import modeling

    target_class = getattr(modeling, arch.target)
    if arch.check is not None:
        arch.check(hf_config)
    config = module.config_from_hf(hf_config)
    for name, value in arch.config.items():
        setattr(config, name, value)
    make = (
        (lambda: _on_meta(target_class, copy.deepcopy(config)))
        if meta
        else (lambda: target_class(copy.deepcopy(config)))
    )
    model = make()
    produced = {t for key in source for t in _targets(arch.rules, key)}
    if config.tie_word_embeddings and produced & set(model.all_tied_weights_keys):
        config.tie_word_embeddings = False
        model = make()
    state = convert_state_dict(
        source, arch.rules, expected_keys=expected_target_keys(model), drop=module.DROP
    )
    aside = {k[len(ASIDE) :]: v for k, v in state.items() if k.startswith(ASIDE)}
    state = {k: v for k, v in state.items() if not k.startswith(ASIDE)}
    result = model.load_state_dict(state, strict=False, assign=meta)
    if set(result.missing_keys) - set(model.all_tied_weights_keys) or result.unexpected_keys:
        raise ConversionError(f"load_state_dict disagreed with the key check: {result}")
    model.tie_weights()
    return model.eval(), state, aside


def _implied_config_holds(config, arch) -> bool:
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
    ours, theirs = _attention_layout(config), _attention_layout(again)
    if ours != theirs:
        raise ConversionError(
            f"{src} has layer types {sorted(set(ours[0]))} with sliding_window={ours[1]}, global_tokens={ours[2]}, "
            f"which {family} cannot express (its layers: {sorted(set(theirs[0]))}); converting back would change "
            "what the model computes on longer inputs. Convert back only a model with the family's attention, e.g. "
            f"from_pretrained(folder, layer_types={[theirs[0][0]]} * {config.num_hidden_layers}) then save_pretrained, "
            "if that is what you want"
        )


def _to_hf(src: Path, tmp: Path, *, use_safetensors: bool, log) -> ConversionReport:
    import transformers
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    from .. import modeling

    config = transformers.AutoConfig.from_pretrained(src)
    origin = getattr(config, "converted_from", None)
    if not isinstance(origin, dict) or "model_type" not in origin:
        raise ConversionError(
            f"{src / 'config.json'} does not say which transformers family it came from (no `converted_from`); "
            "only folders written by `swapformer convert`, or models loaded from them and saved again, convert back"
        )
    module = _family(origin["model_type"])
    ours = (config.architectures or [None])[0]
    target_class = getattr(modeling, ours or "", None)
    if target_class is None:
        raise ConversionError(
            f"{src / 'config.json'} names architectures={config.architectures}; expected a swapformer class"
        )
    hf_config = module.config_to_hf(config)
    _check_attention_layout(config, module.config_from_hf(hf_config), src, origin["model_type"])
    archs = architectures_for(module, hf_config)
    candidates = [a for a, arch in archs.items() if arch.target == ours]
    if not candidates:
        raise ConversionError(
            f"{ours} has no {origin['model_type']} counterpart; it converts back: {', '.join(archs)}"
        )
    _check_implied_config(config, ours, origin["model_type"], {a: archs[a] for a in candidates})
    candidates = [a for a in candidates if _implied_config_holds(config, archs[a])]
    arch = origin.get("architecture") if origin.get("architecture") in candidates else candidates[0]
    if archs[arch].check is not None:
        archs[arch].check(hf_config)
    hf_class = getattr(transformers, arch)
    log(f"converting {ours} from {src} back to {arch} ({origin['model_type']})")

    source_model = _load(target_class, src, use_safetensors=use_safetensors)
    state = untied_state_dict(source_model)
    if (src / UNUSED_WEIGHTS).exists():
        _check_safetensors(src / UNUSED_WEIGHTS)
        state.update({ASIDE + k: v for k, v in load_file(src / UNUSED_WEIGHTS).items()})
    skeleton = _on_meta(hf_class, hf_config)
    try:
        hf_state = invert_state_dict(
            state,
            archs[arch].rules,
            source_keys=skeleton.state_dict().keys(),
            tied=dict(skeleton.all_tied_weights_keys),
            drop=module.DROP,
        )
    except ConversionError as e:
        if ASIDE in str(e):
            raise ConversionError(
                f"{e}. The `{ASIDE}` tensors live in {UNUSED_WEIGHTS}, which `swapformer convert` wrote next to the "
                f"converted model; copy that file into {src}"
            ) from e
        raise
    hf_config.architectures = [arch]
    hf_config.save_pretrained(tmp)
    save_torch_state_dict({k: v.contiguous() for k, v in hf_state.items()}, tmp)
    if (src / "generation_config.json").exists():
        shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
    _copy_side_files(src, tmp)

    pad_token_id = hf_config.pad_token_id
    del source_model, state, hf_state
    diffs, tokens = _verify(target_class, src, hf_class, tmp, pad_token_id, use_safetensors)
    return ConversionReport(str(src), str(tmp), origin["model_type"], ours, arch, diffs, tokens)
