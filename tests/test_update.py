"""Tests of jaxmp._src.update: optimizer steps that lose nothing when skipped."""

import functools
import warnings

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
    # Against plain optax: equal up to bfloat16 rounding, which XLA may do
    # inside or outside a fusion (excess precision) depending on the program.
    for a, b in zip(jax.tree_util.tree_leaves((p_scan, s_scan)),
                    jax.tree_util.tree_leaves((p_ref, s_ref))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2)
    # Bit for bit against the same program given only the good steps: the
    # skipped steps left no trace.
    good = jnp.ones(num_good, jnp.bool_)
    (p_good, s_good), _ = jax.lax.scan(body, (params, opt.init(params)), good)
    assert _bits(p_scan) == _bits(p_good)
    assert _bits(s_scan) == _bits(s_good)


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
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16)
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


# The optimizer's own overflow is skipped too. -----------------------------------

def test_non_finite_update_on_finite_grads_is_skipped_and_said():
    # float16 parameters: 60000 + 10000 overflows, although the gradients are finite.
    opt = optax.sgd(1.0)
    params = {"w": jnp.full((3,), 60000.0, jnp.float16), "b": jnp.ones(2)}
    state = opt.init(params)
    grads = {"w": jnp.full((3,), -1e4, jnp.float16), "b": jnp.ones(2)}
    step = jax.jit(functools.partial(jaxmp.optimizer_update, optimizer=opt, return_applied=True))
    with pytest.warns(RuntimeWarning, match="optimizer's update .* was not"):
        new_params, new_state, applied = jax.block_until_ready(
            step(params, opt_state=state, grads=grads, finite=jnp.asarray(True)))
    assert not bool(applied)
    assert _bits(new_params) == _bits(params) and _bits(new_state) == _bits(state)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_infinite_update_leaves_params_and_state_bit_identical(name):
    # An update that is inf although the gradients are finite: a huge learning-rate scale.
    inner = OPTIMIZERS[name]()
    opt = optax.chain(inner, optax.scale(3e38), optax.scale(3e38))
    params = _params()
    # Warm the inner optimizer so that its moments and counts are non-zero.
    params, inner_state = jaxmp.optimizer_update(params, inner, inner.init(params), _grads(),
                                                 jnp.asarray(True))
    state = (inner_state,) + tuple(opt.init(params)[1:])
    # float32 parameters and state: checked when asked (the default checks
    # half-precision trees only), skipped without a message (a step carries a
    # host callback only when float16 values can overflow; see below).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new_params, new_state, applied = jaxmp.optimizer_update(
            params, opt, state, _grads(), jnp.asarray(True), return_applied=True,
            check_update=True)
    assert not bool(applied)
    assert _bits(new_params) == _bits(params) and _bits(new_state) == _bits(state)
    # Unchecked, the absurd update goes through: that is what the check is for.
    unchecked, *_ = jaxmp.optimizer_update(params, opt, state, _grads(), jnp.asarray(True),
                                           check_update=False)
    assert not bool(jaxmp.all_finite(unchecked))


def test_half_precision_trees_are_checked_by_default():
    opt = optax.sgd(1.0)
    params = {"w": jnp.full(3, 3e38, jnp.bfloat16)}
    grads = {"w": jnp.full(3, -3e38, jnp.bfloat16)}  # 6e38 overflows bfloat16 too
    new_params, _, applied = jaxmp.optimizer_update(
        params, opt, opt.init(params), grads, jnp.asarray(True), return_applied=True)
    assert not bool(applied) and _bits(new_params) == _bits(params)


def test_float16_update_overflow_is_skipped_and_said():
    opt = optax.sgd(1.0)
    params = {"w": jnp.full(3, 60000.0, jnp.float16)}
    grads = {"w": jnp.full(3, -1e4, jnp.float16)}
    with pytest.warns(RuntimeWarning, match="step was skipped"):
        new_params, _, applied = jax.jit(
            jaxmp.optimizer_update, static_argnums=1, static_argnames="return_applied")(
                params, opt, opt.init(params), grads, jnp.asarray(True), return_applied=True)
    assert not bool(applied)
    assert _bits(new_params) == _bits(params)


