"""Which rows of the capability table run on this machine, and which of them can stand in for another.

Every backend a refusal suggests comes from here, so it names only backends that run where the message
is read: their optional package is installed, a device they run on is present, and (when the model is
known) their row has what the model needs. Torch-free like the rest of configuration/: CUDA is asked of
torch only when the process has already imported it, as every process that builds a model has.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

from .capability_table import BACKENDS, LAYER_TYPE_PATTERN, Capabilities


def devices_here() -> set[str]:
    """The devices this process can run attention on."""
    torch = sys.modules.get("torch")
    return {"cpu", "cuda"} if torch is not None and torch.cuda.is_available() else {"cpu"}


def installed(caps: Capabilities) -> bool:
    return not caps.needs or importlib.util.find_spec(caps.needs) is not None


def capable(has: Callable[[Capabilities], bool], device: str | None = None, devices=None) -> list[str]:
    """The backends whose row satisfies `has` and that run here, in table order: on `device` or one of
    `devices` (where a model's weights are), when given."""
    devices = {device} if device else devices or devices_here()
    return [n for n, c in BACKENDS.items() if has(c) and installed(c) and devices & set(c.devices)]


def model_needs(config) -> dict[str, bool]:
    """The yes/no features of the table a model of `config` needs, whatever the batch."""
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    causal = bool(getattr(config, "causal", False))
    return {
        "gqa": config.num_key_value_heads != config.num_attention_heads,
        "latent_attention": getattr(config, "kv_lora_rank", None) is not None,
        "position_bias": config.position_embedding_type in ("alibi", "relative_bias"),
        "causal": causal,
        "sinks": bool(getattr(config, "attention_sinks", False)),
        "bidirectional": not causal or encoder_decoder,
        "cross_attention": encoder_decoder,
        "linformer": getattr(config, "linformer_k", None) is not None,
    }


def serves(caps: Capabilities, config) -> bool:
    """Whether a backend with row `caps` computes every layer of `config`'s model (any model if None)."""
    if config is None:
        return True
    patterns = {LAYER_TYPE_PATTERN[t] for t in config._all_layer_types()}
    needs = [feature for feature, needed in model_needs(config).items() if needed]
    return patterns <= set(caps.patterns) and all(getattr(caps, f) for f in needs)


def stand_ins(offered: Callable[[Capabilities], bool], config=None, devices=None) -> list[str]:
    """The backends `offered` selects that run here (on `devices`, when given) and serve `config`; when
    none does (the rows offered are CUDA's and there is none), every backend that runs there and serves it."""
    return capable(lambda c: offered(c) and serves(c, config), devices=devices) or capable(
        lambda c: serves(c, config), devices=devices
    )


def replacements(backend: str, config, device: str) -> list[str]:
    """Backends that can stand in for `backend` on `device`: installed, computing `config`'s model there
    forward and backward. Those made for the same devices as `backend` come first, then table order."""
    fits = [n for n in capable(lambda c: device in c.backward and serves(c, config), device) if n != backend]
    same = [n for n in fits if BACKENDS[n].devices == BACKENDS[backend].devices]
    return same + [n for n in fits if n not in same]
