"""The checks and refusals of the capability table (`capability_table.py`: what each backend can do).

The table is read when a config is built with `attn_implementation=...` and when a model chooses its
backend (`from_config`, `from_pretrained`, `set_attn_implementation`). An impossible combination
fails there, naming the backend, the feature and what to use instead. No backend silently falls back
to another and none silently drops a mask. Facts that only the batch can reveal (a padding mask
handed to `sdpa_fa`, gradients through flex on CPU, attention dropout in a training forward on flex, a
forward traced by torch.compile or torch.export) fail in the forward with the same kind of message.

Torch-free on purpose: checks over the table and config values. Checks that need torch (the device
of the weights, installed kernels) live in `modeling/attention/functions.py`.
"""

from __future__ import annotations

from .availability import capable, model_needs, replacements, stand_ins
from .availability import installed as _installed
from .capability_markdown import capability_table_markdown
from .capability_table import (
    AUTO_BACKEND,
    AUTO_STATIC_ORDER,
    BACKENDS,
    DESCRIPTIONS,
    FEATURES,
    HUB_KERNEL,
    LAYER_TYPE_PATTERN,
    PATTERNS,
    PER_LAYER_BACKEND,
    UNSUPPORTED,
    Capabilities,
    runs_everything,
)


def has_feature(caps: Capabilities, feature: str) -> bool:
    """A yes/no column of the table, or `pattern:<kind>` for one pattern kind."""
    if feature.startswith("pattern:"):
        return feature.removeprefix("pattern:") in caps.patterns
    return bool(getattr(caps, feature))


def check_backend_name(name, where: str = "", config=None, devices=None) -> str:
    """Return `name` if swapformer runs it, else raise a ValueError that says what to use here.

    Worded as transformers' own models word it (`PreTrainedModel.get_correct_attn_implementation`,
    same type, same opening), followed by the names of swapformer's backends that run on this machine
    (on `devices`, and compute `config`'s model, when given); `where` ends it (which mapping entry)."""
    if name in BACKENDS or name in (PER_LAYER_BACKEND, AUTO_BACKEND):
        return name
    opening = f"Specified `attn_implementation={_quoted(name)}` is not supported"
    refusal = UNSUPPORTED.get(name) if isinstance(name, str) else None
    if refusal is None and isinstance(name, str) and "/" in name:
        refusal = HUB_KERNEL
    if refusal is not None:
        reason, offered = refusal
        raise ValueError(f"{opening}: {reason}; use {_names(stand_ins(offered, config, devices))}{where}")
    names = ", ".join(
        f"`{_quoted(n)}`" if i else f"`attn_implementation={_quoted(n)}`"
        for i, n in enumerate(stand_ins(lambda c: True, config, devices))
    )
    raise ValueError(
        f"{opening}. The only possible arguments are {names} (those that run on this machine; `swapformer "
        f"backends` shows what the others need), or a {{layer type: backend}} mapping such as "
        f'{{"full_attention": "sdpa", "sliding_attention": "sparse"}}.{where}'
    )


def _quoted(name) -> str:
    return f'"{name}"' if isinstance(name, str) else repr(name)


def check_layer_backends(mapping: dict, layer_types: list[str] | None) -> dict:
    """Validate a {layer type: backend} mapping; every layer type in use must have a backend."""
    for layer_type, backend in mapping.items():
        if layer_type not in LAYER_TYPE_PATTERN:
            raise ValueError(
                f"attn_implementation mapping key {layer_type!r} is not a layer type; use "
                f"{', '.join(map(repr, LAYER_TYPE_PATTERN))}"
            )
        check_backend_name(backend, f" It was given for {layer_type} layers.")
        if backend == PER_LAYER_BACKEND:
            raise ValueError("a per-layer mapping cannot name another mapping")
    if layer_types is not None:
        missing = sorted(set(layer_types) - set(mapping))
        if missing:
            raise ValueError(
                f"attn_implementation mapping {mapping} gives no backend for layer types {missing} used by this model"
            )
    return dict(mapping)


def check_backend_for_config(name: str, config, devices=None) -> None:
    """Raise if backend `name` (or each backend of a per-layer mapping) cannot compute `config`'s model."""
    check_backend_name(name, config=config, devices=devices)
    layer_types = dict.fromkeys(config._all_layer_types())
    if name == PER_LAYER_BACKEND:
        pairs = [(t, config._attn_layer_backends[t]) for t in layer_types]
    else:
        pairs = [(t, name) for t in layer_types]
    needs = [feature for feature, needed in model_needs(config).items() if needed]
    for layer_type, backend in pairs:
        if backend == AUTO_BACKEND:  # chooses per forward among the backends these checks accept
            continue
        pattern = LAYER_TYPE_PATTERN[layer_type]
        require(
            backend, f"pattern:{pattern}", f"{pattern!r} attention ({layer_type} layers)", devices=devices
        )
        for feature in needs:
            require(backend, feature, _described(backend, feature), devices=devices)


def _described(backend: str, feature: str) -> str:
    """A feature as a refusal names it; learned sinks with the reason this backend lacks them."""
    if feature == "sinks":
        return f"learned attention sinks (attention_sinks=True: {BACKENDS[backend].no_sinks or 'not in its row'})"
    return DESCRIPTIONS.get(feature, feature)


def check_batch_feature(backend: str, feature: str, description: str) -> None:
    """Refuse a batch that needs `feature` (a `Capabilities` flag) which `backend` lacks: facts only the
    inputs reveal (packed sequences), checked in the forward with the same message as at choice time."""
    require(backend, feature, description, needed_by="this batch")


