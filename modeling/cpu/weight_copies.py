"""Decoding weight copies, a CPU route: generate() runs on input-major copies of the decoding weights,
which `DecodingWeights` lends to their modules for one call (docs/architecture.md, decision 9);
`copies_for_generate` is what generate() enters (SwapformerGenerationMixin, generation.py). Off with the
other routes (`cpu_routes(False)`, SWAPFORMER_CPU_ROUTES=off; routes.py); `model.decoding_copies` is
its own switch."""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from transformers.utils import logging

from .routes import cpu_linear_route, cpu_routes_on, routes_off_reason

logger = logging.get_logger(__name__)


class DecodingWeights:
    """Input-major copies of the weight matrices that each decoding step reads, lent to their modules
    for the length of one generate() call, then handed back.

    At batch 1 a decoding step multiplies one row by every weight matrix, streamed from memory each
    time. On CPU that product runs faster on a matrix stored (in, out), the layout of GPT-2's Conv1D,
    than on `nn.Linear`'s (out, in): the vocabulary-sized LM head in about 0.55x the time, square
    and wide matrices in 0.5-0.9x, narrow ones (MLP down, GQA k/v) not faster, so they are not copied.
    No torch product reads the (out, in) matrix at that speed (docs/architecture.md, decision 9), so the copies are
    the price: their bytes while generate() runs, and the time to make them once per call (see the
    README's generation benchmark).

    The Parameters themselves are never touched (same object, storage, strides and autograd state),
    so an optimizer holding them (fused AdamW keys its state to storage and strides), inference_mode,
    tying and saving see nothing. During the call each module's `weight` entry points at its copy;
    the copies are made under no_grad, so they are plain leaves whatever mode generate() runs in.
    Skipped: subclassed or quantized layers, weights off the CPU or on meta, modules with an
    Accelerate hook (offloading swaps their weights itself), the encoder of an encoder-decoder (it
    runs once per prompt) and cross-attention keys/values (computed once, then cached).
    `model.decoding_copies` chooses: "auto" (default: "all" where the copies pay for themselves, see
    `worth_copying`, else "none"; they never do for fp32 on the oneDNN route of linear.py), "all",
    "lm_head" (the largest gain per byte) or "none" (no extra memory, the speed of the Parameters'
    layout). Copies that would take more than half of the memory
    available are cut down to the head, or to nothing, with a warning. Concurrent generate() calls on
    one model share one set of copies (counted under a lock; the first call's choice holds).
    """

    CHOICES = ("auto", "all", "lm_head", "none")
    # Measured (README, generation benchmark): the input-major layout makes a (rows, in) x (in, out)
    # product faster only for 1 or 2 rows per step (the 50257 x 768 head: 0.54x and 0.47x the time;
    # 4 rows and more: 0.9-0.96x, and a 3072 x 768 MLP matrix 1.2x slower), and one call's copying
    # (41-111 ms) was repaid after 11 (Llama), 17 (BART) and 26 (GPT-2) new tokens.
    MAX_ROWS = 2
    MIN_NEW_TOKENS = 32

    @classmethod
    def worth_copying(cls, rows: int, new_tokens: int, model: nn.Module | None = None) -> bool:
        """Whether "auto" copies: few rows per decoding step and enough steps to repay the copying,
        unless `model`'s fp32 CPU linears run on oneDNN (linear.py), which reads the (out, in) layout
        at full speed: GPT-2 small 16.4 ms per step without copies against 16.5 with them (26.4 on
        MKL with copies), Llama 7.6 against 7.8 (benchmarks/generation_speed.py)."""
        if model is not None and onednn_decodes(model):
            return False
        return rows <= cls.MAX_ROWS and new_tokens >= cls.MIN_NEW_TOKENS

    _lock = threading.Lock()

    def __init__(self, model: nn.Module, choice: str | None = None):
        self.model, self.choice, self.users, self.lent = model, choice, 0, []  # lent: (module, Parameter)

    @staticmethod
    def candidates(model: nn.Module, choice: str | None = None) -> list[nn.Linear]:
        """The plain CPU `nn.Linear`s read at every decoding step with at least as many outputs as
        inputs, as far as `choice` (default `model.decoding_copies`) allows."""
        choice = check_decoding_copies(
            getattr(model, "decoding_copies", "auto") if choice is None else choice
        )
        if choice == "none":
            return []
        skip = set()
        if getattr(model.config, "is_encoder_decoder", False):
            skip.update(id(m) for m in model.get_encoder().modules())
        for module in model.modules():
            if getattr(module, "is_cross_attention", False):
                skip.update((id(module.k_proj), id(module.v_proj)))
        modules = [model.get_output_embeddings()] if choice == "lm_head" else model.modules()
        return [
            m
            for m in modules
            if type(m) is nn.Linear
            and id(m) not in skip
            and not hasattr(m, "_hf_hook")
            and m.out_features >= m.in_features
            and type(m.weight) is nn.Parameter
            and m.weight.device.type == "cpu"
            and m.weight.is_floating_point()
            and m.weight.is_contiguous()
        ]

    @staticmethod
    def size(modules: list[nn.Linear]) -> int:
        """Bytes of the copies of `modules`' weights (a tied tensor once)."""
        weights = {id(m.weight): m.weight for m in modules}
        return sum(w.numel() * w.element_size() for w in weights.values())

    def plan(self) -> list[nn.Linear]:
        """The candidates, cut down when their copies would take over half the available memory."""
        modules = self.candidates(self.model, self.choice)
        free = available_memory_bytes()
        if free is None or self.size(modules) <= free // 2:
            return modules
        head = self.candidates(self.model, "lm_head")
        kept = head if 0 < self.size(head) <= free // 2 else []
        logger.warning_once(
            f"generate() copies the decoding weights input-major for faster CPU decoding; the copies "
            f"({self.size(modules) / 2**20:.0f} MiB) would take over half of the available memory "
            f"({free / 2**20:.0f} MiB), so {'only the LM head is' if kept else 'nothing is'} copied (set "
            "model.decoding_copies to 'lm_head' or 'none' to choose)"
        )
        return kept

    def lend(self) -> None:
        copies: dict[int, nn.Parameter] = {}  # one copy per tensor, also when tied
        for module in self.plan():
            weight = module.weight
            if id(weight) not in copies:
                copies[id(weight)] = nn.Parameter(input_major_copy(weight), requires_grad=False)
            self.lent.append((module, weight))
            module.weight = copies[id(weight)]  # a Parameter: nn.Module registers it in the weight's place

    def hand_back(self) -> None:
        for module, weight in reversed(self.lent):
            module.weight = weight
        self.lent.clear()

    @classmethod
    @contextlib.contextmanager
    def during(cls, model: nn.Module, choice: str | None = None):
        """Lend the copies (`choice`, default `model.decoding_copies`) to `model` inside the block
        (shared by overlapping calls)."""
        with cls._lock:
            lease = model.__dict__.get("_decoding_weights")
            if lease is None:
                lease = cls(model, choice)
                try:
                    lease.lend()
                except BaseException:
                    lease.hand_back()
                    raise
                model.__dict__["_decoding_weights"] = lease
            lease.users += 1
        try:
            yield lease
        finally:
            with cls._lock:
                lease.users -= 1
                if lease.users == 0:
                    lease.hand_back()
                    del model.__dict__["_decoding_weights"]


