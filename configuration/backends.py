"""What each attention backend can do, as data.

The table is read when a config is built with `attn_implementation=...` and when a model chooses its
backend (`from_config`, `from_pretrained`, `set_attn_implementation`). An impossible combination
fails there, naming the backend, the feature and what to use instead. No backend silently falls back
to another and none silently drops a mask. Facts that only the batch can reveal (a padding mask
handed to `sdpa_fa`, gradients through flex on CPU, attention dropout in a training forward on flex, a
forward traced by torch.compile or torch.export) fail in the forward with the same kind of message.

Torch-free on purpose: pure data plus checks over config values. Checks that need torch (the device
of the weights, installed kernels) live in `modeling/attention.py`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

PATTERNS = ("full", "sliding", "sliding_global", "bigbird")
# layer type (config) -> pattern kind (mask)
LAYER_TYPE_PATTERN = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "sliding_global_attention": "sliding_global",
    "bigbird_attention": "bigbird",
}
PER_LAYER_BACKEND = "swapformer_per_layer"

# Every feature, in the order of the README table.
FEATURES = (
    "patterns",
    "causal",
    "bidirectional",
    "cross_attention",
    "padding",
    "packing",
    "custom_mask",
    "gqa",
    "latent_attention",
    "dropout",
    "position_bias",
    "linformer",
    "output_attentions",
    "kv_cache",
    "backward",
    "sinks",
    "compile",
    "devices",
    "dtypes",
)


@dataclass(frozen=True)
class Capabilities:
    patterns: tuple[str, ...] = PATTERNS
    causal: bool = True
    bidirectional: bool = True
    cross_attention: bool = True
    padding: bool = True
    packing: bool = True  # several sequences per row kept apart (restarting position_ids, cu_seq_lens_*)
    # a 4D attention_mask (batch, 1, query, key) of any pattern: the backend applies a dense or per-block
    # mask evaluated from the pattern (modeling/masks.py), not only padding and kernel arguments
    custom_mask: bool = True
    gqa: bool = True
    # multi-head latent attention (DecoderConfig.kv_lora_rank): per-head keys wider than the values
    latent_attention: bool = True
    dropout: bool = True
    position_bias: bool = True  # additive score biases: ALiBi, T5 relative bias
    # Linformer's projected keys and values (config.linformer_k, modeling/linformer.py): dense attention
    # over linformer_k rows without a mask, padding zeroed before the projection
    linformer: bool = True
    # "native": the kernel returns the weights; "recomputed": swapformer recomputes them for the layers
    # asked, in chunks of queries, with eager's math
    output_attentions: str = "native"
    kv_cache: bool = True
    backward: tuple[str, ...] = ("cpu", "cuda")  # devices where gradients flow
    # learned attention sinks (config.attention_sinks): a logit per head in the softmax denominator
    sinks: bool = True
    no_sinks: str = ""  # why not, when `sinks` is False
    # devices where a model on this backend runs inside torch.compile(fullgraph=True) and torch.export,
    # and why not elsewhere (checked in the forward that runs compiled: only it knows)
    compile: tuple[str, ...] = ("cpu", "cuda")
    no_compile: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    needs: str = ""  # an optional package (its import name), checked when chosen
    install: str = ""  # the command that installs `needs`
    full_layers_as: str = ""  # the backend that runs this one's full_attention layers
    note: str = ""


BACKENDS: dict[str, Capabilities] = {
    "eager": Capabilities(note="the reference every backend is tested against; O(n^2) dense mask"),
    "sdpa": Capabilities(
        output_attentions="recomputed",
        note="torch SDPA with a dense boolean/additive mask: O(n^2) mask, fused kernel",
    ),
    "sparse": Capabilities(
        output_attentions="recomputed",
        full_layers_as="sdpa",
        compile=(),
        no_compile="it sizes its block layout from the data; its full_attention layers run as sdpa and do compile",
        note="block-sparse in PyTorch, with native fp32 CPU kernels for inference: skips masked blocks, O(n * (window + globals + random)); full layers run as sdpa",
    ),
    "flex_attention": Capabilities(
        dropout=False,
        position_bias=False,
        linformer=False,
        output_attentions="recomputed",
        backward=("cuda",),
        compile=("cuda",),
        no_compile="torch inductor cannot lower flex attention inside a compiled model on CPU (flex compiles its own "
        "kernel when the model runs uncompiled)",
        sinks=False,
        no_sinks="the sink needs each row's log-sum-exp, which transformers' flex function returns only on CUDA "
        "(its s_aux path, not wired into swapformer), or one more key, which the BlockMask built from the pattern "
        "does not have",
        note="torch flex_attention with the pattern as a BlockMask; compiled on first use (~15 s on CPU); "
        "attention_dropout applies only in training, which flex refuses; Linformer layers are not wired to it "
        "(their projected rows have no token pattern to lower)",
    ),
    "flash_attention_2": Capabilities(
        patterns=("full", "sliding"),
        custom_mask=False,  # the kernel takes a padding mask or varlen boundaries, not a mask per pair
        position_bias=False,
        latent_attention=False,  # flash-attn's kernels take one head width for q, k and v
        output_attentions="recomputed",
        devices=("cuda",),
        backward=("cuda",),
        dtypes=("float16", "bfloat16"),
        compile=(),
        no_compile="transformers' flash path unpads padded batches with data-dependent sizes",
        sinks=False,
        no_sinks="the flash-attn package's kernels take no sink logit and return no log-sum-exp to rescale by",
        needs="flash_attn",
        install="pip install 'swapformer[flash]'",
        note="the flash-attn package (pip install 'swapformer[flash]')",
    ),
    "sdpa_fa": Capabilities(
        patterns=("full",),
        padding=False,
        packing=False,
        custom_mask=False,
        position_bias=False,
        latent_attention=False,  # SDPA's FlashAttention kernel takes one head width for q, k and v
        dropout=True,
        output_attentions="recomputed",
        devices=("cuda",),
        backward=("cuda",),
        compile=("cuda",),
        dtypes=("float16", "bfloat16"),
        sinks=False,
        no_sinks="the sink is one more key every query sees, which needs a mask, and this kernel takes none",
        note="torch SDPA pinned to its FlashAttention kernel, for CUDA machines without flash-attn; no masks but causality",
    ),
}


# How a refusal names a feature, where its column name is not enough.
DESCRIPTIONS = {
    "linformer": "Linformer's projected keys and values (linformer_k)",
    "custom_mask": "a 4D attention_mask (batch, 1, query, key)",
}


def runs_everything(caps: Capabilities) -> bool:
    """Every pattern and every yes/no feature of the table."""
    return caps.patterns == PATTERNS and all(getattr(caps, f) is not False for f in FEATURES)


# Names transformers knows that swapformer does not run: why, and which rows to offer instead.
UNSUPPORTED = {
    "flash_attention_3": ("FlashAttention 3 is not wired into swapformer", lambda c: c.devices == ("cuda",)),
    "flash_attention_4": ("FlashAttention 4 is not wired into swapformer", lambda c: c.devices == ("cuda",)),
    "paged|eager": ("paged attention is not supported", runs_everything),
}


def capable(has: Callable[[Capabilities], bool], device: str | None = None) -> list[str]:
    """The backends whose row satisfies `has` (and that run on `device`, when given), in table order."""
    return [n for n, c in BACKENDS.items() if has(c) and (device is None or device in c.devices)]


def has_feature(caps: Capabilities, feature: str) -> bool:
    """A yes/no column of the table, or `pattern:<kind>` for one pattern kind."""
    if feature.startswith("pattern:"):
        return feature.removeprefix("pattern:") in caps.patterns
    return bool(getattr(caps, feature))


def check_backend_name(name, where: str = "") -> str:
    """Return `name` if swapformer runs it, else raise a ValueError that says what to use.

    Worded as transformers' own models word it (`PreTrainedModel.get_correct_attn_implementation`,
    same type, same opening), followed by swapformer's names; `where` ends it (which mapping entry)."""
    if name in BACKENDS or name == PER_LAYER_BACKEND:
        return name
    opening = f"Specified `attn_implementation={_quoted(name)}` is not supported"
    if name in UNSUPPORTED:
        reason, offered = UNSUPPORTED[name]
        raise ValueError(f"{opening}: {reason}; use {_names(capable(offered))}{where}")
    names = ", ".join(
        f"`{_quoted(n)}`" if i else f"`attn_implementation={_quoted(n)}`" for i, n in enumerate(BACKENDS)
    )
    raise ValueError(
        f"{opening}. The only possible arguments are {names}, or a {{layer type: backend}} mapping such as "
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


def check_backend_for_config(name: str, config) -> None:
    """Raise if backend `name` (or each backend of a per-layer mapping) cannot compute `config`'s model."""
    check_backend_name(name)
    layer_types = dict.fromkeys(config._all_layer_types())
    if name == PER_LAYER_BACKEND:
        pairs = [(t, config._attn_layer_backends[t]) for t in layer_types]
    else:
        pairs = [(t, name) for t in layer_types]
    needs = [feature for feature, needed in model_needs(config).items() if needed]
    for layer_type, backend in pairs:
        pattern = LAYER_TYPE_PATTERN[layer_type]
        require(backend, f"pattern:{pattern}", f"{pattern!r} attention ({layer_type} layers)")
        for feature in needs:
            require(backend, feature, _described(backend, feature))


def _described(backend: str, feature: str) -> str:
    """A feature as a refusal names it; learned sinks with the reason this backend lacks them."""
    if feature == "sinks":
        return f"learned attention sinks (attention_sinks=True: {BACKENDS[backend].no_sinks or 'not in its row'})"
    return DESCRIPTIONS.get(feature, feature)


def check_batch_feature(backend: str, feature: str, description: str) -> None:
    """Refuse a batch that needs `feature` (a `Capabilities` flag) which `backend` lacks: facts only the
    inputs reveal (packed sequences), checked in the forward with the same message as at choice time."""
    require(backend, feature, description, needed_by="this batch")


def require(backend: str, feature: str, description: str, needed_by: str = "this model") -> None:
    """Raise the table's refusal when `backend`'s row lacks `feature` (see `has_feature`), naming every
    backend whose row has it."""
    if not has_feature(BACKENDS[backend], feature):
        alternatives = capable(lambda c: has_feature(c, feature))
        raise ValueError(
            f"attn_implementation={backend!r} does not support {description}, which {needed_by} needs; "
            f"use one of {', '.join(map(repr, alternatives))}"
        )


def check_backend_available(name: str, config, *, cuda: bool, weight_devices: set[str]) -> None:
    """Checks made when a model is put on backend `name` (each backend of a mapping): `config`'s needs,
    the optional package, a device it runs on, the device of the weights (`weight_devices`, empty while
    the model is being built, as transformers skips it then). The torch facts come from the caller."""
    check_backend_for_config(name, config)
    backends = sorted(set(config._attn_layer_backends.values())) if name == PER_LAYER_BACKEND else [name]
    available = {"cpu", "cuda"} if cuda else {"cpu"}
    for backend in backends:
        caps = BACKENDS[backend]
        if not _installed(caps):
            where = next((d for d in caps.devices if d in available), caps.devices[0])
            raise ValueError(
                f"attn_implementation={backend!r} needs the {caps.needs} package, which is not installed: "
                f"{caps.install} on a {_devices(caps.devices)} machine, or use "
                f"{_names(replacements(backend, config, where))}"
            )
        if not available & set(caps.devices):
            raise ValueError(
                f"attn_implementation={backend!r} runs on {_devices(caps.devices)} only and no "
                f"{_devices(caps.devices)} device is available; use {_names(replacements(backend, config, 'cpu'))}"
            )
        for device in sorted(weight_devices - set(caps.devices)):
            raise ValueError(
                f"attn_implementation={backend!r} does not run on device {device!r} (it runs on "
                f"{', '.join(caps.devices)}); move the model first or use "
                f"{_names(replacements(backend, config, device))}"
            )


def replacements(backend: str, config, device: str) -> list[str]:
    """Backends that can stand in for `backend` on `device`: installed, computing `config`'s model there
    forward and backward. Those made for the same devices as `backend` come first, then table order."""

    def fits(name: str) -> bool:
        caps = BACKENDS[name]
        if (
            name == backend
            or not _installed(caps)
            or device not in caps.devices
            or device not in caps.backward
        ):
            return False
        try:
            check_backend_for_config(name, config)
        except ValueError:
            return False
        return True

    same = [n for n in BACKENDS if fits(n) and BACKENDS[n].devices == BACKENDS[backend].devices]
    return same + [n for n in BACKENDS if fits(n) and n not in same]


def _installed(caps: Capabilities) -> bool:
    return not caps.needs or importlib.util.find_spec(caps.needs) is not None


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


def _names(backends: list[str]) -> str:
    quoted = [repr(n) for n in backends]
    if not quoted:
        return "no other backend"
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def capability_table_markdown() -> str:
    """The backend x feature table, as Markdown (the README's copy is generated from this)."""
    head = "| backend | " + " | ".join(f.replace("_", " ") for f in FEATURES) + " |"
    rule = "|" + "---|" * (len(FEATURES) + 1)
    rows = []
    for name, caps in BACKENDS.items():
        cells = []
        for feature in FEATURES:
            value = getattr(caps, feature)
            if isinstance(value, bool):
                cells.append("yes" if value else "no")
            elif isinstance(value, tuple):
                cells.append(", ".join(value) if value else "none")
            else:
                cells.append(str(value))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    notes = [
        f"- `{name}`: "
        + "; ".join(
            filter(
                None,
                (
                    caps.note,
                    caps.no_compile and f"not compiled: {caps.no_compile}",
                    caps.no_sinks and f"no sinks: {caps.no_sinks}",
                ),
            )
        )
        for name, caps in BACKENDS.items()
        if caps.note or caps.no_compile or caps.no_sinks
    ]
    notes.append(
        "- compile: the devices where the model runs inside `torch.compile(fullgraph=True)` and `torch.export` "
        "(tested on CPU; the CUDA entries are not run by this project's CPU-only tests)"
    )
    return "\n".join([head, rule, *rows, "", *notes])
