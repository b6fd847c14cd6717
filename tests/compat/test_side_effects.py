"""Importing swapformer, building its models and running them leaves transformers (and torch, and the
interpreter's import machinery) as they were, apart from the registrations (issue 27, item 3).

A fresh interpreter imports transformers and the modules swapformer touches, takes a snapshot of every
attribute of every loaded `transformers.*` module and of each class defined there (by identity), of the
contents of the registries they hold (dicts and the Auto mappings' extra content), of `torch.nn`, of
builtins, `sys.meta_path` and `sys.path_hooks`; then imports swapformer, builds a tiny model of each
architecture, runs a forward (and generate() for the two that generate), and compares. Every difference
must be one of the registrations listed in `ALLOWED`.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache, StaticCache, StaticSlidingWindowLayer

import swapformer
from swapformer.modeling.caches.cache import SlidingWindowLayer
from swapformer.modeling.compat.hf_compat import DynamicSlidingWindowLayer

from conftest import build, max_diff, run_python, tiny_config

# (where, key): a registry entry swapformer adds. `where` is "module:attribute", with ".content" for the
# extra content of an Auto mapping; key is the entry's key as repr() writes it.
ALLOWED = {
    # AutoConfig: the three model types
    *(
        ("transformers.models.auto.configuration_auto:CONFIG_MAPPING.content", repr(t))
        for t in ("swapformer_encoder", "swapformer_decoder", "swapformer_seq2seq")
    ),
    # the attention functions and their mask functions, under prefixed names
    *(
        (f"transformers.{module}._global_mapping", repr(name))
        for module in ("modeling_utils:AttentionInterface", "masking_utils:AttentionMaskInterface")
        for name in ("swapformer_sparse", "swapformer_sdpa_fa", "swapformer_per_layer")
    ),
    # cache layer classes of swapformer's layer types
    ("transformers.cache_utils:DYNAMIC_LAYER_TYPE_MAPPING", "'bigbird_attention'"),
    ("transformers.cache_utils:DYNAMIC_LAYER_TYPE_MAPPING", "'sliding_global_attention'"),
    ("transformers.cache_utils:STATIC_LAYER_TYPE_MAPPING", "'bigbird_attention'"),
    ("transformers.cache_utils:STATIC_LAYER_TYPE_MAPPING", "'sliding_global_attention'"),
}
# The Auto model mappings gain swapformer's config classes as keys (repr of a class is its path).
AUTO_MODEL_MAPPING = "transformers.models.auto.modeling_auto:"
# transformers' own per-model-class cache, which transformers fills when a model class is first run
# (it does so for its own classes too); keyed by swapformer's classes once they ran.
PER_CLASS_CACHES = {
    "transformers.utils.output_capturing:_CAN_RECORD_REGISTRY",
    "transformers.modeling_utils:_CAN_RECORD_REGISTRY",  # the same dict, imported there
}
SWAPFORMER_CONFIGS = {
    f"<class 'swapformer.configuration.configuration_swapformer.{name}'>"
    for name in ("EncoderConfig", "DecoderConfig", "Seq2SeqConfig")
}

SCRIPT = r"""
import builtins, importlib, json, sys, types

import torch
import torch.nn
import torch.nn.functional
import transformers

TOUCHED = [
    "transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto",
    "transformers.trainer", "transformers.trainer_callback", "transformers.cache_utils",
    "transformers.modeling_utils", "transformers.masking_utils", "transformers.generation.utils",
    "transformers.integrations", "transformers.integrations.sdpa_attention",
    "transformers.integrations.flex_attention", "transformers.modeling_rope_utils",
    "transformers.activations", "transformers.modelcard", "transformers.configuration_utils",
]
for name in TOUCHED:
    importlib.import_module(name)
# what a public `from transformers import X` of swapformer resolves on the lazy top level, resolved now
for name in ("DynamicCache", "StaticCache", "EncoderDecoderCache", "Cache", "DynamicLayer", "StaticLayer",
             "StaticSlidingWindowLayer", "GenerationMixin", "PreTrainedModel", "PreTrainedConfig",
             "AttentionInterface", "AttentionMaskInterface", "AutoConfig", "initialization"):
    getattr(transformers, name, None)

TORCH = ["torch.nn", "torch.nn.functional", "torch.nn.modules.module", "torch.nn.modules.linear"]


def ident(value):
    return f"{type(value).__name__}@{id(value)}"


def contents(where, value, out):
    extra = None if isinstance(value, type) else getattr(value, "_extra_content", None)
    if isinstance(extra, dict):  # transformers' lazy Auto mappings keep registrations here
        out[where + ".content"] = {repr(k): ident(v) for k, v in list(dict.items(extra))}
    elif isinstance(value, dict):  # the stored items, without a subclass's loading `items()`
        out[where] = {repr(k): ident(v) for k, v in list(dict.items(value))}


