"""The training loop: one readable function over the HF model API, on Accelerate.

One optimizer step reads one global batch of `batch_size x grad_accum x processes` blocks, rebuilt
from the step number alone (data.BlockOrder, objectives seeded by step). Each process takes its rows,
and every micro-batch loss is normalised by the labelled tokens of the whole global batch
(`num_items_in_batch`), so gradient accumulation and data parallelism both give the gradient of one
big batch: 1 process x 2 accumulation steps and 2 processes x 1 follow the same loss curve.

A checkpoint (`accelerator.save_state`: weights, optimizer, scheduler, RNG states, plus
trainer_state.json with the step and the metrics so far) is written every `save_every` steps under
checkpoints/step_N, atomically (written to a temporary name, then renamed). `--resume` loads the
latest and continues from its step: the same batches, the same random draws, the same losses.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from ..configuration import BACKENDS
from ..modeling import DecoderForCausalLM, EncoderForMaskedLM, Seq2SeqForConditionalGeneration
from . import data as data_mod
from .args import (
    CONFIG_CLASSES,
    TrainArgs,
    TrainArgumentError,
    attn_backends,
    attn_choice,
    model_options,
    validate,
)
from .evaluation import model_log_probs, perplexity, target_counts, unigram_log_probs
from .hub import HUB_IGNORE, push_folder
from .objectives import SpanCorruption, make_objective
from .report import hardware, plot_loss_curve, write_model_card
from .tokenizer import load_tokenizer, train_tokenizer

MODEL_CLASSES = {
    "decoder": DecoderForCausalLM,
    "encoder": EncoderForMaskedLM,
    "encoder-decoder": Seq2SeqForConditionalGeneration,
}
RUN_FILE = "training_args.json"
STATE_FILE = "trainer_state.json"


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being finite."""


# Checks made before anything is read or built ------------------------------------------------------


