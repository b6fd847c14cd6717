"""What `swapformer train` says while it works, and what it says about a run that had already finished.

A stage that can take more than a second or two before or after the progress bar (reading the
documents, training the tokenizer, tokenizing, the final evaluation and the folder) is announced on the
logger `swapformer.training` at INFO, from the main process: one line before it starts, one with its
time after. The command line shows that logger on stderr (`shown_on_stderr`) unless --no-progress;
Python callers choose with `logging`, as for any library.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import pathlib
import sys
import time

from .checkpointing import STATE_FILE

logger = logging.getLogger("swapformer.training")

# What a finished folder holds, by group, in the order it is told (anything else is listed by name).
FOLDER_GROUPS = (
    ("the model", ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json")),
    ("its remote code", ("*.py",)),
    ("the tokenizer", ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")),
    ("the model card", ("README.md",)),
    ("the metrics", ("metrics.json", "metrics.jsonl", "loss_curve.png")),
    ("the arguments", ("training_args.json",)),
)


class Stage:
    """What a finished stage adds to its closing line (`result`)."""

    result: str = ""


@contextlib.contextmanager
def stage(accelerator, what: str, detail: str):
    """Log `what: detail...` before the block and `what: done in N s; result` after it (main process)."""
    said = accelerator.is_main_process
    if said:
        logger.info(f"{what}: {detail}...")
    start, done = time.perf_counter(), Stage()
    yield done
    if said:
        logger.info(
            f"{what}: done in {time.perf_counter() - start:.1f} s{'; ' + done.result if done.result else ''}"
        )


@contextlib.contextmanager
def shown_on_stderr():
    """The stage lines on stderr, as plain lines, for the duration of a `swapformer train` command."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def finished_metrics(out: pathlib.Path, checkpoint: pathlib.Path, max_steps: int) -> dict | None:
    """The saved metrics of the run in `out` if it had already finished: its latest checkpoint is at
    `max_steps` and metrics.json (written last, report.write_folder) records that step; else None."""
    step = json.loads((checkpoint / STATE_FILE).read_text())["step"]
    metrics_file = out / "metrics.json"
    if step < max_steps or not metrics_file.is_file():
        return None
    metrics = json.loads(metrics_file.read_text())
    return metrics if metrics.get("steps") == step else None


def finished_message(out: pathlib.Path, metrics: dict) -> str:
    """What `swapformer train --resume` says of a run that had already finished."""
    return (
        f"the run in {out} had already finished (all {metrics['steps']} steps, validation "
        f"perplexity {metrics['val_perplexity']:.2f} against a unigram baseline of "
        f"{metrics['unigram_perplexity']:.2f}); nothing was trained or written.\n"
        f"It holds {folder_contents(out)}.\n"
        "Load it with from_pretrained; to train it again from scratch, pass --overwrite instead of --resume."
    )


def folder_contents(out: pathlib.Path) -> str:
    """The files of a finished run's folder, by group: "the model (config.json, ...), ..."."""
    files = sorted(p.name for p in out.iterdir() if p.is_file() and not p.name.startswith("."))
    parts = []
    for label, patterns in FOLDER_GROUPS:
        group = [name for name in files if any(fnmatch.fnmatch(name, p) for p in patterns)]
        files = [name for name in files if name not in group]
        if label == "its remote code" and group:
            parts.append(f"{label} ({len(group)} .py files)")
        elif group:
            parts.append(f"{label} ({', '.join(group)})")
    if (out / "runs").is_dir():
        parts.append("TensorBoard logs (runs/)")
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*") if p.is_dir())
    if checkpoints:
        count = f"{len(checkpoints)} checkpoint{'s' if len(checkpoints) > 1 else ''}"
        parts.append(f"{count} for --resume (checkpoints/{', '.join(checkpoints)})")
    if files:
        parts.append(f"also {', '.join(files)}")
    return ", ".join(parts[:-1]) + f" and {parts[-1]}" if len(parts) > 1 else "".join(parts)
