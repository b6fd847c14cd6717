"""The two sides of train_vs_trainer.py, each run in its own child process: swapformer's training loop,
and transformers' Trainer with the run_clm recipe. Each returns its figures as a dict and saves what it
trained on (race_record_<side>.pt) for race_checks.py."""

from __future__ import annotations

import json
import math
import pathlib
import time

import torch

# cProfile categories: {name: [(file path ending, function)]}, whose cumulative times are summed.
# "forward" is derived: the side's forward + backward function minus what runs inside it (`INSIDE`).
# category: (swapformer's functions, Trainer's functions), each "file path ending:function"
SIDE_PARTS = {
    "batch (data)": (["training/data.py:step_batch"], ["transformers/trainer.py:get_batch_samples"]),
    "forward + backward": (["training/step.py:forward_backward"], ["transformers/trainer.py:training_step"]),
    "evaluation": (["training/evaluation.py:evaluate"], ["transformers/trainer.py:evaluate"]),
    "checkpoint + folder": (
        ["training/checkpointing.py:save_checkpoint", "training/report.py:write_folder"],
        ["transformers/trainer.py:_save_checkpoint", "transformers/trainer.py:save_model"],
    ),
    "metrics log": (["training/report.py:__call__"], ["transformers/trainer.py:log"]),
}


def side_parts(side: int) -> dict:
    """{category: [(file path ending, function)]} of one side (0: swapformer, 1: Trainer)."""
    return {name: [tuple(w.split(":")) for w in pair[side]] for name, pair in SIDE_PARTS.items()}


SWAPFORMER_PARTS, TRAINER_PARTS = side_parts(0), side_parts(1)
COMMON_PARTS = {
    "backward": [("torch/autograd/__init__.py", "backward")],
    "clip": [("accelerate/accelerator.py", "clip_grad_norm_")],  # both sides clip through Accelerate
    "optimizer (AdamW)": [("torch/optim/adam.py", "step")],  # AdamW's step is Adam's
}
INSIDE = {"swapformer": ("backward", "clip"), "Trainer": ("backward",)}


class Recorder:
    """Watches a run from outside, through torch's public hooks: the weights of the first model to run
    a forward (before any update), the loss of its first training forward, and the input_ids of every
    training and evaluation forward. `excluded` is the time this costs, left out of the figures."""

    def __init__(self):
        self.init, self.first_loss = None, None
        self.train, self.eval, self.step_ends = [], [], []
        self.excluded = 0.0
        self._global = torch.nn.modules.module.register_module_forward_pre_hook(self._first_forward)

    def _first_forward(self, module, args):
        if self.init is not None or not hasattr(module, "get_input_embeddings"):
            return
        t = time.perf_counter()
        self.init = {k: v.detach().clone() for k, v in module.state_dict().items()}
        module.get_input_embeddings().register_forward_pre_hook(self._inputs)
        self._loss_hook = module.register_forward_hook(self._loss)
        self._global.remove()
        self.excluded += time.perf_counter() - t

    def _inputs(self, module, args):
        (self.train if module.training else self.eval).append(args[0].detach().clone())

    def _loss(self, module, args, output):
        if module.training:
            self.first_loss = float(output.loss)
            self._loss_hook.remove()

    def step_end(self, *_):
        self.step_ends.append(time.time())

    def figures(self, spec: dict, start: float, end: float, perplexity: float) -> dict:
        """Wall, time to first step, tokens per second (steps 2..N) and peak RSS of this process."""
        tokens = (len(self.step_ends) - 1) * spec["batch"] * spec["grad_accum"] * spec["seq_len"]
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        return {
            "wall_s": end - start - self.excluded,
            "first_step_s": self.step_ends[0] - start - self.excluded,
            "tokens_per_s": tokens / (self.step_ends[-1] - self.step_ends[0]),
            "peak_rss_mib": hwm / 1024,
            "val_perplexity": perplexity,
            "first_loss": self.first_loss,
            "excluded_s": self.excluded,
        }

    def save(self, path: pathlib.Path, **extra) -> None:
        train = torch.cat(self.train) if self.train else torch.empty(0)
        evals = torch.cat(self.eval) if self.eval else torch.empty(0)
        torch.save({"train": train, "eval": evals, "init": self.init, **extra}, path)


