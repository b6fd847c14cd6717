"""Configurations of the three swapformer architectures.

One base class holds what every architecture shares (sizes, heads, positions, norms, MLP, dropout,
initialisation); `EncoderConfig`, `DecoderConfig` and `Seq2SeqConfig` only add what is theirs.
Everything is validated at construction, so a wrong value fails here with a message that names it,
not later inside a kernel. This module must not import torch: configs are read on machines and in
tools that never build a model.

transformers 5.x configs are dataclasses: fields are declared as annotated class
attributes, derived values are filled in `__post_init__`, and base fields such as
`tie_word_embeddings` or `is_encoder_decoder` are fields too, never assigned before the base init.
"""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

from .backends import LAYER_TYPE_PATTERN, PER_LAYER_BACKEND, check_backend_name, check_layer_backends

POSITION_TYPES = ("learned", "sinusoidal", "rope", "alibi", "relative_bias", "none")
NORM_TYPES = ("layernorm", "rmsnorm")
MLP_TYPES = ("mlp", "gated")
# Keys of transformers.activations.ACT2FN that make sense inside a Transformer MLP.
ACTIVATIONS = (
    "gelu",
    "gelu_new",
    "gelu_fast",
    "gelu_pytorch_tanh",
    "quick_gelu",
    "relu",
    "relu2",
    "silu",
    "swish",
    "tanh",
)
INITIALIZERS = ("normal", "xavier")
# Linformer's sharing of its projections E, F (Wang et al. 2020, section 4): one matrix for keys and values
# of every layer and head ("layerwise"), one per layer for keys and values ("key_value"), or one E and one
# F per layer ("headwise": shared by the heads of a layer only)
LINFORMER_SHARING = ("layerwise", "key_value", "headwise")

# Where a window + global cache puts its kept leading tokens (modeling/sinks.py: streaming sinks)
STREAMING_POSITIONS = ("absolute", "cache")
# RoPE variants of transformers' `rope_parameters` that swapformer computes (with transformers' own
# ROPE_INIT_FUNCTIONS), and the keys each needs besides `rope_type` and `rope_theta`.
ROPE_TYPES = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
LAYER_TYPES = tuple(LAYER_TYPE_PATTERN)
# Pattern kinds with global tokens (the layers `global_projections` applies to).
GLOBAL_KINDS = ("sliding_global", "bigbird")
# Tensor-parallel styles of an attention layer (transformers' names, Llama's choices): heads are split over
# ranks, the projections into heads by columns and the one out of them by rows. The MLP's inner width is
# split the same way (`_stack_tp_plan`).
ATTENTION_TP_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
# Longformer's own projections of global tokens (`global_projections`), sharded by heads as q/k/v are
GLOBAL_TP_PLAN = {f"{name}_global_proj": "colwise" for name in "qkv"}
# MLA (modeling/mla.py): the up-projections by heads, with the query's (`_stack_tp_plan`); the latent
# projections (q_a_proj, kv_a_proj_with_mqa) are shared by all heads and stay whole on every rank
LATENT_TP_PLAN = {"kv_b_proj": "colwise", "o_proj": "rowwise"}


def tensor_parallel_plan(config) -> dict[str, str]:
    """The base model's tensor-parallel plan (`base_model_tp_plan`): a rule for each module `config` builds,
    and for nothing else (transformers warns about a rule that matches nothing).

    Every token embedding is split by vocabulary rows, the layout of the heads' LM projection
    (`colwise_gather_output`, their `_tp_plan`), so that a projection tied to an embedding has one layout in
    both places, as transformers shards Llama's `embed_tokens`. `config` may be a config class, whose class
    attributes are its defaults.
    """
    if not config.is_encoder_decoder:
        return {"embed_tokens": "embedding_rowwise", **_stack_tp_plan(config, causal=config.causal)}
    embeddings = ["shared"] if config.shared_embeddings else ["encoder.embed_tokens", "decoder.embed_tokens"]
    plan = dict.fromkeys(embeddings, "embedding_rowwise")
    for prefix, is_decoder in (("encoder.", False), ("decoder.", True)):
        rules = _stack_tp_plan(config, causal=is_decoder, cross_attention=is_decoder)
        plan.update({prefix + rule: style for rule, style in rules.items()})
    return plan


def _stack_tp_plan(config, *, causal: bool, cross_attention: bool = False) -> dict[str, str]:
    """The rules of one stack of blocks: its self-attention, cross-attention and MLP projections."""
    if getattr(config, "kv_lora_rank", None) is not None:
        attention = {"q_proj" if config.q_lora_rank is None else "q_b_proj": "colwise", **LATENT_TP_PLAN}
    elif config.global_projections and not causal:
        attention = {**ATTENTION_TP_PLAN, **GLOBAL_TP_PLAN}
    else:
        attention = ATTENTION_TP_PLAN
    plan = (
        {}
        if per_head_tables(config)
        else {f"layers.*.self_attn.{name}": style for name, style in attention.items()}
    )
    if cross_attention:
        plan.update({f"layers.*.cross_attn.{name}": style for name, style in ATTENTION_TP_PLAN.items()})
    if config.mlp_type == "gated":
        plan["layers.*.mlp.gate_proj"] = "colwise"
    plan.update({"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"})
    return plan


