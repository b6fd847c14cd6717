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
    "gqa",
    "dropout",
    "position_bias",
    "output_attentions",
    "kv_cache",
    "backward",
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
    gqa: bool = True
    dropout: bool = True
    position_bias: bool = True  # additive score biases: ALiBi, T5 relative bias
    # "native": the kernel returns the weights; "recomputed": swapformer recomputes them for the layers
    # asked, in chunks of queries, with eager's math
    output_attentions: str = "native"
    kv_cache: bool = True
    backward: tuple[str, ...] = ("cpu", "cuda")  # devices where gradients flow
    # devices where a model on this backend runs inside torch.compile(fullgraph=True) and torch.export,
    # and why not elsewhere (checked in the forward that runs compiled: only it knows)
    compile: tuple[str, ...] = ("cpu", "cuda")
    no_compile: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    needs: str = ""  # an optional package, checked when chosen
    note: str = ""


BACKENDS: dict[str, Capabilities] = {
    "eager": Capabilities(note="the reference every backend is tested against; O(n^2) dense mask"),
    "sdpa": Capabilities(
        output_attentions="recomputed",
        note="torch SDPA with a dense boolean/additive mask: O(n^2) mask, fused kernel",
    ),
    "sparse": Capabilities(
        output_attentions="recomputed",
        compile=(),
        no_compile="it sizes its block layout from the data; its full_attention layers run as sdpa and do compile",
        note="block-sparse in plain PyTorch: skips masked blocks, O(n * (window + globals + random)); full layers run as sdpa",
    ),
    "flex_attention": Capabilities(
        dropout=False,
        position_bias=False,
        output_attentions="recomputed",
        backward=("cuda",),
        compile=("cuda",),
        no_compile="torch inductor cannot lower flex attention inside a compiled model on CPU (flex compiles its own "
        "kernel when the model runs uncompiled)",
        note="torch flex_attention with the pattern as a BlockMask; compiled on first use (~15 s on CPU); "
        "attention_dropout applies only in training, which flex refuses",
    ),
    "flash_attention_2": Capabilities(
        patterns=("full", "sliding"),
        position_bias=False,
        output_attentions="recomputed",
        devices=("cuda",),
        backward=("cuda",),
        dtypes=("float16", "bfloat16"),
        compile=(),
        no_compile="transformers' flash path unpads padded batches with data-dependent sizes",
        needs="flash_attn",
        note="the flash-attn package (pip install 'swapformer[flash]')",
    ),
    "sdpa_fa": Capabilities(
        patterns=("full",),
        padding=False,
        packing=False,
        position_bias=False,
        dropout=True,
        output_attentions="recomputed",
        devices=("cuda",),
        backward=("cuda",),
        compile=("cuda",),
        dtypes=("float16", "bfloat16"),
        note="torch SDPA pinned to its FlashAttention kernel, for CUDA machines without flash-attn; no masks but causality",
    ),
}

# Names transformers knows that swapformer does not run, with what to use instead.
UNSUPPORTED = {
    "flash_attention_3": "FlashAttention 3 is not wired into swapformer; use 'flash_attention_2' or 'sdpa_fa'",
    "flash_attention_4": "FlashAttention 4 is not wired into swapformer; use 'flash_attention_2' or 'sdpa_fa'",
    "paged|eager": "paged attention is not supported; use 'eager' or 'sdpa'",
}


def check_backend_name(name, where: str = "") -> str:
    """Return `name` if swapformer runs it, else raise a ValueError that says what to use.

    Worded as transformers' own models word it (`PreTrainedModel.get_correct_attn_implementation`,
    same type, same opening), followed by swapformer's names; `where` ends it (which mapping entry)."""
    if name in BACKENDS or name == PER_LAYER_BACKEND:
        return name
    opening = f"Specified `attn_implementation={_quoted(name)}` is not supported"
    if name in UNSUPPORTED:
        raise ValueError(f"{opening}: {UNSUPPORTED[name]}{where}")
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


