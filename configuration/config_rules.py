"""Rules between fields of a configuration, one small named function per fact, grouped by feature.

Each rule takes a config whose fields already passed their own checks (`config_fields.check_fields`)
and raises a ValueError naming the values and the fix. A config class lists the rules it obeys in
`rules` (its base's plus its own); the order of the groups below is the order they run in.
"""

from __future__ import annotations

from .backends import LAYER_TYPE_PATTERN, check_layer_backends
from .config_fields import check_choice, check_int, check_number

LAYER_TYPES = tuple(LAYER_TYPE_PATTERN)
# Pattern kinds with global tokens (the layers `global_projections` applies to).
GLOBAL_KINDS = ("sliding_global", "bigbird")
# RoPE variants of transformers' `rope_parameters` that swapformer computes (with transformers' own
# ROPE_INIT_FUNCTIONS), and the keys each needs besides `rope_type` and `rope_theta`.
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# Keys of `rope_parameters` that are positive numbers when given
ROPE_POSITIVE_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
)


# Heads and positions ------------------------------------------------------------------------------


def heads_divide(config) -> None:
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(
            f"num_attention_heads={config.num_attention_heads} is not divisible by num_key_value_heads="
            f"{config.num_key_value_heads}; use a divisor (1 for MQA, {config.num_attention_heads} for MHA)"
        )


def rope_head_dim_even(config) -> None:
    whole_head = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0) == 1.0
    if config.position_embedding_type == "rope" and config.head_dim % 2 and whole_head:
        raise ValueError(
            f"position_embedding_type='rope' needs an even head_dim, got head_dim={config.head_dim}"
        )


def relative_bias_buckets(config) -> None:
    """T5 buckets: half exact, half log-spaced up to max_distance (per direction when bidirectional)."""
    if config.position_embedding_type != "relative_bias":
        return
    buckets, distance = config.relative_attention_num_buckets, config.relative_attention_max_distance
    if buckets < 4:
        raise ValueError(f"relative_attention_num_buckets={buckets} is too small; use >= 4 (T5: 32)")
    if distance <= buckets // 2:
        raise ValueError(
            f"relative_attention_max_distance={distance} must exceed "
            f"relative_attention_num_buckets // 2 = {buckets // 2} (T5: 128 for 32)"
        )


# Layer types and windows --------------------------------------------------------------------------


def check_layer_list(config, name: str, layer_types, count: int, count_name: str) -> None:
    """One known attention type per layer; windowed layers need a window."""
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != count:
        raise ValueError(
            f"{name} must list one attention type per layer ({count_name}={count}), got {layer_types!r}"
        )
    for layer_type in layer_types:
        check_choice(f"{name} entry", layer_type, LAYER_TYPES)
    windowed = [t for t in layer_types if t != "full_attention"]
    if windowed and config.sliding_window is None:
        raise ValueError(f"{name} has {windowed[0]!r} layers but sliding_window is None; set sliding_window")


def layer_types_match_layers(config) -> None:
    check_layer_list(config, "layer_types", config.layer_types, config.num_hidden_layers, "num_hidden_layers")


def window_inside_learned_table(config) -> None:
    window = config.sliding_window
    if (
        window is not None
        and config.position_embedding_type == "learned"
        and window >= config.max_position_embeddings
    ):
        raise ValueError(
            f"sliding_window={window} covers the whole learned position table "
            f"(max_position_embeddings={config.max_position_embeddings}), so the window never applies; "
            "use full_attention layers or a smaller window"
        )


def layer_backends_cover_layers(config) -> None:
    if config._attn_layer_backends is not None:
        check_layer_backends(config._attn_layer_backends, config._all_layer_types())


# RoPE ---------------------------------------------------------------------------------------------


def rope_type_known(config) -> None:
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"Unknown rope_parameters['rope_type']={rope_type!r}; swapformer computes "
            f"{', '.join(map(repr, ROPE_TYPES))}"
        )
    check_number(
        "rope_theta", params.get("rope_theta"), minimum=0.0, above=True, fix="the usual RoPE base is 10000.0"
    )
    if rope_type != "default" and config.position_embedding_type != "rope":
        raise ValueError(
            f"rope_parameters has rope_type={rope_type!r} but position_embedding_type="
            f"{config.position_embedding_type!r}; set position_embedding_type='rope' or drop the scaling"
        )
    missing = [key for key in ROPE_TYPES[rope_type] if params.get(key) is None]
    if missing:
        raise ValueError(
            f"rope_parameters for rope_type={rope_type!r} needs {', '.join(map(repr, missing))}, got {params}"
        )


def partial_rotary(config) -> None:
    """RoPE rotates the first int(head_dim * factor) dims of each head (StableLM, Phi, GPT-NeoX), in
    pairs: that count must be even and > 0."""
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    name = "rope_parameters['partial_rotary_factor']"
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise TypeError(f"{name} must be a number in (0, 1], got {factor!r} ({type(factor).__name__})")
    if not 0 < factor <= 1:
        raise ValueError(
            f"{name}={factor!r} must be in (0, 1]: the share of each head that RoPE rotates (StableLM: 0.25)"
        )
    if factor != 1 and config.position_embedding_type != "rope":
        raise ValueError(
            f"{name}={factor} but position_embedding_type={config.position_embedding_type!r}; set "
            "position_embedding_type='rope' or drop partial_rotary_factor"
        )
    rotated = int(config.head_dim * factor)
    if rotated == 0 or rotated % 2:
        even = max(2, rotated - rotated % 2)
        raise ValueError(
            f"{name}={factor} rotates int(head_dim={config.head_dim} * {factor}) = {rotated} dims; RoPE rotates "
            f"pairs of dims, so that must be even and > 0: use a factor that gives an even count, e.g. "
            f"{even / config.head_dim:g} ({even} dims)"
        )


