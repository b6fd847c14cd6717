"""What the base models and their task heads share, gathered for the heads: the inputs passed through to
the stack (`BaseModelKwargs`, core/inputs.py), the cache argument (caches/cache.py), `TaskHead` and the
output conventions (core/stack.py), and the heads' own keyword inputs (`HeadKwargs`). Each lives where a
plain forward already reads, so a decoder's forward runs nothing here.

A head's `forward` is written as transformers writes its heads (Llama, BERT, BART): the positional
prefix and the head's own inputs are explicit parameters, swapformer's own input
`global_attention_mask` is a keyword-only one (Trainer keeps only dataset columns that forward names,
generate() only keywords it names or knows), and the standard inputs of every transformers model pass
as `**kwargs: Unpack[HeadKwargs]`. The forward then calls `TaskHead.run_head`: the base model
(`self.model`), then the head's own `head_outputs` (logits and loss). Forwards that take a cache read
it with `cache_argument`, first thing, as transformers' `deprecate_kwarg` reads it for Llama."""

from __future__ import annotations

import torch

from ..caches.cache import cache_argument, use_cache_unless_checkpointing
from ..core.inputs import PACKING_INPUTS, BaseModelKwargs, check_base_inputs, stack_inputs
from ..core.stack import TaskHead, keep_positions, model_output


class HeadKwargs(BaseModelKwargs, total=False):
    """A task head's `**kwargs`: the base-model inputs and Trainer's count of labelled tokens in the
    whole accumulated batch (`num_items_in_batch`, for heads with `accepts_loss_kwargs`)."""

    num_items_in_batch: int | torch.Tensor | None


__all__ = [
    "PACKING_INPUTS",
    "BaseModelKwargs",
    "HeadKwargs",
    "TaskHead",
    "cache_argument",
    "check_base_inputs",
    "keep_positions",
    "model_output",
    "stack_inputs",
    "use_cache_unless_checkpointing",
]
