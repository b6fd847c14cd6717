"""One contract test per touch point with transformers (modeling/compat/hf_compat.py lists them).

Each test checks that the name still exists and behaves as swapformer relies on, and fails with a
message naming the touch point and what changed, so a transformers upgrade that breaks one says where.
"""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch
import transformers
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedConfig, PreTrainedModel

import swapformer
from swapformer.configuration.backends import PER_LAYER_BACKEND
from swapformer.configuration.configuration_swapformer import ACTIVATIONS
from swapformer.modeling.attention.functions import sdpa_fa_attention_forward
from swapformer.modeling.compat import hf_compat as hf_compat
from swapformer.modeling.sparse.sparse import sparse_attention_forward

from conftest import MIXED_LAYERS, build, padded_batch, tiny_config


def contract(ok: bool, touch_point: str, change: str) -> None:
    assert ok, f"transformers touch point {touch_point}: {change} (see modeling/compat/hf_compat.py)"


def parameters(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


# Registrations -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fn",
    [
        ("swapformer_sparse", sparse_attention_forward),
        ("swapformer_sdpa_fa", sdpa_fa_attention_forward),
        (PER_LAYER_BACKEND, hf_compat.per_layer_attention_forward),
    ],
)
def test_attention_functions_are_registered_under_prefixed_names(name, fn):
    contract(AttentionInterface().get(name) is fn, f"AttentionInterface[{name!r}]", "not registered")
    contract(name in AttentionMaskInterface(), f"AttentionMaskInterface[{name!r}]", "not registered")


def test_bare_user_facing_names_are_not_taken_in_transformers_registries():
    for name in hf_compat.REGISTERED:
        contract(
            name not in AttentionInterface(), f"AttentionInterface[{name!r}]", "swapformer took a bare name"
        )
        contract(name not in AttentionMaskInterface(), f"AttentionMaskInterface[{name!r}]", "bare name taken")


def test_registering_a_name_transformers_owns_is_refused():
    before = AttentionInterface().get("sdpa")
    registry = hf_compat._GlobalView(AttentionInterface)
    with pytest.raises(
        ValueError, match="cannot register .* as an attention function 'sdpa': transformers already"
    ):
        hf_compat.register(registry, "sdpa", sparse_attention_forward, "an attention function")
    contract(
        AttentionInterface().get("sdpa") is before, "AttentionInterface['sdpa']", "replaced by swapformer"
    )


def test_attention_interface_local_names_stay_local():
    """`ALL_ATTENTION_FUNCTIONS` relies on an instance's item assignment shadowing the global registry
    for that instance only, and on `get_interface(name, default)` reading both."""
    contract(
        parameters(AttentionInterface.get_interface)[1:] == ["attn_implementation", "default"],
        "AttentionInterface.get_interface",
        f"signature is now {inspect.signature(AttentionInterface.get_interface)}",
    )
    local = hf_compat.ALL_ATTENTION_FUNCTIONS
    contract(
        local.get_interface("sparse", None) is sparse_attention_forward, "local AttentionInterface", "lookup"
    )
    contract(
        local.get_interface("sdpa", None) is AttentionInterface().get("sdpa"), "AttentionInterface", "globals"
    )
    with pytest.raises(KeyError):
        AttentionInterface().get_interface("sparse", None)


def test_swapformer_runs_its_own_functions_whoever_registered_last(monkeypatch):
    """A remote-code copy of swapformer loaded in the same process registers the same prefixed names
    again (same function of another copy: allowed); this copy's layers still look up its own."""
    other = AttentionInterface()
    for name in ("swapformer_sparse", PER_LAYER_BACKEND):
        monkeypatch.setitem(AttentionInterface._global_mapping, name, lambda *a, **k: None)
    local = hf_compat.ALL_ATTENTION_FUNCTIONS
    contract(local.get_interface("sparse", None) is sparse_attention_forward, "local 'sparse'", "not ours")
    contract(
        local.get_interface(PER_LAYER_BACKEND, None) is hf_compat.per_layer_attention_forward,
        f"local {PER_LAYER_BACKEND!r}",
        "resolved through the global registry",
    )
    contract(other.get("swapformer_sparse") is not sparse_attention_forward, "monkeypatch", "had no effect")


