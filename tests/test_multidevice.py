"""Multi-device behaviour on several CPU devices (conftest.py asks for 4)."""

import functools
import re

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
    loss, grads, scaler, finite = jaxmp.mp_value_and_grad(_loss, axis_name=axis_name,
                                                          compute_dtype=jnp.float16)(
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
        loss, grads, new, finite = jaxmp.mp_value_and_grad(_loss, axis_name="data",
                                                           compute_dtype=jnp.float16)(
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
        return jaxmp.mp_value_and_grad(_loss, axis_name="data",
                                       compute_dtype=jnp.float16)(params, x, y, scaler_state=scaler)

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


# --- Tensor parallel, FSDP and 2-D meshes inside shard_map -------------------------------------


@pytest.fixture(scope="module")
def mesh2d():
    if jax.device_count() < NUM:
        pytest.skip(f"needs {NUM} devices")
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _tp_loss(params, x, y):
    """Megatron-style MLP: w1 split by columns, w2 by rows along "model", summed over "model"."""
    h = jnp.tanh(x @ params["w1"])
    pred = jax.lax.psum(h @ params["w2"], "model") + params["b"]
    return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)


def _full_loss(params, x, y):
    """The same model on one device, in float32: the reference."""
    h = jnp.tanh(x @ params["w1"])
    pred = h @ params["w2"] + params["b"]
    return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)


def _tp_setup(n=16):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    params = {"w1": jax.random.normal(k1, (8, 8)) / 3, "w2": jax.random.normal(k2, (8, 1)) / 3,
              "b": jnp.full((1,), 0.1)}
    return params, jax.random.normal(k3, (n, 8)), jax.random.normal(k4, (n,))


TP_SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}
FSDP_SPECS = {"w1": P("data", None), "w2": P("data", None), "b": P()}


def _fsdp_loss(params, x, y):
    """FSDP: every weight sharded along "data" and gathered for the forward pass."""
    w1 = jax.lax.all_gather(params["w1"], "data", tiled=True)
    w2 = jax.lax.all_gather(params["w2"], "data", tiled=True)
    pred = jnp.tanh(x @ w1) @ w2 + params["b"]
    return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)


def _sharded_step(mesh, loss_fn, specs, params, x, y, scaler, accumulate=False, **options):
    """One jaxmp step in shard_map; gradients come back with the parameters' specs."""
    make = (lambda f, **o: jaxmp.accumulate_value_and_grad(f, 2, **o)) if accumulate else (
        jaxmp.mp_value_and_grad)

    def body(params, x, y, scaler):
        return make(loss_fn, **options)(params, x, y, scaler_state=scaler)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P("data"), P()),
                       out_specs=(P(), specs, P(), P()))
    params = jax.device_put(params, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs))
    return jax.jit(fn)(params, x, y, scaler)


def _assert_close_to_reference(loss, grads, params, x, y):
    ref_loss, ref_grads = jax.value_and_grad(_full_loss)(params, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for k in params:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=5e-2, atol=5e-3, err_msg=k)


@pytest.mark.parametrize("axis_name", ["data", ("data", "model")])
@pytest.mark.parametrize("accumulate", [False, True])
def test_shard_map_tensor_parallel_matches_float32_reference(mesh2d, axis_name, accumulate):
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    loss, grads, new, finite = _sharded_step(mesh2d, _tp_loss, TP_SPECS, params, x, y, scaler,
                                             accumulate=accumulate, axis_name=axis_name)
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite) and float(new.scale) == 2.0**10


@pytest.mark.parametrize("accumulate", [False, True])
def test_shard_map_fsdp_matches_float32_reference(mesh, accumulate):
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    loss, grads, _, finite = _sharded_step(mesh, _fsdp_loss, FSDP_SPECS, params, x, y, scaler,
                                           accumulate=accumulate, axis_name="data")
    assert grads["w1"].sharding.spec == P("data")  # each device holds its shard's gradient
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite)


FSDP_TP_SPECS = {"w1": P("data", "model"), "w2": P(("data", "model"), None), "b": P()}


