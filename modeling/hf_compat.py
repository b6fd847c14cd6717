"""Every place swapformer reaches into transformers beyond its public API, and every registration.

Other modules import these names from here, and `tests/test_hf_compat.py` holds one contract test per
touch point, so a transformers upgrade that moves or changes one fails there, naming it.

Registrations (into transformers' process-wide registries), under prefixed names only; registering
never replaces an entry transformers (or anyone else) made under the same name (`register`):
    AttentionInterface / AttentionMaskInterface  `swapformer_sparse`, `swapformer_sdpa_fa`, and
        `swapformer_per_layer` (the dispatcher of a {layer type: backend} mapping)
    cache layer types  `bigbird_attention` (dynamic: transformers' full `DynamicLayer`; static) and
        `sliding_global_attention` (static; its dynamic layer registers itself through transformers'
        `_layer_type` hook, see modeling/cache.py: GlobalWindowLayer)

The user-facing names `attn_implementation="sparse"` / `"sdpa_fa"` stay what configs hold and save:
`ALL_ATTENTION_FUNCTIONS` below is swapformer's own `AttentionInterface` instance, the way
transformers documents for a model that maps names locally. It knows them beside every globally
registered function, and only swapformer's attention layers look functions up in it.

Private names (not exported by `transformers` itself, or internals of its classes):
    ACT2FN                       transformers.activations: the activations by name
    initialization (`init`)      transformers.initialization: init functions that respect loaded weights
    DynamicSlidingWindowLayer    transformers.cache_utils: the sliding-window cache layer
    DYNAMIC_LAYER_TYPE_MAPPING, STATIC_LAYER_TYPE_MAPPING
                                 transformers.cache_utils: cache layer class per layer type
Hooks swapformer overrides or reads on transformers' base classes (contract-tested, not imported):
    PreTrainedModel.get_correct_attn_implementation, set_attn_implementation,
    mark_tied_weights_as_initialized, create_masks_for_generate; the `_layer_type` subclass hook of
    cache layers; PreTrainedConfig._attn_implementation_internal, _remove_keys_not_serialized and its
    `validate_layer_type` class validator (configuration/configuration_swapformer.py; configuration
    imports no torch, so those are not imported from here).
Outside modeling (hub_cards/publish.py, which may import modeling but not the reverse):
    Trainer.push_to_hub is wrapped (once, marked) so that, for a swapformer model, the README that
    Trainer writes through `self.create_model_card` just before `upload_folder` becomes swapformer's
    card, after a preflight; swapformer replaces `create_model_card` on the instance for that call only.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import AttentionInterface, AttentionMaskInterface, DynamicLayer, StaticLayer
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    DynamicSlidingWindowLayer,
)

from ..configuration.backends import PER_LAYER_BACKEND
from .attention import eager_attention_forward, sdpa_fa_attention_forward
from .sparse import sparse_attention_forward

__all__ = [
    "ACT2FN",
    "ALL_ATTENTION_FUNCTIONS",
    "DYNAMIC_LAYER_TYPE_MAPPING",
    "STATIC_LAYER_TYPE_MAPPING",
    "DynamicSlidingWindowLayer",
    "REGISTERED",
    "init",
    "register",
]

PREFIX = "swapformer_"


def per_layer_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """Runs the backend the {layer type: backend} mapping gives this module's layer type."""
    backend = module.config.backend_for(module.layer_type)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(backend, eager_attention_forward)
    return fn(module, query, key, value, attention_mask, **kwargs)


def _no_hf_mask(*args, **kwargs):
    raise NotImplementedError(
        "swapformer models build their own masks (modeling/masks.py); transformers' mask builders do not apply"
    )


def _same_function(a, b) -> bool:
    """`a` is `b`, or the same function of another copy of swapformer's code (remote code flattens the
    modules into a folder of its own: same name, same module basename)."""
    return a is b or _where(a) == _where(b)


def _where(fn) -> tuple:
    return getattr(fn, "__qualname__", None), getattr(fn, "__module__", "").rpartition(".")[2]


def register(registry: dict, name: str, value, what: str) -> None:
    """`registry[name] = value`, unless something else already holds `name` there: then a ValueError
    names the clash. `registry` is a transformers registry (an interface instance or a mapping)."""
    existing = registry.get(name)
    if existing is not None and not _same_function(existing, value):
        raise ValueError(
            f"cannot register {value!r} as {what} {name!r}: transformers already has {existing!r} under that "
            f"name, and swapformer never replaces an entry it did not make"
        )
    registry[name] = value


class _GlobalView:
    """get/set over a transformers interface's global registry through its public API (`register`)."""

    def __init__(self, interface: type):
        self.interface = interface

    def get(self, name):
        return self.interface().get(name)

    def __setitem__(self, name, value):
        self.interface.register(name, value)


# name -> attention function, registered globally under the prefixed name
REGISTERED: dict[str, Callable] = {
    "sparse": sparse_attention_forward,
    "sdpa_fa": sdpa_fa_attention_forward,
}


def _register_all() -> None:
    functions = {PREFIX + name: fn for name, fn in REGISTERED.items()}
    functions[PER_LAYER_BACKEND] = per_layer_attention_forward
    for name, fn in functions.items():
        # `register` is transformers' public classmethod; a fresh instance reads the global registry
        register(_GlobalView(AttentionInterface), name, fn, "an attention function")
        register(_GlobalView(AttentionMaskInterface), name, _no_hf_mask, "a mask function")
    # BigBird layers keep every key (random blocks make any earlier block visible to a later query);
    # registering is what makes `DynamicCache(config=...)` / `StaticCache(config=...)` accept the types.
    register(DYNAMIC_LAYER_TYPE_MAPPING, "bigbird_attention", DynamicLayer, "a dynamic cache layer for")
    for layer_type in ("sliding_global_attention", "bigbird_attention"):
        register(STATIC_LAYER_TYPE_MAPPING, layer_type, StaticLayer, "a static cache layer for")


_register_all()

# swapformer's own lookup: every global entry, plus the user-facing names and the dispatcher, for
# swapformer's layers only. Held locally, each copy of the code (the package, a remote-code folder loaded
# in the same process) runs its own functions, whichever copy registered the global entries last.
ALL_ATTENTION_FUNCTIONS = AttentionInterface()
for _name, _fn in (*REGISTERED.items(), (PER_LAYER_BACKEND, per_layer_attention_forward)):
    ALL_ATTENTION_FUNCTIONS[_name] = _fn
