"""What every swapformer model shares: weight initialisation, the backend check made when a backend
is chosen, input validation, the token loss, and saving with generated remote code."""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import threading
import warnings

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.generation import GenerationMixin
from transformers.utils import logging

from ..configuration.backends import PER_LAYER_BACKEND, check_layer_backends
from ..configuration.configuration_swapformer import SwapformerConfig
from .attention import check_backend_for_model
from .cache import static_key_slots
from .hf_compat import init
from .layers import RMSNorm
from .remote_code import write_remote_code

logger = logging.get_logger(__name__)


class SwapformerPreTrainedModel(PreTrainedModel):
    config_class = SwapformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Maps an Auto class name to the model class; filled per architecture, read for `auto_map`.
    auto_classes: dict[str, type] = {}

    # Backend choice -----------------------------------------------------------------------------

    def get_correct_attn_implementation(
        self, requested_attention: str | None, is_init_check: bool = False
    ) -> str:
        """Called by transformers whenever a backend is chosen (`from_config`, `from_pretrained`,
        `set_attn_implementation`): this is where impossible combinations fail, never in forward."""
        name = "sdpa" if requested_attention is None else requested_attention
        check_backend_for_model(name, self, is_init_check=is_init_check)
        return name

    def set_attn_implementation(self, attn_implementation, allow_all_kernels: bool = False):
        """transformers' method, plus {layer type: backend} mappings (transformers would read a dict as
        per-sub-config backends and, finding no sub-configs, change nothing)."""
        if not (isinstance(attn_implementation, dict) and "" not in attn_implementation):
            return super().set_attn_implementation(attn_implementation, allow_all_kernels=allow_all_kernels)
        config = self.config
        before = (config._attn_implementation_internal, config._attn_layer_backends)
        config._attn_layer_backends = check_layer_backends(attn_implementation, config._all_layer_types())
        try:
            self.get_correct_attn_implementation(PER_LAYER_BACKEND)
        except Exception:
            config._attn_implementation_internal, config._attn_layer_backends = before
            raise
        config._attn_implementation_internal = PER_LAYER_BACKEND

    def create_masks_for_generate(
        self, config=None, inputs_embeds=None, attention_mask=None, cache=None, **kwargs
    ):
        """generate() calls this for compileable (static) caches to pre-build transformers' 4-D masks.
        swapformer builds its own masks from the 2-D padding mask: it is padded with zeros to every slot
        of the static cache, so each decoding step has the same shapes (one compiled graph, as
        transformers' 4-D masks give). Caches with sliding layers move their window every step anyway
        and get the mask as it is."""
        slots = static_key_slots(cache)
        if attention_mask is None or slots is None or attention_mask.shape[-1] >= slots:
            return attention_mask
        return nn.functional.pad(attention_mask, (0, slots - attention_mask.shape[-1]))

    # Initialisation -----------------------------------------------------------------------------

    def mark_tied_weights_as_initialized(self, loading_info) -> None:
        """transformers' step of `from_pretrained`, which for custom code also takes out of the missing
        keys every name of a tensor reachable under several names (a shared module) on the grounds
        that one of them was loaded. When none was (the seq2seq `shared` embedding, which is also
        `encoder.embed_tokens` and `decoder.embed_tokens`), the tensor would stay on the meta device,
        uninitialised and unreported; those names are put back, so it is materialised, initialised
        and listed in the load report like any missing weight."""
        missing = set(loading_info.missing_keys)
        super().mark_tied_weights_as_initialized(loading_info)
        names_of: dict[int, list[str]] = {}
        for name, tensor in self.state_dict(keep_vars=True).items():
            names_of.setdefault(id(tensor), []).append(name)
        for names in names_of.values():
            if len(names) > 1 and missing.issuperset(names):
                loading_info.missing_keys.update(n for n in names if n not in self.all_tied_weights_keys)

    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        std = config.initializer_range
        if isinstance(module, nn.Linear):
            if config.initializer == "xavier":
                init.xavier_uniform_(module.weight)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)

    # Saving -------------------------------------------------------------------------------------

    def save_pretrained(
        self, save_directory, *args, is_main_process: bool = True, push_to_hub: bool = False, **kwargs
    ):
        """`PreTrainedModel.save_pretrained`, plus the modeling code as flat sibling files and an
        `auto_map` naming every Auto class of this architecture, so the folder loads with
        `trust_remote_code=True` where swapformer is not installed."""
        if push_to_hub:
            # transformers uploads before returning; save here first, then push a full folder.
            hub_keys = (
                "repo_id",
                "commit_message",
                "commit_description",
                "private",
                "token",
                "create_pr",
                "revision",
            )
            hub_kwargs = {k: kwargs.pop(k) for k in hub_keys if k in kwargs}
            repo_id = hub_kwargs.pop("repo_id", os.path.basename(os.path.normpath(str(save_directory))))
            self.save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
            return self.push_to_hub(repo_id, **hub_kwargs)
        self.config.auto_map = {
            name: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"
            for name, cls in self.auto_classes.items()
        }
        self.config.auto_map["AutoConfig"] = (
            f"{type(self.config).__module__.rsplit('.', 1)[-1]}.{type(self.config).__name__}"
        )
        result = super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            write_remote_code(type(self), save_directory)
            if (publish := _publishing()) is not None:
                publish.write_card(self, save_directory)
        return result

    def post_init(self):
        super().post_init()
        if (publish := _publishing()) is not None:
            publish.install_trainer_hook()  # Trainer.push_to_hub then uploads swapformer's card

    def push_to_hub(self, repo_id: str, **kwargs):
        """`PreTrainedModel.push_to_hub` (same arguments) that uploads swapformer's model card, or keeps
        the repository's card when a user wrote it, after a preflight (hub_cards/publish.py)."""
        publish = _publishing()
        if publish is None:  # remote code on a machine without swapformer: transformers' own upload
            return super().push_to_hub(repo_id, **kwargs)
        return publish.push_model(self, repo_id, **kwargs)