def _fsdp_tp_loss(params, x, y):
    """FSDP along "data" (weights gathered) and tensor parallel along "model" (summed)."""
    w1 = jax.lax.all_gather(params["w1"], "data", tiled=True)
    w2 = jax.lax.all_gather(params["w2"], "data", tiled=True)
    pred = jax.lax.psum(jnp.tanh(x @ w1) @ w2, "model") + params["b"]
    return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)


def test_shard_map_fsdp_on_two_dimensional_mesh(mesh2d):
    """FSDP along "data" and tensor parallel along "model" at once."""
    specs, loss_fn = FSDP_TP_SPECS, _fsdp_tp_loss
    params, x, y = _tp_setup()
    # w2 rows are split over "data" and "model": reorder so that model shard m, data shard d
    # holds the rows of w1's columns in model shard m.
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    w2 = params["w2"].reshape(2, 2, 2, 1).transpose(1, 0, 2, 3).reshape(8, 1)
    loss, grads, _, finite = _sharded_step(mesh2d, loss_fn, specs, dict(params, w2=w2), x, y,
                                           scaler, axis_name="data")
    grads = dict(grads, w2=grads["w2"].reshape(2, 2, 2, 1).transpose(1, 0, 2, 3).reshape(8, 1))
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite)


def test_shard_map_overflow_in_one_model_shard_skips_on_every_device(mesh2d):
    """Each model shard has its own loss term; only shard 1's gradient overflows float16."""

    def loss_fn(params, x, y):
        local = jnp.mean((x @ params["w1"]).astype(jnp.float32) ** 2)
        del y
        return jax.lax.psum(local, "model")

    params, x, y = _tp_setup()
    params["w1"] = params["w1"].at[:, 4:].multiply(1e3)  # model shard 1 only
    scaler = jaxmp.init_scaler(initial_scale=2.0**15)

    def body(params, x, y, scaler):
        loss, grads, new, finite = jaxmp.mp_value_and_grad(loss_fn, axis_name="data",
                                                           compute_dtype=jnp.float16)(
            params, x, y, scaler_state=scaler)
        alone = jaxmp.all_finite(grads)
        add = lambda t: jax.tree_util.tree_map(lambda v: v[None], t)
        return add(finite), add(new.scale), add(alone), add(jnp.all(jnp.isfinite(grads["w1"])))

    every = P(("data", "model"))
    fn = jax.shard_map(body, mesh=mesh2d, in_specs=(TP_SPECS, P("data"), P("data"), P()),
                       out_specs=every)
    finite, scale, alone, local = jax.jit(fn)(params, x, y, scaler)
    assert np.asarray(local).tolist() == [True, False, True, False]  # the overflow is local
    assert np.asarray(finite).tolist() == [False] * NUM
    assert np.asarray(scale).tolist() == [2.0**14] * NUM
    assert np.asarray(alone).tolist() == [False] * NUM


def test_shard_map_opt_out_gives_per_device_gradients(mesh):
    params, x, y = _setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def body(params, x, y, scaler):
        loss, grads, new, finite = jaxmp.mp_value_and_grad(_loss, axis_name=(),
                                                           compute_dtype=jnp.float16)(
            params, x, y, scaler_state=scaler)
        add = lambda t: jax.tree_util.tree_map(lambda v: v[None], t)
        return add(loss), add(grads), new, finite

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                       out_specs=(P("data"), P("data"), P(), P()))
    loss, grads, new, finite = jax.jit(fn)(params, x, y, scaler)
    xs, ys = x.reshape(NUM, -1, 5), y.reshape(NUM, -1)
    for d in range(NUM):
        ref_loss, ref_grads = jax.value_and_grad(_loss)(params, xs[d], ys[d])
        np.testing.assert_allclose(loss[d], ref_loss, rtol=2e-2)
        for k in params:
            np.testing.assert_allclose(grads[k][d], ref_grads[k], rtol=5e-2, atol=5e-3)
    assert bool(finite) and float(new.scale) == 2.0**10


