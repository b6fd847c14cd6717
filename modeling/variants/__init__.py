"""Attention variants chosen when a model is built: MLA, Linformer, sinks, streaming, global projections."""