def check_run(args: TrainArgs) -> tuple[TrainArgs, dict]:
    """Resolve the preset and validate the arguments and the model options; return (args, config
    options). Raises TrainArgumentError naming the flag at fault."""
    args = args.resolved()
    validate(args)
    options = model_options(args)
    lengths = SpanCorruption.lengths_for(args) if args.arch == "encoder-decoder" else {"input": args.seq_len}
    needed = max(lengths.values())
    positions = options.setdefault("max_position_embeddings", needed)
    if needed > positions:
        detail = ", ".join(f"{k} {v}" for k, v in lengths.items())
        raise TrainArgumentError(
            f"--seq-len {args.seq_len} needs {needed} positions ({detail}) but the model has "
            f"max_position_embeddings={positions}; lower --seq-len or raise max_position_embeddings (--set)"
        )
    try:  # build the model once on the meta device: checks every option, the backend and its package
        config = CONFIG_CLASSES[args.arch](**options, vocab_size=args.vocab_size or 32000)
        with torch.device("meta"):
            MODEL_CLASSES[args.arch]._from_config(config, attn_implementation=attn_choice(args.attn))
    except (TypeError, ValueError, ImportError) as e:
        raise TrainArgumentError(f"model options (--config/--set/--attn): {e}") from e
    check_precision(args.mixed_precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for backend in sorted(attn_backends(args.attn)):
        if device in BACKENDS[backend].backward:
            continue
        trainable = [n for n, c in BACKENDS.items() if device in c.backward]
        raise TrainArgumentError(
            f"--attn {backend!r} has no backward pass on {device}, so it cannot train here; use one of "
            f"{', '.join(map(repr, trainable))} (and switch backends after training with set_attn_implementation)"
        )
    return args, options


def usable_precisions() -> dict[str, str]:
    """{--mixed-precision value: why it cannot run here, or "" if it can}, for this machine.

    Accelerate accepts every value anywhere and fails later: fp8 on a CPU trained two steps and died
    in save_state ("invalid python storage") with torchao installed, and raised in the Accelerator
    without it. fp8 needs Accelerate's fp8 recipes, which run on NVIDIA GPUs of compute capability
    8.9 or newer (Ada, Hopper) with transformer_engine, MS-AMP or torchao installed."""
    from accelerate.utils import is_msamp_available, is_torchao_available, is_transformer_engine_available

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
    elif not (is_transformer_engine_available() or is_msamp_available() or is_torchao_available()):
        usable["fp8"] = "fp8 needs transformer_engine, MS-AMP or torchao installed (pip install torchao)"
    return usable


def check_precision(precision: str) -> None:
    """Refuse a --mixed-precision this machine cannot train with, before anything is written."""
    why = usable_precisions().get(precision, "")
    if why:
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only, no CUDA GPU"
        runs = ", ".join(p for p, reason in usable_precisions().items() if not reason)
        raise TrainArgumentError(
            f"--mixed-precision {precision} cannot train on this machine ({where}): {why}. "
            f"Here, choose --mixed-precision {runs}"
        )


def check_output_dir(args: TrainArgs) -> pathlib.Path | None:
    """The checkpoint to resume from (None for a fresh run); refuses to overwrite a different run."""
    out = pathlib.Path(args.output_dir)
    run_file = out / RUN_FILE
    if args.resume is not None:
        if not run_file.is_file():
            raise TrainArgumentError(
                f"--resume: --output-dir {str(out)!r} holds no run ({RUN_FILE}) to resume"
            )
        differ = args.differences(json.loads(run_file.read_text()))
        if differ:
            raise TrainArgumentError(
                f"--resume: these arguments differ from the run in {str(out)!r}: {', '.join(differ)}; "
                "a resumed run must repeat them to continue exactly"
            )
        ckpt = latest_checkpoint(out) if args.resume == "latest" else pathlib.Path(args.resume)
        if ckpt is None or not (ckpt / STATE_FILE).is_file():
            raise TrainArgumentError(
                f"--resume: no complete checkpoint {'under ' + str(out / 'checkpoints') if ckpt is None else str(ckpt)}; "
                "start again with --overwrite"
            )
        return ckpt
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not run_file.is_file():
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} exists and holds no swapformer run; choose a new or empty folder"
            )
        if not args.overwrite and latest_checkpoint(out) is None and not (out / "config.json").exists():
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} holds a run that stopped before its first checkpoint (killed, or "
                "it diverged): nothing to resume. Pass --overwrite to start it again, or choose another folder"
            )
        if not args.overwrite:
            raise TrainArgumentError(
                f"--output-dir {str(out)!r} already holds a run ({RUN_FILE}); pass --overwrite to replace it "
                "or --resume to continue it"
            )
    return None


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


# accelerate launch --use_fsdp / --use_deepspeed (or an `accelerate config` that chose them) set these
SHARDING_LAUNCHES = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


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


def latest_checkpoint(out: pathlib.Path) -> pathlib.Path | None:
    done = sorted(
        p for p in (out / "checkpoints").glob("step_*") if p.suffix != ".tmp" and (p / STATE_FILE).is_file()
    )
    return done[-1] if done else None


# The run ------------------------------------------------------------------------------------------