@pytest.mark.parametrize("attn", ["sparse", {"full_attention": "sdpa", "sliding_attention": "sparse"}])
def test_user_facing_names_resolve_and_survive_save_and_load(attn, tmp_path):
    config = tiny_config("decoder", layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    model = build(swapformer.DecoderForCausalLM, config, attn=attn)
    ids, mask = padded_batch()
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
    contract(model.config.backend_for("sliding_attention") == "sparse", "attn_implementation", "name changed")
    # transformers does not write the backend to config.json; one written there by hand (or by an older
    # version) is read back as the user-facing name
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text()) | {"attn_implementation": "sparse"}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    loaded_config = transformers.AutoConfig.from_pretrained(tmp_path)
    contract(
        loaded_config._attn_implementation == "sparse", "config.json attn_implementation", "not 'sparse'"
    )
    contract(
        transformers.AutoModel.from_config(loaded_config).config._attn_implementation == "sparse",
        "config.json attn_implementation='sparse'",
        "a model built from it is not on 'sparse'",
    )
    model.save_pretrained(tmp_path / "model")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", attn_implementation=copy.copy(attn)
    )
    with torch.no_grad():
        got = loaded.eval()(ids, attention_mask=mask).logits
    contract(
        torch.allclose(got, want, atol=1e-5), "from_pretrained(attn_implementation=...)", "outputs changed"
    )


def test_cache_layer_types_are_registered():
    mappings = {
        "dynamic": hf_compat.DYNAMIC_LAYER_TYPE_MAPPING,
        "static": hf_compat.STATIC_LAYER_TYPE_MAPPING,
    }
    for kind, layer_type in [("dynamic", "bigbird_attention"), ("static", "bigbird_attention")] + [
        ("static", "sliding_global_attention"),
        ("dynamic", "sliding_global_attention"),
    ]:
        contract(
            layer_type in mappings[kind], f"cache_utils.{kind.upper()}_LAYER_TYPE_MAPPING", f"no {layer_type}"
        )
    for layer_type in ("full_attention", "sliding_attention"):  # the keys swapformer's layer types extend
        contract(
            layer_type in mappings["dynamic"], "cache_utils.DYNAMIC_LAYER_TYPE_MAPPING", f"lost {layer_type}"
        )


def test_swapformer_writes_the_cache_layer_mappings_in_one_place(monkeypatch):
    """`hf_compat.register_cache_layers` is the only writer: it puts swapformer's classes under its layer
    types (what `DynamicCache(config=...)` then builds) and refuses to replace another's entry."""
    from swapformer.modeling.caches.cache import GlobalWindowLayer

    dynamic, static = dict(hf_compat.DYNAMIC_LAYER_TYPE_MAPPING), dict(hf_compat.STATIC_LAYER_TYPE_MAPPING)
    for mapping in (dynamic, static):
        for layer_type in ("bigbird_attention", "sliding_global_attention"):
            mapping.pop(layer_type)
    monkeypatch.setattr(hf_compat, "DYNAMIC_LAYER_TYPE_MAPPING", dynamic)
    monkeypatch.setattr(hf_compat, "STATIC_LAYER_TYPE_MAPPING", static)
    hf_compat.register_cache_layers(global_window_layer=GlobalWindowLayer)
    assert dynamic["sliding_global_attention"] is GlobalWindowLayer
    assert dynamic["bigbird_attention"] is transformers.DynamicLayer
    assert static["sliding_global_attention"] is static["bigbird_attention"] is transformers.StaticLayer
    dynamic["sliding_global_attention"] = transformers.DynamicLayer  # someone else's entry
    with pytest.raises(ValueError, match="cannot register .*'sliding_global_attention'.*never replaces"):
        hf_compat.register_cache_layers(global_window_layer=GlobalWindowLayer)


def test_dynamic_cache_builds_the_registered_layer_class_per_layer_type():
    layers = transformers.DynamicCache(config=tiny_config("decoder", **MIXED_LAYERS)).layers
    built = {t: type(layer).__name__ for t, layer in zip(MIXED_LAYERS["layer_types"], layers)}
    contract(
        built["sliding_global_attention"] == "GlobalWindowLayer"
        and built["bigbird_attention"] == "DynamicLayer",
        "DynamicCache(config=...) with cache_utils.DYNAMIC_LAYER_TYPE_MAPPING",
        f"built {built}",
    )


# Private imports -----------------------------------------------------------------------------------


def test_act2fn_has_every_activation_the_config_accepts():
    missing = [name for name in ACTIVATIONS if name not in hf_compat.ACT2FN]
    contract(not missing, "transformers.activations.ACT2FN", f"lost {missing}")
    out = hf_compat.ACT2FN["gelu"](torch.tensor([1.0]))
    contract(torch.allclose(out, torch.nn.functional.gelu(torch.tensor([1.0]))), "ACT2FN['gelu']", "not GELU")


def test_initialization_functions():
    for name in ("normal_", "zeros_", "ones_", "xavier_uniform_"):
        contract(callable(getattr(hf_compat.init, name, None)), f"transformers.initialization.{name}", "gone")
    w = torch.empty(3, 3)
    hf_compat.init.zeros_(w)
    contract(bool((w == 0).all()), "transformers.initialization.zeros_", "does not write the tensor")


