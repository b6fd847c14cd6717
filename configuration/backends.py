"""What each attention backend can do, as data.

The table is read in two places: when a config is built with `attn_implementation=...`, and when a
model chooses its backend (`from_config`, `from_pretrained`, `set_attn_implementation`). An
impossible combination fails there, with the backend, the feature and what to use instead. No
backend silently falls back to another and no backend silently drops a mask.

Torch-free on purpose: it is pure data plus checks over config values. Checks that need torch (the
device of the weights, installed kernels) live in `modeling/attention.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

# Every feature a backend may or may not have. Kept as a tuple so README tables keep one order.
FEATURES = (
    "causal",
    "bidirectional",
    "cross_attention",
    "padding",
    "gqa",
    "dropout",
    "position_bias",
    "output_attentions",
    "kv_cache",
    "backward",
    "devices",
    "dtypes",
)


@dataclass(frozen=True)
class Capabilities:
    causal: bool = True
    bidirectional: bool = True
    cross_attention: bool = True
    padding: bool = True
    gqa: bool = True
    dropout: bool = True
    # additive score biases (ALiBi, T5 relative bias)
    position_bias: bool = True
    # "native": the kernel returns the weights; "recomputed": swapformer recomputes them from q and k
    # for the layers asked, with eager's math
    output_attentions: str = "native"
    kv_cache: bool = True
    backward: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")
    note: str = ""


BACKENDS: dict[str, Capabilities] = {
    "eager": Capabilities(note="reference implementation (the oracle every backend is tested against)"),
    "sdpa": Capabilities(
        output_attentions="recomputed",
        note="torch.nn.functional.scaled_dot_product_attention with a boolean or additive mask",
    ),
}

# Names transformers knows that swapformer does not (yet) run, with what to use instead.
UNSUPPORTED = {
    "flash_attention_2": "FlashAttention is not wired into swapformer yet; use 'sdpa' (on CUDA it selects a flash kernel)",
    "flash_attention_3": "FlashAttention 3 is not supported; use 'sdpa'",
    "flex_attention": "flex_attention is not wired into swapformer yet; use 'sdpa'",
}


def supported_backends() -> tuple[str, ...]:
    return tuple(BACKENDS)


def check_backend_name(name) -> str:
    """Return `name` if swapformer runs it, else raise a ValueError that says what to use."""
    if isinstance(name, dict):
        for sub in name.values():
            check_backend_name(sub)
        return name
    if name in BACKENDS:
        return name
    if name in UNSUPPORTED:
        raise ValueError(f"attn_implementation={name!r}: {UNSUPPORTED[name]}")
    raise ValueError(
        f"Unknown attn_implementation={name!r}; swapformer supports {', '.join(map(repr, BACKENDS))}"
    )


def check_backend_for_config(name: str, config) -> None:
    """Raise if backend `name` cannot compute the function `config` describes."""
    check_backend_name(name)
    caps = BACKENDS[name]
    needs = {
        "gqa": config.num_key_value_heads != config.num_attention_heads,
        "position_bias": config.position_embedding_type in ("alibi", "relative_bias"),
        "causal": bool(getattr(config, "causal", False)),
        "bidirectional": not getattr(config, "causal", False) or getattr(config, "is_encoder_decoder", False),
        "cross_attention": bool(getattr(config, "is_encoder_decoder", False)),
    }
    for feature, needed in needs.items():
        if needed and not getattr(caps, feature):
            capable = [n for n, c in BACKENDS.items() if getattr(c, feature)]
            raise ValueError(
                f"attn_implementation={name!r} does not support {feature}, which this "
                f"{type(config).__name__} needs; use one of {', '.join(map(repr, capable))}"
            )


def capability_table_markdown() -> str:
    """The backend x feature table, as Markdown (the README's copy is generated from this)."""
    head = "| backend | " + " | ".join(FEATURES) + " |"
    rule = "|" + "---|" * (len(FEATURES) + 1)
    rows = []
    for name, caps in BACKENDS.items():
        cells = []
        for feature in FEATURES:
            value = getattr(caps, feature)
            if isinstance(value, bool):
                cells.append("yes" if value else "no")
            elif isinstance(value, tuple):
                cells.append(", ".join(value))
            else:
                cells.append(str(value))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *rows])
