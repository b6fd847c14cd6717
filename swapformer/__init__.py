"""swapformer: Hugging Face-compatible Transformers whose attention backend you can swap.

Importing the package imports its configs and models and registers them with transformers' Auto classes
(and its attention functions with transformers' attention interfaces), so `AutoModel*.from_config` /
`from_pretrained` build swapformer models without `trust_remote_code`. It does nothing else: no import
hooks, no wrapping of transformers' functions. The other subpackages (`hub_cards`, `training`, `cli`,
...) load on first attribute access (PEP 562). The `swapformer` command answers `--help` and `--version`
without importing this package (swapformer_command.py).
"""

from __future__ import annotations

import importlib

from . import auto, modeling
from .configuration import (
    BACKENDS,
    PER_LAYER_BACKEND,
    DecoderConfig,
    EncoderConfig,
    Seq2SeqConfig,
    SwapformerConfig,
    capability_table_markdown,
)
from .conversion import convert, stretch
from .modeling import *  # noqa: F403  (the models, caches and CPU routes: modeling.__all__)

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "PER_LAYER_BACKEND",
    "capability_table_markdown",
    "SwapformerConfig",
    "EncoderConfig",
    "DecoderConfig",
    "Seq2SeqConfig",
    "convert",
    "stretch",
    *modeling.__all__,  # noqa: F405
]
# subpackages loaded on first access (`swapformer.hub_cards`), as an explicit import would
_SUBPACKAGES = ("chunking", "cli", "hub_cards", "metrics", "training", "visualize")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBPACKAGES})


def register() -> None:
    """Register every swapformer config and model with transformers' Auto classes. Importing swapformer
    already did; calling it again changes nothing."""
    auto.register_all()


register()
