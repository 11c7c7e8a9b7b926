"""Faults: a long jitted loop with inf and NaN injected into random batches."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

STEPS, BATCH = 300, 16
MIN_SCALE, MAX_SCALE = 4.0, 2.0**12
# rmsprop with momentum keeps two moment trees, where a NaN would stay for good.
OPTIMIZER = optax.rmsprop(1e-2, momentum=0.9)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean(((h @ params["v"])[:, 0] - y) ** 2)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": jax.random.normal(k1, (4, 8)) * 0.5,
        "b": jnp.zeros((8,)),
        "v": jax.random.normal(k2, (8, 1)) * 0.5,
    }


def make_data():
    """Batches of a regression task, a tenth of them poisoned, plus a storm of 12 in a row."""
    kx, kw = jax.random.split(jax.random.key(1))
    xs = np.array(jax.random.normal(kx, (STEPS, BATCH, 4)))
    ys = np.sin(xs @ np.array(jax.random.normal(kw, (4,)))).astype(np.float32)
    rng = np.random.default_rng(0)
    poisoned = rng.random(STEPS) < 0.1
    poisoned[150:162] = True  # an overflow storm: drives the scale down to min_scale
    for step in np.flatnonzero(poisoned):
        row, col = rng.integers(BATCH), rng.integers(4)
        value = rng.choice([np.inf, -np.inf, np.nan])
        if rng.random() < 0.5:
            xs[step, row, col] = value
        else:
            ys[step, row] = value
    return jnp.asarray(xs), jnp.asarray(ys), poisoned


def train(params, scaler, xs, ys, **grad_options):
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, **grad_options)

    def body(carry, batch):
        params, opt_state, scaler = carry
        _, grads, scaler, finite = grad_fn(params, *batch, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, OPTIMIZER, opt_state, grads, finite)
        healthy = jaxmp.all_finite((params, opt_state))
        return (params, opt_state, scaler), (finite, healthy, scaler.scale)

    carry = (params, OPTIMIZER.init(params), scaler)
    return jax.jit(lambda c, b: jax.lax.scan(body, c, b))(carry, (xs, ys))


@pytest.mark.parametrize(
    "compute_dtype, scaler",
    [
        (jnp.float16, jaxmp.init_scaler(
            initial_scale=2.0**10, growth_interval=5, min_scale=MIN_SCALE, max_scale=MAX_SCALE)),
        (jnp.float16, jaxmp.init_scaler(
            initial_scale=2.0**10, growth_interval=5, min_scale=MIN_SCALE, max_scale=MAX_SCALE,
            hysteresis=3)),
        (jnp.bfloat16, jaxmp.noop_scaler()),
    ],
    ids=["float16", "float16-hysteresis3", "bfloat16-noop"],
)
def test_poisoned_batches_never_reach_params_or_optimizer_state(compute_dtype, scaler):
    xs, ys, poisoned = make_data()
    params = init_params()
    (final_params, final_opt_state, final_scaler), (finite, healthy, scales) = train(
        params, scaler, xs, ys, compute_dtype=compute_dtype)
    finite, healthy, scales = np.asarray(finite), np.asarray(healthy), np.asarray(scales)

    assert healthy.all()  # after every one of the 300 steps
    assert bool(jaxmp.all_finite((final_params, final_opt_state)))
    # Every poisoned batch overflowed, and no clean one did.
    np.testing.assert_array_equal(~finite, poisoned)
    assert int(final_scaler.skipped_steps) == poisoned.sum() == (~finite).sum()
    assert ((scales >= final_scaler.min_scale) & (scales <= final_scaler.max_scale)).all()
    if final_scaler.mode == "dynamic":
        # Both bounds were reached, so both were tested.
        assert scales.max() == MAX_SCALE and scales.min() == MIN_SCALE
    # Training made progress on the clean data.
    clean = ~poisoned
    before = loss_fn(params, xs[clean][-10:].reshape(-1, 4), ys[clean][-10:].reshape(-1))
    after = loss_fn(final_params, xs[clean][-10:].reshape(-1, 4), ys[clean][-10:].reshape(-1))
    assert float(after) < 0.5 * float(before)


def test_skipped_batches_leave_no_trace():
    """In float32, the loop over all batches ends where a loop over the clean ones ends."""
    xs, ys, poisoned = make_data()
    params = init_params()
    (with_faults, opt_faults, _), _ = train(
        params, jaxmp.noop_scaler(), xs, ys, use_mixed_precision=False)
    clean = ~poisoned
    (reference, opt_reference, scaler), (finite, _, _) = train(
        params, jaxmp.noop_scaler(), xs[clean], ys[clean], use_mixed_precision=False)
    assert np.asarray(finite).all() and int(scaler.skipped_steps) == 0
    for a, b in zip(jax.tree_util.tree_leaves((with_faults, opt_faults)),
                    jax.tree_util.tree_leaves((reference, opt_reference))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