def _publishing():
    """swapformer.hub_cards.publish, or None in remote code loaded where swapformer is not installed (the
    module is found by name, so the remote-code export does not follow it into the flat folder)."""
    try:
        return importlib.import_module("swapformer.hub_cards.publish")
    except ImportError:
        return None


class DecodingWeights:
    """Input-major copies of the weight matrices that each decoding step reads, lent to their modules
    for the length of one generate() call, then handed back.

    At batch 1 a decoding step multiplies one row by every weight matrix, streamed from memory each
    time. On CPU that product runs faster on a matrix stored (in, out), the layout of GPT-2's Conv1D,
    than on `nn.Linear`'s (out, in): the vocabulary-sized LM head in about 0.55x the time, square
    and wide matrices in 0.5-0.9x, narrow ones (MLP down, GQA k/v) not faster, so they are not copied.
    No torch product reads the (out, in) matrix at that speed (DESIGN_NOTES.md 9), so the copies are
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
    `worth_copying`, else "none"), "all", "lm_head" (the largest gain per byte) or "none" (no extra
    memory, the speed of the Parameters' layout). Copies that would take more than half of the memory
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
    def worth_copying(cls, rows: int, new_tokens: int) -> bool:
        """Whether "auto" copies: few rows per decoding step and enough steps to repay the copying."""
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
            module._parameters["weight"] = copies[id(weight)]

    def hand_back(self) -> None:
        for module, weight in reversed(self.lent):
            module._parameters["weight"] = weight
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


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


class SwapformerGenerationMixin(GenerationMixin):
    """transformers' generate(), decoding on input-major copies of the CPU weights (`DecodingWeights`)."""

    decoding_copies: str = "auto"  # or "all", "lm_head", "none": see DecodingWeights

    def generate(self, *args, **kwargs):
        choice = check_decoding_copies(self.decoding_copies)
        if choice == "auto":
            choice = "all" if DecodingWeights.worth_copying(*self._decoding_shape(args, kwargs)) else "none"
        with DecodingWeights.during(self, choice):
            return super().generate(*args, **kwargs)

    def _decoding_shape(self, args, kwargs) -> tuple[int, int]:
        """(rows per decoding step, new tokens at most) of a generate() call, from its arguments and
        generation config as generate() resolves them (arguments override the config)."""
        config = kwargs.get("generation_config") or self.generation_config

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
            prompt = 0 if self.config.is_encoder_decoder or not torch.is_tensor(inputs) else inputs.shape[1]
            new_tokens = option("max_length", 20) - prompt
        return rows, new_tokens


