"""Flax examples: ``python -m examples.flax.train_linen``, ``python -m examples.flax.train_nnx``."""
