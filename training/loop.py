"""The training loop: the stages composed, one readable function over the HF model API, on Accelerate.

    preflight.preflight        every argument, path, the model and the output folder checked
    launch.make_accelerator    the processes and the precision
    notices.finished_metrics   with --resume of a run that had already finished: nothing more to do
    data.prepare_data          documents, tokenizer, token blocks; only then a fresh run's folder
    model.build_model          the model, from the config fields and the tokenizer
    checkpointing.restore      with --resume: weights, optimizer, scheduler, RNG and the trainer state
    for each step:
        data.step_batch        the global batch, rebuilt from the step number alone
        step.optimizer_step    forward, backward, clipping, optimizer and schedule
        evaluation.evaluate    every `eval_every` steps, and once at the end
        report.MetricsLog      metrics.jsonl and the tracker
        checkpointing.save_checkpoint   every `save_every` steps
    report.write_folder        the Hub-ready folder; hub.push_folder with --push-to-hub

The state (`trainer_state.json` in every checkpoint) holds the step, the step records, the
evaluations and the training time; everything else is rebuilt from the arguments.
"""

from __future__ import annotations

import pathlib
import time
from dataclasses import dataclass

from .args import TrainArgs
from .checkpointing import drop_unstarted_run, new_state, restore, save_checkpoint, save_tied_weights_once
from .data import RunData, prepare_data, step_batch
from .evaluation import evaluate
from .hub import push_folder
from .launch import check_distributed, make_accelerator
from .model import build_model
from .notices import finished_metrics, stage
from .preflight import preflight
from .report import MetricsLog, write_folder
from .step import TrainingDiverged, make_optimizer, make_scheduler, optimizer_step


@dataclass
class Run:
    """What the stages share once the data is ready."""

    args: TrainArgs
    accelerator: object
    data: RunData
    out: pathlib.Path
    model: object  # wrapped by accelerator.prepare
    optimizer: object
    scheduler: object
    state: dict  # what trainer_state.json holds
    log: MetricsLog
    num_parameters: int


def train(args: TrainArgs, *, step_hook=None) -> dict:
    """Run `swapformer train`; returns the final metrics (or {"stopped_at": step} for --stop-after).

    `step_hook(step, model)`, if given, runs after each optimizer step (tests use it to inject faults).
    """
    from accelerate.utils import set_seed

    start_time = time.time()
    args, options, resume_from = preflight(args)
    out = pathlib.Path(args.output_dir)
    accelerator = make_accelerator(args, out)
    save_tied_weights_once(accelerator)
    check_distributed(accelerator)
    if resume_from is not None:
        finished = finished_metrics(out, resume_from, args.max_steps)
        if finished is not None:
            return already_finished(accelerator, out, args, finished)
    set_seed(args.seed)
    data = prepare_data(args, accelerator, out, fresh=resume_from is None)
    try:
        run = start(args, options, accelerator, data, out, resume_from)
        stopped = run_steps(run, resume_from, step_hook)
        if stopped is not None:
            return {"stopped_at": stopped}
        return finish(run, start_time)
    except BaseException as e:
        if resume_from is None and not isinstance(e, TrainingDiverged):
            drop_unstarted_run(accelerator, out)
        raise


def already_finished(accelerator, out: pathlib.Path, args: TrainArgs, metrics: dict) -> dict:
    """--resume of a run that had already finished: nothing is trained or written; its saved metrics,
    marked `already_finished` (the folder is uploaded if --push-to-hub asks)."""
    if not accelerator.is_main_process:
        return {}
    metrics = {**metrics, "already_finished": True}
    if args.push_to_hub:
        metrics["hub_url"] = push_folder(out, args.push_to_hub, private=args.hub_private)
    return metrics


def start(args: TrainArgs, options: dict, accelerator, data: RunData, out, resume_from) -> Run:
    """The model, optimizer and schedule, prepared; the trainer state, restored on --resume."""
    model = build_model(args, options, data.tokenizer)
    num_parameters = sum(p.numel() for p in model.parameters())
    model, optimizer = accelerator.prepare(model, make_optimizer(model, args))
    scheduler = make_scheduler(accelerator, optimizer, args)
    global_batch = args.batch_size * args.grad_accum * accelerator.num_processes
    state = new_state(data.fingerprint, global_batch)
    if resume_from is not None:
        state = restore(accelerator, resume_from, state)
        if data.stream is not None:  # --streaming: where each process's stream goes on
            data.stream.restore(state.get("stream", {}), resume_from)
    log = MetricsLog(accelerator, out / "metrics.jsonl", state, args)
    return Run(args, accelerator, data, out, model, optimizer, scheduler, state, log, num_parameters)


