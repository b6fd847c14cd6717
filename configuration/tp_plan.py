"""The tensor-parallel plan of a configuration (`base_model_tp_plan`), built from its fields.

Torch-free: transformers reads the plan from the config (`tp_plan="auto"`).
"""

from __future__ import annotations

# Tensor-parallel styles of an attention layer (transformers' names, Llama's choices): heads are split over
# ranks, the projections into heads by columns and the one out of them by rows. The MLP's inner width is
# split the same way (`_stack_tp_plan`).
ATTENTION_TP_PLAN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
# Longformer's own projections of global tokens (`global_projections`), sharded by heads as q/k/v are
GLOBAL_TP_PLAN = {f"{name}_global_proj": "colwise" for name in "qkv"}
# MLA (modeling/variants/mla.py): the up-projections by heads, with the query's (`_stack_tp_plan`); the latent
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


class PlanOfConfig:
    """`base_model_tp_plan`, which transformers reads on the config (`tp_plan="auto"`): built from the config's
    fields when read, so it follows a field changed after construction and is never saved; read on the class,
    the plan of its defaults. A plan assigned to an instance replaces it (a non-data descriptor)."""

    def __get__(self, config, owner) -> dict[str, str]:
        return tensor_parallel_plan(owner if config is None else config)