def test_sliding_window_cache_layer():
    """The window-of-1 fix (modeling/caches/cache_layers.py: SlidingWindowLayer) subclasses it and reads these."""
    layer_class = hf_compat.DynamicSlidingWindowLayer
    contract(
        issubclass(layer_class, transformers.DynamicLayer), "DynamicSlidingWindowLayer", "not a DynamicLayer"
    )
    layer = layer_class(sliding_window=3)
    contract(layer.sliding_window == 3, "DynamicSlidingWindowLayer.sliding_window", "attribute gone")
    for method in ("update", "get_mask_sizes", "get_seq_length", "crop"):
        contract(callable(getattr(layer, method, None)), f"DynamicSlidingWindowLayer.{method}", "gone")


def test_sliding_window_layer_counts_tokens_and_records_the_past_for_assisted_decoding():
    """The croppable window layers of modeling/caches/cache_layers.py and int8_cache.py read `cumulative_length` (every
    token seen) and `record_past` (generate() sets it for assisted decoding: nothing is dropped until
    `crop`), as transformers' own layer keeps them."""
    layer = hf_compat.DynamicSlidingWindowLayer(sliding_window=3)
    kv = torch.randn(1, 2, 5, 4)
    layer.update(kv, kv)
    contract(
        getattr(layer, "cumulative_length", None) == 5,
        "DynamicSlidingWindowLayer.cumulative_length",
        "not the tokens seen",
    )
    contract(
        getattr(layer, "record_past", None) is False,
        "DynamicSlidingWindowLayer.record_past",
        "not False by default",
    )
    recording = hf_compat.DynamicSlidingWindowLayer(sliding_window=3)
    recording.record_past = True
    recording.update(kv, kv)
    contract(
        recording.keys.shape[-2] == 5, "DynamicSlidingWindowLayer.record_past", "keys dropped while recording"
    )


def test_every_swapformer_cache_layer_records_the_past_with_the_keywords_generate_passes():
    """Assisted decoding calls `cache.activate_past_recording(...)`, and the cache passes its keywords on
    to every layer (transformers 5.25 added `recurrent_states_to_keep`); swapformer's layers of each
    kind (dynamic, int8; full, window, window + globals) take them and start recording."""
    from swapformer.modeling.caches.cache import dynamic_cache
    from swapformer.modeling.caches.int8_cache import int8_cache

    takes = inspect.signature(transformers.Cache.activate_past_recording).parameters
    keywords = {"recurrent_states_to_keep": 2} if any(p.kind is p.VAR_KEYWORD for p in takes.values()) else {}
    layer_types = ["full_attention", "sliding_attention", "sliding_global_attention"]
    config = tiny_config("decoder", num_hidden_layers=3, layer_types=layer_types, sliding_window=4)
    for cache in (dynamic_cache(config), int8_cache(config)):
        cache.activate_past_recording(**keywords)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                contract(
                    layer.record_past is True,
                    f"Cache.activate_past_recording -> {type(layer).__name__}",
                    f"did not record with {keywords}",
                )


# Hooks swapformer overrides on transformers' base classes --------------------------------------------


@pytest.mark.parametrize(
    "method, params",
    [
        ("get_correct_attn_implementation", ["self", "requested_attention", "is_init_check"]),
        (
            "_check_and_adjust_attn_implementation",
            ["self", "attn_implementation", "is_init_check", "allow_all_kernels"],
        ),
        ("set_attn_implementation", ["self", "attn_implementation", "allow_all_kernels"]),
        ("mark_tied_weights_as_initialized", ["self", "loading_info"]),
    ],
)
def test_model_hooks_still_exist(method, params):
    fn = getattr(PreTrainedModel, method, None)
    contract(fn is not None, f"PreTrainedModel.{method}", "gone (swapformer overrides it)")
    contract(
        parameters(fn) == params, f"PreTrainedModel.{method}", f"signature is now {inspect.signature(fn)}"
    )


def test_generate_calls_the_models_mask_hook(monkeypatch):
    """generate() with a static cache asks the model's `create_masks_for_generate` (swapformer pads the
    2-D mask to every cache slot there) instead of transformers' mask builder."""
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"), attn="sdpa")
    calls = []
    hook = type(model).create_masks_for_generate
    monkeypatch.setattr(
        type(model), "create_masks_for_generate", lambda *a, **k: calls.append(1) or hook(*a, **k)
    )
    ids, mask = padded_batch(batch=2, length=5, padding="left")
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, cache_implementation="static")
    contract(
        bool(calls), "GenerationMixin -> model.create_masks_for_generate", "generate() no longer calls it"
    )


def test_config_internals():
    config = PreTrainedConfig()
    contract(
        hasattr(config, "_attn_implementation_internal"),
        "PreTrainedConfig._attn_implementation_internal",
        "gone",
    )
    contract(
        callable(getattr(config, "_remove_keys_not_serialized", None)), "_remove_keys_not_serialized", "gone"
    )
    validators = [v.__name__ for v in getattr(PreTrainedConfig, "__class_validators__", ())]
    contract(
        "validate_layer_type" in validators,
        "PreTrainedConfig validate_layer_type",
        f"validators {validators}",
    )


