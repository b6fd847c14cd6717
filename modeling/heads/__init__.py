"""The three architectures, their task heads, losses and generation."""