def require(
    backend: str, feature: str, description: str, needed_by: str = "this model", devices=None
) -> None:
    """Raise the table's refusal when `backend`'s row lacks `feature` (see `has_feature`), naming every
    backend whose row has it and that runs on this machine."""
    if not has_feature(BACKENDS[backend], feature):
        alternatives = capable(lambda c: has_feature(c, feature), devices=devices)
        raise ValueError(
            f"attn_implementation={backend!r} does not support {description}, which {needed_by} needs; "
            f"use one of {', '.join(map(repr, alternatives))}"
        )


def check_backend_available(name: str, config, *, cuda: bool, weight_devices: set[str]) -> None:
    """Checks made when a model is put on backend `name` (each backend of a mapping): `config`'s needs,
    the optional package, a device it runs on, the device of the weights (`weight_devices`, empty while
    the model is being built, as transformers skips it then). The torch facts come from the caller."""
    available = {"cpu", "cuda"} if cuda else {"cpu"}
    target = weight_devices or available  # where the model runs: its weights', or anywhere here while built
    check_backend_for_config(name, config, target)
    backends = sorted(set(config._attn_layer_backends.values())) if name == PER_LAYER_BACKEND else [name]
    for backend in (b for b in backends if b != AUTO_BACKEND):
        caps = BACKENDS[backend]
        # the device first: on a machine without one, installing the package would not help
        if not available & set(caps.devices):
            raise ValueError(
                f"attn_implementation={backend!r} runs on {_devices(caps.devices)} only and no "
                f"{_devices(caps.devices)} device is available; use {_names(replacements(backend, config, 'cpu'))}"
            )
        if not _installed(caps):
            where = next((d for d in caps.devices if d in target), min(target))
            raise ValueError(
                f"attn_implementation={backend!r} needs the {caps.needs} package, which is not installed: "
                f"{caps.install}, or use {_names(replacements(backend, config, where))}"
            )
        for device in sorted(weight_devices - set(caps.devices)):
            raise ValueError(
                f"attn_implementation={backend!r} does not run on device {device!r} (it runs on "
                f"{', '.join(caps.devices)}); move the model first or use "
                f"{_names(replacements(backend, config, device))}"
            )


def _devices(devices: tuple[str, ...]) -> str:
    return " or ".join(d.upper() for d in devices)


def check_backend_for_forward(
    backend: str, kind: str, config, device: str, *, training: bool, needs_grad: bool, compiling: bool
) -> None:
    """Facts only the forward knows: training, gradients, the device of the batch, torch.compile.

    Args:
        kind: the pattern of the layers (`sparse` runs full layers as sdpa).
        needs_grad: gradients are being recorded (training under torch.no_grad() is inference).
        compiling: the forward runs inside torch.compile or torch.export.
    """
    caps = BACKENDS[backend]
    if training and needs_grad and device not in caps.backward:
        can = capable(lambda c: device in c.backward, device)
        raise ValueError(
            f"attn_implementation={backend!r} cannot train on {device.upper()} (it has no backward there); call "
            f"model.eval() or run under torch.no_grad() for inference, or use {_names(can)} to train"
        )
    if training and config.attention_dropout > 0 and not caps.dropout:
        can = capable(lambda c: c.dropout, device)
        raise ValueError(
            f"attn_implementation={backend!r} cannot apply attention_dropout={config.attention_dropout} in training; "
            f"call model.eval() for inference (dropout is off there), set attention_dropout=0.0, or train with "
            f"{_names(can)}"
        )
    if compiling and not compiles(backend, kind, device):
        can = capable(lambda c: device in c.compile, device)
        raise ValueError(
            f"attn_implementation={backend!r} cannot run inside torch.compile(fullgraph=True) or torch.export on "
            f"{device} ({kind!r} layers): {caps.no_compile}. Compile with {_names(can)} (the same function), or "
            f"run {backend!r} uncompiled"
        )


def compiles(backend: str, kind: str, device: str) -> bool:
    """Whether `backend` runs `kind` layers on `device` inside torch.compile(fullgraph=True) / export."""
    caps = BACKENDS[backend]
    if kind == "full" and caps.full_layers_as:
        caps = BACKENDS[caps.full_layers_as]
    return device in caps.compile


# The facts `check_backend_for_forward` checks, as sets a forward reads without calling into this module
# (modeling/core/layers.py: check_backend_for_batch); the refusal and its words stay above.
TRAINS_ON = frozenset((name, device) for name, caps in BACKENDS.items() for device in caps.backward)
APPLIES_DROPOUT = frozenset(name for name, caps in BACKENDS.items() if caps.dropout)
COMPILES_ON = frozenset(
    (name, kind, device)
    for name in BACKENDS
    for kind in PATTERNS
    for device in {d for caps in BACKENDS.values() for d in caps.compile}
    if compiles(name, kind, device)
)


def _names(backends: list[str]) -> str:
    quoted = [repr(n) for n in backends]
    if not quoted:
        return "no other backend"
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


__all__ = [
    "APPLIES_DROPOUT",
    "AUTO_BACKEND",
    "AUTO_STATIC_ORDER",
    "BACKENDS",
    "COMPILES_ON",
    "DESCRIPTIONS",
    "FEATURES",
    "LAYER_TYPE_PATTERN",
    "PATTERNS",
    "PER_LAYER_BACKEND",
    "TRAINS_ON",
    "UNSUPPORTED",
    "Capabilities",
    "capability_table_markdown",
    "runs_everything",
    "capable",
    "stand_ins",
    "check_backend_available",
    "check_backend_for_config",
    "check_backend_for_forward",
    "check_backend_name",
    "check_batch_feature",
    "check_layer_backends",
    "compiles",
    "has_feature",
    "model_needs",
    "replacements",
    "require",
]
