"""Training: the `swapformer train` job (Accelerate loop, data, tokenizer training, metrics)."""