def lr_lambda(args: TrainArgs):
    """Linear warm-up to the peak, then cosine decay to `min_lr_ratio` x peak at `max_steps`."""

    def factor(i: int) -> float:  # i: optimizer steps taken so far
        if i < args.warmup_steps:
            return (i + 1) / args.warmup_steps
        progress = min(1.0, (i - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on norms and biases (1-D)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def step_generator(seed: int, step: int) -> torch.Generator:
    """The random stream of one step's objective (masks, spans), the same in every process."""
    return torch.Generator().manual_seed(seed * 1_000_003 + 7919 * step + 1)


@dataclass
class RunData:
    """Everything derived from the corpus; the same in every process."""

    tokenizer: object
    corpus_name: str
    train_docs: list
    val_docs: list
    train_blocks: torch.Tensor  # (N, seq_len) token ids
    val_blocks: torch.Tensor
    objective: object
    order: data_mod.BlockOrder
    val_batches: list[dict]  # the objective applied once, with a fixed generator
    test_docs: list  # a DatasetDict's test split, scored once after training (may be empty)
    test_blocks: torch.Tensor
    test_batches: list[dict]


def prepare_data(args: TrainArgs, accelerator, out: pathlib.Path, fresh: bool) -> RunData:
    """Documents, split, tokenizer, token blocks and evaluation batches, all checked before anything is
    written (a bad file, an empty split or an unusable tokenizer must not leave a folder behind).

    Every process reads the documents (the same in each). The main process trains or loads the
    tokenizer and packs the blocks; if that fails, every process raises its error. Only then does it
    create the output folder of a fresh run (tokenizer and training_args.json), from which the other
    processes read the tokenizer."""
    docs, corpus_name = data_mod.load_documents(args.data, args.text_column)
    train_docs, val_docs = data_mod.split_documents(
        docs, args.val_fraction, args.max_train_chars, args.max_val_chars
    )
    test_docs = data_mod.documents_of_test_split(docs, args.max_val_chars)
    splits = (corpus_name, train_docs, val_docs, test_docs)
    data, error = None, None
    if accelerator.is_main_process:
        try:
            with tempfile.TemporaryDirectory() as scratch:
                tokenizer = _run_tokenizer(args, out, fresh, train_docs, scratch)
                data = _tokenized(args, tokenizer, *splits)
                if fresh:
                    start_run_folder(out, args, tokenizer)
        except Exception as e:
            error = e
    _raise_everywhere(accelerator, error)
    accelerator.wait_for_everyone()
    if data is None:
        data = _tokenized(args, load_tokenizer(str(out), args.arch), *splits)
    return data


def _run_tokenizer(args: TrainArgs, out: pathlib.Path, fresh: bool, train_docs: list, scratch: str):
    """The run's tokenizer as every process will read it back from the output folder: a fresh one
    (trained, or --tokenizer) goes through save_pretrained and load_tokenizer in `scratch` first."""
    if not fresh:
        return load_tokenizer(str(out), args.arch)
    if args.tokenizer is not None:
        try:
            tokenizer = load_tokenizer(args.tokenizer, args.arch)
        except TrainArgumentError:
            raise
        except (OSError, ValueError) as e:  # what transformers raises for a folder it cannot read
            raise TrainArgumentError(
                f"--tokenizer {args.tokenizer!r} is not a saved tokenizer folder ({e}); give a folder written "
                "by save_pretrained, or omit --tokenizer to train one"
            ) from e
    else:
        tokenizer = train_tokenizer((d.text for d in train_docs), args.vocab_size)
    tokenizer.save_pretrained(scratch)
    return load_tokenizer(scratch, args.arch)


def start_run_folder(out: pathlib.Path, args: TrainArgs, tokenizer) -> None:
    """Create a fresh run's folder (replacing the run check_output_dir allowed to replace)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    (out / RUN_FILE).write_text(json.dumps(args.to_json(), indent=2) + "\n")


def _raise_everywhere(accelerator, error: Exception | None) -> None:
    """Re-raise the main process's preparation error in it, and a copy in every other process (which
    would otherwise wait for it at the next collective call forever)."""
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        verdict = [None if error is None else (isinstance(error, TrainArgumentError), str(error))]
        broadcast_object_list(verdict)
        if not accelerator.is_main_process and verdict[0] is not None:
            users, message = verdict[0]
            raise (TrainArgumentError if users else RuntimeError)(message)
    if error is not None:
        raise error


def _tokenized(args: TrainArgs, tokenizer, corpus_name, train_docs, val_docs, test_docs) -> RunData:
    """Token blocks, the objective and the fixed evaluation batches; refuses a split too short for one
    block."""
    train_blocks = data_mod.pack(tokenizer, train_docs, args.seq_len)
    val_blocks = data_mod.pack(tokenizer, val_docs, args.seq_len)
    test_blocks = data_mod.pack(tokenizer, test_docs, args.seq_len)
    splits = [("training", train_blocks, train_docs), ("validation", val_blocks, val_docs)]
    if test_docs:
        splits.append(("test", test_blocks, test_docs))
    for name, blocks, split in splits:
        if len(blocks) == 0:
            chars = sum(len(d.text) for d in split)
            raise TrainArgumentError(
                f"the {name} split ({len(split)} documents, {chars} characters) is shorter than one "
                f"--seq-len {args.seq_len} block; give more --data, raise --max-train-chars/--max-val-chars "
                "or lower --seq-len"
            )
    objective = make_objective(tokenizer, args)
    if args.packing:
        objective = data_mod.DocumentPacking(objective, tokenizer.eos_token_id)
    order = data_mod.BlockOrder(len(train_blocks), args.seed)
    return RunData(
        tokenizer,
        corpus_name,
        train_docs,
        val_docs,
        train_blocks,
        val_blocks,
        objective,
        order,
        _eval_batches(args, objective, val_blocks, -1),
        test_docs,
        test_blocks,
        _eval_batches(args, objective, test_blocks, -3),
    )


def _eval_batches(args: TrainArgs, objective, blocks: torch.Tensor, stream: int) -> list[dict]:
    """The objective applied once to evaluation blocks, with a generator of their own (`stream`)."""
    generator = step_generator(args.seed, stream)
    return [
        objective(blocks[i : i + args.batch_size], generator) for i in range(0, len(blocks), args.batch_size)
    ]


def build_model(args: TrainArgs, options: dict, tokenizer):
    config = CONFIG_CLASSES[args.arch](
        **options,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **({"decoder_start_token_id": tokenizer.bos_token_id} if args.arch == "encoder-decoder" else {}),
    )
    torch.manual_seed(args.seed)
    model = MODEL_CLASSES[args.arch]._from_config(config, attn_implementation=attn_choice(args.attn))
    if args.gradient_checkpointing:
        # non-reentrant: the variant that works under DDP and with inputs that need no gradient
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def make_optimizer(model: torch.nn.Module, args: TrainArgs) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        param_groups(model, args.weight_decay),
        lr=args.lr,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_eps,
    )


def restore(accelerator, checkpoint: pathlib.Path, fresh_state: dict) -> dict:
    """Load an Accelerate checkpoint (weights, optimizer, scheduler, RNG) and return its trainer state,
    after checking that the data and the global batch are those it was trained with."""
    saved = json.loads((checkpoint / STATE_FILE).read_text())
    if (saved["data"], saved["global_batch"]) != (fresh_state["data"], fresh_state["global_batch"]):
        raise TrainArgumentError(
            f"--resume: the training data or the global batch changed since {checkpoint} (data "
            f"{saved['data']} -> {fresh_state['data']}, global batch {saved['global_batch']} -> "
            f"{fresh_state['global_batch']})"
        )
    accelerator.load_state(str(checkpoint))
    return saved


def train(args: TrainArgs, *, step_hook=None) -> dict:
    """Run `swapformer train`; returns the final metrics (or {"stopped_at": step} for --stop-after).

    `step_hook(step, model)`, if given, runs after each optimizer step (tests use it to inject faults).
    """
    from accelerate.utils import set_seed

    start_time = time.time()
    args, options = check_run(args)
    check_launch(args)
    resume_from = check_output_dir(args)
    out = pathlib.Path(args.output_dir)
    accelerator = make_accelerator(args, out)
    check_distributed(accelerator)
    set_seed(args.seed)
    # the preflight: data, tokenizer and blocks are checked before a fresh run's folder is created
    data = prepare_data(args, accelerator, out, fresh=resume_from is None)
    try:
        return _train_prepared(args, options, accelerator, data, out, resume_from, start_time, step_hook)
    except BaseException as e:
        if resume_from is None and not isinstance(e, TrainingDiverged):
            _drop_unstarted_run(accelerator, out)
        raise


def make_accelerator(args: TrainArgs, out: pathlib.Path):
    """The run's Accelerator (it writes nothing until a checkpoint or the trackers start)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    tracker = "tensorboard" if importlib.util.find_spec("tensorboard") else None
    # accelerate keeps one AcceleratorState per Python process and refuses another mixed precision in a
    # second train() call (a notebook, the tests); the distributed part (PartialState) is kept
    AcceleratorState._reset_state()
    return Accelerator(
        mixed_precision=args.mixed_precision,
        log_with=tracker,
        project_dir=str(out),
        # several processes without GPUs: accelerate only picks CPU data parallelism (gloo) when told
        cpu=not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1,
    )


def _drop_unstarted_run(accelerator, out: pathlib.Path) -> None:
    """A fresh run that failed or was interrupted before its first checkpoint leaves nothing to resume:
    remove its folder, so the same command works again (a diverged run keeps its log to look at)."""
    if accelerator.is_main_process and latest_checkpoint(out) is None and not (out / "config.json").exists():
        shutil.rmtree(out, ignore_errors=True)


def _train_prepared(args, options, accelerator, data, out, resume_from, start_time, step_hook) -> dict:
    """The run once its data is ready and (on a fresh run) its folder made: train, evaluate, write."""
    from tqdm.auto import tqdm

    tracker = bool(accelerator.log_with)
    model = build_model(args, options, data.tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    model, optimizer = accelerator.prepare(model, make_optimizer(model, args))
    # Not prepared: a prepared scheduler steps once per process per optimizer step.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    accelerator.register_for_checkpointing(scheduler)

    global_batch = args.batch_size * args.grad_accum * accelerator.num_processes
    state = {"step": 0, "history": [], "evals": [], "train_seconds": 0.0}
    state.update(data=data_mod.fingerprint(data.train_blocks), global_batch=global_batch)
    if resume_from is not None:
        state = restore(accelerator, resume_from, state)
    metrics_file = out / "metrics.jsonl"
    # the log holds exactly the steps the state knows (a resume drops those redone)
    if accelerator.is_main_process:
        metrics_file.write_text("".join(json.dumps(r) + "\n" for r in _log_records(state)))
        if tracker:
            accelerator.init_trackers("runs", config={k: str(v) for k, v in args.to_json().items()})

    bar = tqdm(
        total=args.max_steps,
        initial=state["step"],
        desc="train",
        unit="step",
        disable=not (accelerator.is_main_process and args.progress),
        dynamic_ncols=True,
    )
    last_ckpt = resume_from
    tokens_per_step = global_batch * args.seq_len
    while state["step"] < args.max_steps:
        step = state["step"] + 1
        t0 = time.time()
        indices = data.order.indices((step - 1) * global_batch, global_batch)
        batch = data.objective(data.train_blocks[indices], step_generator(args.seed, step))
        loss, grad_norm = forward_backward(accelerator, model, batch, data.objective, args)
        # fp16's loss scaler skips steps with infinite gradients by design; anything else non-finite stops
        fp16_skip = args.mixed_precision == "fp16" and math.isfinite(loss)
        if not math.isfinite(loss) or not (math.isfinite(grad_norm) or fp16_skip):
            bar.close()
            raise TrainingDiverged(
                f"training stopped at step {step}: the loss is {loss} and the gradient norm {grad_norm}; "
                f"the weights were not updated. Last good checkpoint: {last_ckpt or 'none (no checkpoint yet)'}. "
                "Lower --lr, raise --warmup-steps or use --mixed-precision no, then start again with "
                "--overwrite (or --resume with the same arguments)"
            )
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        dt = time.time() - t0
        state["step"], state["train_seconds"] = step, state["train_seconds"] + dt
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": step * tokens_per_step,
            "tokens_per_s": tokens_per_step / dt,
            "epoch": data.order.epoch(step * global_batch),
            "train_seconds": state["train_seconds"],
        }
        state["history"].append(record)
        if step_hook is not None:
            step_hook(step, model)
        if step % args.eval_every == 0 and step < args.max_steps:
            _log(accelerator, metrics_file, _evaluate(accelerator, model, data, state, step))
        _log(accelerator, metrics_file, record)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.max_steps:
            last_ckpt = _save_checkpoint(accelerator, out, state, args.keep_checkpoints)
        if args.stop_after is not None and args.stop_after <= step < args.max_steps:
            bar.close()
            return {"stopped_at": step}
    bar.close()

    final_eval = _evaluate(accelerator, model, data, state, state["step"])
    if data.test_batches:  # a DatasetDict's test split: scored once, reported beside validation
        final_eval = {**final_eval, **_evaluate(accelerator, model, data, state, state["step"], split="test")}
    weights = accelerator.get_state_dict(model)  # whole tensors, also under FSDP (collective: all processes)
    metrics = {}
    if accelerator.is_main_process:
        _log(accelerator, metrics_file, final_eval)
        run = dict(
            num_parameters=num_parameters,
            num_processes=accelerator.num_processes,
            distributed_type=accelerator.distributed_type.value,
            start_time=start_time,
        )
        metrics = write_folder(
            out, args, accelerator.unwrap_model(model), weights, data, state, final_eval, run
        )
    accelerator.wait_for_everyone()
    if tracker:
        accelerator.end_training()
    if accelerator.is_main_process and args.push_to_hub:  # after the barrier: an upload may take a while
        metrics["hub_url"] = push_folder(out, args.push_to_hub, private=args.hub_private)
    return metrics


def forward_backward(accelerator, model, batch: dict, objective, args: TrainArgs) -> tuple[float, float]:
    """This process's micro-batches of the global batch, gradients accumulated; returns the mean loss
    over the global batch's labelled tokens and the clipped gradient norm."""
    world, rank, micro = accelerator.num_processes, accelerator.process_index, args.batch_size
    # DDP averages gradients over processes: each normalises by its share of the global count
    items = objective.num_targets(batch) / world
    loss_sum = torch.zeros((), device=accelerator.device)
    for i in range(args.grad_accum):
        rows = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
        inputs = {k: v[rows].to(accelerator.device) for k, v in batch.items()}
        last = i == args.grad_accum - 1
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            loss = model(**inputs, num_items_in_batch=items).loss  # prepare() added autocast if asked
            accelerator.backward(loss)
        loss_sum += loss.detach()
    loss = float(accelerator.reduce(loss_sum, reduction="sum")) / world
    return loss, float(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))


