"""No module but the touch-point ledgers reaches into a dependency beyond its documented public API.

The ledgers (modeling/compat/hf_compat.py for transformers, modeling/compat/torch_compat.py, modeling/compat/accelerate_compat.py)
hold every such name with a contract test (test_hf_compat.py, test_compat.py), so a release that moves one
fails in one place, naming it. This test reads the source of everything the package ships, and of the
examples, benchmarks and scripts, and lists each import or attribute that is not public; it fails on
any outside the ledgers. Tests themselves may import internals: they are the references.

Public means: the package's top level, a name whose dotted path has no segment starting with "_", in a
module the package documents for users (the table below); everything else is the ledgers' business.
"""

from __future__ import annotations

import ast

import pytest

from conftest import ROOT

SCANNED = (
    "swapformer",
    "configuration",
    "modeling",
    "conversion",
    "training",
    "hub_cards",
    "examples",
    "benchmarks",
    "scripts",
)
LEDGERS = {
    "modeling/compat/hf_compat.py",
    "modeling/compat/torch_compat.py",
    "modeling/compat/accelerate_compat.py",
}
PACKAGES = ("torch", "transformers", "accelerate", "peft", "tokenizers", "evaluate", "huggingface_hub")

# Documented submodules beyond the top level: None = every public name in it, else the names documented.
# torch documents its whole namespace except "_"-prefixed names, so only the underscore rule applies to it.
PUBLIC_MODULES: dict[str, frozenset[str] | None] = {
    "transformers.modeling_outputs": None,  # "Model outputs" reference page
    "transformers.utils.logging": None,  # "Logging" reference page
    "transformers.utils": frozenset({"logging", "ModelOutput"}),
    "accelerate.utils": frozenset({"set_seed", "gather_object", "broadcast_object_list", "DistributedType"}),
    "huggingface_hub.errors": None,  # "Errors" reference page
    "huggingface_hub.utils": frozenset({"validate_repo_id"}),  # "Utilities": validators
    **{
        f"tokenizers.{m}": None
        for m in ("decoders", "models", "normalizers", "pre_tokenizers", "processors", "trainers")
    },
}
# Attributes of torch modules every nn.Module has but torch keeps private (no public reader)
MODULE_INTERNALS = {
    "_parameters",
    "_buffers",
    "_modules",
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_public(module: str, name: str | None) -> bool:
    """Whether importing `name` from `module` (or `module` itself when name is None) is public."""
    parts = module.split(".")
    if any(_private(p) for p in parts) or (name is not None and _private(name)):
        return False
    if parts[0] == "torch" or len(parts) == 1:
        return True
    if module in PUBLIC_MODULES:
        names = PUBLIC_MODULES[module]
        return name is None or names is None or name in names
    return False


def violations(source: str, label: str) -> list[str]:
    """`label:line: what` for each non-public dependency name `source` uses."""
    tree = ast.parse(source, filename=label)
    roots: dict[str, str] = {}  # local name -> the dotted dependency path it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in PACKAGES:
                    continue
                if not _module_public(alias.name, None):
                    found.append((node.lineno, f"import {alias.name}"))
                local = alias.asname or alias.name.split(".")[0]
                roots[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                torch_submodule = dotted.startswith("torch.") and _module_public(dotted, None)
                if not (_module_public(node.module, alias.name) or torch_submodule):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                roots[alias.asname or alias.name] = dotted
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in MODULE_INTERNALS:
            found.append((node.lineno, f"nn.Module internal .{node.attr}"))
        if id(node) in inner:  # only whole chains: `torch._C.f`, not also `torch._C`
            continue
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.insert(0, base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in roots and any(_private(p) for p in chain):
            found.append((node.lineno, f"{roots[base.id]}.{'.'.join(chain)}"))
    return [f"{label}:{line}: {what}" for line, what in found]


def _files():
    for folder in SCANNED:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_private_dependency_names_live_only_in_the_ledgers():
    found = []
    for path in _files():
        if str(path.relative_to(ROOT)) not in LEDGERS:
            found += violations(path.read_text(), str(path.relative_to(ROOT)))
    found = sorted(set(found))
    assert not found, (
        "private names of a dependency used outside the touch-point ledgers (move each into "
        "modeling/compat/hf_compat.py, torch_compat.py or accelerate_compat.py with a contract test):\n  "
        + "\n  ".join(found)
    )


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "from transformers.cache_utils import DynamicLayer",
            "from transformers.cache_utils import DynamicLayer",
        ),
        ("import torch\ntorch._C._get_mkldnn_enabled()", "torch._C._get_mkldnn_enabled"),
        (
            "from torch import nn\nnn.modules.module._global_forward_hooks",
            "torch.nn.modules.module._global_forward_hooks",
        ),
        ("import torch.nn.functional as F\nF._canonical_mask", "torch.nn.functional._canonical_mask"),
        (
            "from accelerate.utils import is_msamp_available",
            "from accelerate.utils import is_msamp_available",
        ),
        ("from accelerate.state import AcceleratorState\nAcceleratorState._reset_state()", "_reset_state"),
        ("m._parameters['weight'] = w", "nn.Module internal ._parameters"),
        ("from torch.utils._python_dispatch import f", "from torch.utils._python_dispatch import f"),
    ],
)
def test_the_scan_finds_each_kind(source, expected):
    found = violations(source, "probe.py")
    assert any(expected in f for f in found), found


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nimport torch.nn.functional as F\nF.linear",
        "from transformers import DynamicCache, GenerationMixin",
        "from transformers.modeling_outputs import BaseModelOutput",
        "from transformers.utils import logging",
        "from accelerate.utils import set_seed",
        "from torch.utils.cpp_extension import load",
        "from torch.nn.attention import flex_attention",
        "from tokenizers import Tokenizer, models",
        "import torch\ntorch.backends.mkldnn.is_available()",
        "class A:\n    def f(self):\n        return self.__class__.__name__",
    ],
)
def test_the_scan_passes_public_names(source):
    assert violations(source, "probe.py") == []
