"""The tiny `swapformer train` runs of the training tests (tests/training/test_train.py) and of the packed
training tests (tests/attention/test_packing.py): their arguments, their command line, their losses, and waiting
for a run in another process to reach a step (and killing it there)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time

import psutil

from swapformer.training.args import TrainArgs, flag

TINY_MODEL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
TINY_RUN = dict(
    vocab_size=600,
    seq_len=32,
    batch_size=4,
    max_steps=8,
    lr=3e-3,
    warmup_steps=1,
    save_every=3,
    eval_every=4,
    max_train_chars=60_000,
    max_val_chars=6_000,
    val_fraction=0.15,
)


def tiny_args(out: pathlib.Path, data: pathlib.Path | None, **overrides) -> TrainArgs:
    base = dict(TINY_RUN, output_dir=str(out), data=[str(data)] if data is not None else [], no_progress=True)
    options = {**TINY_MODEL, **overrides.pop("set", {})}
    base.update(overrides)
    return TrainArgs(set=options, **base)


def tiny_argv(out: pathlib.Path, data: pathlib.Path, **overrides) -> list[str]:
    """The command-line form of tiny_args."""
    argv = ["train", "--output-dir", str(out), "--data", str(data), "--no-progress"]
    for name, value in {**TINY_RUN, **overrides}.items():
        argv += [flag(name), str(value)]
    for name, value in TINY_MODEL.items():
        argv += ["--set", f"{name}={value}"]
    return argv


def losses(out: pathlib.Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


def wait_for_step(proc: subprocess.Popen, out: pathlib.Path, step: int) -> None:
    """Poll the run's metrics.jsonl until it has logged `step` (the run must still be going)."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        logged = losses(out) if (out / "metrics.jsonl").exists() else []
        if logged and logged[-1][0] >= step:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be interrupted"


def cpu_env() -> dict[str, str]:
    """The environment of a run in another process: this one's as it is now (the session's cache folder
    included), one thread, and CPU even where a GPU exists."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def accelerate_launch(processes: int) -> list[str]:
    """`accelerate launch` of `processes` CPU processes of `python -m swapformer` (append its arguments),
    on a free port so that launches of parallel test runs do not meet."""
    command = [str(pathlib.Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu"]
    command += ["--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no"]
    return command + ["--dynamo_backend", "no", "--main_process_port", str(free_port()), "-m", "swapformer"]


def kill_after_step(command: list[str], out: pathlib.Path, step: int) -> int:
    """Run `swapformer train` as `command` in another process (one thread, as the in-process tests), SIGKILL
    it once it has logged `step`, and return the last step it logged. A launcher's workers are killed with
    it, and waited for: `accelerate launch` starts each in a session of its own, so they would outlive it."""
    proc = subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_step(proc, out, step)
    finally:
        tree = [psutil.Process(proc.pid)]
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += tree[0].children(recursive=True)
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=60)
        proc.wait()
    return losses(out)[-1][0]
