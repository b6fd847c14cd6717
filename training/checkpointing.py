"""The run folder on disk: its arguments, its checkpoints, and resuming from them.

A fresh run's folder is created once its data is ready (`start_run_folder`: the tokenizer and
training_args.json). A checkpoint (`accelerator.save_state`: weights, optimizer, scheduler, RNG
states, plus trainer_state.json with the step, the data position (`blocks_read`: the token blocks the run
has read, in the order data.BlockOrder draws from the seed) and the metrics so far) is written every `save_every`
steps under checkpoints/step_N, atomically (written to a temporary name, then renamed). `--resume`
loads the latest and continues from its step: the same batches, the same random draws, the same
losses. preflight.check_output_dir decides, before anything is written, whether a folder may be
resumed or replaced.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

from .args import TrainArgs, TrainArgumentError

RUN_FILE = "training_args.json"
STATE_FILE = "trainer_state.json"


def latest_checkpoint(out: pathlib.Path) -> pathlib.Path | None:
    """The newest complete checkpoint under `out`/checkpoints (a .tmp folder is a save cut short)."""
    done = sorted(
        p for p in (out / "checkpoints").glob("step_*") if p.suffix != ".tmp" and (p / STATE_FILE).is_file()
    )
    return done[-1] if done else None


def start_run_folder(out: pathlib.Path, args: TrainArgs, tokenizer) -> None:
    """Create a fresh run's folder (replacing the run preflight.check_output_dir allowed to replace)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    (out / RUN_FILE).write_text(json.dumps(args.to_json(), indent=2) + "\n")


def new_state(data_fingerprint: str, global_batch: int) -> dict:
    """The trainer state of a run at step 0 (what trainer_state.json holds)."""
    state = {"step": 0, "blocks_read": 0, "history": [], "evals": [], "train_seconds": 0.0}
    state.update(data=data_fingerprint, global_batch=global_batch)
    return state


def restore(accelerator, checkpoint: pathlib.Path, fresh_state: dict) -> dict:
    """Load an Accelerate checkpoint (weights, optimizer, scheduler, RNG) and return its trainer state,
    after checking that the data and the global batch are those it was trained with."""
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    if (saved["data"], saved["global_batch"]) != (fresh_state["data"], fresh_state["global_batch"]):
        raise TrainArgumentError(
            f"--resume: the training data or the global batch changed since {checkpoint} "
            f"({data_change(saved['data'], fresh_state['data'])}, global batch {saved['global_batch']} -> "
            f"{fresh_state['global_batch']})"
        )
    accelerator.load_state(str(checkpoint))
    return saved


def data_change(saved: str, now: str) -> str:
    """Two data fingerprints compared in words; a streamed run's (streaming.StreamCorpus.fingerprint) names
    its inputs and its tokenizer apart, so the message says which changed."""
    if saved == now or not (saved.startswith("stream-") and now.startswith("stream-")):
        return f"data {saved} -> {now}"
    parts = ("the --data files (a path, size or modification time)", "the tokenizer in the run's folder")
    changed = [what for what, a, b in zip(parts, saved.split("-")[1:], now.split("-")[1:]) if a != b]
    return f"{' and '.join(changed)} changed: data {saved} -> {now}"


def save_tied_weights_once(accelerator) -> None:
    """Checkpoints store a tied weight once, under its source name (`lm_head.weight` is
    `embed_tokens.weight`): the copy is dropped before accelerate writes, which it otherwise does itself
    after a warning ("Removed shared tensor ... while saving") that reads like an error. The files are the
    same; safetensors' `load_model` restores the tie on --resume."""

    def drop_tied_copies(models, weights, output_dir) -> None:
        for model, state in zip(models, weights):
            tied = getattr(accelerator.unwrap_model(model), "all_tied_weights_keys", None) or {}
            prefix = "module." if any(key.startswith("module.") for key in state) else ""  # DDP
            for copy, source in tied.items():
                a, b = state.get(prefix + copy), state.get(prefix + source)
                if a is not None and b is not None and a.data_ptr() == b.data_ptr():
                    del state[prefix + copy]

    accelerator.register_save_state_pre_hook(drop_tied_copies)


def save_checkpoint(accelerator, out: pathlib.Path, state: dict, keep: int) -> pathlib.Path:
    """accelerate's state plus trainer_state.json, under checkpoints/step_N (renamed into place when
    complete, so a kill mid-save leaves the previous checkpoint the latest); keeps the `keep` newest."""
    final = out / "checkpoints" / f"step_{state['step']:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    # every process has written its part (its RNG state) before the main one renames the folder; without
    # this a second process could still be writing into `tmp` ("Parent directory ... does not exist")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / STATE_FILE).write_text(json.dumps(state) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        done = sorted(p for p in final.parent.glob("step_*") if not p.name.endswith(".tmp"))
        for old in done[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def drop_unstarted_run(accelerator, out: pathlib.Path) -> None:
    """A fresh run that failed or was interrupted before its first checkpoint leaves nothing to resume:
    remove its folder, so the same command works again (a diverged run keeps its log to look at)."""
    if accelerator.is_main_process and latest_checkpoint(out) is None and not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)