def test_generate_builds_its_cache_in_prepare_cache_for_generation():
    """generation.SwapformerGenerationMixin overrides `_prepare_cache_for_generation` to give the
    cache generate() builds swapformer's layer objects: it must still take (generation_config,
    model_kwargs, ...) and put the cache it builds in model_kwargs["cache"], leaving a caller's cache."""
    from transformers import GenerationConfig, GenerationMixin

    fn = getattr(GenerationMixin, "_prepare_cache_for_generation", None)
    contract(fn is not None, "GenerationMixin._prepare_cache_for_generation", "gone")
    contract(
        parameters(fn)[:3] == ["self", "generation_config", "model_kwargs"],
        "GenerationMixin._prepare_cache_for_generation",
        f"signature is now {inspect.signature(fn)}",
    )
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    built, given = {}, {"cache": transformers.DynamicCache()}
    for kwargs in (built, given):
        mine = given.get("cache")
        fn(model, GenerationConfig(), kwargs, None, 1, 8)
        if kwargs is given:
            contract(
                kwargs["cache"] is mine, "GenerationMixin._prepare_cache_for_generation", "replaced my cache"
            )
    contract(
        isinstance(built.get("cache"), transformers.DynamicCache),
        "GenerationMixin._prepare_cache_for_generation",
        "no longer writes model_kwargs['cache']",
    )


def test_prepare_cache_for_generation_gets_the_final_length_before_any_forward():
    """generation_checks.py refuses a call past a learned position table in that hook (issue 28): it must
    run before the first forward, with max_cache_length fifth, the tokens the decoder will be fed (prompt,
    ids or embeddings, + max_new_tokens - 1)."""
    from transformers import GenerationMixin

    touch = "GenerationMixin._prepare_cache_for_generation"
    names = ["self", "generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"]
    signature = parameters(GenerationMixin._prepare_cache_for_generation)
    contract(signature[:6] == names, touch, f"parameters are now {signature}")
    model = build(swapformer.DecoderForCausalLM, tiny_config("decoder"))
    calls, seen = [], []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    hook = model._prepare_cache_for_generation
    model._prepare_cache_for_generation = lambda *args: seen.append((args[4], len(calls))) or hook(*args)
    ids = torch.arange(3, 8)[None]
    for prompt in ({"input_ids": ids}, {"inputs_embeds": model.get_input_embeddings()(ids)}):
        calls.clear()
        model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    contract(
        seen == [(8, 0), (8, 0)], touch, f"(max_cache_length, forwards before it) are {seen}, not (8, 0)"
    )


def test_trainer_push_to_hub_writes_its_card_through_create_model_card_then_uploads():
    """hub_cards/publish.py: CardTrainerMixin overrides `Trainer.create_model_card` (public, documented) to
    put swapformer's card in the folder: that works while push_to_hub saves, then calls
    self.create_model_card, then uploads the folder, in that order."""
    from transformers import Trainer

    source = inspect.getsource(Trainer.push_to_hub)
    order = [source.find(call) for call in ("self.save_model(", "self.create_model_card(", ".upload_folder(")]
    contract(
        -1 not in order and order == sorted(order),
        "Trainer.push_to_hub",
        f"no longer calls save_model, self.create_model_card and upload_folder in that order (positions {order})",
    )


def test_autogenerated_trainer_comment_marks_the_cards_trainer_writes():
    """hub_cards/publish.py tells a card Trainer generated from one a person wrote by this marker."""
    from transformers.modelcard import TrainingSummary

    marker = hf_compat.autogenerated_trainer_comment()
    card = TrainingSummary(model_name="m").to_model_card()
    contract(
        isinstance(marker, str) and marker.strip() and marker.strip() in card,
        "transformers.modelcard.AUTOGENERATED_TRAINER_COMMENT",
        "no longer in the cards Trainer writes",
    )


@pytest.mark.parametrize("name", sorted(hf_compat.TOUCH_POINTS))
def test_private_names_are_where_the_ledger_says(name):
    contract(hf_compat._private(name) is not None, f"{hf_compat.TOUCH_POINTS[name]}.{name}", "missing")


def test_a_missing_private_name_is_reported_with_the_version_and_the_name(monkeypatch):
    monkeypatch.setitem(hf_compat.TOUCH_POINTS, "NO_SUCH_NAME", "transformers.cache_utils")
    with pytest.raises(
        ImportError, match=f"transformers {transformers.__version__} has no transformers.cache_utils"
    ):
        hf_compat._private("NO_SUCH_NAME")