def test_applied_flag_and_two_tuple_by_default():
    opt = optax.adam(1e-2)
    params = _params()
    out = jaxmp.optimizer_update(params, opt, opt.init(params), _grads(), jnp.asarray(True))
    assert len(out) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # healthy and ordinary skipped steps say nothing
        for finite, bad in ((True, False), (False, True)):
            *_, applied = jax.jit(jaxmp.optimizer_update, static_argnums=1,
                                  static_argnames="return_applied")(
                params, opt, opt.init(params), _grads(bad), jnp.asarray(finite),
                return_applied=True)
            assert bool(applied) == finite
    with pytest.raises(TypeError, match="return_applied must be True or False"):
        jaxmp.optimizer_update(params, opt, opt.init(params), _grads(), jnp.asarray(True),
                               return_applied="yes")


# Equinox modules and optimizers that take extra arguments. ------------------------

def test_equinox_module_with_non_array_leaves_matches_apply_updates():
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        linear: eqx.nn.Linear
        activation: callable
        temperature: float
        steps: jax.Array

        def __call__(self, x):
            return self.activation(self.linear(x) / self.temperature)

    model = Model(eqx.nn.Linear(3, 2, key=jax.random.key(0)), jax.nn.gelu, 2.0,
                  jnp.zeros((), jnp.int32))

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    x = jax.random.normal(jax.random.key(1), (8, 3))
    opt = optax.adam(1e-2)
    opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
    _, grads, _, finite = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16)(
        model, x, scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
    new, new_state = jaxmp.optimizer_update(model, opt, opt_state, grads, finite)
    assert new.activation is jax.nn.gelu and new.temperature == 2.0
    assert _bits(new.steps) == _bits(model.steps)
    with jax.numpy_dtype_promotion("standard"):
        updates, ref_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    ref = eqx.apply_updates(model, updates)
    assert _bits(eqx.filter(new, eqx.is_array)) == _bits(eqx.filter(ref, eqx.is_array))
    assert _bits(new_state) == _bits(ref_state)
    same, _ = jaxmp.optimizer_update(model, opt, opt_state, grads, jnp.asarray(False))
    assert _bits(eqx.filter(same, eqx.is_array)) == _bits(eqx.filter(model, eqx.is_array))


def test_extra_args_reach_reduce_on_plateau():
    opt = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1))
    params = {"w": jnp.ones(2)}
    state = opt.init(params)
    grads = {"w": jnp.ones(2)}
    for loss in (1.0, 2.0, 3.0, 4.0):  # never improving: the scale halves
        params, state = jaxmp.optimizer_update(params, opt, state, grads, jnp.asarray(True),
                                               value=jnp.asarray(loss))
    ref_params, ref_state = {"w": jnp.ones(2)}, opt.init({"w": jnp.ones(2)})
    with jax.numpy_dtype_promotion("standard"):
        for loss in (1.0, 2.0, 3.0, 4.0):
            u, ref_state = opt.update(grads, ref_state, ref_params, value=jnp.asarray(loss))
            ref_params = optax.apply_updates(ref_params, u)
    assert float(state[1].scale) < 1.0
    assert _bits(params) == _bits(ref_params) and _bits(state) == _bits(ref_state)


def test_extra_args_reach_lbfgs_and_value_fn_gets_whole_params():
    target = jnp.array([1.0, -2.0])

    def value_fn(params):
        assert params["name"] == "quadratic"  # the non-array leaf is put back
        return jnp.sum((params["w"] - target) ** 2)

    opt = optax.lbfgs()
    params = {"w": jnp.zeros(2), "name": "quadratic"}
    state = opt.init({"w": params["w"], "name": None})
    for _ in range(3):
        value, g = jax.value_and_grad(lambda w: value_fn({"w": w, "name": "quadratic"}))(params["w"])
        grads = {"w": g, "name": None}
        params, state = jaxmp.optimizer_update(params, opt, state, grads, jnp.asarray(True),
                                               value=value, grad=grads, value_fn=value_fn)
    np.testing.assert_allclose(params["w"], target, atol=1e-4)
    assert params["name"] == "quadratic"


def test_extra_args_are_ignored_by_plain_optimizers():
    opt = optax.sgd(0.5)
    params = {"w": jnp.ones(2)}
    new, _ = jaxmp.optimizer_update(params, opt, opt.init(params), {"w": jnp.ones(2)},
                                    jnp.asarray(True), value=jnp.asarray(3.0))
    assert new["w"].tolist() == [0.5, 0.5]


# Master weights: a trace-time warning for half-precision parameters under float16 scaling. --

def _square_loss(w, x):
    return jnp.mean((x @ w) ** 2)


