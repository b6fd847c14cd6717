"""What each attention backend can do, as data: the capability table.

The table is read when a config is built with `attn_implementation=...` and when a model chooses its
backend; the checks and their messages are in `backends.py`, the README's Markdown copy is made by
`capability_markdown.py`. Torch-free on purpose.
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
# attn_implementation="auto": per layer type, the fastest backend this table accepts for each forward, measured
# on the machine (modeling/attention/auto_backend.py); SWAPFORMER_AUTO=static takes the first of this order
# that the table accepts instead, measuring nothing
AUTO_BACKEND = "auto"
AUTO_STATIC_ORDER = {
    "full": ("flash_attention_2", "sdpa_fa", "sdpa", "flex_attention", "eager"),
    "sliding": ("flash_attention_2", "sparse", "sdpa", "flex_attention", "eager"),
    "sliding_global": ("sparse", "sdpa", "flex_attention", "eager"),
    "bigbird": ("sparse", "sdpa", "flex_attention", "eager"),
}

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
    # mask evaluated from the pattern (modeling/attention/masks.py), not only padding and kernel arguments
    custom_mask: bool = True
    gqa: bool = True
    # multi-head latent attention (DecoderConfig.kv_lora_rank): per-head keys wider than the values
    latent_attention: bool = True
    dropout: bool = True
    position_bias: bool = True  # additive score biases: ALiBi, T5 relative bias
    # Linformer's projected keys and values (config.linformer_k, modeling/variants/linformer.py): dense attention
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
    # devices where attn_implementation="auto" measures it as a candidate, and why not elsewhere
    auto_devices: tuple[str, ...] = ("cpu", "cuda")
    no_auto: str = ""
    # holds a layer's (heads, queries, keys) scores whole: auto measures it only while they are small
    # (modeling/attention/auto_measure.py: SCORE_BYTES), since its run would need far more memory than the others'
    score_matrix: bool = False
    note: str = ""


BACKENDS: dict[str, Capabilities] = {
    "eager": Capabilities(
        score_matrix=True, note="the reference every backend is tested against; O(n^2) dense mask"
    ),
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
        auto_devices=("cuda",),
        no_auto="on CPU its first call compiles a kernel (about 15 s), far over auto's measuring budget, and it was "
        "slower than sparse on every window pattern measured on CPU (docs/benchmarks.md)",
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


def runs_everything(caps: Capabilities) -> bool:
    """Every pattern and every yes/no feature of the table."""
    return caps.patterns == PATTERNS and all(getattr(caps, f) is not False for f in FEATURES)


# Names transformers knows that swapformer does not run: why, and which rows to offer instead (those of
# them that run on the machine; every row that does when none of them runs there: availability.stand_ins).
UNSUPPORTED = {
    "flash_attention_3": ("FlashAttention 3 is not wired into swapformer", lambda c: c.devices == ("cuda",)),
    "flash_attention_4": ("FlashAttention 4 is not wired into swapformer", lambda c: c.devices == ("cuda",)),
    "paged|eager": ("paged attention is not supported", runs_everything),
}
# Any "org/name" (transformers loads such a name as an attention kernel from the Hub, `kernels` package).
HUB_KERNEL = (
    "attention kernels from the Hub are not wired into swapformer",
    lambda c: c.devices == ("cuda",),
)


# How a refusal names a feature, where its column name is not enough.
DESCRIPTIONS = {
    "linformer": "Linformer's projected keys and values (linformer_k)",
    "custom_mask": "a 4D attention_mask (batch, 1, query, key)",
}
