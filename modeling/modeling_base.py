"""What every swapformer model shares: weight initialisation, the backend check made when a backend
is chosen, input validation, the token loss, and saving with generated remote code."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMixin

from ..configuration.backends import PER_LAYER_BACKEND, check_layer_backends
from ..configuration.configuration_swapformer import SwapformerConfig
from .attention import check_backend_for_model
from .layers import RMSNorm
from .remote_code import write_remote_code
from .stack import static_key_slots


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

    def post_init(self):
        super().post_init()
        self.register_state_dict_post_hook(contiguous_state_dict)

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
        return result


def use_decoding_layout(model: nn.Module) -> int:
    """Store the weights of `model`'s plain CPU `nn.Linear`s with at least as many outputs as inputs
    (the LM head, MLP up/gate, square attention projections) input-major; returns how many changed.

    Each decoding step multiplies one row by every weight matrix, read from memory each time. On CPU
    that matrix-vector product runs faster on such a matrix stored (in, out), the layout of GPT-2's
    Conv1D, than on `nn.Linear`'s (out, in): the vocabulary-sized LM head takes about 0.6x the time,
    square and wide matrices a few percent less, narrow ones (MLP down) none (see the README's
    generation benchmark). Shapes, values and Parameter objects (so tying) are unchanged, only the
    strides; state dicts still hold contiguous tensors (`contiguous_state_dict`), so every way of
    saving works. Subclassed or quantized layers and weights off the CPU are left alone.
    """
    changed = 0
    with torch.no_grad():
        for module in model.modules():
            if type(module) is not nn.Linear or module.out_features < module.in_features:
                continue
            weight = module.weight
            if (
                type(weight) is not nn.Parameter
                or weight.device.type != "cpu"
                or not weight.is_floating_point()
            ):
                continue
            if weight.is_contiguous():
                weight.data = weight.data.t().contiguous().t()
                changed += 1
    return changed


def contiguous_state_dict(module, state_dict, prefix, local_metadata) -> None:
    """State-dict post-hook: tensors (not `keep_vars` Parameters) in the decoding layout are handed
    out contiguous, as safetensors and transformers' tied-weight checks need."""
    for key, value in state_dict.items():
        if key.startswith(prefix) and not isinstance(value, nn.Parameter) and not value.is_contiguous():
            state_dict[key] = value.contiguous()


class SwapformerGenerationMixin(GenerationMixin):
    """transformers' generate(), with CPU weights in the faster decoding layout."""

    def generate(self, *args, **kwargs):
        use_decoding_layout(self)
        return super().generate(*args, **kwargs)


def finish_output(config, output, return_dict: bool | None):
    """The ModelOutput, or its tuple (None fields dropped, loss first) when return_dict is False."""
    return output if (config.return_dict if return_dict is None else return_dict) else output.to_tuple()


def keep_positions(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions of h (B, T, E) that need logits: the last N (0 means all) or those indexed."""
    if isinstance(logits_to_keep, int):
        return h[:, -logits_to_keep:] if logits_to_keep else h
    return h[:, logits_to_keep]


def resolve_cache_argument(cache, past_key_values):
    """`cache` is the transformers 5.x name; `past_key_values` is still accepted, never both."""
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            "Pass the KV cache once, as cache= (past_key_values= is its deprecated name), not both"
        )
    return past_key_values


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    shift: bool,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
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
    """
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
    "finish_output",
    "keep_positions",
    "resolve_cache_argument",
    "token_cross_entropy",
    "sequence_classification_loss",
]