@torch.no_grad()
def input_major_copy(weight: torch.Tensor, rows: int = 512) -> torch.Tensor:
    """`weight` (out, in) with the same values, stored (in, out). Copied in blocks of `rows` output
    rows: about 2x faster on CPU than one transposing copy (measured, a 50257 x 768 head)."""
    out = torch.empty(weight.shape[1], weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], rows):
        out[:, start : start + rows].copy_(weight[start : start + rows].t())
    return out.t()


def onednn_decodes(model: nn.Module) -> bool:
    """Whether `model`'s fp32 CPU weights are multiplied on the oneDNN route (linear.py)."""
    weight = next(model.parameters(), None)
    return (
        weight is not None
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and cpu_linear_route() == "onednn"
    )


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def copies_for_generate(model: nn.Module, args: tuple, kwargs: dict):
    """The context a generate() call of `model` runs in: its decoding weights lent as input-major copies
    as `model.decoding_copies` chooses ("auto": where `DecodingWeights.worth_copying`), or nothing while
    the CPU routes are off."""
    choice = check_decoding_copies(getattr(model, "decoding_copies", "auto"))
    if not cpu_routes_on():
        return contextlib.nullcontext()
    if choice == "auto":
        worth = DecodingWeights.worth_copying(*decoding_shape(model, args, kwargs), model=model)
        choice = "all" if worth else "none"
    return DecodingWeights.during(model, choice)


def copies_in_force() -> str:
    """Whether generate() may copy decoding weights and why, for `swapformer env`."""
    off = routes_off_reason()
    if off is not None:
        return f"off ({off})"
    if cpu_linear_route() == "onednn":
        return "on (model.decoding_copies; 'auto' copies nothing on the oneDNN linear route)"
    rows, tokens = DecodingWeights.MAX_ROWS, DecodingWeights.MIN_NEW_TOKENS
    return (
        f"on (model.decoding_copies; 'auto' copies for at most {rows} rows per step and {tokens}+ new tokens)"
    )


def decoding_shape(model: nn.Module, args: tuple, kwargs: dict) -> tuple[int, int]:
    """(rows per decoding step, new tokens at most) of `model.generate(*args, **kwargs)`, from its
    arguments and generation config as generate() resolves them (arguments override the config)."""
    config = kwargs.get("generation_config") or model.generation_config

    def option(name, default):
        value = kwargs.get(name, getattr(config, name, None))
        return default if value is None else value

    inputs = (
        args[0]
        if args
        else next(
            (kwargs[k] for k in ("input_ids", "inputs", "inputs_embeds") if kwargs.get(k) is not None),
            None,
        )
    )
    batch = inputs.shape[0] if torch.is_tensor(inputs) else 1
    rows = batch * max(option("num_beams", 1), option("num_return_sequences", 1))
    new_tokens = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    if new_tokens is None:
        prompt = 0 if model.config.is_encoder_decoder or not torch.is_tensor(inputs) else inputs.shape[1]
        new_tokens = option("max_length", 20) - prompt
    return rows, new_tokens


def check_decoding_copies(choice) -> str:
    if choice not in DecodingWeights.CHOICES:
        raise ValueError(
            f"decoding_copies={choice!r}; choose one of {DecodingWeights.CHOICES} (what generate() copies "
            "input-major for faster CPU decoding)"
        )
    return choice
