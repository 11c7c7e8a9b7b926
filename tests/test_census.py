"""The trace-time check of the share of FLOPs in half precision (jaxmp/_src/census.py): which
line its MostlyFloat32Warning names for a float32 value the model makes itself."""

import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxmp
from jaxmp._src import census
from jaxmp._src import jaxprs
from tests import helpers

# User code: a Haiku graph net written for JAX's default promotion.
pytestmark = pytest.mark.usefixtures("standard_promotion")


def test_the_warning_names_the_line_that_made_the_float32_value():
    # The globals are made float32 inside the model (jnp.zeros), which casting the inputs does
    # not reach: the global update's products run in float32. The warning named the line of
    # the first such product (inside the net); it now names where the float32 was made too.
    loss, params, state, graph, targets = helpers.graph_net()
    step = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, has_aux=True,
                                   autocast=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.make_jaxpr(step)(params, state, graph, targets,
                             scaler_state=jaxmp.scaler_for(jnp.bfloat16))
    said = [str(c.message) for c in caught if c.category is jaxmp.debug.MostlyFloat32Warning]
    assert len(said) == 1
    assert "a dot_general of float32 x bfloat16 operands at helpers.py:" in said[0]
    assert f"; its float32 operand was made at {helpers.graph_zeros_line()}." in said[0]


def _products(fn, *args):
    """The products of ``fn``'s program, and its index: ``(products, producer, same)``."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = [eqn for eqn, _, _ in census.census(jaxpr)]
    return found, jaxprs.nested_producers(jaxpr), jaxprs.call_aliases(jaxpr)


def test_wide_origin_prefers_the_value_made_wide_to_promotions():
    w, x = jnp.ones((8, 8), jnp.bfloat16), jnp.ones((4, 8), jnp.bfloat16)

    def f(w, x):
        z = jnp.zeros((4, 8))  # float32: JAX's promotion converts x to it in the concatenate
        h = jax.jit(lambda a, b: jnp.concatenate([a, b]))(x, z)  # across a nested call
        return jnp.tanh(h.reshape(8, 8)) @ w

    (product,), producer, same = _products(f, w, x)
    var, (eqn, _) = census.wide_origin(product, producer, same)
    assert eqn.primitive.name == "broadcast_in_dim" and var.aval.shape == (4, 8)

    def g(w, x):  # a float32 product's result is its own: the second names the first
        return (x.astype(jnp.float32) @ w) @ w

    (first, second), producer, same = _products(g, w, x)
    assert census.wide_origin(second, producer, same)[1][0].primitive.name == "dot_general"
    # With only conversions to go by (x's and w's, by promotion), the first conversion.
    var, (eqn, _) = census.wide_origin(first, producer, same)
    assert eqn.primitive.name == "convert_element_type" and var.aval.shape == x.shape
    # An input is an input.
    (product,), producer, same = _products(lambda w, x: x @ w, w.astype(jnp.float32), x)
    var, found = census.wide_origin(product, producer, same)
    assert found is None and var.aval.dtype == jnp.float32