def test_half_precision_params_under_float16_scaling_warn_at_trace_time():
    w, x = jnp.ones((3, 2), jnp.float16), jnp.ones((4, 3))
    traced = []

    @jax.jit
    def step(w, x, s):
        traced.append(1)
        return jaxmp.mp_value_and_grad(_square_loss, autocast=False,
                                       compute_dtype=jnp.float16)(w, x, scaler_state=s)

    with pytest.warns(UserWarning, match="master weights in float32") as record:
        step(w, x, jaxmp.init_scaler())
    assert "float16" in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(w, x, jaxmp.init_scaler())  # cached: no new trace, no new warning
    assert len(traced) == 1


@pytest.mark.parametrize("case", ["float32_params", "pure_bfloat16", "no_mixed_precision"])
def test_master_weight_check_is_quiet_otherwise(case):
    x = jnp.ones((4, 3))
    # float32 master weights under float16 loss scaling (a dynamic scaler is for float16).
    w, options, scaler = jnp.ones((3, 2)), {"compute_dtype": jnp.float16}, jaxmp.init_scaler()
    if case == "pure_bfloat16":
        w, options, scaler = w.astype(jnp.bfloat16), {"compute_dtype": jnp.bfloat16}, \
            jaxmp.noop_scaler()
    elif case == "no_mixed_precision":
        w, options = w.astype(jnp.float16), {"use_mixed_precision": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxmp.mp_value_and_grad(_square_loss, autocast=False, **options)(
            w, x, scaler_state=scaler)


def test_step_with_messages_still_lowers_for_a_gpu_on_this_machine():
    # The stuck and overflow messages are host callbacks, which cannot be lowered for another
    # platform; jaxmp.debug.matmul_flops (lowered for "cuda") retraces the step without them.
    opt = optax.adam(1e-2)

    @jax.jit
    def step(w, s, scaler, x):
        _, g, scaler, finite = jaxmp.mp_value_and_grad(_square_loss, autocast=False,
                                                       compute_dtype=jnp.float16)(
            w, x, scaler_state=scaler)
        w, s = jaxmp.optimizer_update(w, opt, s, g, finite)
        return w, s, scaler

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    args = (w, opt.init(w), jaxmp.init_scaler(), x)
    assert "callback" not in str(jax.make_jaxpr(step)(*args))  # float32 master weights: none
    # float16 parameters (and so float16 Adam moments) carry the update-overflow message.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the half-master-weights warning
        args = (w.astype(jnp.float16), opt.init(w.astype(jnp.float16)), jaxmp.init_scaler(), x)
        step(*args)  # traced and cached with the callback
        assert "callback" in str(jax.make_jaxpr(step)(*args))
        flops = jaxmp.debug.matmul_flops(step, *args, platform="cuda")
        assert set(flops) == {"float16"}
        step(*args)  # and training still has it
        assert "callback" in str(jax.make_jaxpr(step)(*args))


def test_select_tree_selects_numpy_and_python_numbers_and_checks_other_leaves():
    # A step counter that starts as a Python int (flax's TrainState.create), NumPy leaves.
    new, old = {"step": 1, "a": np.ones(2)}, {"step": 0, "a": np.zeros(2)}
    chosen = jaxmp.select_tree(jnp.asarray(True), new, old)
    assert int(chosen["step"]) == 1 and chosen["a"].tolist() == [1.0, 1.0]
    kept = jaxmp.select_tree(jnp.asarray(False), new, old)
    assert int(kept["step"]) == 0 and kept["a"].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="two different non-array leaves"):
        jaxmp.select_tree(jnp.asarray(True), {"f": "relu"}, {"f": "gelu"})


def test_select_tree_type_change_names_the_path_and_the_fix():
    new = {"layers": [{"w": jnp.ones(2)}], "n": jnp.ones(3, jnp.int32)}
    old = {"layers": [{"w": jnp.ones(2, jnp.bfloat16)}], "n": jnp.ones(3, jnp.int32)}
    with pytest.raises(ValueError, match=r"at \['layers'\]\[0\]\['w'\].*Make both bfloat16"):
        jaxmp.select_tree(jnp.asarray(True), new, old)
    # A shape change, or a change to a non-floating dtype: the path, and no cast to suggest.
    with pytest.raises(ValueError, match=r"int32\[3\] \(the old one\) at \['n'\]") as info:
        jaxmp.select_tree(jnp.asarray(False), {**old, "n": jnp.ones(3)}, old)
    assert "astype" not in str(info.value)
