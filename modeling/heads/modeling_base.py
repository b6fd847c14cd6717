"""What every swapformer model shares: weight initialisation, the backend check made when a backend
is chosen, saving with generated remote code. What base models and task heads share about inputs and
outputs (the cache argument included) is gathered in task_heads.py, losses in losses.py, generate()'s
weight copies in cpu/weight_copies.py."""

from __future__ import annotations

import importlib
import os

from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from ...configuration.backends import PER_LAYER_BACKEND, check_layer_backends
from ...configuration.configuration_swapformer import SwapformerConfig
from ..attention.auto_backend import AUTO_BACKEND
from ..attention.auto_backend import mode as auto_mode
from ..attention.functions import check_backend_for_model
from ..caches.cache import static_key_slots
from ..compat.hf_compat import init
from ..core.layers import Attention, RMSNorm
from ..core.positions import RotaryEmbedding
from ..remote_code import write_remote_code
from ..variants.linformer import LinformerProjections
from .attention_plan import AttentionPlan, attention_plan
from .weights_files import truncated_weights

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
        mapping = self.config._attn_layer_backends if name == PER_LAYER_BACKEND else {}
        if AUTO_BACKEND in (name, *mapping.values()):
            auto_mode()  # a wrong SWAPFORMER_AUTO fails where "auto" is chosen, not at the first forward
        return name

    def attention_plan(self) -> AttentionPlan:
        """Per layer type, the backend asked for and, for "auto", what runs in each situation seen so far
        (this process, and the disk cache of this machine) and why: the measured times or the static order.
        `print(model.attention_plan())` shows it; `.row(layer_type).choices` holds the data."""
        return attention_plan(self)

    def _check_and_adjust_attn_implementation(
        self, attn_implementation, is_init_check: bool = False, allow_all_kernels: bool = False
    ):
        """transformers' step before `get_correct_attn_implementation`; it loads an "org/name" Hub kernel
        without asking that hook, so swapformer refuses such a name here first, with what runs here."""
        if isinstance(attn_implementation, str) and "/" in attn_implementation:
            check_backend_for_model(attn_implementation, self, is_init_check=is_init_check)
        return super()._check_and_adjust_attn_implementation(
            attn_implementation, is_init_check=is_init_check, allow_all_kernels=allow_all_kernels
        )

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
        elif isinstance(module, LinformerProjections):
            module.reset_parameters()
        elif isinstance(module, RotaryEmbedding):
            module.reset_frequencies()  # non-persistent: loading leaves them torch.empty_like
        elif isinstance(module, Attention) and module.sinks is not None:
            init.normal_(module.sinks, mean=0.0, std=std)  # as gpt-oss initialises its sinks
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)

    # Loading and saving -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`; a local safetensors file cut short is named, with its size and
        the fix, in one line, where safetensors' error names neither (weights_files.py)."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except SafetensorError:
            problem = truncated_weights(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
            if problem is None:
                raise
        raise ValueError(problem)  # outside `except`: the safetensors traceback says nothing more

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


__all__ = ["SwapformerPreTrainedModel"]
