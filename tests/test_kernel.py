"""The shared gradient step: options every wrapper accepts and rejects the same way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from tests.helpers import matmul_loss

WRAPPERS = {
    "jaxmp.mp_value_and_grad": lambda fn, **kw: jaxmp.mp_value_and_grad(fn, **kw),
    "jaxmp.mp_grad": lambda fn, **kw: jaxmp.mp_grad(fn, **kw),
    "jaxmp.accumulate_value_and_grad":
        lambda fn, **kw: jaxmp.accumulate_value_and_grad(fn, 2, **kw),
}


W, X = jnp.linspace(-1.0, 1.0, 3), jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)


@pytest.mark.parametrize("api", sorted(WRAPPERS))
def test_missing_scaler_state_names_the_wrapper_and_how_to_make_one(api):
    fn = WRAPPERS[api](matmul_loss)
    with pytest.raises(TypeError, match=f"The function returned by {api} needs the keyword "
                                        r"argument scaler_state=.*"
                                        r"jaxmp.scaler_for\(compute_dtype\)"):
        fn(W, X)


@pytest.mark.parametrize("api", sorted(WRAPPERS))
def test_bool_argnums_is_rejected_by_every_wrapper(api):
    with pytest.raises(TypeError, match="argnums must be an int or a non-empty sequence of ints, "
                                        "got True"):
        WRAPPERS[api](matmul_loss, argnums=True)


@pytest.mark.parametrize("api", sorted(WRAPPERS))
def test_no_cast_argnums_cannot_overlap_argnums(api):
    with pytest.raises(ValueError, match=r"Arguments \[0\] are in both argnums and "
                                         "no_cast_argnums"):
        WRAPPERS[api](matmul_loss, no_cast_argnums=(0,))


def _stateful_loss(w, stats, x):
    # Like a batch-norm layer: the running statistics must arrive in float32,
    # while the activations run in the compute dtype.
    assert stats["mean"].dtype == jnp.float32
    assert x.dtype == jnp.float16
    h = x @ w
    new_mean = 0.9 * stats["mean"] + 0.1 * jnp.mean(h, axis=0).astype(jnp.float32)
    return jnp.mean(h.astype(jnp.float32) ** 2), {"mean": new_mean}


def _reference(w, stats, x):
    h = x @ w
    new_mean = 0.9 * stats["mean"] + 0.1 * jnp.mean(h, axis=0)
    return jnp.mean(h ** 2), {"mean": new_mean}


def test_no_cast_argnums_passes_state_uncast_and_matches_float32():
    w = jnp.linspace(-0.5, 0.5, 6).reshape(3, 2)
    stats = {"mean": jnp.asarray([1e-4, 3.0], jnp.float32)}  # 1e-4 is not float16-exact
    fn = jax.jit(jaxmp.mp_value_and_grad(_stateful_loss, has_aux=True, no_cast_argnums=1,
                                         autocast=False, compute_dtype=jnp.float16))
    (loss, new_stats), grads, _, finite = fn(w, stats, X, scaler_state=jaxmp.init_scaler(2.0**10))
    (ref_loss, ref_stats), ref_grads = jax.value_and_grad(_reference, has_aux=True)(w, stats, X)
    assert bool(finite) and new_stats["mean"].dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-2, atol=1e-3)
    np.testing.assert_allclose(new_stats["mean"], ref_stats["mean"], rtol=1e-2)


def test_accumulate_no_cast_argnums_is_not_split_nor_cast():
    w = jnp.linspace(-0.5, 0.5, 6).reshape(3, 2)
    stats = {"mean": jnp.asarray([1e-4, 3.0], jnp.float32)}  # leading axis 2 == k
    fn = jaxmp.accumulate_value_and_grad(_stateful_loss, 2, has_aux=True, no_cast_argnums=1,
                                         autocast=False, compute_dtype=jnp.float16)
    (loss, new_stats), grads, _, finite = fn(w, stats, X, scaler_state=jaxmp.init_scaler(2.0**10))
    ref_loss, ref_grads = jax.value_and_grad(lambda w: _reference(w, stats, X)[0])(w)
    assert bool(finite)
    assert new_stats["mean"].shape == (2, 2)  # stacked per micro-batch, each from the whole stats
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-2, atol=1e-3)


def _dropout_loss(w, x, key):
    keep = jax.random.bernoulli(key, 0.5, (x.shape[-1],))
    return jnp.mean((x @ jnp.where(keep, w, jnp.zeros_like(w))) ** 2)


@pytest.mark.parametrize("make_key", [jax.random.PRNGKey, jax.random.key], ids=["raw", "typed"])
def test_accumulate_passes_a_single_key_to_every_microbatch(make_key):
    key = make_key(3)
    state = jaxmp.init_scaler(2.0**10)
    loss, grads, _, finite = jaxmp.accumulate_value_and_grad(_dropout_loss, 2,
                                                             compute_dtype=jnp.float16)(
        W, X, key, scaler_state=state)
    ref_loss, ref_grads = jax.value_and_grad(_dropout_loss)(W, X, key)
    assert bool(finite)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    np.testing.assert_allclose(grads, ref_grads, rtol=1e-2, atol=1e-3)


def test_accumulate_error_for_a_non_batch_argument_says_to_use_batch_argnums():
    with pytest.raises(ValueError, match=r"argument 2 has shape \(3,\).*leave it out of "
                                         "batch_argnums"):
        jaxmp.accumulate_value_and_grad(lambda w, x, c: matmul_loss(w * c, x), 2,
                                        compute_dtype=jnp.float16)(
            W, X, jnp.ones(3), scaler_state=jaxmp.init_scaler())