@pytest.mark.parametrize("accumulate", [False, True])
def test_shard_map_opt_out_with_per_device_parameters(mesh, accumulate):
    """axis_name=() with parameters that differ per device (varying along the mesh axis, as
    in_specs=P("data") makes them): each device gets its own shard's gradient of its own
    parameters, never averaged, and nothing marks an already varying parameter varying again
    (issue 40: pvary of a varying value raised)."""
    params, x, y = _setup()
    per_device = jax.tree_util.tree_map(
        lambda p: jnp.stack([p * (1.0 + 0.25 * d) for d in range(NUM)]), params)
    make = (functools.partial(jaxmp.accumulate_value_and_grad, num_microbatches=2)
            if accumulate else jaxmp.mp_value_and_grad)

    def body(params, x, y, scaler):
        own = jax.tree_util.tree_map(lambda v: v[0], params)
        loss, grads, new, finite = make(_loss, axis_name=(), compute_dtype=jnp.float16)(
            own, x, y, scaler_state=scaler)
        add = lambda t: jax.tree_util.tree_map(lambda v: v[None], t)
        return add(loss), add(grads), new, finite

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P()),
                       out_specs=(P("data"), P("data"), P(), P()))
    loss, grads, new, finite = jax.jit(fn)(per_device, x, y,
                                           jaxmp.init_scaler(initial_scale=2.0**10))
    xs, ys = x.reshape(NUM, -1, 5), y.reshape(NUM, -1)
    for d in range(NUM):
        own = jax.tree_util.tree_map(lambda v: v[d], per_device)
        ref_loss, ref_grads = jax.value_and_grad(_loss)(own, xs[d], ys[d])
        np.testing.assert_allclose(loss[d], ref_loss, rtol=2e-2)
        for k in params:
            np.testing.assert_allclose(grads[k][d], ref_grads[k], rtol=5e-2, atol=5e-3,
                                       err_msg=f"device {d}, {k}")
    assert bool(finite) and float(new.scale) == 2.0**10


def test_shard_map_without_vma_checks_is_still_data_parallel(mesh):
    params, x, y = _setup()
    ref_loss, ref_grads = jax.value_and_grad(_loss)(params, x, y)
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def body(params, x, y, scaler):
        return jaxmp.mp_value_and_grad(_loss, axis_name="data",
                                       compute_dtype=jnp.float16)(params, x, y, scaler_state=scaler)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                       out_specs=P(), check_vma=False)
    loss, grads, _, finite = jax.jit(fn)(params, x, y, scaler)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    for k in params:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=5e-2, atol=5e-3)
    assert bool(finite)


@pytest.mark.parametrize("make", [
    lambda **o: jaxmp.mp_value_and_grad(_loss, **o),
    lambda **o: jaxmp.accumulate_value_and_grad(_loss, 2, **o),
])
def test_shard_map_misuse_of_axis_name_raises_at_trace_time(mesh, make):
    params, x, y = _setup()
    scaler = jaxmp.init_scaler()

    def run(**options):
        def body(params, x, y, scaler):
            return make(**options)(params, x, y, scaler_state=scaler)[0]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                           out_specs=P("data"))
        return jax.jit(fn).trace(params, x, y, scaler)

    with pytest.raises(ValueError, match=r"axis_name=None.*axis_name='data'.*axis_name=\(\)"):
        run()
    with pytest.raises(ValueError, match="'batch' is not bound here"):
        run(axis_name="batch")
    with pytest.raises(ValueError, match="'model' is not bound here"):
        run(axis_name=("data", "model"))
    # Outside shard_map an axis name is a mistake too; None changes nothing.
    with pytest.raises(ValueError, match="outside shard_map.*leave it None"):
        jax.jit(lambda *a: make(axis_name="data")(*a, scaler_state=scaler))(params, x, y)


def test_reduce_dtype_is_validated_and_used(mesh):
    with pytest.raises(ValueError, match="reduce_dtype"):
        jaxmp.mp_value_and_grad(_loss, reduce_dtype=jnp.int32, compute_dtype=jnp.float16)
    params, x, y = _setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def all_reduce_types(reduce_dtype):
        def body(params, x, y, scaler):
            return jaxmp.mp_value_and_grad(_loss, axis_name="data", reduce_dtype=reduce_dtype,
                                           compute_dtype=jnp.float16)(
                params, x, y, scaler_state=scaler)[1]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                           out_specs=P())
        hlo = jax.jit(fn).lower(params, x, y, scaler).as_text(dialect="hlo")  # before XLA passes
        # e.g. "%all-reduce = (f32[5,8]{1,0}, f32[8,1]{1,0}) all-reduce(...)"
        lines = [line.split(" all-reduce(")[0] for line in hlo.splitlines() if " all-reduce(" in line]
        return {t for line in lines for t in re.findall(r"(\w+)\[5,8\]", line)}

    assert all_reduce_types(None) == {"f32"}
    assert all_reduce_types(jnp.bfloat16) == {"bf16"}


