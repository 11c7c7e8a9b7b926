"""Equinox example: ``python -m examples.equinox.train``."""