def check_backend_for_config(name: str, config) -> None:
    """Raise if backend `name` (or each backend of a per-layer mapping) cannot compute `config`'s model."""
    check_backend_name(name)
    if name == PER_LAYER_BACKEND:
        pairs = [(t, config._attn_layer_backends[t]) for t in dict.fromkeys(config._all_layer_types())]
    else:
        pairs = [(t, name) for t in dict.fromkeys(config._all_layer_types())]
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    causal = bool(getattr(config, "causal", False))
    for layer_type, backend in pairs:
        caps = BACKENDS[backend]
        pattern = LAYER_TYPE_PATTERN[layer_type]
        if pattern not in caps.patterns:
            _refuse(
                backend, f"{pattern!r} attention ({layer_type} layers)", lambda c, p=pattern: p in c.patterns
            )
        needs = {
            "gqa": config.num_key_value_heads != config.num_attention_heads,
            "position_bias": config.position_embedding_type in ("alibi", "relative_bias"),
            "causal": causal,
            "bidirectional": not causal or encoder_decoder,
            "cross_attention": encoder_decoder,
        }
        for feature, needed in needs.items():
            if needed and not getattr(caps, feature):
                _refuse(backend, feature, lambda c, f=feature: getattr(c, f))


def check_batch_feature(backend: str, feature: str, description: str) -> None:
    """Refuse a batch that needs `feature` (a `Capabilities` flag) which `backend` lacks: facts only the
    inputs reveal (packed sequences), checked in the forward with the same message as at choice time."""
    if not getattr(BACKENDS[backend], feature):
        _refuse(backend, description, lambda c: getattr(c, feature), needed_by="this batch")


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
        can = [n for n, c in BACKENDS.items() if device in c.backward and device in c.devices]
        raise ValueError(
            f"attn_implementation={backend!r} cannot train on {device.upper()} (it has no backward there); call "
            f"model.eval() or run under torch.no_grad() for inference, or use {_names(can)} to train"
        )
    if training and config.attention_dropout > 0 and not caps.dropout:
        can = [n for n, c in BACKENDS.items() if c.dropout and device in c.devices]
        raise ValueError(
            f"attn_implementation={backend!r} cannot apply attention_dropout={config.attention_dropout} in training; "
            f"call model.eval() for inference (dropout is off there), set attention_dropout=0.0, or train with "
            f"{_names(can)}"
        )
    if compiling and not compiles(backend, kind, device):
        can = [n for n, c in BACKENDS.items() if device in c.compile and device in c.devices]
        raise ValueError(
            f"attn_implementation={backend!r} cannot run inside torch.compile(fullgraph=True) or torch.export on "
            f"{device} ({kind!r} layers): {caps.no_compile}. Compile with {_names(can)} (the same function), or "
            f"run {backend!r} uncompiled"
        )


def compiles(backend: str, kind: str, device: str) -> bool:
    """Whether `backend` runs `kind` layers on `device` inside torch.compile(fullgraph=True) / export."""
    # sparse runs full layers as sdpa (see modeling/sparse.py)
    return device in BACKENDS["sdpa" if (backend, kind) == ("sparse", "full") else backend].compile


def _names(backends: list[str]) -> str:
    quoted = [repr(n) for n in backends]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _refuse(backend: str, feature: str, has, needed_by: str = "this model") -> None:
    capable = [n for n, c in BACKENDS.items() if has(c)]
    raise ValueError(
        f"attn_implementation={backend!r} does not support {feature}, which {needed_by} needs; "
        f"use one of {', '.join(map(repr, capable))}"
    )


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
        + "; ".join(filter(None, (caps.note, caps.no_compile and f"not compiled: {caps.no_compile}")))
        for name, caps in BACKENDS.items()
        if caps.note or caps.no_compile
    ]
    notes.append(
        "- compile: the devices where the model runs inside `torch.compile(fullgraph=True)` and `torch.export` "
        "(tested on CPU; the CUDA entries are not run by this project's CPU-only tests)"
    )
    return "\n".join([head, rule, *rows, "", *notes])