# --- jit with NamedSharding: XLA partitions, jaxmp is called as on one device -------------------

JIT_LAYOUTS = {
    # name: (mesh axes, parameter specs, batch spec)
    "data_parallel": ((NUM,), ("data",), {"w1": P(), "w2": P(), "b": P()}, P("data")),
    "fsdp": ((NUM,), ("data",), {"w1": P("data", None), "w2": P("data", None), "b": P()},
             P("data")),
    "two_d": ((2, 2), ("data", "model"), TP_SPECS, P("data")),
}


def _jit_layout(name):
    if jax.device_count() < NUM:
        pytest.skip(f"needs {NUM} devices")
    shape, axes, specs, batch = JIT_LAYOUTS[name]
    mesh = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    put = lambda tree, spec: jax.device_put(
        tree, jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), spec))
    return mesh, lambda params: put(params, specs), lambda arr: put(arr, batch)


def _masked_loss(params, x, y, mask):
    """The float32-reference model plus sum(w1 * mask): mask picks gradient elements to inflate."""
    return _full_loss(params, x, y) + jnp.sum(params["w1"] * mask).astype(jnp.float32)


@pytest.mark.parametrize("layout", sorted(JIT_LAYOUTS))
def test_jit_named_sharding_matches_float32_reference(layout):
    _, put_params, put_batch = _jit_layout(layout)
    params, x, y = _tp_setup()
    mask = jnp.zeros((8, 8))
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    step = jax.jit(lambda p, x, y, s: jaxmp.mp_value_and_grad(_masked_loss,
                                                              compute_dtype=jnp.float16)(
        p, x, y, mask, scaler_state=s))
    loss, grads, _, finite = step(put_params(params), put_batch(x), put_batch(y), scaler)
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite)


@pytest.mark.parametrize("layout", sorted(JIT_LAYOUTS))
def test_jit_named_sharding_single_element_overflow_skips_bit_for_bit(layout):
    """One float16 gradient element of w1, in one shard, overflows: the whole step is skipped."""
    _, put_params, put_batch = _jit_layout(layout)
    params, x, y = _tp_setup()
    # 100 * scale 1024 > 65504: element (6, 5) of w1's float16 gradient overflows. It lives in
    # data shard 3 (FSDP rows) and model shard 1 (two_d columns).
    mask = jnp.zeros((8, 8)).at[6, 5].set(100.0)
    opt = optax.adam(1e-2)
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    @jax.jit
    def train_step(params, opt_state, scaler, x, y):
        # The cast path: a float16 matrix product overflows one element.
        loss, grads, scaler, finite = jaxmp.mp_value_and_grad(_masked_loss, autocast=False,
                                                              compute_dtype=jnp.float16)(
            params, x, y, mask, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, opt, opt_state, grads, finite)
        return params, opt_state, scaler, finite, grads

    params = put_params(params)
    opt_state = opt.init(params)
    new_params, new_opt_state, new_scaler, finite, grads = train_step(
        params, opt_state, scaler, put_batch(x), put_batch(y))
    bad = ~np.isfinite(np.asarray(grads["w1"]))
    assert bad.sum() == 1 and bad[6, 5]  # a single element overflowed...
    assert not bool(finite)  # ...and the step is skipped everywhere
    for old, new in zip(jax.tree_util.tree_leaves((params, opt_state)),
                        jax.tree_util.tree_leaves((new_params, new_opt_state))):
        assert np.asarray(old).tobytes() == np.asarray(new).tobytes()
    assert float(new_scaler.scale) == 2.0**9 and int(new_scaler.skipped_steps) == 1


# --- reduce_dtype where XLA or autodiff reduces ---------------------------------------------------


