"""Model-card templates rendered into Hub-ready folders (package data), and the upload paths that carry
swapformer's card (`publish.py`). `CardTrainerMixin` gives a Trainer class of your own swapformer's card
in `push_to_hub`: `class CardTrainer(CardTrainerMixin, transformers.Trainer): ...`."""

from .publish import CardTrainerMixin, PublishError

__all__ = ["CardTrainerMixin", "PublishError"]
