"""Attention: the backend functions, the mask predicate and its lowerings, packed sequences, 4D masks."""
