"""Tests of jaxmp.scaler_for: the scaler a training script uses for each compute dtype."""

import jax
import jax.numpy as jnp
import pytest

import jaxmp


def _same(a, b):
    """Same type, settings included (static fields are part of the tree structure), same numbers."""
    return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
            and all(bool(jnp.all(x == y)) for x, y in
                    zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))))


@pytest.mark.parametrize("dtype", [jnp.float16, "float16", "f16", jnp.dtype("float16")])
def test_float16_gets_a_dynamic_scaler_with_the_given_settings(dtype):
    assert _same(jaxmp.scaler_for(dtype), jaxmp.init_scaler())
    state = jaxmp.scaler_for(dtype, initial_scale=1024.0, growth_interval=200)
    assert _same(state, jaxmp.init_scaler(initial_scale=1024.0, growth_interval=200))
    assert float(state.scale) == 1024.0 and state.growth_interval == 200


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "bfloat16", jnp.float32, "float32"])
def test_bfloat16_and_float32_get_no_scaling(dtype):
    state = jaxmp.scaler_for(dtype, growth_interval=200)  # settings of the dynamic scaler: unused
    assert _same(state, jaxmp.noop_scaler())
    # No scaling, but a non-finite step is still counted.
    assert float(jaxmp.scale(state, jnp.asarray(3.0))) == 3.0
    assert int(jaxmp.adjust(state, jnp.asarray(False)).skipped_steps) == 1


@pytest.mark.parametrize("dtype, message", [
    (jnp.float64, "compute_dtype must be one of float16, bfloat16, float32; got float64"),
    (jnp.int32, "compute_dtype must be one of float16, bfloat16, float32; got int32"),
    ("fp16", "compute_dtype must be a floating-point dtype, got .fp16."),
])
def test_other_dtypes_are_refused(dtype, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.scaler_for(dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_settings_are_checked_whatever_the_dtype(dtype):
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        jaxmp.scaler_for(dtype, backoff_factor=2.0)
    with pytest.raises(TypeError, match="growth_intervall"):
        jaxmp.scaler_for(dtype, growth_intervall=200)
