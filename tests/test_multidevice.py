"""Multi-device behaviour on several CPU devices (conftest.py asks for 4)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp

NUM = 4


def _loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    pred = h @ params["w2"]
    return jnp.mean((pred[:, 0] - y) ** 2)


def _setup(n=16):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k1, (5, 8)) / 3, "w2": jax.random.normal(k2, (8, 1)) / 3}
    x = jax.random.normal(k3, (n, 5))
    y = jax.random.normal(k4, (n,))
    return params, x, y


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < NUM:
        pytest.skip(f"needs {NUM} devices")
    return jax.make_mesh((NUM,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def _train_step(params, opt_state, scaler, x, y, opt, axis_name=None):
    loss, grads, scaler, finite = jaxmp.mp_value_and_grad(_loss, axis_name=axis_name)(
        params, x, y, scaler_state=scaler)
    params, opt_state = jaxmp.optimizer_update(params, opt, opt_state, grads, finite)
    return params, opt_state, scaler, loss, finite


def test_named_sharding_data_parallel_equals_single_device(mesh):
    params, x, y = _setup()
    opt = optax.sgd(0.1)  # linear in the gradients: does not amplify rounding as adam does
    scaler = jaxmp.init_scaler(initial_scale=2.0**10, growth_interval=2)
    step = jax.jit(lambda *a: _train_step(*a, opt))
    single = (params, opt.init(params), scaler)
    replicated = NamedSharding(mesh, P())
    batch = NamedSharding(mesh, P("data"))
    sharded = jax.device_put(single, replicated)
    xs, ys = jax.device_put(x, batch), jax.device_put(y, batch)
    assert len(xs.sharding.device_set) == NUM
    for _ in range(3):
        *single, loss1, fin1 = step(*single, x, y)
        *sharded, loss2, fin2 = step(*sharded, xs, ys)
        np.testing.assert_allclose(loss2, loss1, rtol=1e-5)
        assert bool(fin1) == bool(fin2)
    # Half-precision partial sums are split differently across devices: allow rounding.
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5),
                           sharded, single)
    assert float(sharded[2].scale) == float(single[2].scale) == 2.0**11


def _per_device(mesh, x, y, params, scaler):
    """Runs mp_value_and_grad in shard_map and returns every device's copy of the results."""

    def body(params, x, y, scaler):
        loss, grads, new, finite = jaxmp.mp_value_and_grad(_loss, axis_name="data")(
            params, x, y, scaler_state=scaler)
        add = lambda t: jax.tree_util.tree_map(lambda v: v[None], t)
        return add(loss), add(grads), add(new), add(finite)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                       out_specs=P("data"))
    batch = NamedSharding(mesh, P("data"))
    return jax.jit(fn)(params, jax.device_put(x, batch), jax.device_put(y, batch), scaler)


def test_shard_map_gives_gradient_of_mean_of_per_device_losses(mesh):
    params, x, y = _setup()
    xs, ys = x.reshape(NUM, -1, 5), y.reshape(NUM, -1)

    def mean_loss(p):
        return jnp.mean(jnp.stack([_loss(p, xs[i], ys[i]) for i in range(NUM)]))

    ref_loss, ref_grads = jax.value_and_grad(mean_loss)(params)
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    loss, grads, new, finite = _per_device(mesh, x, y, params, scaler)
    for d in range(NUM):
        np.testing.assert_allclose(loss[d], ref_loss, rtol=2e-2)
        for k in params:
            np.testing.assert_allclose(grads[k][d], ref_grads[k], rtol=5e-2, atol=5e-3)
    assert np.asarray(finite).all()


def test_shard_map_one_device_overflows_all_agree(mesh):
    params, x, y = _setup()
    x = x.at[5].set(jnp.inf)  # row 5 lives on device 1 only
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    _, _, new, finite = _per_device(mesh, x, y, params, scaler)
    assert np.asarray(finite).tolist() == [False] * NUM
    assert np.asarray(new.scale).tolist() == [2.0**9] * NUM
    assert np.asarray(new.skipped_steps).tolist() == [1] * NUM


def test_pmap_with_axis_name(mesh):
    params, x, y = _setup()
    xs, ys = x.reshape(NUM, -1, 5), y.reshape(NUM, -1)
    ys = ys.at[2, 0].set(jnp.nan)  # device 2 produces a NaN loss
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def body(x, y):
        return jaxmp.mp_value_and_grad(_loss, axis_name="data")(params, x, y, scaler_state=scaler)

    _, _, new, finite = jax.pmap(body, axis_name="data")(xs, ys)
    assert np.asarray(finite).tolist() == [False] * NUM
    assert np.asarray(new.scale).tolist() == [2.0**9] * NUM


def test_all_finite_with_axis_name(mesh):
    x = jnp.ones((NUM, 3)).at[3, 1].set(jnp.nan)

    def body(v):
        return jaxmp.all_finite(v, axis_name="data")[None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert np.asarray(out).tolist() == [False] * NUM