def write_folder(out, args, model, weights, data: RunData, state, final_eval, run) -> dict:
    """The Hub-ready folder: weights and remote code, tokenizer, metrics, loss curve, model card."""
    counts = target_counts(
        data.train_blocks, data.objective, len(data.tokenizer), step_generator(args.seed, -2)
    )
    baseline = perplexity(unigram_log_probs(counts, data.val_batches, data.objective.shift))
    metrics = {
        "val_perplexity": final_eval["val_perplexity"],
        "val_loss": final_eval["val_loss"],
        "unigram_perplexity": baseline["perplexity"],
        "val_tokens": final_eval["val_tokens"],
        **_test_metrics(counts, data, final_eval),
        "final_train_loss": state["history"][-1]["loss"],
        "steps": state["step"],
        "tokens_seen": state["step"] * state["global_batch"] * args.seq_len,
        "epochs": data.order.epoch(state["step"] * state["global_batch"]),
        "global_batch": state["global_batch"],
        "num_processes": run["num_processes"],
        "distributed_type": run["distributed_type"],
        "num_parameters": run["num_parameters"],
        "train_blocks": len(data.train_blocks),
        "val_blocks": len(data.val_blocks),
        "train_seconds": state["train_seconds"],
        "total_seconds": time.time() - run["start_time"],
        "hardware": hardware(),
        "corpus": data.corpus_name,
    }
    model.save_pretrained(out, state_dict=weights, safe_serialization=True)
    data.tokenizer.save_pretrained(out)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    # git-based uploads leave the resume states out too (push_folder passes the same patterns)
    (out / ".gitignore").write_text("".join(f"{pattern}\n" for pattern in HUB_IGNORE))
    plot_loss_curve(state["history"], state["evals"], str(out / "loss_curve.png"))
    write_model_card(
        str(out / "README.md"),
        args=args,
        model=model,
        metrics=metrics,
        corpus_name=data.corpus_name,
        corpus_text=_corpus_text(args, data),
    )
    return metrics


