"""Tests of jaxmp._src.grad: mp_value_and_grad and mp_grad against float32 references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import jaxprs

HALF = [jnp.float16, jnp.bfloat16]
# Relative tolerance of a half-precision computation against float32.
RTOL = {jnp.float16: 2e-2, jnp.bfloat16: 8e-2}


def _mlp_params(key, sizes=(6, 16, 3)):
    params = []
    for k, (a, b) in zip(jax.random.split(key, len(sizes) - 1), zip(sizes[:-1], sizes[1:])):
        params.append({"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
                       "b": jnp.zeros((b,), jnp.float32)})
    return params


def _mlp_loss(params, x, labels):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _data(key, n=8):
    kx, ky = jax.random.split(key)
    return jax.random.normal(kx, (n, 6), jnp.float32), jax.random.randint(ky, (n,), 0, 3)


def _assert_tree_close(a, b, rtol, atol=0.0):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(
        np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol), a, b)


@pytest.fixture(scope="module")
def mlp_reference():
    """The MLP, its batch and its float32 loss and gradients, computed once per module."""
    params = _mlp_params(jax.random.key(0))
    x, y = _data(jax.random.key(1))
    ref_loss, ref_grads = jax.value_and_grad(_mlp_loss)(params, x, y)
    return params, x, y, ref_loss, ref_grads


@pytest.mark.parametrize("dtype", HALF)
def test_matches_float32_reference(dtype, mlp_reference):
    params, x, y, ref_loss, ref_grads = mlp_reference
    state = jaxmp.init_scaler(initial_scale=2.0**10)
    loss, grads, new_state, finite = jax.jit(
        jaxmp.mp_value_and_grad(_mlp_loss, compute_dtype=dtype))(params, x, y, scaler_state=state)
    assert bool(finite)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL[dtype])
    grad_scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(ref_grads))
    _assert_tree_close(grads, ref_grads, rtol=RTOL[dtype], atol=RTOL[dtype] * grad_scale)
    for g, p in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(params)):
        assert g.dtype == p.dtype == jnp.float32
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)


def test_inputs_are_cast_to_compute_dtype_but_ints_are_not():
    seen = {}

    def loss_fn(params, batch):
        seen.update(w=params["w"].dtype, x=batch["x"].dtype, y=batch["y"].dtype,
                    key=batch["key"].dtype)
        return jnp.sum(params["w"] * batch["x"])

    batch = {"x": jnp.ones(2), "y": jnp.arange(2), "key": jax.random.key(0)}
    jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.bfloat16, autocast=False)(
        {"w": jnp.ones(2)}, batch, scaler_state=jaxmp.init_scaler())
    assert seen["w"] == seen["x"] == jnp.bfloat16
    assert seen["y"] == jnp.int32 and jnp.issubdtype(seen["key"], jax.dtypes.prng_key)


def test_regression_unscale_uses_the_scale_of_the_backward_pass(mlp_reference):
    # MPX divided by the *updated* scale: on a step where the scale grows the
    # gradients came out halved.
    params, x, y, ref_loss, ref_grads = mlp_reference
    state = jaxmp.init_scaler(initial_scale=256.0, growth_interval=1)
    loss, grads, new_state, finite = jaxmp.mp_value_and_grad(_mlp_loss, autocast=False,
                                                             compute_dtype=jnp.float16)(
        params, x, y, scaler_state=state)
    assert bool(finite) and float(new_state.scale) == 512.0  # this step grew the scale
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-2)
    ratio = (jnp.linalg.norm(jax.flatten_util.ravel_pytree(grads)[0])
             / jnp.linalg.norm(jax.flatten_util.ravel_pytree(ref_grads)[0]))
    np.testing.assert_allclose(ratio, 1.0, rtol=2e-2)


def test_regression_large_loss_with_large_scale_is_not_inf():
    # MPX scaled the loss in float16: a loss of 12 with scale 8192 was reported inf forever.
    def loss_fn(w):
        return jnp.sum(w) * 12.0 / w.shape[0]

    state = jaxmp.init_scaler(initial_scale=8192.0)
    loss, grads, state, finite = jaxmp.mp_value_and_grad(loss_fn,
                                                         compute_dtype=jnp.float16)(
                                                             jnp.ones(4), scaler_state=state)
    assert float(loss) == 12.0 and bool(finite)
    np.testing.assert_allclose(grads, np.full(4, 3.0), rtol=1e-3)
    assert int(state.skipped_steps) == 0


def test_overflow_reports_not_finite_and_backs_off():
    def loss_fn(w):
        return jnp.sum(w * 1000.0)  # gradient 1000 * scale 2**15 overflows float16

    state = jaxmp.init_scaler(initial_scale=2.0**15)
    loss, grads, new_state, finite = jaxmp.mp_value_and_grad(loss_fn, autocast=False,
                                                             compute_dtype=jnp.float16)(
        jnp.ones(3), scaler_state=state)
    assert not bool(finite)
    assert float(loss) == 3000.0  # the loss itself is still the true loss
    assert float(new_state.scale) == 2.0**14 and int(new_state.skipped_steps) == 1


def test_loss_scaling_rescues_gradients_that_underflow_in_float16():
    x = jnp.full((4,), 1e-4, jnp.float32)

    def loss_fn(w, x):
        return jnp.sum((w * x) * 1e-4)  # gradient 1e-8 < float16's smallest subnormal (6e-8)

    w = jnp.ones(4)
    ref = jax.grad(loss_fn)(w, x)
    grad_fn = jaxmp.mp_grad(loss_fn, autocast=False,
                            compute_dtype=jnp.float16)  # the inputs cast to float16
    unscaled, _, _ = grad_fn(w, x, scaler_state=jaxmp.static_scaler(1.0))
    scaled, _, _ = grad_fn(w, x, scaler_state=jaxmp.static_scaler(2.0**15))
    assert float(jnp.max(jnp.abs(unscaled))) == 0.0
    np.testing.assert_allclose(scaled, ref, rtol=2e-2)


def test_aux_comes_back_in_float32_and_state_is_stable_in_scan():
    # Batch-norm-like running statistics carried from step to step.
    def loss_fn(params, stats, x):
        h = x @ params
        mean = jnp.mean(h.astype(jnp.float32), axis=0)
        new_stats = {"mean": 0.9 * stats["mean"] + 0.1 * mean.astype(stats["mean"].dtype),
                     "count": stats["count"] + 1}
        return jnp.mean(h ** 2), new_stats

    params = jnp.ones((3, 2)) * 0.1
    stats = {"mean": jnp.zeros(2, jnp.float32), "count": jnp.array(0, jnp.int32)}
    xs = jax.random.normal(jax.random.key(0), (5, 4, 3))
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, has_aux=True, compute_dtype=jnp.float16)

    def step(carry, x):
        params, stats, state = carry
        (loss, stats), grads, state, finite = grad_fn(params, stats, x, scaler_state=state)
        return (params - 0.1 * grads, stats, state), loss

    carry = (params, stats, jaxmp.init_scaler())
    (params2, stats2, state2), losses = jax.lax.scan(step, carry, xs)
    assert stats2["mean"].dtype == jnp.float32 and stats2["count"].dtype == jnp.int32
    assert int(stats2["count"]) == 5 and params2.dtype == jnp.float32
    assert losses.dtype == jnp.float32


def test_jitted_step_compiles_once():
    traces = []
    grad_fn = jaxmp.mp_value_and_grad(_mlp_loss, compute_dtype=jnp.float16)

    @jax.jit
    def step(params, state, x, y):
        traces.append(1)
        loss, grads, state, finite = grad_fn(params, x, y, scaler_state=state)
        return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads), state

    params, state = _mlp_params(jax.random.key(0)), jaxmp.init_scaler(growth_interval=1)
    for i in range(4):
        params, state = step(params, state, *_data(jax.random.key(i)))
    assert len(traces) == 1


def test_argnums_tuple_and_negative():
    def loss_fn(a, b, c):
        return jnp.sum(a * b) + jnp.sum(c)

    a, b, c = jnp.ones(2), jnp.full((2,), 3.0), jnp.ones(2)
    loss, grads, _, _ = jaxmp.mp_value_and_grad(loss_fn, argnums=(0, 1), compute_dtype=jnp.float16)(
        a, b, c, scaler_state=jaxmp.init_scaler(initial_scale=64.0))
    assert isinstance(grads, tuple) and len(grads) == 2
    np.testing.assert_allclose(grads[0], b)
    np.testing.assert_allclose(grads[1], a)
    _, grads_c, _, _ = jaxmp.mp_value_and_grad(loss_fn, argnums=-1, compute_dtype=jnp.float16)(
        a, b, c, scaler_state=jaxmp.init_scaler(initial_scale=64.0))
    np.testing.assert_allclose(grads_c, np.ones(2))


def test_non_float_leaves_get_none_gradients():
    # As with equinox.filter_grad: an Equinox-style tree with ints and callables.
    params = {"w": jnp.ones(3), "n": jnp.array(2), "act": jnp.tanh, "name": "layer"}

    def loss_fn(p):
        return jnp.sum(p["act"](p["w"])) * p["n"].astype(p["w"].dtype)

    grads, _, finite = jaxmp.mp_grad(loss_fn, compute_dtype=jnp.float16)(
        params, scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
    assert bool(finite)
    assert grads["n"] is None and grads["act"] is None and grads["name"] is None
    np.testing.assert_allclose(grads["w"], 2.0 * (1 - np.tanh(1.0) ** 2), rtol=1e-2)


def test_use_mixed_precision_false_is_plain_float32():
    params = _mlp_params(jax.random.key(0))
    x, y = _data(jax.random.key(1))
    ref_loss, ref_grads = jax.value_and_grad(_mlp_loss)(params, x, y)
    state = jaxmp.init_scaler()
    loss, grads, new_state, finite = jaxmp.mp_value_and_grad(_mlp_loss, use_mixed_precision=False,
                                                             compute_dtype=jnp.float16)(
        params, x, y, scaler_state=state)
    np.testing.assert_array_equal(loss, ref_loss)
    jax.tree_util.tree_map(np.testing.assert_array_equal, grads, ref_grads)
    assert bool(finite) and new_state is state


def test_mp_grad_return_structure():
    def loss_fn(w):
        return jnp.sum(w ** 2), {"norm": jnp.linalg.norm(w)}

    state = jaxmp.init_scaler(initial_scale=16.0)
    (grads, aux), new_state, finite = jaxmp.mp_grad(loss_fn, has_aux=True, compute_dtype=jnp.bfloat16)(
        jnp.ones(2), scaler_state=state)
    np.testing.assert_allclose(grads, np.full(2, 2.0))
    assert aux["norm"].dtype == jnp.float32 and bool(finite)
    grads, new_state, finite = jaxmp.mp_grad(lambda w: jnp.sum(w),
                                             compute_dtype=jnp.float16)(
                                                 jnp.ones(2), scaler_state=state)
    np.testing.assert_allclose(grads, np.ones(2))


def test_float32_compute_dtype_with_scaling_matches_reference():
    params = _mlp_params(jax.random.key(0))
    x, y = _data(jax.random.key(1))
    ref_grads = jax.grad(_mlp_loss)(params, x, y)
    grads, _, _ = jaxmp.mp_grad(_mlp_loss, compute_dtype=jnp.float32)(
        params, x, y, scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
    _assert_tree_close(grads, ref_grads, rtol=1e-5, atol=1e-7)


def test_works_under_equinox_filter_jit():
    # eqx.filter_jit binds arguments to inspect.signature: the wrapper must not
    # claim fn's signature, which has no scaler_state.
    eqx = pytest.importorskip("equinox")
    grad_fn = eqx.filter_jit(jaxmp.mp_value_and_grad(lambda w: jnp.sum(w * w),
                                                     compute_dtype=jnp.float16))
    loss, grads, _, finite = grad_fn(jnp.ones(2), scaler_state=jaxmp.init_scaler(initial_scale=8.0))
    assert float(loss) == 2.0 and bool(finite)
    np.testing.assert_allclose(grads, np.full(2, 2.0))
    grads, _, _ = eqx.filter_jit(jaxmp.mp_grad(lambda w: jnp.sum(w), compute_dtype=jnp.float16))(
        jnp.ones(2), scaler_state=jaxmp.init_scaler(initial_scale=8.0))
    np.testing.assert_allclose(grads, np.ones(2))
    assert jaxmp.mp_grad(lambda w: jnp.sum(w), compute_dtype=jnp.float16).__name__ == "<lambda>"


def test_a_float16_loss_caps_the_scale_below_its_own_overflow():
    # d(loss)/d(loss) is the scale, in the loss's dtype: 2**16 is inf in float16,
    # so a float16 loss would skip every step at which the scale grew past 2**15.
    def loss_fn(w, x):
        return jnp.sum(x * w)  # all float16 when the inputs are cast

    w, x = jnp.full((4,), 0.5), jnp.ones((4,))
    state = jaxmp.init_scaler(initial_scale=2.0**14, growth_interval=1)
    step = jax.jit(jaxmp.mp_value_and_grad(loss_fn, autocast=False, compute_dtype=jnp.float16))
    for _ in range(4):
        loss, grads, state, finite = step(w, x, scaler_state=state)
        assert bool(finite)
    assert float(state.scale) == 2.0**15 and int(state.skipped_steps) == 0
    np.testing.assert_array_equal(np.asarray(grads), np.ones(4))
    # Under autocast the sum runs in float32: the scale grows as configured.
    state = jaxmp.init_scaler(initial_scale=2.0**14, growth_interval=1)
    step = jax.jit(jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16))
    for _ in range(4):
        _, _, state, finite = step(w, x, scaler_state=state)
        assert bool(finite)
    assert float(state.scale) == 2.0**18


def _tanh_loss(params, x, labels):
    h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    logits = h @ params[1]["w"] + params[1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def test_autocast_rules_move_an_operation_to_float32():
    params = _mlp_params(jax.random.key(0))
    x, y = _data(jax.random.key(1))
    ref_grads = jax.grad(_tanh_loss)(params, x, y)
    rules = jaxmp.AutocastRules(full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"})
    state = jaxmp.init_scaler(initial_scale=2.0**10)

    def tanh_dtypes(fn):
        closed = jax.make_jaxpr(lambda p: fn(p, x, y, scaler_state=state))(params)
        return {str(v.aval.dtype) for eqn, _, _ in jaxprs.walk(closed.jaxpr)
                if eqn.primitive.name == "tanh" for v in eqn.outvars}

    default = jaxmp.mp_value_and_grad(_tanh_loss, compute_dtype=jnp.float16)
    assert tanh_dtypes(default) == {"float16"}
    step = jaxmp.mp_value_and_grad(_tanh_loss, compute_dtype=jnp.float16, autocast_rules=rules)
    assert tanh_dtypes(step) == {"float32"}
    _, grads, _, finite = jax.jit(step)(params, x, y, scaler_state=state)
    assert bool(finite)
    _assert_tree_close(grads, ref_grads, rtol=2e-2, atol=2e-3)
    grad_fn = jaxmp.mp_grad(_tanh_loss, compute_dtype=jnp.float16, autocast_rules=rules)
    assert tanh_dtypes(grad_fn) == {"float32"}


def test_autocast_rules_need_autocast_and_a_rules_value():
    rules = jaxmp.AutocastRules(full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"})
    with pytest.raises(ValueError, match="autocast_rules= needs autocast=True"):
        jaxmp.mp_value_and_grad(_tanh_loss, autocast=False, autocast_rules=rules)
    with pytest.raises(ValueError, match="autocast_rules= needs autocast=True"):
        jaxmp.mp_grad(_tanh_loss, autocast=False, autocast_rules=rules)
    with pytest.raises(TypeError, match="must be a jaxmp.AutocastRules"):
        jaxmp.mp_value_and_grad(_tanh_loss, autocast_rules={"tanh"})