def rope_scaling_values(config) -> None:
    params = config.rope_parameters
    for key in ROPE_POSITIVE_KEYS:
        if params.get(key) is not None:
            fix = "see transformers' rope_parameters documentation for its usual value"
            check_number(f"rope_parameters[{key!r}]", params[key], minimum=0.0, above=True, fix=fix)
    if params.get("original_max_position_embeddings") is not None:
        name = "rope_parameters['original_max_position_embeddings']"
        check_int(name, params["original_max_position_embeddings"], 1)
    if params.get("rope_type") == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(
            f"rope_parameters high_freq_factor={params['high_freq_factor']} must exceed low_freq_factor="
            f"{params['low_freq_factor']} (Llama 3.1: 4.0 and 1.0)"
        )


# Longformer's global projections ------------------------------------------------------------------


def global_projections_bidirectional(config) -> None:
    """`global_projections=True` needs bidirectional self-attention (see the class doc)."""
    if config.global_projections and config.causal and not config.is_encoder_decoder:
        raise ValueError(
            "global_projections=True needs bidirectional self-attention, and this decoder's is causal: a "
            "global token's own projections attend to every key, later tokens included (Longformer's "
            "query_global/key_global/value_global), which a causal decoder's tokens may not see. Use an "
            "EncoderConfig (or a Seq2SeqConfig, whose encoder takes it), or global_projections=False"
        )


def global_projections_have_globals(config) -> None:
    if config.global_projections and not any(
        LAYER_TYPE_PATTERN[t] in GLOBAL_KINDS for t in config.layer_types
    ):
        raise ValueError(
            f"global_projections=True needs layers with global tokens, but layer_types={config.layer_types} has "
            "none; use 'sliding_global_attention' or 'bigbird_attention' layers, or global_projections=False"
        )


# Linformer ----------------------------------------------------------------------------------------


def linformer_fits(config) -> None:
    """`linformer_k`: a bidirectional stack of full layers without a position bias (see the class doc)."""
    k = config.linformer_k
    if k is None:
        return
    if k > config.max_position_embeddings:
        raise ValueError(
            f"linformer_k={k} exceeds max_position_embeddings={config.max_position_embeddings}, the longest "
            "sequence E and F project: it would keep more rows than there are tokens; use a smaller "
            "linformer_k (Wang et al. use 128 or 256 for 512 tokens)"
        )
    if config.causal:
        what = "an encoder-decoder's decoder" if config.is_encoder_decoder else "a decoder"
        raise ValueError(
            f"linformer_k={k} needs bidirectional self-attention, and {what} is causal: E and F mix every "
            "position of the sequence into each projected key and value, later tokens included, so no "
            "causal mask can apply. Use an EncoderConfig with linformer_k, or linformer_k=None"
        )
    other = sorted({t for t in config.layer_types if t != "full_attention"})
    if other:
        raise ValueError(
            f"linformer_k={k} replaces the keys of full_attention layers by projected rows, but layer_types "
            f"has {other[0]!r} layers, whose window needs token keys; use full_attention layers, or "
            "linformer_k=None"
        )
    if config.position_embedding_type in ("alibi", "relative_bias"):
        raise ValueError(
            f"linformer_k={k} cannot take position_embedding_type={config.position_embedding_type!r}: its bias "
            "is per (query, key) token pair, and projected keys are mixtures of tokens; use 'learned', "
            "'sinusoidal' or 'rope' positions, or linformer_k=None"
        )


# Streaming positions ------------------------------------------------------------------------------


def streaming_positions_fit(config) -> None:
    """`streaming_positions="cache"` re-rotates the kept leading tokens of a window + global cache: a
    causal decoder with such layers, RoPE of fixed frequencies."""
    if config.streaming_positions == "absolute":
        return
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    needs = {
        "a decoder (DecoderConfig)": config.causal and not config.is_encoder_decoder,
        "position_embedding_type='rope'": config.position_embedding_type == "rope",
        "a rope_type other than 'dynamic' (whose frequencies change with the length)": rope_type != "dynamic",
        "'sliding_global_attention' layers": "sliding_global_attention" in config.layer_types,
        "global_tokens >= 1 (the sink tokens)": config.global_tokens >= 1,
    }
    missing = [need for need, met in needs.items() if not met]
    if missing:
        raise ValueError(
            f"streaming_positions='cache' (StreamingLLM's positions within the cache) needs {'; '.join(missing)}; "
            f"got {type(config).__name__} with position_embedding_type={config.position_embedding_type!r}, "
            f"rope_type={rope_type!r}, layer_types={config.layer_types}, global_tokens={config.global_tokens}. "
            "Fix those, or use streaming_positions='absolute'"
        )


SHARED_RULES = (
    heads_divide,
    rope_head_dim_even,
    relative_bias_buckets,
    layer_types_match_layers,
    window_inside_learned_table,
    layer_backends_cover_layers,
    rope_type_known,
    partial_rotary,
    rope_scaling_values,
    global_projections_bidirectional,
    global_projections_have_globals,
    linformer_fits,
    streaming_positions_fit,
)