def profiled(job, parts: dict, inside: tuple, spec: dict) -> tuple:
    """`job()`, under cProfile when the spec asks; (its result, {category: seconds}, top lines)."""
    if not spec["profile"]:
        return job(), {}, []
    import cProfile
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(job)
    stats = pstats.Stats(prof).stats
    cum = {
        name: sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items() if (file, fn) in _ends(file, where))
        for name, where in {**parts, **COMMON_PARTS}.items()
    }
    cum["forward (and loss)"] = cum.pop("forward + backward") - sum(cum[k] for k in inside)
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    top = [
        f"{tt:7.2f} s own, {ct:7.2f} s cum  {pathlib.Path(f).name}:{ln} {fn}"
        for (f, ln, fn), (_, _, tt, ct, _) in own
    ]
    return result, cum, top


def _ends(file: str, where: list) -> set:
    return {(file, fn) for end, fn in where if file.replace("\\", "/").endswith(end)}


def swapformer_side(spec: dict, start: float) -> dict:
    from swapformer.training.args import TrainArgs
    from swapformer.training.loop import train

    rec = Recorder()
    out = pathlib.Path(spec["work"]) / "swapformer-run"
    args = TrainArgs(
        preset="small",
        data=[spec["corpus"]],
        tokenizer=spec["tokenizer"],
        output_dir=str(out),
        overwrite=True,
        no_progress=True,
        set=spec["shape"],
        max_train_chars=0,
        max_val_chars=0,
        **spec["optimizer"],
        # the final evaluation and one checkpoint only, as Trainer's side
        **from_spec(spec, "seq_len batch_size=batch grad_accum max_steps=steps lr warmup_steps=warmup seed"),
        **from_spec(spec, "save_every=steps eval_every=steps"),
    )
    metrics, cum, top = profiled(
        lambda: train(args, step_hook=rec.step_end), SWAPFORMER_PARTS, INSIDE["swapformer"], spec
    )
    end = time.time()
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in history if "lr" in r]
    rec.save(pathlib.Path(spec["work"]) / "race_record_swapformer.pt", lrs=lrs)
    return {**rec.figures(spec, start, end, metrics["val_perplexity"]), "profile": cum, "top": top}


def run_clm_blocks(corpus: str, tokenizer, seq_len: int):
    """run_clm's data recipe: `Dataset.map` tokenization, then `group_texts` into blocks of `seq_len`.
    Each document ends with `</s>` (as swapformer separates documents); the remainder is dropped."""
    from datasets import load_from_disk

    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [x + [eos] for x in ids]}

    def group_texts(batch):
        joined = [t for ids in batch["input_ids"] for t in ids]
        total = len(joined) // seq_len * seq_len
        return {"input_ids": [joined[i : i + seq_len] for i in range(0, total, seq_len)]}

    raw = load_from_disk(corpus)
    tokenized = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)
    return tokenized.map(group_texts, batched=True, batch_size=None)


def in_order_of(dataset, drawn: torch.Tensor):
    """`dataset`'s rows in the order swapformer drew its blocks (benchmark bookkeeping, not timed): a
    block swapformer trained on that run_clm did not make is refused here."""
    import numpy as np

    rows = np.asarray(dataset.with_format("numpy")["input_ids"], dtype=np.int64)
    index = {row.tobytes(): i for i, row in enumerate(rows)}
    order = [index.get(b.numpy().astype(np.int64).tobytes()) for b in drawn]
    missing = sum(i is None for i in order)
    if missing:
        raise RuntimeError(
            f"{missing} of the {len(order)} blocks swapformer trained on are not among the {len(rows)} blocks "
            "the run_clm recipe made: the two sides do not read the same tokens"
        )
    return dataset.select(order)


