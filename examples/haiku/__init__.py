"""Haiku examples: ``python -m examples.haiku.train``."""
