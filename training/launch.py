"""The machine and the launcher: what this machine can train, whether `accelerate launch` set up what
was asked, and the run's Accelerator.

Accelerate accepts some launches it then runs as something else (one process instead of several, no
sharding without CUDA, a precision that fails after the first steps); each is refused here with the
command that works, before anything is written.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import torch

from ..configuration import BACKENDS
from ..modeling.compat.accelerate_compat import fp8_unavailable, reset_accelerator_state
from .args import TrainArgs, TrainArgumentError, named_backends

# accelerate launch --use_fsdp / --use_deepspeed (or an `accelerate config` that chose them) set these
SHARDING_LAUNCHES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


def usable_precisions(fp8: bool = True) -> dict[str, str]:
    """{--mixed-precision value: why it cannot run here, or "" if it can}, for this machine.

    Accelerate accepts every value anywhere and fails later: fp8 on a CPU trained two steps and died
    in save_state ("invalid python storage") with torchao installed, and raised in the Accelerator
    without it. fp8 needs Accelerate's fp8 recipes, which run on NVIDIA GPUs of compute capability
    8.9 or newer (Ada, Hopper) with a recipe package installed. Which packages those are changes with
    Accelerate's releases (1.16 dropped MS-AMP), so Accelerate is asked, and only when `fp8` is true:
    a run that did not ask for fp8 never depends on that check."""
    usable = {"no": "", "fp16": "", "bf16": "", "fp8": ""}
    if not torch.cuda.is_available():
        usable["fp8"] = "fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper)"
        return usable  # torch's CPU autocast runs fp16 and bf16
    if not torch.cuda.is_bf16_supported():
        usable["bf16"] = f"{torch.cuda.get_device_name()} has no bf16 support"
    if torch.cuda.get_device_capability() < (8, 9):
        major, minor = torch.cuda.get_device_capability()
        usable["fp8"] = (
            f"fp8 needs compute capability 8.9 or newer; {torch.cuda.get_device_name()} has {major}.{minor}"
        )
    elif fp8:
        usable["fp8"] = fp8_unavailable()
    else:
        usable["fp8"] = "not checked"
    return usable


def check_precision(precision: str) -> None:
    """Refuse a --mixed-precision this machine cannot train with, before anything is written."""
    usable = usable_precisions(fp8=precision == "fp8")
    why = usable.get(precision, "")
    if why:
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only, no CUDA GPU"
        runs = ", ".join(p for p, reason in usable.items() if not reason)
        raise TrainArgumentError(
            f"--mixed-precision {precision} cannot train on this machine ({where}): {why}. "
            f"Here, choose --mixed-precision {runs}"
        )


def check_backward(attn: str) -> None:
    """Every backend --attn names has a backward pass on this machine's device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in sorted(named_backends(attn)):
        if device in BACKENDS[backend].backward:
            continue
        trainable = [n for n, c in BACKENDS.items() if device in c.backward]
        raise TrainArgumentError(
            f"--attn {backend!r} has no backward pass on {device}, so it cannot train here; use one of "
            f"{', '.join(map(repr, trainable))} (and switch backends after training with set_attn_implementation)"
        )


def check_launch(args: TrainArgs) -> None:
    """Refuse launches that would silently train something else than asked.

    `accelerate launch --num_processes N` on a machine without GPUs starts ONE process (its simple
    launcher; only --multi_gpu makes it run torchrun), with a global batch N times smaller than asked.
    Its trace: MASTER_ADDR set (N > 1) but no WORLD_SIZE. And a launcher --mixed_precision would be
    overridden by this command's --mixed-precision (default "no"), which training_args.json records."""
    check_sharding_launch()
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched is None:
        return
    if (
        "MASTER_ADDR" in os.environ
        and "WORLD_SIZE" not in os.environ
        and "OMPI_COMM_WORLD_SIZE" not in os.environ
    ):
        raise TrainArgumentError(
            "accelerate launch --num_processes started a single process: without GPUs, accelerate starts "
            "several only with --multi_gpu (torchrun; swapformer then trains on CPU with gloo). Run "
            "`accelerate launch --multi_gpu --num_processes N -m swapformer train ...`"
        )
    if launched not in ("no", args.mixed_precision):  # "no" is also the launcher's default: not a choice
        raise TrainArgumentError(
            f"accelerate launch --mixed_precision {launched} differs from --mixed-precision "
            f"{args.mixed_precision}; give swapformer train --mixed-precision {launched} (it is recorded with "
            "the run's arguments)"
        )


def sharding_requested() -> str | None:
    """ "FSDP" or "DeepSpeed" when accelerate launched this process for it, else None."""
    for variable, name in SHARDING_LAUNCHES.items():
        if os.environ.get(variable, "false").lower() in ("true", "1"):
            return name
    return None


def check_sharding_launch() -> None:
    """Accelerate 1.15 sets up FSDP and DeepSpeed only on GPUs; on a machine without CUDA it runs an
    FSDP launch as plain data parallelism (every process holds the whole model; no error), so refuse it."""
    sharding = sharding_requested()
    if sharding is not None and not torch.cuda.is_available():
        raise TrainArgumentError(
            f"accelerate launch asked for {sharding} (--use_{sharding.lower()} or an `accelerate config` "
            f"answer), but this machine has no CUDA GPU, and there Accelerate does not shard: every process "
            "would train a whole, unsharded copy. On CPU use data parallelism: `accelerate launch --multi_gpu "
            f"--num_processes N -m swapformer train ...`; {sharding} needs CUDA GPUs"
        )


def check_distributed(accelerator) -> None:
    """The sharding asked for is the one Accelerate set up (it may fall back silently, e.g. with one
    process outside torchrun)."""
    from accelerate.utils import DistributedType

    sharding = sharding_requested()
    wanted = {"FSDP": DistributedType.FSDP, "DeepSpeed": DistributedType.DEEPSPEED}.get(sharding)
    if wanted is not None and accelerator.distributed_type != wanted:
        raise TrainArgumentError(
            f"accelerate launch asked for {sharding}, but Accelerate set up {accelerator.distributed_type.value} "
            f"({accelerator.num_processes} process(es) on {accelerator.device}); launch with "
            f"`accelerate launch --use_{sharding.lower()} --num_processes N` on CUDA GPUs, or drop {sharding}"
        )


def make_accelerator(args: TrainArgs, out: pathlib.Path):
    """The run's Accelerator (it writes nothing until a checkpoint or the trackers start)."""
    from accelerate import Accelerator

    tracker = "tensorboard" if importlib.util.find_spec("tensorboard") else None
    # accelerate keeps one AcceleratorState per Python process and refuses another mixed precision in a
    # second train() call (a notebook, the tests); the distributed part (PartialState) is kept
    reset_accelerator_state()
    return Accelerator(
        mixed_precision=args.mixed_precision,
        log_with=tracker,
        project_dir=str(out),
        # several processes without GPUs: accelerate only picks CPU data parallelism (gloo) when told
        cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
    )