def check_decoding_copies(choice) -> str:
    if choice not in DecodingWeights.CHOICES:
        raise ValueError(
            f"decoding_copies={choice!r}; choose one of {DecodingWeights.CHOICES} (what generate() copies "
            "input-major for faster CPU decoding)"
        )
    return choice


def finish_output(config, output, return_dict: bool | None):
    """The ModelOutput, or its tuple (None fields dropped, loss first) when return_dict is False."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def keep_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of h (B, T, E) that need logits, by transformers' rule (`slice_logits_to_keep`):
    an int N keeps the last N (0: all); a 1-D tensor indexes positions of every row; a 2-D integer
    tensor (B, N) positions per row; a 2-D bool mask (B, T) the True positions, flattened to (n, E)."""
    if isinstance(logits_to_keep, int):
        return h[:, -logits_to_keep:] if logits_to_keep else h
    if logits_to_keep.dim() == 2:
        if logits_to_keep.dtype == torch.bool:
            return h[logits_to_keep.to(h.device)]
        return torch.take_along_dim(h, logits_to_keep.to(h.device)[..., None], dim=1)
    return h[:, logits_to_keep]


# The cache argument ------------------------------------------------------------------------------

# transformers 5.24 renamed the cache argument to `cache` and deprecates the old names with
# `deprecate_kwarg(old, "5.40.0", new_name="cache")` (Llama, BART: past_key_values; Mamba:
# cache_params); the warning below is that decorator's text.
OLD_CACHE_NAMES = ("past_key_values", "cache_params")
CACHE_NAMES_REMOVED_IN = "5.40.0"


def cache_argument(forward):
    """Decorates a forward whose cache parameter is `cache`: `past_key_values=` and `cache_params=`
    are taken with transformers' FutureWarning (shown once per call site, as Python shows it),
    two names for the cache at once raise, and `cache_position` (which transformers 5.24's models
    take and no longer need) is checked against the cache instead of being silently ignored."""
    signature = inspect.signature(forward)
    names = list(signature.parameters)
    cache_at = names.index("cache")  # position in (self, *args)
    # the tokens the cache grows by: the decoder's, for an encoder-decoder
    new_tokens = (
        ("decoder_input_ids", "decoder_inputs_embeds", "labels")
        if "decoder_input_ids" in names
        else ("input_ids", "inputs_embeds")
    )

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        given = [n for n in OLD_CACHE_NAMES if kwargs.get(n) is not None]
        for n in OLD_CACHE_NAMES:
            if kwargs.get(n) is None:
                kwargs.pop(n, None)
        if given:
            positional = args[cache_at - 1] if len(args) >= cache_at else None
            if kwargs.get("cache") is not None or positional is not None:
                given.insert(0, "cache")
            if len(given) > 1:
                raise ValueError(
                    f"Both `{given[0]}` and `{given[1]}` are set for `{type(self).__name__}.forward`: pass the "
                    "cache once, as `cache=`, not both (`past_key_values` and `cache_params` are its deprecated names)"
                )
            if not torch.compiler.is_compiling():
                warnings.warn(
                    f"`{given[0]}` is deprecated and will be removed in version {CACHE_NAMES_REMOVED_IN} for "
                    f"`{type(self).__name__}.forward`. Use `cache` instead.",
                    FutureWarning,
                    stacklevel=2,
                )
            if len(args) >= cache_at:
                args = (*args[: cache_at - 1], kwargs.pop(given[0]), *args[cache_at:])
            else:
                kwargs["cache"] = kwargs.pop(given[0])
        cache_position = kwargs.pop("cache_position", None)
        if cache_position is not None and not torch.compiler.is_compiling():
            check_cache_position(cache_position, signature.bind(self, *args, **kwargs).arguments, new_tokens)
        return forward(self, *args, **kwargs)

    return wrapper