def run_steps(run: Run, last_checkpoint: pathlib.Path | None, step_hook) -> int | None:
    """Optimizer steps up to --max-steps; returns the step --stop-after ended at, else None."""
    from tqdm.auto import tqdm

    args, state = run.args, run.state
    show = run.accelerator.is_main_process and not args.no_progress
    bar = tqdm(
        total=args.max_steps,
        initial=state["step"],
        desc="train",
        unit="step",
        disable=not show,
        dynamic_ncols=True,
    )
    try:
        while state["step"] < args.max_steps:
            step = state["step"] + 1
            record = one_step(run, step, last_checkpoint)
            if step_hook is not None:
                step_hook(step, run.model)
            if step % args.eval_every == 0 and step < args.max_steps:
                run.log(evaluate_split(run))
            run.log(record)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            bar.update(1)
            if step % args.save_every == 0 or step == args.max_steps:
                if run.data.stream is not None:  # a collective call: every process's stream position
                    state["stream"] = run.data.stream.position()
                last_checkpoint = save_checkpoint(run.accelerator, run.out, state, args.keep_checkpoints)
            if args.stop_after is not None and args.stop_after <= step < args.max_steps:
                return step
    finally:
        bar.close()
    return None


def one_step(run: Run, step: int, last_checkpoint: pathlib.Path | None) -> dict:
    """Optimizer step `step`; advances the state and returns the step's record."""
    args, state = run.args, run.state
    t0 = time.time()
    batch = step_batch(run.data, step, state["global_batch"], args.seed)
    loss, grad_norm, lr = optimizer_step(
        run.accelerator,
        run.model,
        run.optimizer,
        run.scheduler,
        batch,
        run.data.objective,
        args,
        step=step,
        last_checkpoint=last_checkpoint,
    )
    dt = time.time() - t0
    state["step"], state["train_seconds"] = step, state["train_seconds"] + dt
    state["blocks_read"] = step * state["global_batch"]  # the data position: where step + 1 reads on
    tokens_per_step = state["global_batch"] * args.seq_len
    record = {
        "step": step,
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens": step * tokens_per_step,
        "tokens_per_s": tokens_per_step / dt,
        "epoch": run.data.order.epoch(step * state["global_batch"]),
        "train_seconds": state["train_seconds"],
    }
    state["history"].append(record)
    return record


def evaluate_split(run: Run, split: str = "val") -> dict:
    """The evaluation record of `split` at the current step; a validation is kept in the state."""
    batches = run.data.val_batches if split == "val" else run.data.test_batches
    shift = run.data.objective.shift
    record = evaluate(run.accelerator, run.model, batches, shift, run.state["step"], split)
    if split == "val" and record:
        run.state["evals"].append(record)
    return record


def finish(run: Run, start_time: float) -> dict:
    """The final evaluation (and the test split's, if any), the Hub-ready folder and the upload."""
    accelerator, args = run.accelerator, run.args
    detail = (
        f"the final evaluation ({len(run.data.val_blocks):,} validation blocks), then the folder {run.out}"
    )
    with stage(accelerator, "finishing", detail):
        final_eval = evaluate_split(run)
        if run.data.test_batches:  # a DatasetDict's test split: scored once, reported beside validation
            final_eval = {**final_eval, **evaluate_split(run, split="test")}
        weights = accelerator.get_state_dict(run.model)  # whole tensors, also under FSDP (collective)
        metrics = {}
        if accelerator.is_main_process:
            run.log(final_eval)
            facts = dict(
                num_parameters=run.num_parameters,
                num_processes=accelerator.num_processes,
                distributed_type=accelerator.distributed_type.value,
                start_time=start_time,
            )
            model = accelerator.unwrap_model(run.model)
            metrics = write_folder(run.out, args, model, weights, run.data, run.state, final_eval, facts)
        accelerator.wait_for_everyone()
    run.log.close()
    if accelerator.is_main_process and args.push_to_hub:  # after the barrier: an upload may take a while
        metrics["hub_url"] = push_folder(run.out, args.push_to_hub, private=args.hub_private)
    return metrics
