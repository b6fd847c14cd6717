"""Draw the pictures the README shows (docs/images/), with swapformer.visualize.

python scripts/make_pictures.py
"""

from __future__ import annotations

import pathlib

import swapformer
from swapformer import visualize
from swapformer.configuration.configuration_swapformer import LAYER_TYPES

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "images"


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    encoder = swapformer.EncoderConfig(
        num_hidden_layers=4,
        layer_types=list(LAYER_TYPES),  # one layer of each type
        sliding_window=8,
        global_tokens=2,
        attention_block_size=8,
        num_random_blocks=2,
        max_position_embeddings=512,
    )
    visualize.plot_pattern(encoder, 96).savefig(OUT / "patterns_encoder.png", dpi=70)
    decoder = swapformer.DecoderConfig(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=16,
        max_position_embeddings=512,
    )
    visualize.plot_pattern(decoder, 64).savefig(OUT / "patterns_decoder.png", dpi=70)
    for name in ("patterns_encoder.png", "patterns_decoder.png"):
        print(f"wrote docs/images/{name}")


if __name__ == "__main__":
    main()