def snapshot():
    out = {}
    names = [n for n in list(sys.modules) if n == "transformers" or n.startswith("transformers.")]
    for name in names + TORCH:
        module = sys.modules.get(name)
        if module is None:
            continue
        attrs = dict(vars(module))
        out[name + ":"] = {k: ident(v) for k, v in attrs.items()}
        for attr, value in attrs.items():
            contents(f"{name}:{attr}", value, out)
            if isinstance(value, type) and value.__module__ == name:
                out[f"{name}:{attr}.__class__"] = {"": ident(type(value))}
                cls_attrs = dict(vars(value))
                out[f"{name}:{attr}."] = {k: ident(v) for k, v in cls_attrs.items()}
                for key, item in cls_attrs.items():
                    contents(f"{name}:{attr}.{key}", item, out)
    out["builtins:"] = {k: ident(v) for k, v in vars(builtins).items()}
    out["sys.meta_path"] = {str(i): ident(f) for i, f in enumerate(sys.meta_path)}
    out["sys.path_hooks"] = {str(i): ident(f) for i, f in enumerate(sys.path_hooks)}
    return out


MODE = sys.argv[1]
if MODE == "run":  # what transformers itself sets up on first use of any model (e.g. nn.Module.smart_apply)
    llama = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, pad_token_id=0)
    with torch.no_grad():
        transformers.LlamaForCausalLM(llama).generate(torch.tensor([[5, 6]]), max_new_tokens=2, do_sample=False)
before = snapshot()
import swapformer

if MODE == "run":
    small = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 layer_types=["sliding_attention", "full_attention"], sliding_window=2)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        encoder = swapformer.EncoderModel(swapformer.EncoderConfig(**small)).eval()
        encoder(ids)
        decoder = swapformer.DecoderForCausalLM(swapformer.DecoderConfig(**small)).eval()
        decoder(ids)
        decoder.generate(ids, max_new_tokens=3, do_sample=False)
        seq2seq = swapformer.Seq2SeqForConditionalGeneration(
            swapformer.Seq2SeqConfig(**small, decoder_start_token_id=1)).eval()
        seq2seq(ids, decoder_input_ids=ids[:, :1])
        seq2seq.generate(ids, max_new_tokens=3, do_sample=False)
after = snapshot()

diffs = []
for where, entries in before.items():
    now = after.get(where, {})
    for key, value in entries.items():
        if key not in now:
            diffs.append(["removed", where, key])
        elif now[key] != value:
            diffs.append(["changed", where, key])
    for key in now.keys() - entries.keys():
        value = now[key]
        module = sys.modules.get(where[:-1]) if where.endswith(":") else None
        # a submodule imported later, or a public name a lazy module resolved on first access: not a change
        submodule = value.startswith("module@")
        lazy = module is not None and key in getattr(module, "_class_to_module", {})
        if not (submodule or lazy):
            diffs.append(["added", where, key])
print("DIFFS " + json.dumps(diffs))
"""


def differences(mode: str) -> list[list[str]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    return run_python(SCRIPT, mode, env=env, tag="DIFFS")


def unexpected(diffs: list[list[str]]) -> list[list[str]]:
    def allowed(kind: str, where: str, key: str) -> bool:
        if kind != "added":
            return False
        if where.startswith(AUTO_MODEL_MAPPING) and where.endswith(".content"):
            return key in SWAPFORMER_CONFIGS
        if where in PER_CLASS_CACHES:
            return key.startswith(repr("<class 'swapformer.")[:-1])
        return (where, key) in ALLOWED

    return [d for d in diffs if not allowed(*d)]


def test_importing_swapformer_changes_nothing_in_transformers_but_the_registrations():
    assert unexpected(differences("import")) == []


def test_building_running_and_generating_changes_nothing_more():
    assert unexpected(differences("run")) == []


def test_the_snapshot_sees_a_wrapped_method_and_an_import_hook():
    """The comparison would catch the side effects this test exists for (a negative control)."""
    script = SCRIPT.replace(
        "import swapformer\n",
        "import swapformer\nimport transformers.trainer as t\nt.Trainer.push_to_hub = lambda self: None\n"
        "sys.meta_path.insert(0, object())\n",
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    found = unexpected(run_python(script, "import", env=env, tag="DIFFS"))
    assert ["changed", "transformers.trainer:Trainer.", "push_to_hub"] in found
    assert any(where == "sys.meta_path" for _, where, _ in found), found


IMPORT_HOOKS = r"""
import json, sys
hooks = lambda: [(getattr(f, "__module__", "") or type(f).__module__, type(f).__qualname__)
                 for f in (*sys.meta_path, *sys.path_hooks)]
