"""Tests of jaxmp._src.update: optimizer steps that lose nothing when skipped."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 50)),
    "clip_chain": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3)),
}


def _params():
    return {"w": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16)}


def _grads(bad=False):
    g = {"w": jnp.full((2, 3), 0.5, jnp.float32), "b": jnp.full((3,), -0.25, jnp.bfloat16)}
    if bad:
        g["w"] = g["w"].at[0, 1].set(jnp.nan)
        g["b"] = g["b"].at[2].set(jnp.inf)
    return g


def _bits(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_finite_step_equals_optax(name):
    opt = OPTIMIZERS[name]()
    params = _params()
    state = opt.init(params)
    # Warm the state so moments are non-zero.
    params, state = jaxmp.optimizer_update(params, opt, state, _grads(), jnp.asarray(True))

    @jax.jit
    def reference(params, state, grads):
        with jax.numpy_dtype_promotion("standard"):  # optax itself is not strict-clean
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

    ref_params, ref_state = reference(params, state, _grads())
    new_params, new_state = jax.jit(jaxmp.optimizer_update, static_argnums=1)(
        params, opt, state, _grads(), jnp.asarray(True))
    assert _bits(new_params) == _bits(ref_params)
    assert _bits(new_state) == _bits(ref_state)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_skipped_step_is_bit_identical(name):
    opt = OPTIMIZERS[name]()
    params = _params()
    state = opt.init(params)
    params, state = jaxmp.optimizer_update(params, opt, state, _grads(), jnp.asarray(True))
    new_params, new_state = jax.jit(jaxmp.optimizer_update, static_argnums=1)(
        params, opt, state, _grads(bad=True), jnp.asarray(False))
    assert _bits(new_params) == _bits(params)
    assert _bits(new_state) == _bits(state)
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)


def test_inside_scan_skips_exactly_the_bad_steps():
    opt = optax.adam(1e-2)
    params = _params()
    flags = jnp.array([True, False, True, False, False, True])

    def body(carry, finite):
        p, s = carry
        g = jax.tree_util.tree_map(lambda x: jnp.where(finite, x, jnp.nan).astype(x.dtype), _grads())
        return jaxmp.optimizer_update(p, opt, s, g, finite), None

    (p_scan, s_scan), _ = jax.lax.scan(body, (params, opt.init(params)), flags)
    # Reference: apply only the good steps with plain optax.
    num_good = int(np.asarray(flags).sum())

    @jax.jit
    def good_steps(p, s):
        def body(carry, _):
            p, s = carry
            with jax.numpy_dtype_promotion("standard"):  # optax itself is not strict-clean
                u, s = opt.update(_grads(), s, p)
                return (optax.apply_updates(p, u), s), None
        return jax.lax.scan(body, (p, s), None, length=num_good)[0]

    p_ref, s_ref = good_steps(params, opt.init(params))
    assert _bits(p_scan) == _bits(p_ref)
    assert _bits(s_scan) == _bits(s_ref)


def test_params_with_none_leaves_as_equinox_partition_leaves_them():
    params = {"linear": {"weight": jnp.ones((2, 2)), "bias": None}, "act": None}
    grads = {"linear": {"weight": jnp.full((2, 2), 0.5), "bias": None}, "act": None}
    opt = optax.adam(0.1)
    state = opt.init(params)
    new_params, _ = jaxmp.optimizer_update(params, opt, state, grads, jnp.asarray(True))
    assert new_params["linear"]["bias"] is None and new_params["act"] is None
    assert float(new_params["linear"]["weight"][0, 0]) < 1.0
    same_params, same_state = jaxmp.optimizer_update(params, opt, state, grads, jnp.asarray(False))
    assert _bits(same_params) == _bits(params) and _bits(same_state) == _bits(state)


def test_end_to_end_with_mp_value_and_grad_never_lets_nan_in():
    def loss_fn(w, x):
        return jnp.mean((x @ w) ** 2)

    opt = optax.adam(1e-2)
    w = jnp.ones((3, 2))
    grad_fn = jaxmp.mp_value_and_grad(loss_fn)
    xs = jnp.ones((4, 5, 3)).at[2].set(jnp.inf)  # the third batch is poisoned

    def body(carry, x):
        w, s, scaler = carry
        _, g, scaler, finite = grad_fn(w, x, scaler_state=scaler)
        w, s = jaxmp.optimizer_update(w, opt, s, g, finite)
        return (w, s, scaler), finite

    (w, s, scaler), finite = jax.lax.scan(body, (w, opt.init(w), jaxmp.init_scaler(initial_scale=256.0)), xs)
    assert np.asarray(finite).tolist() == [True, True, False, True]
    assert bool(jnp.all(jnp.isfinite(w)))
    assert int(scaler.skipped_steps) == 1


def test_select_tree_rejects_type_change():
    with pytest.raises(ValueError, match="changed a leaf's type"):
        jaxmp.select_tree(jnp.asarray(True), {"a": jnp.ones(2)}, {"a": jnp.ones(2, jnp.bfloat16)})
