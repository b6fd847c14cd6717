"""The base configuration of the three swapformer architectures: the fields they share.

Each field is declared once below, with its rule (`config_fields.py`: kind, range or choices, owning
feature, fix); the rules between fields are in `config_rules.py`. Everything is validated at
construction, so a wrong value fails here with a message that names it, not later inside a kernel.
This module must not import torch: configs are read on machines and in tools that never build a model.

transformers 5.x configs are dataclasses: fields are declared as annotated class attributes, derived
values are filled in `__post_init__`, and base fields such as `tie_word_embeddings` or
`is_encoder_decoder` are fields too, never assigned before the base init.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .backends import AUTO_BACKEND, PER_LAYER_BACKEND, check_backend_name, check_layer_backends
from .config_fields import check_fields, check_int, choice, flag, free, integer, number, probability, token_id
from .config_rules import SHARED_RULES
from .tp_plan import PlanOfConfig

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
# Where a window + global cache puts its kept leading tokens (modeling/variants/sinks.py: streaming sinks)
STREAMING_POSITIONS = ("absolute", "cache")
SCALE_FIX = "or None for head_dim ** -0.5 (T5 uses 1.0)"
INIT_FIX = "it is the std of the initial weights (0.02 is usual)"
EPS_FIX = "it keeps the norm's division away from zero (1e-5 for LayerNorm, 1e-6 for RMSNorm are usual)"


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
            window plus k). RoPE decoders with `sliding_global_attention` layers (modeling/variants/sinks.py).
        attention_sinks: each self-attention layer learns `sinks`, one logit per query head that joins
            the softmax's denominator and carries no value (gpt-oss's attention sinks; modeling/variants/sinks.py).
    """

    model_type = "swapformer"
    # read by transformers (tp_plan="auto", pipeline stages) for the base models: the encoder's and the
    # decoder's (embed_tokens, layers, norm), as Llama's
    base_model_tp_plan = PlanOfConfig()
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }
    # The rules between fields this class obeys (config_rules.py), run after each field's own check
    _rules = SHARED_RULES

    # The field table: one line per field, default first (None: derived in __post_init__ unless optional).
    vocab_size: int = integer(32000, minimum=1, feature="sizes")
    hidden_size: int = integer(768, minimum=1, feature="sizes")
    num_hidden_layers: int = integer(12, minimum=1, feature="sizes")
    num_attention_heads: int = integer(12, minimum=1, feature="heads")
    num_key_value_heads: int | None = integer(None, minimum=1, feature="heads")
    head_dim: int | None = integer(None, minimum=1, feature="heads")
    intermediate_size: int | None = integer(None, minimum=1, feature="mlp")
    hidden_act: str = choice("gelu", ACTIVATIONS, feature="mlp")
    mlp_type: str = choice("mlp", MLP_TYPES, feature="mlp")
    max_position_embeddings: int = integer(512, minimum=1, feature="positions")
    position_embedding_type: str = choice("learned", POSITION_TYPES, feature="positions")
    rope_parameters: dict | None = free(None, feature="rope")
    relative_attention_num_buckets: int = integer(32, minimum=1, feature="relative bias")
    relative_attention_max_distance: int = integer(128, minimum=1, feature="relative bias")
    norm_type: str = choice("layernorm", NORM_TYPES, feature="norms")
    norm_eps: float = number(1e-5, minimum=0.0, above=True, feature="norms", fix=EPS_FIX)
    pre_norm: bool = flag(True, feature="norms")
    embedding_norm: bool = flag(False, feature="embeddings")
    scale_embeddings: bool = flag(False, feature="embeddings")
    attention_bias: bool = flag(True, feature="attention")
    mlp_bias: bool = flag(True, feature="mlp")
    attention_scale: float | None = number(
        None, minimum=0.0, optional=True, feature="attention", fix=SCALE_FIX
    )
    hidden_dropout: float = probability(0.1)
    embedding_dropout: float | None = probability(None, optional=True)
    embedding_dropout_first: bool = flag(False, feature="dropout")
    final_dropout: bool = flag(False, feature="dropout")
    attention_dropout: float = probability(0.0)
    activation_dropout: float = probability(0.0)
    classifier_dropout: float | None = probability(None, optional=True)
    initializer: str = choice("normal", INITIALIZERS, feature="initialisation")
    initializer_range: float = number(0.02, minimum=0.0, feature="initialisation", fix=INIT_FIX)
    tie_word_embeddings: bool = flag(True, feature="embeddings")
    layer_types: list[str] | None = free(None, feature="patterns")
    sliding_window: int | None = integer(None, minimum=1, optional=True, feature="patterns")
    global_tokens: int = integer(0, minimum=0, feature="patterns")
    attention_block_size: int = integer(64, minimum=1, feature="patterns")
    num_random_blocks: int = integer(3, minimum=0, feature="patterns")
    random_seed: int = integer(0, minimum=0, feature="patterns")
    global_projections: bool = flag(False, feature="global projections")
    linformer_k: int | None = integer(None, minimum=1, optional=True, feature="linformer")
    linformer_sharing: str = choice("layerwise", LINFORMER_SHARING, feature="linformer")
    attention_sinks: bool = flag(False, feature="sinks")
    streaming_positions: str = choice("absolute", STREAMING_POSITIONS, feature="streaming positions")
    use_cache: bool = flag(True, feature="generation")
    pad_token_id: int | None = token_id()
    bos_token_id: int | None = token_id()
    eos_token_id: int | list[int] | None = token_id()

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
        self._derive_defaults()
        self._validate()
        if backend is not None and not isinstance(backend, dict):
            check_backend_name(backend)

    def _derive_defaults(self) -> None:
        """Fill the fields whose `None` means a value derived from others; their sources are checked first."""
        check_int("hidden_size", self.hidden_size, 1)
        check_int("num_attention_heads", self.num_attention_heads, 1)
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
        check_int("num_hidden_layers", self.num_hidden_layers, 1)
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    def _validate(self) -> None:
        """Each field against its rule in the table, then the rules between fields."""
        check_fields(self)
        for rule in self._rules:
            rule(self)

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

    def to_dict(self) -> dict:
        """transformers' dict, plus `attn_implementation` when it is "auto", which names no machine (issue 30)."""
        d = super().to_dict()
        return {**d, "attn_implementation": AUTO_BACKEND} if self._attn_implementation == AUTO_BACKEND else d

    @property
    def rope_theta(self) -> float:
        """The RoPE base, read from `rope_parameters` (the attribute of configs before transformers 5)."""
        return (self.rope_parameters or {}).get("rope_theta", self.default_theta)

    @rope_theta.setter
    def rope_theta(self, value) -> None:
        self.rope_parameters = {**(self.rope_parameters or {}), "rope_theta": value}

    def _all_layer_types(self) -> list[str]:
        return list(self.layer_types)

    # Derived values used by the modeling code ----------------------------------------------------

    @property
    def effective_attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attention_scale is None else float(self.attention_scale)


__all__ = ["SwapformerConfig"]