def _test_metrics(counts: torch.Tensor, data: RunData, final_eval: dict) -> dict:
    """The test split's figures (none without one), with the unigram baseline on its targets."""
    if not data.test_batches:
        return {}
    baseline = perplexity(unigram_log_probs(counts, data.test_batches, data.objective.shift))
    return {
        "test_perplexity": final_eval["test_perplexity"],
        "test_loss": final_eval["test_loss"],
        "test_unigram_perplexity": baseline["perplexity"],
        "test_tokens": final_eval["test_tokens"],
        "test_blocks": len(data.test_blocks),
    }


def _log_records(state: dict) -> list[dict]:
    """Step records and evaluation records, in step order (an evaluation before its step's record)."""
    evals = {e["step"]: e for e in state["evals"]}
    out = []
    for record in state["history"]:
        if record["step"] in evals:
            out.append(evals[record["step"]])
        out.append(record)
    return out


def _log(accelerator, path: pathlib.Path, record: dict) -> None:
    """Append `record` to metrics.jsonl (and the tracker); the main process writes."""
    if not accelerator.is_main_process:
        return
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])


def _evaluate(accelerator, model, data: RunData, state: dict, step: int, split: str = "val") -> dict:
    """Loss and perplexity on the validation split (`split="val"`, kept in the state's evaluations) or
    the test split ("test"). Every process scores its share of the batches with the wrapped model (each
    runs the same number of forwards, which FSDP needs; the last share is padded with batch 0), and the
    main process computes the metric over all rows in batch order."""
    from accelerate.utils import gather_object

    world, rank = accelerator.num_processes, accelerator.process_index
    batches = data.val_batches if split == "val" else data.test_batches
    per_process = -(-len(batches) // world)
    mine = list(range(rank, len(batches), world))
    padded = mine + [0] * (per_process - len(mine))
    rows = model_log_probs(model, [batches[i] for i in padded], data.objective.shift)
    per_batch = [len(batches[i]["labels"]) for i in padded]
    scored = []  # (batch index, rows of that batch), padding dropped
    for k, i in enumerate(mine):
        start = sum(per_batch[:k])
        scored.append((i, rows[start : start + per_batch[k]]))
    scored = gather_object(scored) if world > 1 else scored
    record = {}
    if accelerator.is_main_process:
        result = perplexity([row for _, batch_rows in sorted(scored) for row in batch_rows])
        record = {
            "step": step,
            f"{split}_loss": result["nll"],
            f"{split}_perplexity": result["perplexity"],
            f"{split}_tokens": result["num_tokens"],
        }
        if split == "val":
            state["evals"].append(record)
    return record


def _save_checkpoint(accelerator, out: pathlib.Path, state: dict, keep: int) -> pathlib.Path:
    """accelerate's state plus trainer_state.json, under checkpoints/step_N (renamed into place when
    complete, so a kill mid-save leaves the previous checkpoint the latest)."""
    final = out / "checkpoints" / f"step_{state['step']:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
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


def _corpus_text(args: TrainArgs, data: RunData) -> str:
    source = (
        "the Python standard library that ran the training (its `.py` files, docstrings included; test "
        "suites and site-packages left out)"
        if not args.data
        else f"`{', '.join(args.data)}`"
    )
    test = (
        f"; test (the dataset's test split, scored once after training): {len(data.test_docs)} documents, "
        f"{data.test_blocks.numel():,} tokens"
        if data.test_docs
        else ""
    )
    return (
        f"`{data.corpus_name}`: {source}. Documents go to validation by a hash of their name "
        f"(fraction {args.val_fraction}; a dataset's own validation split instead, where it has one), so the "
        f"split is deterministic. Training: {len(data.train_docs)} documents, {data.train_blocks.numel():,} "
        f"tokens; validation: {len(data.val_docs)} documents, {data.val_blocks.numel():,} tokens{test} "
        f"(blocks of {args.seq_len} tokens, documents joined by `</s>`"
        f"{'; each document its own sequence, no attention across documents (--packing)' if args.packing else ''})."
    )