before = hooks()
import swapformer
print("HOOKS " + json.dumps([h for h in hooks() if h not in before]))
"""


def test_importing_swapformer_first_installs_no_import_hook():
    """With transformers not yet imported, `import swapformer` adds no finder or path hook of its own
    (torch and transformers, which it imports, add theirs, as they would for any user)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    added = run_python(IMPORT_HOOKS, env=env, tag="HOOKS")
    assert [h for h in added if h[0].split(".")[0] == "swapformer"] == []


# No class swapping on a user's cache -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_users_cache_keeps_its_layer_objects_and_decodes_as_the_uncached_forward(kind):
    """transformers' window layers in a cache the user built (a window of 1 in a `DynamicCache`, whose
    get_mask_sizes disagrees with the keys it keeps; `StaticSlidingWindowLayer` among full static layers)
    keep their objects and classes through a prompt and three steps, and each step's logits are those
    of the uncached forward over the same tokens (the reference)."""
    window = 1 if kind == "dynamic" else 3
    config = tiny_config(
        "decoder",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        position_embedding_type="rope",
    )
    model = build(swapformer.DecoderForCausalLM, config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    if kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1])
    layers = list(cache.layers)
    classes = [type(layer) for layer in layers]
    assert DynamicSlidingWindowLayer in classes or StaticSlidingWindowLayer in classes
    with torch.no_grad():
        model(ids[:, :5], cache=cache)
        for end in range(6, ids.shape[1] + 1):
            got = model(ids[:, end - 1 : end], cache=cache).logits[:, -1]
            want = model(ids[:, :end], use_cache=False).logits[:, -1]
            assert max_diff(got, want) <= 1e-5, end
    assert all(a is b for a, b in zip(cache.layers, layers)) and len(cache.layers) == len(layers)
    assert [type(layer) for layer in cache.layers] == classes


def test_the_caches_swapformer_builds_get_its_window_of_one():
    """The cache generate() builds for itself (not a user's), and the one a forward with `use_cache=True`
    makes, get swapformer's window-1 layer, which keeps no key between steps; it decodes what a user's
    cache with transformers' layer decodes."""
    config = tiny_config("decoder", layer_types=["sliding_attention", "full_attention"], sliding_window=1)
    model = build(swapformer.DecoderForCausalLM, config).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    options = dict(max_new_tokens=4, do_sample=False, return_dict_in_generate=True, output_logits=True)
    own = model.generate(ids, **options)
    users = model.generate(ids, cache=DynamicCache(config=model.config), **options)
    assert isinstance(own.cache.layers[0], SlidingWindowLayer) and own.cache.layers[0].keys.shape[-2] == 0
    assert type(users.cache.layers[0]) is DynamicSlidingWindowLayer
    assert torch.equal(own.sequences, users.sequences)
    assert max(max_diff(a, b) for a, b in zip(own.logits, users.logits)) <= 1e-5
    with torch.no_grad():
        made = model(ids, use_cache=True).cache
    assert isinstance(made.layers[0], SlidingWindowLayer) and made.layers[0].keys.shape[-2] == 0


def test_a_users_encoder_decoder_cache_is_read_not_rebuilt():
    """A seq2seq with sliding decoder layers: transformers builds the cross-attention part of an
    `EncoderDecoderCache` from the decoder's layer types, so a cache made by the user that way holds
    window layers that would drop encoder keys. swapformer refuses it, naming the layer and the fix,
    instead of replacing the user's layer objects; the caches it builds itself (generate(),
    `use_cache=True`) keep every encoder key and decode as the uncached forward does."""
    from transformers import EncoderDecoderCache

    config = tiny_config(
        "seq2seq",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=2,
        decoder_layer_types=["sliding_attention", "full_attention"],
    )
    model = build(swapformer.Seq2SeqForConditionalGeneration, config).eval()
    ids, decoder_ids = torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.tensor([[1, 5, 6]])
    users = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))
    cross = list(users.cross_attention_cache.layers)
    with pytest.raises(
        ValueError, match=r"cross-attention.*layer 0.*DynamicSlidingWindowLayer.*DynamicCache\(\)"
    ):
        model(ids, decoder_input_ids=decoder_ids, cache=users)
    assert all(a is b for a, b in zip(users.cross_attention_cache.layers, cross))
    good = EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache())
    with torch.no_grad():
        first = model(ids, decoder_input_ids=decoder_ids[:, :2], cache=good)
        step = model(ids, decoder_input_ids=decoder_ids[:, 2:], cache=good).logits[:, -1]
        want = model(ids, decoder_input_ids=decoder_ids, use_cache=False).logits[:, -1]
        made = model(ids, decoder_input_ids=decoder_ids[:, :2], use_cache=True).cache
    assert first.cache is good and max_diff(step, want) <= 1e-5
    assert not any(getattr(layer, "is_sliding", False) for layer in made.cross_attention_cache.layers)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    assert not any(getattr(layer, "is_sliding", False) for layer in out.cache.cross_attention_cache.layers)
