"""Tests of jaxmp.scaler_for: the scaler a training script uses for each compute dtype."""

import jax
import jax.numpy as jnp
import pytest

import jaxmp
from tests.helpers import matmul_loss


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


# One default compute dtype, and a word when a dynamic scaler meets it. ---------------------

def test_every_function_has_the_same_default_compute_dtype():
    # Issue 34: autocast defaulted to bfloat16, mp_value_and_grad and find_nonfinite to float16.
    import inspect  # pylint: disable=g-import-not-at-top

    functions = (jaxmp.autocast, jaxmp.mp_value_and_grad, jaxmp.accumulate_value_and_grad,
                 jaxmp.debug.find_nonfinite)
    defaults = {f.__name__: inspect.signature(f).parameters["compute_dtype"].default
                for f in functions}
    assert set(defaults.values()) == {jnp.bfloat16}, defaults
    # mp_grad passes its options on: the same default.
    grad_fn = jaxmp.mp_grad(lambda w, x: jnp.sum(x @ w))
    jaxpr = str(jax.make_jaxpr(lambda w, x: grad_fn(w, x, scaler_state=jaxmp.noop_scaler()))(
        jnp.ones((4, 4)), jnp.ones((2, 4))))
    assert "bf16[2,4]" in jaxpr and "f16[" not in jaxpr.replace("bf16[", "")


def test_a_dynamic_scaler_with_bfloat16_is_said_once_while_tracing():
    import warnings  # pylint: disable=g-import-not-at-top

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    step = jax.jit(lambda w, x, s: jaxmp.mp_value_and_grad(matmul_loss)(w, x, scaler_state=s))
    with pytest.warns(UserWarning, match=r"computes in bfloat16 .* dynamic loss scaler") as caught:
        step(w, x, jaxmp.init_scaler())
        step(w, 2 * x, jaxmp.init_scaler())  # the same trace: said once
    said = [c for c in caught if "dynamic loss scaler" in str(c.message)]
    assert len(said) == 1 and "jaxmp.scaler_for(jnp.bfloat16)" in str(said[0].message)
    assert said[0].filename == __file__  # the user's line
    with warnings.catch_warnings():  # the right scaler, float16, or no mixed precision: silent
        warnings.simplefilter("error")
        for fn, scaler in [
                (jaxmp.mp_value_and_grad(matmul_loss), jaxmp.scaler_for(jnp.bfloat16)),
                (jaxmp.mp_value_and_grad(matmul_loss, compute_dtype=jnp.float16),
                 jaxmp.init_scaler()),
                (jaxmp.mp_value_and_grad(matmul_loss, use_mixed_precision=False),
                 jaxmp.init_scaler())]:
            jax.eval_shape(lambda w, x, s, fn=fn: fn(w, x, scaler_state=s), w, x, scaler)
