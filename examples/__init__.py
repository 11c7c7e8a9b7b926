"""Examples of jaxmp, run from the repository root as modules: ``python -m examples.compare``."""
