"""Test configuration (tests and doctests): several CPU devices, strict promotion.

Both must be set before JAX initialises its backends, so they live here, at
import time of the test session.
"""

import os
import re

import pytest

# The suite runs on CPU devices. With JAX's CUDA plugin installed (pip install -e
# ".[gpu-compile]", for the gpu_program tests) and no GPU, the plugin registers its
# platform for deviceless compilation only under JAX_PLATFORMS=cpu.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after the platform is chosen)

# Multi-device behaviour is tested on CPU with several host devices.
jax.config.update("jax_num_cpu_devices", 4)
# A mixed-precision library must never rely on implicit promotion
# (bfloat16 * float32 -> float32 silently throws the saving away).
jax.config.update("jax_numpy_dtype_promotion", "strict")


# The fixtures that several test files share (tests/helpers.py).
pytest_plugins = ["tests.helpers"]


def _long_tests() -> frozenset:
    """The node ids listed in tests/long_tests.txt (one per line after its seconds)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "long_tests.txt")
    with open(path) as f:
        return frozenset(line.split()[1] for line in f
                         if line.strip() and not line.startswith("#"))


_LONG_TESTS = _long_tests()


def pytest_itemcollected(item):
    # Before -m selects: a long test is a slow one (run by `pytest -m slow`).
    if item.nodeid in _LONG_TESTS:
        item.add_marker("slow")


def pytest_configure(config):
    # The default run compiles without XLA:CPU's LLVM optimisations, as the quick benchmarks
    # and several tests already do: compiling is most of its time, and unoptimised code
    # compiles in about half of it. The programs (the optimised HLO: the dtypes, op names and
    # collectives that tests read) are the same; the code that runs them is less optimised, and
    # rounds float16 and bfloat16 transcendentals a little differently, within every tolerance.
    # The slow and gpu_program runs keep XLA's default, as does an XLA_FLAGS that sets a level.
    markexpr, flags = config.getoption("markexpr") or "", os.environ.get("XLA_FLAGS", "")
    default_run = ("not slow" in markexpr and "not gpu_program" in markexpr
                   and not re.search(r"(?<!not )\b(slow|gpu_program)\b", markexpr))
    if default_run and "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0".strip()


def pytest_collection_modifyitems(config, items):
    # Each docstring example runs once. tests/test_docstrings.py runs the examples of every
    # public name in a fresh interpreter, as a user pastes them (an empty namespace, JAX's default
    # configuration), which also catches an example that leans on its module's namespace; so
    # --doctest-modules leaves those out here and runs the rest (private modules' examples, and
    # the module docstrings), in this process, where they share its compiled programs.
    from tests import helpers  # pylint: disable=g-import-not-at-top

    covered = {docstring for _, docstring in helpers.public_examples()}
    run_elsewhere = [item for item in items
                     if isinstance(item, pytest.DoctestItem) and item.dtest.docstring in covered]
    if run_elsewhere:
        config.hook.pytest_deselected(items=run_elsewhere)
        left_out = set(map(id, run_elsewhere))
        items[:] = [item for item in items if id(item) not in left_out]