def check_cache_position(cache_position: torch.Tensor, arguments: dict, new_tokens: tuple[str, ...]) -> None:
    """New tokens always follow the cached ones (as in transformers 5.24, where `cache_position` is
    no longer read); a `cache_position` saying otherwise is an error rather than silently ignored."""
    cache = arguments.get("cache")
    past = cache.get_seq_length() if cache is not None else 0
    for name in new_tokens:
        if arguments.get(name) is not None:
            length = arguments[name].shape[1]
            break
    else:
        return
    expected = torch.arange(past, past + length, device=cache_position.device)
    if cache_position.shape[-1:] != (length,) or not bool((cache_position == expected).all()):
        shown = cache_position.flatten()[:8].tolist()
        raise ValueError(
            f"cache_position={shown}{'...' if cache_position.numel() > 8 else ''} disagrees with the inputs: "
            f"{length} new token(s) after {past} cached ones sit at positions {past}..{past + length - 1}. New "
            "tokens always follow the cache; drop cache_position, or crop the cache (cache.crop(n)) to rewrite it"
        )


def use_cache_unless_checkpointing(module: nn.Module, use_cache: bool | None) -> bool:
    """`use_cache` (default: the config's), switched off with transformers' warning while gradient
    checkpointing trains: recomputed layers would write the cache twice."""
    use_cache = module.config.use_cache if use_cache is None else use_cache
    if use_cache and module.gradient_checkpointing and module.training and torch.is_grad_enabled():
        # Llama's text (transformers.utils.generic.merge_with_config_defaults)
        logger.warning_once(
            "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`."
        )
        return False
    return bool(use_cache)


# Losses ------------------------------------------------------------------------------------------


def check_label_ids(labels: torch.Tensor, vocab_size: int, name: str = "labels", ignore_index: int = -100):
    """Token labels lie in [0, vocab_size) or equal `ignore_index`; checked where the user gave them,
    not as an index error inside the loss or the embedding."""
    if torch.compiler.is_compiling() or not labels.numel():
        return
    real = labels[labels != ignore_index]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds token ids in [{int(real.min())}, {int(real.max())}] but vocab_size={vocab_size}; "
            f"use ids in [0, {vocab_size}) and {ignore_index} for positions without loss (the tokenizer and the "
            "model disagree: resize_token_embeddings, or fix the tokenizer)"
        )


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
    name: str = "labels",
) -> torch.Tensor:
    """Cross-entropy over tokens, in fp32.

    Args:
        logits: (B, T, V).
        labels: (B, T), `ignore_index` where no loss is taken.
        shift: predict token t + 1 from position t (causal LM); False for masked LM and seq2seq,
            whose labels are already aligned with the logits.
        num_items_in_batch: number of labelled tokens over the whole (accumulated) batch, as given by
            Trainer or an Accelerate loop; the sum is divided by it so that gradient accumulation gives
            the gradient of one big batch. Without it, the mean over this batch's labelled tokens.
        name: what the user called `labels`, for the error on ids outside the vocabulary.
    """
    check_label_ids(labels, logits.shape[-1], name, ignore_index)
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index)
    total = nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> torch.Tensor | None:
    """transformers' `ForCausalLMLoss`: `labels` (B, T) are shifted inside; `shift_labels` (B, T),
    already aligned with the logits (context parallelism, packing collators), win when both are given."""
    if shift_labels is None:
        if labels is None:
            return None
        return token_cross_entropy(logits, labels, shift=True, num_items_in_batch=num_items_in_batch)
    if tuple(shift_labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"shift_labels has shape {tuple(shift_labels.shape)} but the logits cover {tuple(logits.shape[:-1])} "
            "positions: shift_labels[b, t] is the token that follows position t (-100 for none), one per position "
            "(with logits_to_keep, pass labels instead)"
        )
    return token_cross_entropy(
        logits, shift_labels, shift=False, num_items_in_batch=num_items_in_batch, name="shift_labels"
    )


def sequence_classification_loss(config, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Regression, single-label or multi-label loss, chosen as transformers does (`problem_type`)."""
    num_labels = logits.shape[-1]
    problem = config.problem_type
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return nn.functional.mse_loss(logits.squeeze(-1).float(), labels.squeeze(-1).float())
    if problem == "single_label_classification":
        return nn.functional.cross_entropy(logits.view(-1, num_labels).float(), labels.view(-1))
    return nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())


__all__ = [
    "SwapformerPreTrainedModel",
    "SwapformerGenerationMixin",
    "DecodingWeights",
    "cache_argument",
    "causal_lm_loss",
    "check_label_ids",
    "finish_output",
    "keep_positions",
    "token_cross_entropy",
    "sequence_classification_loss",
    "use_cache_unless_checkpointing",
]
