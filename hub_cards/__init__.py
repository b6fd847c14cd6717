"""Model-card templates rendered into Hub-ready folders (package data)."""
