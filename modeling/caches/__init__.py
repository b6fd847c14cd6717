"""Caches: the view a forward reads, swapformer's cache layer classes, the int8 cache."""
