"""The lines ``precision_report`` names for a wide product: where its float32 operand was made."""

import jax.numpy as jnp
import pytest

import jaxmp
from tests import helpers

# User code: a Haiku graph net written for JAX's default promotion; its step warns that it is
# mostly float32, which is what the report explains.
pytestmark = [pytest.mark.usefixtures("standard_promotion"),
              pytest.mark.filterwarnings("ignore::jaxmp.debug.MostlyFloat32Warning")]


def test_a_row_names_the_line_that_made_its_float32_operand():
    # The model makes its globals float32 (jnp.zeros); the global update (linear_4) concatenates
    # them with the bfloat16 pooled nodes, and JAX's promotion carries float32 into its products.
    # The rows named the line of the concatenate inside the net; they now name the zeros.
    loss, params, state, graph, targets = helpers.graph_net()
    step = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, has_aux=True,
                                   autocast=False)
    report = jaxmp.debug.precision_report(step, params, state, graph, targets,
                                          scaler_state=jaxmp.scaler_for(jnp.bfloat16),
                                          compute_dtype=jnp.bfloat16)
    rows = [w for w in report.wider if w.layer == "linear_4"]
    assert {(w.phase, w.reason) for w in rows} == {("forward", "user"), ("backward", "user")}
    zeros = helpers.graph_zeros_line()
    for w in rows:
        assert w.where.startswith("helpers.py:") and w.where.endswith("(_graph_net)")
        assert f"a float32 result of an earlier operation at {zeros}" in w.says
    assert f"operation at {zeros}" in str(report).replace("\n    ", " ")
