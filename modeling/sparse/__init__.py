"""The block-sparse backend: block layouts, global tokens, BigBird random blocks."""
