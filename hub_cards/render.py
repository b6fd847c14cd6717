"""Render a model card (README.md with Hub metadata) from a template in this folder.

The metadata is huggingface_hub's `ModelCardData`: `library_name`, `tags`, `datasets`, `metrics`
and the evaluation results as `EvalResult`s, which the Hub shows as the model-index widget.
"""

from __future__ import annotations

import pathlib

from huggingface_hub import EvalResult, ModelCard, ModelCardData

TEMPLATES = pathlib.Path(__file__).parent


def render_model_card(
    *,
    model_name: str,
    dataset_name: str,
    task_type: str,
    pipeline_tag: str,
    tags: list[str],
    results: dict[str, float],
    template: str = "model_card.md",
    **values,
) -> ModelCard:
    """A ModelCard whose metadata lists `results` ({metric name: value} on the validation split of
    `dataset_name`) and whose text is `template` filled with `values` (and the arguments above)."""
    data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        datasets=[dataset_name],
        metrics=sorted(results),
        eval_results=[
            EvalResult(
                task_type=task_type,
                dataset_type=dataset_name,
                dataset_name=dataset_name,
                dataset_split="validation",
                metric_type=name,
                metric_name=name,
                metric_value=round(float(value), 4),
            )
            for name, value in results.items()
        ],
    )
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATES / template),
        model_name=model_name,
        dataset_name=dataset_name,
        **values,
    )


def model_values(model) -> dict:
    """The template values of a card's model table that the model and its config hold: class, type,
    width, heads (and key-value heads), positions, norm, MLP, vocabulary and context."""
    cfg = model.config
    return dict(
        model_class=type(model).__name__,
        model_type=cfg.model_type,
        hidden_size=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        positions=cfg.position_embedding_type,
        norm=cfg.norm_type,
        mlp=f"{cfg.mlp_type} ({cfg.hidden_act})",
        vocab_size=cfg.vocab_size,
        max_positions=cfg.max_position_embeddings,
    )
