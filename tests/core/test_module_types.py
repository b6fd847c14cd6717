"""Every layer of every swapformer model that torch defines is torch's exact class (issue 26).

Libraries that check module types (PEFT's GLoRA, quantizers, pruning and export tools) test
`type(m) is nn.Linear`, not `isinstance`; a subclass, even one that only changes `forward`, is then
refused or silently skipped. So a module whose class derives from a torch layer (`nn.Linear`,
`nn.Embedding`, `nn.LayerNorm`, `nn.Dropout`, containers, ...) must be that class itself; swapformer's own
composites (attention, MLP, block, stack, RMSNorm as Llama has its own) derive from `nn.Module` only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import swapformer

from conftest import MLA_TINY, build, tiny_config

HEADS = {
    "encoder": (
        swapformer.EncoderModel,
        swapformer.EncoderForMaskedLM,
        swapformer.EncoderForSequenceClassification,
        swapformer.EncoderForTokenClassification,
        swapformer.EncoderForQuestionAnswering,
    ),
    "decoder": (
        swapformer.DecoderModel,
        swapformer.DecoderForCausalLM,
        swapformer.DecoderForSequenceClassification,
    ),
    "seq2seq": (swapformer.Seq2SeqModel, swapformer.Seq2SeqForConditionalGeneration),
}
GLOBAL = dict(
    layer_types=["sliding_global_attention", "full_attention"],
    sliding_window=3,
    global_tokens=1,
    global_projections=True,
)
MLA = MLA_TINY
VARIANTS = {  # name: (architectures, config options)
    "plain": (("encoder", "decoder", "seq2seq"), {}),
    "gated rmsnorm": (("encoder", "decoder", "seq2seq"), dict(mlp_type="gated", norm_type="rmsnorm")),
    "sinks": (("encoder", "decoder", "seq2seq"), dict(attention_sinks=True)),
    "pooler": (("encoder",), dict(add_pooling_layer=True)),
    "global projections": (("encoder",), GLOBAL),
    "linformer": (("encoder",), dict(position_embedding_type="learned", linformer_k=5)),
    "mla": (("decoder",), MLA),
    "mla without q_lora": (("decoder",), {**MLA, "q_lora_rank": None}),
}
CASES = [
    pytest.param(cls, arch, options, id=f"{cls.__name__}-{variant}")
    for variant, (archs, options) in VARIANTS.items()
    for arch in archs
    for cls in HEADS[arch]
]


def torch_layer_classes(cls: type) -> list[type]:
    """The classes of torch.nn that `cls` is or derives from, besides `nn.Module` itself."""
    return [c for c in cls.__mro__ if c.__module__.startswith("torch.nn.") and c is not nn.Module]


@pytest.mark.parametrize("model_class, arch, options", CASES)
def test_torch_layers_are_torch_classes(model_class, arch, options):
    model = build(model_class, tiny_config(arch, **options))
    subclassed = {
        name: f"{type(m).__module__}.{type(m).__qualname__} derives from {bases[0].__qualname__}"
        for name, m in model.named_modules()
        if (bases := torch_layer_classes(type(m))) and bases[0] is not type(m)
    }
    assert not subclassed, f"subclasses of torch layers: {subclassed}"
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is nn.Linear for m in linears)


def test_the_check_sees_a_subclass():
    """The test above fails on a subclass of a torch layer, and passes torch's classes and composites."""

    class Projection(nn.Linear):
        pass

    assert torch_layer_classes(Projection)[0] is not Projection
    assert torch_layer_classes(nn.Linear) == [nn.Linear]
    assert torch_layer_classes(type(build(swapformer.EncoderModel, tiny_config("encoder")).layers[0])) == []
    assert torch.nn.LayerNorm in torch_layer_classes(nn.LayerNorm)
