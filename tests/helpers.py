"""Models, losses, checks and fixtures that several test files share.

Test files import it as ``from tests import helpers``; its fixtures need no import
(conftest.py loads this module as a plugin). ``tests`` is a namespace package found on
``sys.path``: pytest puts the directory of the root ``conftest.py`` there, as it does for
``benchmarks`` and ``examples``, so this works from a clean clone and under ``pytest -n auto``.
A helper lives here only when the files that use it need exactly the same thing; a variant
(another activation, another initialisation) stays in its file.
"""

import doctest
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp


def mlp_loss(params, x, y):
    """Cross-entropy of a GELU MLP (``params``: a list of ``{"w", "b"}`` layers) on labels ``y``.

    Example:
        >>> params = [{"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}]
        >>> round(float(mlp_loss(params, jnp.ones((4, 3)), jnp.zeros(4, jnp.int32))), 4)
        0.6931
    """
    for layer in params[:-1]:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))


def matmul(w, x):
    """``x @ w``: the one product of a test, as a named function (its name shows in jaxprs)."""
    return x @ w


def matmul_loss(w, x):
    """The mean square of ``x @ w``: a loss with one product and a gradient."""
    return jnp.mean((x @ w) ** 2)


def rel(a, b, axis=None):
    """The relative error ``|a - b| / |b|`` (2-norms, in float64), along ``axis`` or overall."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b, axis=axis) / np.linalg.norm(b, axis=axis)


def assert_bitwise(a, b):
    """``a`` and ``b`` are the same tree of arrays with the same dtypes, shapes and bits."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.fixture
def standard_promotion():
    """Runs a test under JAX's default dtype promotion, as user code is written.

    The rest of the suite runs under strict promotion (conftest.py). A test file of user code
    (models written as framework users write them) makes it apply to all its tests with
    ``pytestmark = pytest.mark.usefixtures("standard_promotion")`` (conftest.py loads this
    module as a plugin, so its fixtures are known to every test file).
    """
    with jax.numpy_dtype_promotion("standard"):
        yield


def public_names():
    """Every public name, relative to jaxmp: ``mp_grad``, ``debug.find_nonfinite``, ...

    The names of ``__all__`` of ``jaxmp``, ``jaxmp.debug`` and ``jaxmp.experimental``, so that a
    name added later is covered.
    """
    return [*jaxmp.__all__, *(f"debug.{name}" for name in jaxmp.debug.__all__),
            *(f"experimental.{name}" for name in jaxmp.experimental.__all__)]


def examples_of(name):
    """``(test name, docstring)`` of ``jaxmp.<name>`` and its methods, those with examples."""
    obj = jaxmp
    for part in name.split("."):
        obj = getattr(obj, part)
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj))
    tests = finder.find(obj, f"jaxmp.{name}", module=False, globs={})
    return [(t.name, t.docstring) for t in tests if t.examples]


def public_examples():
    """``(test name, docstring)`` of every public name's examples (tests/test_docstrings.py)."""
    return [pair for name in sorted(public_names()) for pair in examples_of(name)]