def _collective_types(hlo, op, shape):
    """Element types of the ``op`` collectives (e.g. "all-reduce") with a result of ``shape``."""
    heads = [line.split(f" {op}(")[0] for line in hlo.splitlines() if f" {op}(" in line]
    return {t for head in heads for t in re.findall(r"(\w+)\[" + shape + r"\]", head)}


@pytest.mark.parametrize("make", [  # float16: the test reads float16 all-reduces
    lambda **o: jaxmp.mp_value_and_grad(_full_loss, compute_dtype=jnp.float16, **o),
    lambda **o: jaxmp.mp_value_and_grad(_full_loss, compute_dtype=jnp.float16, autocast=True,
                                        **o),  # products in remat
    lambda **o: jaxmp.accumulate_value_and_grad(_full_loss, 2, compute_dtype=jnp.float16,
                                                **o),  # products in a scan
], ids=["plain", "autocast", "accumulate"])
def test_jit_reduce_dtype_moves_xla_all_reduce_to_float32(make):
    _, put_params, put_batch = _jit_layout("data_parallel")
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    args = (put_params(params), put_batch(x), put_batch(y), scaler)

    def compiled(reduce_dtype):
        fn = make(reduce_dtype=reduce_dtype)
        step = jax.jit(lambda p, x, y, s: fn(p, x, y, scaler_state=s))
        return step(*args), step.lower(*args).compile().as_text()

    (_, _, _, _), before = compiled(None)
    (loss, grads, _, finite), after = compiled(jnp.float32)
    # XLA sums w1's gradient over devices on the matrix product's output: float16 by default.
    assert _collective_types(before, "all-reduce", "8,8") == {"f16"}
    assert _collective_types(after, "all-reduce", "8,8") == {"f32"}
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite)


@pytest.mark.parametrize("autocast", [True, False])
def test_shard_map_fsdp_reduce_dtype_moves_reduce_scatter_to_float32(mesh, autocast):
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)
    out = {}
    for rd in (None, jnp.float32):
        loss, grads, _, finite = _sharded_step(mesh, _fsdp_loss, FSDP_SPECS, params, x, y, scaler,
                                               axis_name="data", reduce_dtype=rd)
        _assert_close_to_reference(loss, grads, params, x, y)
        assert bool(finite)

        def body(p, x, y, s, rd=rd):
            # Both paths gather the shards in float16 (autocast narrows before the gather).
            return jaxmp.mp_value_and_grad(_fsdp_loss, axis_name="data", reduce_dtype=rd,
                                           autocast=autocast, compute_dtype=jnp.float16)(
                p, x, y, scaler_state=s)[1]

        fn = jax.shard_map(body, mesh=mesh, in_specs=(FSDP_SPECS, P("data"), P("data"), P()),
                           out_specs=FSDP_SPECS)
        out[rd] = jax.jit(fn).lower(params, x, y, scaler).as_text(dialect="hlo")
    assert _collective_types(out[None], "reduce-scatter", "2,8") == {"f16"}
    assert _collective_types(out[jnp.float32], "reduce-scatter", "2,8") == {"f32"}


