"""swapformer: Hugging Face-compatible Transformers whose attention backend you can swap.

Importing the package registers its configs and models with transformers' Auto classes, so
`AutoModel*.from_config` / `from_pretrained` build swapformer models without `trust_remote_code`.

The import itself is light (no torch, no transformers), so that `swapformer --help` answers at once:
the public names below are loaded on first use (PEP 562), and the Auto registration runs as soon as
transformers is imported, by whoever imports it, or right away if it already was. Either way it has
happened before any transformers Auto class can be used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the subpackage that defines it
_LAZY = {
    **dict.fromkeys(
        (
            "BACKENDS",
            "PER_LAYER_BACKEND",
            "capability_table_markdown",
            "SwapformerConfig",
            "EncoderConfig",
            "DecoderConfig",
            "Seq2SeqConfig",
        ),
        "configuration",
    ),
    "convert": "conversion",
    "stretch": "conversion",
    **dict.fromkeys(
        (
            "SwapformerPreTrainedModel",
            "EncoderModel",
            "EncoderForMaskedLM",
            "EncoderForSequenceClassification",
            "EncoderForTokenClassification",
            "EncoderForQuestionAnswering",
            "DecoderModel",
            "DecoderForCausalLM",
            "DecoderForSequenceClassification",
            "Seq2SeqModel",
            "Seq2SeqForConditionalGeneration",
            "Int8Cache",
            "int8_cache",
            "cpu_linear",
            "cpu_linear_route",
            "sparse_cpu",
            "sparse_cpu_route",
        ),
        "modeling",
    ),
}
_SUBPACKAGES = (
    "auto",
    "chunking",
    "cli",
    "configuration",
    "conversion",
    "hub_cards",
    "metrics",
    "modeling",
    "training",
    "visualize",
)

__all__ = list(_LAZY)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these come from __getattr__
    from .configuration import (  # noqa: F401
        BACKENDS,
        PER_LAYER_BACKEND,
        DecoderConfig,
        EncoderConfig,
        Seq2SeqConfig,
        SwapformerConfig,
        capability_table_markdown,
    )
    from .conversion import convert, stretch  # noqa: F401
    from .modeling import (  # noqa: F401
        DecoderForCausalLM,
        DecoderForSequenceClassification,
        DecoderModel,
        EncoderForMaskedLM,
        EncoderForQuestionAnswering,
        EncoderForSequenceClassification,
        EncoderForTokenClassification,
        EncoderModel,
        Int8Cache,
        Seq2SeqForConditionalGeneration,
        Seq2SeqModel,
        SwapformerPreTrainedModel,
        cpu_linear,
        cpu_linear_route,
        int8_cache,
        sparse_cpu,
        sparse_cpu_route,
    )


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES})


# Auto registration -------------------------------------------------------------------------------

_lock = threading.RLock()
_registered = False


def register() -> None:
    """Register every swapformer config and model with transformers' Auto classes (idempotent; runs
    by itself as described in the module docstring)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True  # set first: the imports below come back through _RegisterOnImport
        try:
            from . import auto

            auto.register_all()
        except BaseException:
            _registered = False
            raise
    _RegisterOnImport.remove()


def _initializing(module) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Runs `register()` once transformers is imported and no swapformer module is half-imported.

    The registration imports swapformer's configs and models, which import transformers: run in the
    middle of one of those imports, it would meet a partially initialised module. So it waits for the
    last of them to finish. It hooks only `transformers` and `swapformer.*`: it finds their spec with
    the other finders and wraps the `exec_module` of that one module's loader (instance attribute,
    removed after use; the loader keeps its type).
    """

    @classmethod
    def install(cls) -> None:
        if not any(isinstance(f, cls) for f in sys.meta_path):
            sys.meta_path.insert(0, cls())

    @classmethod
    def remove(cls) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, cls)]

    def find_spec(self, name, path=None, target=None):
        if name != "transformers" and not name.startswith(__name__ + "."):
            return None
        for finder in list(sys.meta_path):
            if isinstance(finder, type(self)) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module") or "exec_module" in vars(loader):
            return spec
        original = loader.exec_module

        def exec_module(module):
            try:
                original(module)
            finally:
                vars(loader).pop("exec_module", None)
            if module.__name__ == name:
                _register_when_ready(finished=name)

        loader.exec_module = exec_module
        return spec


def _register_when_ready(finished: str) -> None:
    if _registered or "transformers" not in sys.modules:
        return
    busy = [
        n
        for n, m in list(sys.modules.items())
        if n != finished and (n == "transformers" or n.startswith(__name__ + ".")) and _initializing(m)
    ]
    if not busy:
        register()


if "transformers" in sys.modules:
    register()  # transformers came first: register now, as the eager import always did
else:
    _RegisterOnImport.install()