def trainer_side(spec: dict, start: float) -> dict:
    from transformers import (
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    rec = Recorder()
    work = pathlib.Path(spec["work"])

    class StepClock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            rec.step_end()

    class RaceTrainer(Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            """swapformer's schedule (see `schedule`)."""
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
                    optimizer or self.optimizer, schedule(spec)
                )
            return self.lr_scheduler

    def job():
        tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
        blocks = run_clm_blocks(spec["corpus"], tokenizer, spec["seq_len"])
        t = time.perf_counter()
        drawn = torch.load(work / "race_record_swapformer.pt")["train"]
        train_set = in_order_of(blocks["train"], drawn)
        rec.excluded += time.perf_counter() - t
        model = LlamaForCausalLM.from_pretrained(spec["llama_init"], attn_implementation="sdpa")
        trainer = RaceTrainer(
            model=model,
            args=training_arguments(TrainingArguments, spec, work / "trainer-run"),
            train_dataset=train_set,
            eval_dataset=blocks["validation"],
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
            callbacks=[StepClock()],
        )
        trainer.train()
        loss = trainer.evaluate()["eval_loss"]
        trainer.save_model()
        return trainer, math.exp(loss)

    (trainer, perplexity), cum, top = profiled(job, TRAINER_PARTS, INSIDE["Trainer"], spec)
    end = time.time()
    lrs = [r["learning_rate"] for r in trainer.state.log_history if "learning_rate" in r]
    decayed = {id(p) for g in trainer.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    matrices = {id(p) for p in trainer.model.parameters() if p.dim() >= 2}
    rec.save(work / "race_record_Trainer.pt", lrs=lrs, decay_is_matrices=decayed == matrices)
    return {**rec.figures(spec, start, end, perplexity), "profile": cum, "top": top}


def training_arguments(cls, spec: dict, out: pathlib.Path):
    """Trainer's arguments for the same optimisation as swapformer's side (its defaults elsewhere)."""
    opt = spec["optimizer"]
    same = "weight_decay adam_beta1 adam_beta2 adam_epsilon=adam_eps max_grad_norm"
    return cls(
        output_dir=str(out),
        **from_spec(spec, "per_device_train_batch_size=batch per_device_eval_batch_size=batch"),
        **from_spec(spec, "gradient_accumulation_steps=grad_accum max_steps=steps learning_rate=lr"),
        **from_spec(opt, same),
        warmup_steps=spec["warmup"],
        train_sampling_strategy="sequential",  # the blocks are already in swapformer's order
        logging_steps=1,  # every step's learning rate, for the schedule check
        save_strategy="steps",
        save_steps=spec["steps"],  # one checkpoint at the end, as swapformer's side
        eval_strategy="no",
        prediction_loss_only=True,
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        seed=spec["seed"],
    )


def from_spec(spec: dict, names: str) -> dict:
    """Keyword arguments from `spec`: `names` holds `argument=key` pairs, or `argument` alone where the
    key is the same, separated by spaces."""
    pairs = (name.partition("=") for name in names.split())
    return {argument: spec[key or argument] for argument, _, key in pairs}


def schedule(spec: dict):
    """lr factor after `i` optimizer steps: swapformer's (`swapformer train --help`: linear warm-up,
    then cosine decay to min_lr_ratio x peak), written out for Trainer; race_checks compares the lr of
    every step."""
    floor = spec["optimizer"]["min_lr_ratio"]

    def factor(i: int) -> float:
        if i < spec["warmup"]:
            return (i + 1) / spec["warmup"]
        progress = min(1.0, (i - spec["warmup"]) / max(1, spec["steps"] - spec["warmup"]))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


SIDES = {"swapformer": swapformer_side, "Trainer": trainer_side}