def per_head_tables(config) -> bool:
    """Whether self-attention keeps a table over all query heads beside its projections (ALiBi slopes, T5's
    relative bias, attention sinks). Split by heads, each rank's projections would meet the whole table, so
    such self-attention stays whole on every rank (replicated) while the MLP, the embeddings, the head and
    cross-attention are sharded."""
    return config.position_embedding_type in ("alibi", "relative_bias") or bool(config.attention_sinks)


class _PlanOfConfig:
    """`base_model_tp_plan`, which transformers reads on the config (`tp_plan="auto"`): built from the config's
    fields when read, so it follows a field changed after construction and is never saved; read on the class,
    the plan of its defaults. A plan assigned to an instance replaces it (a non-data descriptor)."""

    def __get__(self, config, owner) -> dict[str, str]:
        return tensor_parallel_plan(owner if config is None else config)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {name}={value}")


def _check_number(
    name: str, value, *, minimum: float, maximum: float | None = None, above: bool = False, fix: str
) -> None:
    """A finite real number >= `minimum` (> when `above`) and <= `maximum`. Only what cannot work is
    refused: values transformers' own configs and tests use (eps 1.0, initializer_range 0) pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}); {fix}")
    low_ok = value > minimum if above else value >= minimum
    if not (math.isfinite(value) and low_ok and (maximum is None or value <= maximum)):
        if maximum is not None:
            bound = f"lie in [{minimum:g}, {maximum:g}]"
        else:
            bound = f"be a finite number {'>' if above else '>='} {minimum:g}"
        raise ValueError(f"{name} must {bound}, got {name}={value!r}; {fix}")


def _check_probability(name: str, value) -> None:
    _check_number(
        name,
        value,
        minimum=0.0,
        maximum=1.0,
        fix="it is a dropout probability (0.1 is usual, 0 turns it off)",
    )


def _check_choice(name: str, value, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"Unknown {name}={value!r}; choose one of {', '.join(map(repr, choices))}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


class SwapformerConfig(PreTrainedConfig):
    """Fields shared by the encoder, decoder and encoder-decoder configurations.

    Args:
        vocab_size: rows of the token embedding.
        hidden_size: model width.
        num_hidden_layers: number of blocks (of the encoder, for `Seq2SeqConfig`).
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads; `None` means as many as query heads (MHA), 1 is MQA,
            anything that divides `num_attention_heads` is GQA.
        head_dim: width of one head; `None` means `hidden_size // num_attention_heads`.
        intermediate_size: inner width of the MLP; `None` means `4 * hidden_size`.
        hidden_act: activation of the MLP (a key of `transformers.activations.ACT2FN`).
        mlp_type: `"mlp"` (up, act, down) or `"gated"` (act(gate) * up, down): SwiGLU with
            `hidden_act="silu"`, GeGLU with a GELU.
        max_position_embeddings: longest sequence the position scheme is meant for; a hard limit
            for `"learned"` positions.
        position_embedding_type: `"learned"` absolute, `"sinusoidal"` absolute, `"rope"`
            (https://arxiv.org/abs/2104.09864), `"alibi"` (https://arxiv.org/abs/2108.12409),
            `"relative_bias"` (T5's bucketed bias, https://arxiv.org/abs/1910.10683) or `"none"`.
        rope_parameters: RoPE settings in transformers' form, e.g. `{"rope_type": "llama3", "rope_theta":
            500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}`. `rope_type` is "default", "linear", "dynamic"
            (NTK, https://arxiv.org/abs/2309.00071 section 3), "yarn" (https://arxiv.org/abs/2309.00071) or
            "llama3"; the keys are those of transformers' `RopeParameters`. `None` means default RoPE with
            `rope_theta`.
        rope_theta: RoPE base (10000.0 by default), kept as an argument and attribute for configs saved
            before `rope_parameters`; it lives in `rope_parameters["rope_theta"]`.
        relative_attention_num_buckets, relative_attention_max_distance: T5 bias buckets.
        norm_type: `"layernorm"` or `"rmsnorm"`.
        norm_eps: epsilon of every norm.
        pre_norm: pre-LN blocks (norm inside the residual branch, plus a final norm) when True,
            post-LN blocks (BERT, BART) when False.
        embedding_norm: a norm right after the embeddings (BERT, BART).
        scale_embeddings: multiply token embeddings by sqrt(hidden_size) (Vaswani, BART option).
        attention_bias, mlp_bias: biases of the attention and MLP projections.
        attention_scale: factor applied to q.k; `None` means `head_dim ** -0.5` (T5 uses 1.0).
        hidden_dropout: dropout on embeddings and on each residual branch.
        embedding_dropout: dropout on the embeddings alone; `None` means `hidden_dropout` (GPT-2's
            `embd_pdrop` may differ from its `resid_pdrop`).
        embedding_dropout_first: drop out the embeddings before `embedding_norm` rather than after it
            (BigBird's order; BERT's is norm, then dropout).
        final_dropout: apply `hidden_dropout` once more to each stack's output, after its final norm
            (T5 does; BERT, GPT-2, Llama and BART do not).
        attention_dropout: dropout on attention probabilities.
        activation_dropout: dropout after the MLP activation.
        classifier_dropout: dropout of classification heads; `None` means `hidden_dropout`.
        initializer: `"normal"` (std `initializer_range`) or `"xavier"` (uniform) for linear weights.
        initializer_range: std of the normal initialiser and of embeddings.
        tie_word_embeddings: share the output projection with the input embedding.
        layer_types: the attention pattern of each layer (of the encoder, for `Seq2SeqConfig`):
            `"full_attention"`, `"sliding_attention"` (a window of `sliding_window`),
            `"sliding_global_attention"` (window plus global tokens, Longformer,
            https://arxiv.org/abs/2004.05150) or `"bigbird_attention"` (window, global tokens and
            random key blocks, BigBird, https://arxiv.org/abs/2007.14062). `None` means all full.
            ModernBERT's layout is one line: `["full_attention" if i % 3 == 0 else "sliding_attention"
            for i in range(n)]`.
        sliding_window: window width w: a query sees keys with 0 <= q - k < w when causal, |q - k| < w
            when bidirectional (the convention of transformers and flash-attn).
        global_tokens: the first k positions are global (attend to all, attended by all); a
            `global_attention_mask` input marks more, per batch row.
        attention_block_size: block size of the random blocks (counted from each sequence's first real
            token, so padding never moves them) and of the sparse backend.
        num_random_blocks: random key blocks per query block (`bigbird_attention`).
        random_seed: seed of the random block layout, stored so every run, process and backend
            draws the same layout.
        global_projections: global tokens get query, key and value projections of their own
            (`q_global_proj`, `k_global_proj`, `v_global_proj`), as Longformer's `query_global`,
            `key_global` and `value_global`: a global token's output is attention of
            q_global(h) over k_global(h), v_global(h) of every key it may see, replacing what the
            ordinary projections would give it; other queries attend to global keys through the
            ordinary projections. Only with `sliding_global_attention` or `bigbird_attention` layers
            and bidirectional self-attention (an encoder, the encoder of a seq2seq).
        linformer_k: Linformer (https://arxiv.org/abs/2006.04768): keys and values of every layer are
            projected along the sequence axis to `linformer_k` rows, K' = E K and V' = F V with E, F of
            shape (linformer_k, max_position_embeddings), so attention costs O(n * linformer_k). A
            sequence of n <= max_position_embeddings tokens uses the first n columns of E and F; padded
            keys and values are zeroed before the projection. Encoders only (every query sees every key),
            `full_attention` layers, no ALiBi or T5 bias. `None` (the default) is ordinary attention.
        linformer_sharing: which projections are shared (Wang et al., section 4): `"layerwise"` (one
            matrix, E = F, for every layer and head), `"key_value"` (one per layer, E = F) or
            `"headwise"` (an E and an F per layer, shared by its heads).
        streaming_positions: the positions the global (sink) tokens kept by a window + global cache
            are rotated at once the cache dropped tokens after them: `"absolute"` (their own, 0..k-1) or
            `"cache"` (StreamingLLM's positions within the cache, https://arxiv.org/abs/2309.17453: just
            before the first window token the cache holds, so no query sees a sink further than the
            window plus k). RoPE decoders with `sliding_global_attention` layers (modeling/sinks.py).
        attention_sinks: each self-attention layer learns `sinks`, one logit per query head that joins
            the softmax's denominator and carries no value (gpt-oss's attention sinks; modeling/sinks.py).
    """

    model_type = "swapformer"
    # read by transformers (tp_plan="auto", pipeline stages) for the base models: the encoder's and the
    # decoder's (embed_tokens, layers, norm), as Llama's
    base_model_tp_plan = _PlanOfConfig()
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    mlp_type: str = "mlp"
    max_position_embeddings: int = 512
    position_embedding_type: str = "learned"
    rope_parameters: dict | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    norm_type: str = "layernorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    embedding_norm: bool = False
    scale_embeddings: bool = False
    attention_bias: bool = True
    mlp_bias: bool = True
    attention_scale: float | None = None
    hidden_dropout: float = 0.1
    embedding_dropout: float | None = None
    embedding_dropout_first: bool = False
    final_dropout: bool = False
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    classifier_dropout: float | None = None
    initializer: str = "normal"
    initializer_range: float = 0.02
    tie_word_embeddings: bool = True
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    global_tokens: int = 0
    attention_block_size: int = 64
    num_random_blocks: int = 3
    random_seed: int = 0
    global_projections: bool = False
    linformer_k: int | None = None
    linformer_sharing: str = "layerwise"
    attention_sinks: bool = False
    streaming_positions: str = "absolute"
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    # Whether (decoder) self-attention is causal. A plain class attribute, not a config field.
    causal = False

    def __post_init__(self, **kwargs):
        backend = kwargs.get("attn_implementation")
        self._attn_layer_backends = None
        for name in ("rope_parameters", "rope_scaling"):
            value = kwargs.get(name, self.rope_parameters if name == "rope_parameters" else None)
            if value is not None and not isinstance(value, dict):
                raise TypeError(
                    f"{name} must be a dict such as {{'rope_type': 'linear', 'factor': 2.0}}, got {value!r}"
                )
        # transformers moves `rope_theta` and the older `rope_scaling` into `rope_parameters` here
        super().__post_init__(**kwargs)
        # The sizes that derived defaults are computed from are checked first.
        _check_int("hidden_size", self.hidden_size, 1)
        _check_int("num_attention_heads", self.num_attention_heads, 1)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                    f"{self.num_attention_heads}; change one of them or set head_dim explicitly"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        _check_int("num_hidden_layers", self.num_hidden_layers, 1)
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self._validate()
        if backend is not None and not isinstance(backend, dict):
            check_backend_name(backend)

    # Validation ---------------------------------------------------------------------------------

    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "relative_attention_num_buckets",
            "relative_attention_max_distance",
        ):
            _check_int(name, getattr(self, name), 1)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by num_key_value_heads="
                f"{self.num_key_value_heads}; use a divisor (1 for MQA, {self.num_attention_heads} for MHA)"
            )
        _check_choice("position_embedding_type", self.position_embedding_type, POSITION_TYPES)
        _check_choice("norm_type", self.norm_type, NORM_TYPES)
        _check_choice("mlp_type", self.mlp_type, MLP_TYPES)
        _check_choice("hidden_act", self.hidden_act, ACTIVATIONS)
        _check_choice("initializer", self.initializer, INITIALIZERS)
        whole_head = (self.rope_parameters or {}).get("partial_rotary_factor", 1.0) == 1.0
        if self.position_embedding_type == "rope" and self.head_dim % 2 and whole_head:
            raise ValueError(
                f"position_embedding_type='rope' needs an even head_dim, got head_dim={self.head_dim}"
            )
        if self.position_embedding_type == "relative_bias":
            # T5 buckets: half exact, half log-spaced up to max_distance (per direction when bidirectional)
            if self.relative_attention_num_buckets < 4:
                raise ValueError(
                    f"relative_attention_num_buckets={self.relative_attention_num_buckets} is too small; use >= 4 (T5: 32)"
                )
            if self.relative_attention_max_distance <= self.relative_attention_num_buckets // 2:
                raise ValueError(
                    f"relative_attention_max_distance={self.relative_attention_max_distance} must exceed "
                    f"relative_attention_num_buckets // 2 = {self.relative_attention_num_buckets // 2} (T5: 128 for 32)"
                )
        self._check_layer_types("layer_types", self.layer_types, self.num_hidden_layers, "num_hidden_layers")
        if self._attn_layer_backends is not None:
            check_layer_backends(self._attn_layer_backends, self._all_layer_types())
        for name, minimum in (
            ("global_tokens", 0),
            ("attention_block_size", 1),
            ("num_random_blocks", 0),
            ("random_seed", 0),
        ):
            _check_int(name, getattr(self, name), minimum)
        self._check_rope_parameters()
        _check_number(
            "norm_eps",
            self.norm_eps,
            minimum=0.0,
            above=True,
            fix="it keeps the norm's division away from zero (1e-5 for LayerNorm, 1e-6 for RMSNorm are usual)",
        )
        _check_number(
            "initializer_range",
            self.initializer_range,
            minimum=0.0,
            fix="it is the std of the initial weights (0.02 is usual)",
        )
        if self.attention_scale is not None:
            _check_number(
                "attention_scale",
                self.attention_scale,
                minimum=0.0,
                fix="or None for head_dim ** -0.5 (T5 uses 1.0)",
            )
        for name in ("hidden_dropout", "attention_dropout", "activation_dropout"):
            _check_probability(name, getattr(self, name))
        for name in ("classifier_dropout", "embedding_dropout"):
            if getattr(self, name) is not None:
                _check_probability(name, getattr(self, name))
        for name in (
            "pre_norm",
            "embedding_norm",
            "scale_embeddings",
            "attention_bias",
            "mlp_bias",
            "tie_word_embeddings",
            "use_cache",
            "final_dropout",
            "embedding_dropout_first",
            "global_projections",
            "attention_sinks",
        ):
            _check_bool(name, getattr(self, name))
        if self.global_projections:
            self._check_global_projections()
        self._check_linformer()
        self._check_streaming_positions()
        for name in self._token_id_fields():
            self._check_token_id(name, getattr(self, name))

    def _token_id_fields(self) -> tuple[str, ...]:
        return ("pad_token_id", "bos_token_id", "eos_token_id")

    def _check_global_projections(self) -> None:
        """`global_projections=True` needs bidirectional layers with global tokens (see the class doc)."""
        if self.causal and not self.is_encoder_decoder:
            raise ValueError(
                "global_projections=True needs bidirectional self-attention, and this decoder's is causal: a "
                "global token's own projections attend to every key, later tokens included (Longformer's "
                "query_global/key_global/value_global), which a causal decoder's tokens may not see. Use an "
                "EncoderConfig (or a Seq2SeqConfig, whose encoder takes it), or global_projections=False"
            )
        if not any(LAYER_TYPE_PATTERN[t] in GLOBAL_KINDS for t in self.layer_types):
            raise ValueError(
                f"global_projections=True needs layers with global tokens, but layer_types={self.layer_types} has "
                "none; use 'sliding_global_attention' or 'bigbird_attention' layers, or global_projections=False"
            )

    def _check_linformer(self) -> None:
        """`linformer_k`: a bidirectional stack of full layers without a position bias (see the class doc)."""
        _check_choice("linformer_sharing", self.linformer_sharing, LINFORMER_SHARING)
        k = self.linformer_k
        if k is None:
            return
        _check_int("linformer_k", k, 1)
        if k > self.max_position_embeddings:
            raise ValueError(
                f"linformer_k={k} exceeds max_position_embeddings={self.max_position_embeddings}, the longest "
                "sequence E and F project: it would keep more rows than there are tokens; use a smaller "
                "linformer_k (Wang et al. use 128 or 256 for 512 tokens)"
            )
        if self.causal:
            what = "an encoder-decoder's decoder" if self.is_encoder_decoder else "a decoder"
            raise ValueError(
                f"linformer_k={k} needs bidirectional self-attention, and {what} is causal: E and F mix every "
                "position of the sequence into each projected key and value, later tokens included, so no "
                "causal mask can apply. Use an EncoderConfig with linformer_k, or linformer_k=None"
            )
        other = sorted({t for t in self.layer_types if t != "full_attention"})
        if other:
            raise ValueError(
                f"linformer_k={k} replaces the keys of full_attention layers by projected rows, but layer_types "
                f"has {other[0]!r} layers, whose window needs token keys; use full_attention layers, or "
                "linformer_k=None"
            )
        if self.position_embedding_type in ("alibi", "relative_bias"):
            raise ValueError(
                f"linformer_k={k} cannot take position_embedding_type={self.position_embedding_type!r}: its bias "
                "is per (query, key) token pair, and projected keys are mixtures of tokens; use 'learned', "
                "'sinusoidal' or 'rope' positions, or linformer_k=None"
            )

    def _check_streaming_positions(self) -> None:
        """`streaming_positions="cache"` re-rotates the kept leading tokens of a window + global cache: a
        causal decoder with such layers, RoPE of fixed frequencies."""
        _check_choice("streaming_positions", self.streaming_positions, STREAMING_POSITIONS)
        if self.streaming_positions == "absolute":
            return
        rope_type = (self.rope_parameters or {}).get("rope_type", "default")
        needs = {
            "a decoder (DecoderConfig)": self.causal and not self.is_encoder_decoder,
            "position_embedding_type='rope'": self.position_embedding_type == "rope",
            "a rope_type other than 'dynamic' (whose frequencies change with the length)": rope_type
            != "dynamic",
            "'sliding_global_attention' layers": "sliding_global_attention" in self.layer_types,
            "global_tokens >= 1 (the sink tokens)": self.global_tokens >= 1,
        }
        missing = [need for need, met in needs.items() if not met]
        if missing:
            raise ValueError(
                f"streaming_positions='cache' (StreamingLLM's positions within the cache) needs {'; '.join(missing)}; "
                f"got {type(self).__name__} with position_embedding_type={self.position_embedding_type!r}, "
                f"rope_type={rope_type!r}, layer_types={self.layer_types}, global_tokens={self.global_tokens}. "
                "Fix those, or use streaming_positions='absolute'"
            )

    def _check_rope_parameters(self) -> None:
        params = self.rope_parameters
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"Unknown rope_parameters['rope_type']={rope_type!r}; swapformer computes "
                f"{', '.join(map(repr, ROPE_TYPES))}"
            )
        _check_number(
            "rope_theta",
            params.get("rope_theta"),
            minimum=0.0,
            above=True,
            fix="the usual RoPE base is 10000.0",
        )
        if rope_type != "default" and self.position_embedding_type != "rope":
            raise ValueError(
                f"rope_parameters has rope_type={rope_type!r} but position_embedding_type="
                f"{self.position_embedding_type!r}; set position_embedding_type='rope' or drop the scaling"
            )
        missing = [key for key in ROPE_TYPES[rope_type] if params.get(key) is None]
        if missing:
            raise ValueError(
                f"rope_parameters for rope_type={rope_type!r} needs {', '.join(map(repr, missing))}, got {params}"
            )
        self._check_partial_rotary(params.get("partial_rotary_factor", 1.0))
        for key in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "attention_factor",
            "beta_fast",
            "beta_slow",
        ):
            if params.get(key) is not None:
                _check_number(
                    f"rope_parameters[{key!r}]",
                    params[key],
                    minimum=0.0,
                    above=True,
                    fix="see transformers' rope_parameters documentation for its usual value",
                )
        if params.get("original_max_position_embeddings") is not None:
            _check_int(
                "rope_parameters['original_max_position_embeddings']",
                params["original_max_position_embeddings"],
                1,
            )
        if rope_type == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError(
                f"rope_parameters high_freq_factor={params['high_freq_factor']} must exceed low_freq_factor="
                f"{params['low_freq_factor']} (Llama 3.1: 4.0 and 1.0)"
            )

    def _check_partial_rotary(self, factor) -> None:
        """RoPE rotates the first int(head_dim * factor) dims of each head (StableLM, Phi, GPT-NeoX), in
        pairs: that count must be even and > 0."""
        name = "rope_parameters['partial_rotary_factor']"
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"{name} must be a number in (0, 1], got {factor!r} ({type(factor).__name__})")
        if not 0 < factor <= 1:
            raise ValueError(
                f"{name}={factor!r} must be in (0, 1]: the share of each head that RoPE rotates (StableLM: 0.25)"
            )
        if factor != 1 and self.position_embedding_type != "rope":
            raise ValueError(
                f"{name}={factor} but position_embedding_type={self.position_embedding_type!r}; set "
                "position_embedding_type='rope' or drop partial_rotary_factor"
            )
        rotated = int(self.head_dim * factor)
        if rotated == 0 or rotated % 2:
            even = max(2, rotated - rotated % 2)
            raise ValueError(
                f"{name}={factor} rotates int(head_dim={self.head_dim} * {factor}) = {rotated} dims; RoPE rotates "
                f"pairs of dims, so that must be even and > 0: use a factor that gives an even count, e.g. "
                f"{even / self.head_dim:g} ({even} dims)"
            )

    @property
    def rope_theta(self) -> float:
        """The RoPE base, read from `rope_parameters` (the attribute of configs before transformers 5)."""
        return (self.rope_parameters or {}).get("rope_theta", self.default_theta)

    @rope_theta.setter
    def rope_theta(self, value) -> None:
        self.rope_parameters = {**(self.rope_parameters or {}), "rope_theta": value}

    def _all_layer_types(self) -> list[str]:
        return list(self.layer_types)

    def _check_layer_types(self, name: str, layer_types, count: int, count_name: str) -> None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != count:
            raise ValueError(
                f"{name} must list one attention type per layer ({count_name}={count}), got {layer_types!r}"
            )
        for layer_type in layer_types:
            _check_choice(f"{name} entry", layer_type, LAYER_TYPES)
        windowed = [t for t in layer_types if t != "full_attention"]
        if windowed and self.sliding_window is None:
            raise ValueError(
                f"{name} has {windowed[0]!r} layers but sliding_window is None; set sliding_window"
            )
        if self.sliding_window is not None:
            _check_int("sliding_window", self.sliding_window, 1)
            if (
                self.position_embedding_type == "learned"
                and self.sliding_window >= self.max_position_embeddings
            ):
                raise ValueError(
                    f"sliding_window={self.sliding_window} covers the whole learned position table "
                    f"(max_position_embeddings={self.max_position_embeddings}), so the window never applies; "
                    "use full_attention layers or a smaller window"
                )

    def validate(self) -> None:
        """The check `save_pretrained` runs: swapformer's validation, then transformers' validators except
        its layer-type one (which rejects swapformer's window + global and BigBird layer types)."""
        self._validate()
        for validator in getattr(PreTrainedConfig, "__class_validators__", ()):
            if validator.__name__ != "validate_layer_type":
                validator(self)

    # Backend per layer type: attn_implementation may be a {layer type: backend} mapping. transformers
    # reads a dict as per-sub-config backends, so the mapping is kept here, outside the serialised
    # fields, and `_attn_implementation` holds the name of the dispatcher that reads it.

    @property
    def _attn_implementation(self):
        return self._attn_implementation_internal

    @_attn_implementation.setter
    def _attn_implementation(self, value):
        if isinstance(value, dict) and "" not in value:
            known = self._all_layer_types() if getattr(self, "layer_types", None) is not None else None
            self._attn_layer_backends = check_layer_backends(value, known)
            value = PER_LAYER_BACKEND
        self._attn_implementation_internal = value

    def backend_for(self, layer_type: str) -> str:
        """The backend that runs layers of `layer_type`."""
        name = self._attn_implementation or "eager"
        if name == PER_LAYER_BACKEND:
            return self._attn_layer_backends[layer_type]
        return name

    def _remove_keys_not_serialized(self, d: dict) -> None:
        super()._remove_keys_not_serialized(d)
        d.pop("_attn_layer_backends", None)

    def _check_token_id(self, name: str, value) -> None:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise ValueError(
                    f"{name}={value!r} must be None or a token id in [0, vocab_size={self.vocab_size})"
                )

    # Derived values used by the modeling code ----------------------------------------------------

    @property
    def effective_attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else float(self.attention_scale)


class EncoderConfig(SwapformerConfig):
    """A bidirectional encoder (BERT, RoBERTa, ModernBERT-like).

    Args:
        type_vocab_size: rows of the token-type (segment) embedding; 0 means none (BERT uses 2).
        add_pooling_layer: BERT's pooler (first token, dense, tanh): `EncoderModel` returns it as
            `pooler_output`, and `EncoderForSequenceClassification` classifies it as
            `BertForSequenceClassification` does (pooler, dropout, linear). Off: the classifier is
            RoBERTa's head on the first token (dropout, dense, tanh, dropout, linear). Converted BERT
            checkpoints turn it on, so a classifier fine-tuned from them starts from the trained pooler.
    """

    model_type = "swapformer_encoder"

    type_vocab_size: int = 0
    add_pooling_layer: bool = False

    def _validate(self) -> None:
        super()._validate()
        _check_int("type_vocab_size", self.type_vocab_size, 0)
        _check_bool("add_pooling_layer", self.add_pooling_layer)


class DecoderConfig(SwapformerConfig):
    """A causal decoder (GPT-2, Llama, Mistral, DeepSeek-V3-like).

    Args:
        kv_lora_rank: multi-head latent attention (MLA, DeepSeek-V2 https://arxiv.org/abs/2405.04434) when
            set: keys and values are up-projected from one per-token latent of this width, which is what
            the cache keeps (with the RoPE key); `None` (default) is ordinary attention. modeling/mla.py.
        q_lora_rank: MLA queries go through a latent of this width (`None`: one query projection).
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA's per-head widths of the query/key part
            without RoPE, of the RoPE part (shared by all heads on the key side) and of the values.
            `head_dim` is the RoPE part's width under MLA (it sizes the RoPE frequencies, as in DeepSeek).
        rope_interleave: MLA's RoPE pairs are interleaved dims (x0, x1), (x2, x3), ... (DeepSeek's
            checkpoints) rather than halves.
        mla_decode: `"absorbed"` (default) decodes from the latent cache with the key up-projection folded
            into the query and the value up-projection into the output; `"decompressed"` up-projects
            every cached latent at every step (the reference; slower).
    """

    model_type = "swapformer_decoder"

    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool = False
    mla_decode: str = "absorbed"

    causal = True

    def __post_init__(self, **kwargs):
        if self.kv_lora_rank is not None and self.head_dim is None:
            self.head_dim = self.qk_rope_head_dim
        super().__post_init__(**kwargs)

    def _validate(self) -> None:
        super()._validate()
        _check_bool("rope_interleave", self.rope_interleave)
        _check_choice("mla_decode", self.mla_decode, ("absorbed", "decompressed"))
        if self.kv_lora_rank is None:
            given = [
                n
                for n in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                if getattr(self, n)
            ]
            if given:
                raise ValueError(
                    f"{', '.join(f'{n}={getattr(self, n)}' for n in given)} only apply to multi-head latent attention, "
                    "which kv_lora_rank turns on; set kv_lora_rank (DeepSeek-V3: 512) or leave them None"
                )
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(
                    f"kv_lora_rank={self.kv_lora_rank} (multi-head latent attention) needs {name}; "
                    "set it (DeepSeek-V3: qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)"
                )
            _check_int(name, value, 1)
        if self.q_lora_rank is not None:
            _check_int("q_lora_rank", self.q_lora_rank, 1)
        if self.position_embedding_type != "rope" or self.qk_rope_head_dim % 2:
            raise ValueError(
                f"kv_lora_rank={self.kv_lora_rank} (multi-head latent attention) needs position_embedding_type="
                f"'rope' and an even qk_rope_head_dim; got {self.position_embedding_type!r} and "
                f"qk_rope_head_dim={self.qk_rope_head_dim}"
            )
        if self.head_dim != self.qk_rope_head_dim:
            raise ValueError(
                f"Under multi-head latent attention head_dim is the RoPE part's width: head_dim={self.head_dim} "
                f"!= qk_rope_head_dim={self.qk_rope_head_dim}; leave head_dim=None or set it equal"
            )
        partial = self.rope_parameters.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ValueError(
                f"rope_parameters['partial_rotary_factor']={partial}: multi-head latent attention rotates its "
                f"whole RoPE part (qk_rope_head_dim={self.qk_rope_head_dim}); drop partial_rotary_factor and set "
                "qk_rope_head_dim to the width that rotates"
            )
        if set(self.layer_types) != {"full_attention"}:
            raise ValueError(
                f"Multi-head latent attention runs full_attention layers only; layer_types={self.layer_types}. "
                "Use layer_types=None (all full) or kv_lora_rank=None"
            )

    @property
    def effective_attention_scale(self) -> float:
        """Under MLA: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times DeepSeek's YaRN `mscale_all_dim`
        correction squared when RoPE is scaled (as transformers' DeepseekV3Attention)."""
        if self.kv_lora_rank is None or self.attention_scale is not None:
            return super().effective_attention_scale
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        params = self.rope_parameters
        if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
            factor = params["factor"]
            mscale = 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= mscale * mscale
        return scale


class Seq2SeqConfig(SwapformerConfig):
    """An encoder-decoder (T5, BART-like). `num_hidden_layers` is the encoder depth.

    Args:
        decoder_layers: decoder depth; `None` means `num_hidden_layers`.
        shared_embeddings: encoder and decoder read one token embedding (`shared`).
        decoder_start_token_id: first decoder input when decoder inputs are made from labels.
        scale_decoder_outputs: multiply the decoder's last hidden state by hidden_size ** -0.5 before
            the LM head (T5 v1.0, whose output projection is the input embedding).
        add_final_logits_bias: the LM adds a fixed per-token bias to its logits, the buffer
            `final_logits_bias` (1, vocab_size) of BART, saved with the weights and not trained.
    """

    model_type = "swapformer_seq2seq"
    # Seq2SeqModel holds two stacks; no pipeline plan (transformers' stages run one stack of layers)
    base_model_pp_plan = None

    decoder_layers: int | None = None
    decoder_layer_types: list[str] | None = None
    shared_embeddings: bool = True
    scale_decoder_outputs: bool = False
    add_final_logits_bias: bool = False
    decoder_start_token_id: int | None = None
    is_encoder_decoder: bool = True
    causal = True  # of the decoder's self-attention; the encoder is always bidirectional

    def __post_init__(self, **kwargs):
        if self.decoder_layers is None:
            self.decoder_layers = self.num_hidden_layers
        if self.decoder_layer_types is None and isinstance(self.decoder_layers, int):
            # Always explicit: transformers' flat encoder-decoder handling turns decoder_layer_types into
            # the layer_types of the decoder's cache, and must not fall back to the encoder's.
            self.decoder_layer_types = ["full_attention"] * self.decoder_layers
        super().__post_init__(**kwargs)

    def _validate(self) -> None:
        super()._validate()
        _check_int("decoder_layers", self.decoder_layers, 1)
        self._check_layer_types(
            "decoder_layer_types", self.decoder_layer_types, self.decoder_layers, "decoder_layers"
        )
        _check_bool("shared_embeddings", self.shared_embeddings)
        _check_bool("scale_decoder_outputs", self.scale_decoder_outputs)
        _check_bool("add_final_logits_bias", self.add_final_logits_bias)
        if not self.is_encoder_decoder:
            raise ValueError("Seq2SeqConfig needs is_encoder_decoder=True")
        causal_global = [t for t in self.decoder_layer_types if LAYER_TYPE_PATTERN[t] in GLOBAL_KINDS]
        if self.global_projections and causal_global:
            raise ValueError(
                f"global_projections=True applies to the encoder, but decoder_layer_types has {causal_global[0]!r} "
                "layers: the decoder's self-attention is causal, and a global token's own projections attend to "
                "every key, later tokens included (Longformer's query_global/key_global/value_global). Use "
                "'sliding_attention' or 'full_attention' decoder layers, or global_projections=False"
            )

    def _token_id_fields(self) -> tuple[str, ...]:
        return (*super()._token_id_fields(), "decoder_start_token_id")

    def _all_layer_types(self) -> list[str]:
        return list(self.layer_types) + list(self.decoder_layer_types)


__all__ = ["SwapformerConfig", "EncoderConfig", "DecoderConfig", "Seq2SeqConfig"]