@pytest.mark.parametrize("spec", ["ij,jk->ik", "bji,kjb->bki"])  # plain; batch + odd layouts
def test_widened_products_have_the_same_gradients(spec):
    """The rewritten matrix products (float32 gradient outputs) match JAX's own gradients."""
    from jaxmp._src import wide_gradients  # pylint: disable=g-import-not-at-top

    shapes = {"ij,jk->ik": ((4, 3), (3, 5)), "bji,kjb->bki": ((2, 3, 4), (5, 3, 2))}[spec]
    k1, k2 = jax.random.split(jax.random.key(3))
    a = jax.random.normal(k1, shapes[0]).astype(jnp.float16)
    b = jax.random.normal(k2, shapes[1]).astype(jnp.float16)

    def loss(a, b):
        out = jnp.einsum(spec, a, b)

        def body(c, w):  # a product inside a scan body is rewritten too
            return jnp.tanh(c * w), None

        out, _ = jax.lax.scan(body, out, jnp.ones((2,) + out.shape, out.dtype))
        return jnp.sum(out.astype(jnp.float32) ** 2)

    wide = wide_gradients.widen_gradient_products(loss, jnp.float32)
    assert "preferred_element_type=float32" in str(jax.make_jaxpr(jax.grad(wide, (0, 1)))(a, b))
    # Operands stay float16 (tensor cores); only the products' outputs are float32.
    assert jaxmp.debug.half_matmul_flop_share(jax.grad(wide, (0, 1)), a, b) == 1.0
    got = jax.value_and_grad(wide, (0, 1))(a, b)
    want = jax.value_and_grad(loss, (0, 1))(a, b)
    assert got[0] == want[0]  # the forward pass is untouched
    for g, w in zip(got[1], want[1]):
        assert g.dtype == w.dtype == jnp.float16 and g.shape == w.shape
        np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_shard_map_pure_tensor_parallel_with_axis_name_model():
    """Batch replicated, parameters split over "model": list "model" so that the replicated bias
    gets one gradient (the loss is the same on every device, its mean is the loss)."""
    if jax.device_count() < NUM:
        pytest.skip(f"needs {NUM} devices")
    model_mesh = jax.make_mesh((NUM,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def body(params, x, y, scaler):
        return jaxmp.mp_value_and_grad(_tp_loss, axis_name="model",
                                       compute_dtype=jnp.float16)(params, x, y,
                                                                    scaler_state=scaler)

    fn = jax.shard_map(body, mesh=model_mesh, in_specs=(TP_SPECS, P(), P(), P()),
                       out_specs=(P(), TP_SPECS, P(), P()))
    loss, grads, _, finite = jax.jit(fn)(params, x, y, scaler)
    _assert_close_to_reference(loss, grads, params, x, y)
    assert bool(finite)


def test_all_finite_alone_reduces_over_every_mesh_axis_and_checks_names(mesh2d):
    x = jnp.ones((4, 4)).at[3, 3].set(jnp.inf)  # lives on the device at data 1, model 1

    def body(v):
        return jaxmp.all_finite(v)[None]

    fn = jax.shard_map(body, mesh=mesh2d, in_specs=P("data", "model"),
                       out_specs=P(("data", "model")))
    assert np.asarray(jax.jit(fn)(x)).tolist() == [False] * NUM
    assert bool(jaxmp.all_finite(jnp.ones(3)))  # outside shard_map: nothing to reduce
    with pytest.raises(ValueError, match="'data' is not bound here"):
        jaxmp.all_finite(jnp.ones(3), axis_name="data")


# --- Collective bytes: the default moves no more than the cast path ------------------------------


def _collective_bytes(compiled_hlo: str) -> dict:
    """Bytes per device each collective kind moves (payload), from compiled HLO, by kind."""
    from benchmarks.collectives import count_collectives  # pylint: disable=g-import-not-at-top

    totals: dict = {}
    for key, counted in count_collectives(compiled_hlo, NUM).items():
        kind = key.split()[0]
        totals[kind] = totals.get(kind, 0) + counted["payload_bytes"]
    return totals


def _layout_step(layout, mesh, mesh2d, autocast):
    """A compiled float16 jaxmp step of ``layout`` (HLO text), default or cast path."""
    params, x, y = _tp_setup()
    scaler = jaxmp.init_scaler(initial_scale=2.0**10)

    def put_tree(tree, specs, m):
        return {k: jax.device_put(v, NamedSharding(m, specs[k])) for k, v in tree.items()}

    if layout == "jit_named_sharding_fsdp":
        fn = jaxmp.mp_value_and_grad(_full_loss, autocast=autocast, compute_dtype=jnp.float16)
        batch = {"x": P("data"), "y": P("data")}
        data = put_tree({"x": x, "y": y}, batch, mesh)
        args = (put_tree(params, FSDP_SPECS, mesh), data["x"], data["y"], scaler)
        step = jax.jit(lambda p, x, y, s: fn(p, x, y, scaler_state=s))
        return step.lower(*args).compile().as_text()
    m, loss, specs = ((mesh, _fsdp_loss, FSDP_SPECS) if layout == "shard_map_fsdp"
                      else (mesh2d, _fsdp_tp_loss, FSDP_TP_SPECS))
    fn = jaxmp.mp_value_and_grad(loss, axis_name="data", autocast=autocast,
                                 compute_dtype=jnp.float16)
    body = jax.shard_map(lambda p, x, y, s: fn(p, x, y, scaler_state=s), mesh=m,
                         in_specs=(specs, P("data"), P("data"), P()),
                         out_specs=(P(), specs, P(), P()))
    return jax.jit(body).lower(put_tree(params, specs, m), x, y, scaler).compile().as_text()


@pytest.mark.parametrize("layout", ["shard_map_fsdp", "shard_map_fsdp_tp_2d",
                                    "jit_named_sharding_fsdp"])
def test_default_moves_no_more_collective_bytes_than_the_cast_path(mesh, mesh2d, layout):
    """Under the default, a parameter the loss gathers for a product is gathered in float16,
    and its gradient reduce-scattered in float16, as on the cast path: all-gather,
    reduce-scatter and all-reduce bytes (compiled HLO, 4 devices) within 2% of the cast path's."""
    default = _collective_bytes(_layout_step(layout, mesh, mesh2d, autocast=True))
    cast = _collective_bytes(_layout_step(layout, mesh, mesh2d, autocast=False))
    assert set(default) <= set(cast), (default, cast)
    for kind, moved in default.items():
        assert moved <= 1.02 * cast[kind], (layout, kind, default, cast)
    if layout.startswith("shard_map"):
        assert cast["all-gather"] > 0 and cast["reduce-scatter"] > 0


def test_a_gathered_value_that_reaches_float32_work_is_gathered_wide(mesh):
    """Only a value that feeds products alone is narrowed before its collective: one that
    also reaches a float32 sum moves in float32, and the loss keeps its float32 digits."""

    def loss(params, x, y):
        w1 = jax.lax.all_gather(params["w1"], "data", tiled=True)
        reg = jnp.sum(w1 ** 2)  # float32 work on the gathered value
        return jnp.mean((jnp.tanh(x @ w1)[:, 0] - y) ** 2) + 1e-3 * reg

    params, x, y = _tp_setup()
    params = {"w1": params["w1"]}
    specs = {"w1": P("data", None)}
    fn = jaxmp.mp_value_and_grad(loss, axis_name="data", compute_dtype=jnp.float16)
    body = jax.shard_map(lambda p, x, y, s: fn(p, x, y, scaler_state=s)[0], mesh=mesh,
                         in_specs=(specs, P("data"), P("data"), P()), out_specs=P())
    hlo = jax.jit(body).lower(params, x, y, jaxmp.init_scaler()).compile().as_text()
    assert _collective_types(hlo, "all-gather", "8,8") == {"f32"}


def test_tensor_parallel_forward_sums_once_in_the_dtype_chosen(mesh2d):
    """The forward psum of partial products under shard_map runs once (the float32 region
    around it does not recompute it in the backward pass), in the products' dtype by default
    (as on the cast path), and in float32 when the user's AutocastRules take ``psum_invariant``
    out of ``passthrough`` (reduce_dtype governs gradient sums only)."""
    params, x, y = _tp_setup()
    rules = jaxmp.AutocastRules(passthrough=jaxmp.autocast.PASSTHROUGH - {"psum_invariant"})
    wide = jaxmp.autocast(_fsdp_tp_loss, jnp.float16, rules=rules)
    params = {k: jax.device_put(v, NamedSharding(mesh2d, FSDP_TP_SPECS[k]))
              for k, v in params.items()}
    for loss, dtype in ((_fsdp_tp_loss, "f16"), (wide, "f32")):
        fn = jaxmp.mp_value_and_grad(loss, axis_name="data", compute_dtype=jnp.float16)
        body = jax.shard_map(lambda p, x, y, s, fn=fn: fn(p, x, y, scaler_state=s), mesh=mesh2d,
                             in_specs=(FSDP_TP_SPECS, P("data"), P("data"), P()),
                             out_specs=(P(), FSDP_TP_SPECS, P(), P()))
        hlo = jax.jit(body).lower(params, x, y, jaxmp.init_scaler()).compile().as_text()
        sums = [line for line in hlo.splitlines()
                if " all-reduce(" in line and "[8,1]" in line.split(" all-reduce(")[0]]
        assert len(sums) == 1, sums  # one forward sum, not recomputed
        assert _collective_types(hlo, "all-reduce", "8,1") == {dtype}


def _scanned_loss(params, x, y):
    """Layers under lax.scan, as scanned models (nn.scan, MaxText) run them."""
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["ws"])
    return jnp.mean((jnp.sum(jax.nn.softmax(h) * 2.0, axis=-1) - y) ** 2)


@pytest.mark.parametrize("axis_name", [(), "data"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_shard_map_step_of_a_scanned_model(mesh, accumulate, axis_name):
    """A loss with layers under lax.scan, in a shard_map body, in float16 (issue 40): the float32
    regions autocast recomputes inside the scan body are traced with the body's varying axes,
    so the scan's carry types match (it raised 'Scan carry input and output got mismatched
    varying manual axes'). Each device's gradient (or their mean) is the float32 one."""
    ws = jax.random.normal(jax.random.key(1), (3, 8, 8)) / 3
    x = jax.random.normal(jax.random.key(2), (4 * NUM, 8))
    y = jax.random.normal(jax.random.key(3), (4 * NUM,))
    make = (functools.partial(jaxmp.accumulate_value_and_grad, num_microbatches=2)
            if accumulate else jaxmp.mp_value_and_grad)

    def body(params, x, y, scaler):
        loss, grads, new, finite = make(_scanned_loss, axis_name=axis_name,
                                        compute_dtype=jnp.float16)(params, x, y,
                                                                   scaler_state=scaler)
        add = lambda t: jax.tree_util.tree_map(lambda v: v[None], t)
        return add(loss), add(grads), new, finite

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                       out_specs=(P("data"), P("data"), P(), P()))
    loss, grads, _, finite = jax.jit(fn)({"ws": ws}, x, y, jaxmp.init_scaler(initial_scale=8.0))
    xs, ys = x.reshape(NUM, -1, 8), y.reshape(NUM, -1)
    refs = [jax.grad(_scanned_loss)({"ws": ws}, xs[d], ys[d])["ws"] for d in range(NUM)]
    for d in range(NUM):
        want = refs[d] if axis_name == () else sum(refs) / NUM
        np.testing.assert_allclose(grads["ws"][d], want, rtol=5e-2, atol=5e-3,
                                   err_msg=f"device {d}")
    assert bool(finite)


def test_shard_map_delayed_scaling_records_the_amax_of_the_whole_batch(mesh):
    """Under shard_map with axis_name, each device's history entry is the scale exponent of the
    largest amax over the devices, the same on every device: not one device's own amax, and
    not a sum over devices (the gradient of a replicated input would be)."""
    from tests import helpers  # pylint: disable=g-import-not-at-top
    keys = jax.random.split(jax.random.key(0), 3)
    params = [{"w": jax.random.normal(keys[0], (16, 32)) / 4, "b": jnp.zeros(32)},
              {"w": jax.random.normal(keys[1], (32, 10)) / 6, "b": jnp.zeros(10)}]
    # Rows of very different sizes: each device's shard has its own amax.
    sizes = jnp.repeat(2.0 ** np.arange(float(NUM)), 4)[:, None]
    x = jax.random.normal(keys[2], (4 * NUM, 16)) * sizes
    y = jnp.arange(4 * NUM) % 10
    options = dict(compute_dtype=jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
                   float8_scaling="delayed")
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y, window=3)
    one = jaxmp.mp_value_and_grad(helpers.mlp_loss, **options)(
        params, x, y, scaler_state=jaxmp.noop_scaler(), float8_state=h)[4]

    def body(params, x, y, h):
        out = jaxmp.mp_value_and_grad(helpers.mlp_loss, axis_name="data", **options)(
            params, x, y, scaler_state=jaxmp.noop_scaler(), float8_state=h)
        return out[4].history[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                       out_specs=P("data"))
    batch = NamedSharding(mesh, P("data"))
    per_device = jax.jit(fn)(params, jax.device_put(x, batch), jax.device_put(y, batch), h)
    # The operands' entries are the whole batch's; each device's cotangents are those of its own
    # mean loss, NUM times the whole batch's (the step averages the gradients after): two more
    # powers of two for NUM = 4.
    expected = np.asarray(one.history).copy()
    expected[:, 2, 0] += np.log2(NUM)
    for d in range(NUM):
        np.testing.assert_array_equal(per_device[d], expected)
