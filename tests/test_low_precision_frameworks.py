"""low_precision_optimizer on framework code, as users write it (issue 24, part 3).

Each test trains a tiny model a few steps with bfloat16 parameters and
half-byte optimizer state, and checks the loss against a float32 reference
(float32 parameters, plain optax, ``jax.value_and_grad``), the dtypes of the
parameters and state, and that a skipped (non-finite) step leaves everything
bit for bit as it was.
"""

import functools

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import jaxmp
from tests.helpers import assert_bitwise
from jaxmp._src import kernel

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
STEPS = 6
LR = 1e-2


def _dtypes(tree):
    """The dtypes of the floating array leaves of ``tree`` with at least one dimension."""
    return {jnp.dtype(x.dtype) for x in jax.tree_util.tree_leaves(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and np.ndim(x)}


def _bytes(tree):
    """Bytes of the array leaves of ``tree`` that grow with the model (at least one dimension)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(tree)
               if hasattr(x, "nbytes") and np.ndim(x) and x.dtype != jnp.uint32)


def _size(params):
    return sum(x.size for x in jax.tree_util.tree_leaves(params)
               if jnp.issubdtype(x.dtype, jnp.floating))


def _near(loss, reference, rtol=0.03):
    assert abs(float(loss) - float(reference)) <= rtol * abs(float(reference)), (loss, reference)


def _images(n=8, size=6, channels=3, seed=1):
    x = jax.random.normal(jax.random.key(seed), (n, size, size, channels))
    y = jnp.arange(n) % 3
    return x, y


# Haiku: transform_with_state with BatchNorm, whatever batch dtype it is initialised with. ------

def _haiku_net(x, is_training):
    x = hk.Conv2D(8, 3)(x)
    x = hk.BatchNorm(True, True, 0.9)(x, is_training)
    x = jax.nn.relu(x)
    return hk.Linear(3)(jnp.mean(x, axis=(1, 2)))


_haiku = hk.transform_with_state(_haiku_net)


def _haiku_loss(params, state, x, y):
    logits, state = _haiku.apply(params, state, None, x, True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def _haiku_reference(x, y):
    params, state = _haiku.init(jax.random.key(0), x, True)
    tx = optax.adam(LR)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, state, opt_state):
        with jax.numpy_dtype_promotion("standard"):
            (loss, state), grads = jax.value_and_grad(_haiku_loss, has_aux=True)(
                params, state, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, loss

    losses = []
    for _ in range(STEPS):
        params, state, opt_state, loss = step(params, state, opt_state)
        losses.append(loss)
    return losses


@pytest.mark.parametrize("init_dtype", [jnp.bfloat16, jnp.float32])
def test_haiku_batchnorm_state_keeps_the_dtype_it_was_initialised_in(init_dtype):
    x, y = _images()
    params, state = _haiku.init(jax.random.key(0), x.astype(init_dtype), True)
    init_dtypes = jax.tree_util.tree_map(lambda a: a.dtype, state)
    params = jaxmp.cast_tree(params, jnp.bfloat16)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="stochastic")
    opt_state = tx.init(params)
    grad_fn = jaxmp.mp_value_and_grad(_haiku_loss, has_aux=True, no_cast_argnums=1,
                                      compute_dtype=jnp.bfloat16)

    @jax.jit
    def step(params, state, opt_state, scaler, x, y):
        (loss, new_state), grads, scaler, finite = grad_fn(params, state, x, y,
                                                           scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        state = jaxmp.select_tree(finite, new_state, state)
        return params, state, opt_state, scaler, loss

    scaler = jaxmp.noop_scaler()
    batch = x.astype(jnp.bfloat16)
    losses = []
    with jax.numpy_dtype_promotion("standard"):  # Haiku's moving averages need it
        for _ in range(STEPS):
            params, state, opt_state, scaler, loss = step(params, state, opt_state, scaler,
                                                          batch, y)
            losses.append(loss)
    assert jax.tree_util.tree_map(lambda a: a.dtype, state) == init_dtypes
    assert _dtypes(params) == {BF16} and _dtypes(opt_state) == {BF16}
    reference = _haiku_reference(x, y)
    _near(losses[0], reference[0], 0.01)
    _near(losses[-1], reference[-1])
    assert float(losses[-1]) < float(losses[0])

    bad = batch.at[0, 0, 0, 0].set(jnp.nan)
    with jax.numpy_dtype_promotion("standard"):
        after = step(params, state, opt_state, scaler, bad, y)
    assert_bitwise(after[:3], (params, state, opt_state))


def test_haiku_state_cast_by_the_user_comes_back_in_its_dtype():
    # Issue 34: a float32 BatchNorm state the user cast to bfloat16, passed without
    # no_cast_argnums, came back float32 from the step and select_tree refused it.
    x, y = _images()
    params, state32 = _haiku.init(jax.random.key(0), x, True)
    params, state = jaxmp.cast_tree((params, state32), jnp.bfloat16)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="nearest")
    grad_fn = jaxmp.mp_value_and_grad(_haiku_loss, has_aux=True, compute_dtype=jnp.bfloat16)

    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def step(params, state, opt_state):
        (_, new_state), grads, _, finite = grad_fn(params, state, x, y,
                                                   scaler_state=jaxmp.noop_scaler())
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        return params, jaxmp.select_tree(finite, new_state, state), opt_state

    with jax.numpy_dtype_promotion("standard"):  # Haiku's moving averages need it
        _, new_state, _ = step(params, state, tx.init(params))
        _, reference = jax.jit(_haiku.apply, static_argnums=4)(
            jaxmp.cast_tree(params, jnp.float32), state32, None, x, True)
    assert _dtypes(new_state) == {BF16}
    for got, want in zip(jax.tree_util.tree_leaves(new_state),
                         jax.tree_util.tree_leaves(reference)):
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0.02, atol=1e-3)


def test_no_cast_state_comes_back_in_its_own_dtype_and_other_aux_in_float32():
    state = {"mean": jnp.zeros(4, jnp.bfloat16), "count": jnp.zeros((), jnp.int32)}

    def loss_fn(w, state, x):
        h = x @ w
        new = {"mean": 0.9 * state["mean"] + 0.1 * jnp.mean(h, axis=0), "count": state["count"] + 1}
        return jnp.mean(h ** 2), (new, {"h": h})

    w, x = jnp.ones((3, 4), jnp.bfloat16), jnp.ones((2, 3), jnp.bfloat16)
    (loss, (new, extra)), grads, _, finite = jaxmp.mp_value_and_grad(
        loss_fn, has_aux=True, no_cast_argnums=1, compute_dtype=jnp.bfloat16)(
            w, state, x, scaler_state=jaxmp.noop_scaler())
    assert new["mean"].dtype == BF16 and new["count"].dtype == jnp.int32
    assert extra["h"].dtype == F32 and grads.dtype == BF16 and bool(finite)
    assert np.asarray(new["mean"], np.float32).tolist() == [float(jnp.bfloat16(0.3))] * 4
    # Without no_cast_argnums, the state (an argument not differentiated) comes back the same.
    (_, (new2, extra2)), _, _, _ = jaxmp.mp_value_and_grad(
        loss_fn, has_aux=True, compute_dtype=jnp.bfloat16)(
            w, state, x, scaler_state=jaxmp.noop_scaler())
    assert new2["mean"].dtype == BF16 and extra2["h"].dtype == F32
    # Without a matching state, every floating aux leaf is float32.
    out = kernel.returned_state_dtypes({"mean": new["mean"]}, [])
    assert out["mean"].dtype == F32
    # A state whose shapes differ is not taken for the one passed in.
    out = kernel.returned_state_dtypes({"mean": jnp.zeros(5, F32)}, [{"mean": state["mean"]}])
    assert out["mean"].dtype == F32


def test_select_tree_names_the_leaf_and_the_fix_when_state_changed_dtype():
    old = {"batch_norm": {"average": jnp.zeros((1, 1, 1, 16), jnp.bfloat16)}}
    new = {"batch_norm": {"average": jnp.zeros((1, 1, 1, 16), jnp.float32)}}
    with pytest.raises(ValueError) as info:
        jaxmp.select_tree(jnp.asarray(True), new, old)
    message = str(info.value)
    assert "['batch_norm']['average']" in message
    assert "float32[1, 1, 1, 16]" in message and "bfloat16[1, 1, 1, 16]" in message
    assert "jaxmp.cast_tree(state, jnp.float32)" in message and "n.astype(o.dtype)" in message


# Equinox: float32 noise and time drawn inside the loss, bfloat16 parameters. -----------------

class _EqxNet(eqx.Module):
    conv: eqx.nn.Conv2d
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.conv = eqx.nn.Conv2d(3, 8, 3, padding=1, key=k1)
        self.head = eqx.nn.Linear(8, 3, key=k2)

    def __call__(self, x):
        h = jax.nn.gelu(self.conv(x))
        return self.head(jnp.mean(h, axis=(1, 2)))


def _eqx_loss(model, x, key):
    k1, k2 = jax.random.split(key)
    noise = jax.random.normal(k1, x.shape)  # float32, drawn in the loss
    t = jax.random.uniform(k2, (x.shape[0], 1, 1, 1))  # diffusion time
    pred = jax.vmap(model)(x + t * noise)
    return jnp.mean((pred - 1.0) ** 2)


def _eqx_train(model, tx, grad_fn, x, scaler=None):
    params, _ = eqx.partition(model, eqx.is_inexact_array)
    opt_state = tx.init(params)

    @eqx.filter_jit
    def step(model, opt_state, scaler, x, key):
        if scaler is None:  # the float32 reference
            with jax.numpy_dtype_promotion("standard"):
                loss, grads = eqx.filter_value_and_grad(_eqx_loss)(model, x, key)
                updates, opt_state = tx.update(grads, opt_state, model)
            return eqx.apply_updates(model, updates), opt_state, scaler, loss, jnp.asarray(True)
        loss, grads, scaler, finite = grad_fn(model, x, key, scaler_state=scaler)
        model, opt_state = jaxmp.optimizer_update(model, tx, opt_state, grads, finite)
        return model, opt_state, scaler, loss, finite

    losses = []
    for i in range(STEPS):
        model, opt_state, scaler, loss, _ = step(model, opt_state, scaler, x, jax.random.key(i))
        losses.append(loss)
    return model, opt_state, scaler, losses, step


def test_equinox_noise_drawn_in_the_loss_trains_bfloat16_parameters():
    x = jax.random.normal(jax.random.key(1), (4, 3, 6, 6))
    model32 = _EqxNet(jax.random.key(0))
    model = jaxmp.cast_tree(model32, jnp.bfloat16)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="kahan")
    grad_fn = jaxmp.mp_value_and_grad(_eqx_loss, compute_dtype=jnp.bfloat16)
    scaler = jaxmp.noop_scaler()

    # Every product, forward and backward, runs in bfloat16.
    flops = jaxmp.debug.matmul_flops(
        lambda m: grad_fn(m, x, jax.random.key(0), scaler_state=scaler)[1], model)
    assert set(flops) == {"bfloat16"} and flops["bfloat16"] > 0
    grads = jax.eval_shape(
        lambda m: grad_fn(m, x, jax.random.key(0), scaler_state=scaler)[1], model)
    assert _dtypes(grads) == {BF16}

    model, opt_state, scaler, losses, step = _eqx_train(model, tx, grad_fn, x, scaler)
    _, _, _, reference, _ = _eqx_train(model32, optax.adam(LR), None, x)
    _near(losses[0], reference[0], 0.01)
    _near(losses[-1], reference[-1])
    assert _dtypes(eqx.filter(model, eqx.is_inexact_array)) == {BF16}
    assert _dtypes(opt_state) == {BF16}

    bad = x.at[0, 0, 0, 0].set(jnp.inf)
    after, after_state, _, _, finite = step(model, opt_state, scaler, bad, jax.random.key(9))
    assert not bool(finite)
    assert_bitwise(eqx.filter((after, after_state), eqx.is_array),
                    eqx.filter((model, opt_state), eqx.is_array))


def _eqx_reference_loss(loss_fn, model, *args):
    """The loss of ``model``'s parameters in float32."""
    with jax.numpy_dtype_promotion("standard"):
        return loss_fn(jaxmp.cast_tree(model, jnp.float32), *args)


def test_float32_views_keep_gradient_accumulation_in_the_parameters_dtype():
    x = jax.random.normal(jax.random.key(1), (4, 3, 6, 6))
    model = jaxmp.cast_tree(_EqxNet(jax.random.key(0)), jnp.bfloat16)
    keys = jax.random.split(jax.random.key(3), 4)  # one key per example: split with the batch

    def loss_fn(model, x, keys):
        return jnp.mean(jax.vmap(lambda xi, k: _eqx_loss(model, xi[None], k))(x, keys))

    step = eqx.filter_jit(jaxmp.accumulate_value_and_grad(loss_fn, 2, compute_dtype=jnp.bfloat16))
    loss, grads, _, finite = step(model, x, keys, scaler_state=jaxmp.noop_scaler())
    whole = eqx.filter_jit(lambda m: _eqx_reference_loss(loss_fn, m, x, keys))(model)
    assert bool(finite) and _dtypes(grads) == {BF16}
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-2)


# Flax linen: TrainState. -----------------------------------------------------------------------

class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(3)(x)


def _linen_data():
    x = jax.random.normal(jax.random.key(1), (8, 5))
    return x, jnp.arange(8) % 3


def _linen_loss(params, apply_fn, x, y):
    logits = apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _linen_step(grad_fn):
    @jax.jit
    def step(state, scaler, x, y):
        loss, grads, scaler, finite = grad_fn(state.params, state.apply_fn, x, y,
                                              scaler_state=scaler)
        params, opt_state, applied = jaxmp.optimizer_update(
            state.params, state.tx, state.opt_state, grads, finite, return_applied=True)
        step = jnp.where(applied, state.step + 1, state.step)
        return state.replace(step=step, params=params, opt_state=opt_state), scaler, loss
    return step


def test_linen_train_state_created_with_the_cast_parameters():
    model, (x, y) = _LinenMLP(), _linen_data()
    params32 = model.init(jax.random.key(0), x)["params"]
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="stochastic")
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=jaxmp.cast_tree(params32, jnp.bfloat16), tx=tx)
    grad_fn = jaxmp.mp_value_and_grad(
        lambda p, apply_fn, x, y: _linen_loss(p, apply_fn, x, y), compute_dtype=jnp.bfloat16)
    step = _linen_step(grad_fn)
    scaler, losses = jaxmp.noop_scaler(), []
    for _ in range(STEPS):
        state, scaler, loss = step(state, scaler, x, y)
        losses.append(loss)
    assert int(state.step) == STEPS
    assert _dtypes(state.params) == {BF16} and _dtypes(state.opt_state) == {BF16}
    assert _bytes((state.params, state.opt_state)) == 6 * _size(params32)

    reference = train_state.TrainState.create(apply_fn=model.apply, params=params32,
                                              tx=optax.adam(LR))
    ref_losses = []
    for _ in range(STEPS):
        with jax.numpy_dtype_promotion("standard"):
            loss, grads = jax.value_and_grad(_linen_loss)(reference.params, model.apply, x, y)
            reference = reference.apply_gradients(grads=grads)
        ref_losses.append(loss)
    _near(losses[0], ref_losses[0], 0.01)
    _near(losses[-1], ref_losses[-1])

    skipped, _, _ = step(state, scaler, x.at[0, 0].set(jnp.nan), y)
    assert_bitwise(skipped, state)


def test_linen_train_state_created_on_float32_parameters():
    """tx.init on float32 parameters, then cast: the same state for these roundings; Kahan refuses."""
    model, (x, _) = _LinenMLP(), _linen_data()
    params32 = model.init(jax.random.key(0), x)["params"]
    params16 = jaxmp.cast_tree(params32, jnp.bfloat16)
    for rounding in ("nearest", "stochastic"):
        tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding=rounding)
        state = train_state.TrainState.create(apply_fn=model.apply, params=params32, tx=tx)
        assert_bitwise(state.opt_state, tx.init(params16))
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="kahan")
    state = train_state.TrainState.create(apply_fn=model.apply, params=params32, tx=tx)
    state = state.replace(params=params16)
    grads = jax.tree_util.tree_map(jnp.ones_like, params16)
    with pytest.raises(ValueError,
                       match=r"TrainState.create\(.*params=jaxmp.cast_tree\(params, jnp.bfloat16\)"):
        jaxmp.optimizer_update(state.params, state.tx, state.opt_state, grads, jnp.asarray(True))


# Flax nnx: nnx.Optimizer. ----------------------------------------------------------------------

class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(5, 16, rngs=rngs)
        self.out = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def _nnx_loss(params, graphdef, x, y):
    model = nnx.merge(graphdef, params)
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_nnx_optimizer_with_low_precision_optimizer():
    x, y = _linen_data()
    model = _NnxMLP(nnx.Rngs(0))
    params32 = jax.tree_util.tree_map(jnp.array, nnx.state(model, nnx.Param))
    nnx.update(model, jaxmp.cast_tree(nnx.state(model, nnx.Param), jnp.bfloat16))
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(LR), param_rounding="stochastic")
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    grad_fn = jaxmp.mp_value_and_grad(_nnx_loss, compute_dtype=jnp.bfloat16)

    @nnx.jit
    def step(model, optimizer, scaler, x, y):
        graphdef, params = nnx.split(model, nnx.Param)
        loss, grads, scaler, finite = grad_fn(params, graphdef, x, y, scaler_state=scaler)

        def apply(optimizer, model, grads):
            with jax.numpy_dtype_promotion("standard"):
                optimizer.update(model, grads)

        nnx.cond(finite, apply, lambda *_: None, optimizer, model, grads)
        return scaler, loss

    scaler, losses = jaxmp.noop_scaler(), []
    for _ in range(STEPS):
        scaler, loss = step(model, optimizer, scaler, x, y)
        losses.append(loss)
    assert _dtypes(nnx.state(model, nnx.Param)) == {BF16}
    assert _dtypes(nnx.state(optimizer, nnx.OptState)) == {BF16}
    assert int(optimizer.step[...]) == STEPS

    ref, ref_losses = _NnxMLP(nnx.Rngs(0)), []
    nnx.update(ref, params32)
    ref_opt = nnx.Optimizer(ref, optax.adam(LR), wrt=nnx.Param)
    for _ in range(STEPS):
        with jax.numpy_dtype_promotion("standard"):
            loss, grads = nnx.value_and_grad(
                lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean())(ref)
            ref_opt.update(ref, grads)
        ref_losses.append(loss)
    _near(losses[0], ref_losses[0], 0.01)
    _near(losses[-1], ref_losses[-1])

    before = jax.tree_util.tree_map(jnp.array, nnx.state((model, optimizer)))
    step(model, optimizer, scaler, x.at[0, 0].set(jnp.nan), y)
    assert_bitwise(nnx.state((model, optimizer)), before)


# optax.MultiSteps and gradient accumulation: the bytes per parameter. --------------------------

@pytest.mark.parametrize("rounding, fewest, multisteps_inside", [
    ("stochastic", 6, 8), ("kahan", 8, 10)])
def test_bytes_per_parameter_with_accumulation(rounding, fewest, multisteps_inside):
    model, (x, y) = _LinenMLP(), _linen_data()
    params = jaxmp.cast_tree(model.init(jax.random.key(0), x)["params"], jnp.bfloat16)
    n = _size(params)
    adam = optax.adam(LR)
    lp = lambda inner: jaxmp.experimental.low_precision_optimizer(inner, param_rounding=rounding)
    per_param = lambda tx: _bytes((params, tx.init(params))) / n
    # accumulate_value_and_grad: the accumulator lives inside the step only.
    assert per_param(lp(adam)) == fewest
    # MultiSteps inside: its accumulator is inner state, kept in state_dtype.
    inside = lp(optax.MultiSteps(adam, every_k_schedule=2))
    assert per_param(inside) == multisteps_inside
    assert _dtypes(inside.init(params).inner.acc_grads) == {BF16}
    # MultiSteps outside: optax's own accumulator, in float32 (optax 0.2.8) or in the
    # parameters' dtype (0.2.6): the page's table gives both.
    outside = optax.MultiSteps(lp(adam), every_k_schedule=2)
    (acc,) = _dtypes(outside.init(params).acc_grads)
    assert acc in (jnp.dtype(jnp.float32), BF16)
    assert per_param(outside) == fewest + jnp.dtype(acc).itemsize


def test_multisteps_inside_low_precision_optimizer_trains_and_skips():
    model, (x, y) = _LinenMLP(), _linen_data()
    params = jaxmp.cast_tree(model.init(jax.random.key(0), x)["params"], jnp.bfloat16)
    tx = jaxmp.experimental.low_precision_optimizer(
        optax.MultiSteps(optax.adam(LR), every_k_schedule=2))
    opt_state = tx.init(params)
    grad_fn = jaxmp.mp_value_and_grad(_linen_loss, compute_dtype=jnp.bfloat16)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads, _, finite = grad_fn(params, model.apply, x, y,
                                         scaler_state=jaxmp.noop_scaler())
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        return params, opt_state, loss

    reference = optax.MultiSteps(optax.adam(LR), every_k_schedule=2)
    ref_params = jaxmp.cast_tree(params, jnp.float32)
    ref_state = reference.init(ref_params)

    @jax.jit
    def ref_step(params, opt_state, x, y):
        with jax.numpy_dtype_promotion("standard"):
            grads = jax.grad(_linen_loss)(params, model.apply, x, y)
            updates, opt_state = reference.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    start = params
    params, opt_state, first = step(params, opt_state, x[:4], y[:4])
    assert_bitwise(params, start)  # a micro-step: accumulated, not applied
    params, opt_state, _ = step(params, opt_state, x[4:], y[4:])
    assert not all(bool(jnp.all(a == b)) for a, b in zip(jax.tree_util.tree_leaves(params),
                                                          jax.tree_util.tree_leaves(start)))
    for _ in range(STEPS + 1):
        ref_params, ref_state = ref_step(ref_params, ref_state, x[:4], y[:4])
        ref_params, ref_state = ref_step(ref_params, ref_state, x[4:], y[4:])
    for _ in range(STEPS):
        params, opt_state, _ = step(params, opt_state, x[:4], y[:4])
        params, opt_state, _ = step(params, opt_state, x[4:], y[4:])
    with jax.numpy_dtype_promotion("standard"):
        loss = _linen_loss(jaxmp.cast_tree(params, jnp.float32), model.apply, x, y)
        ref_loss = _linen_loss(ref_params, model.apply, x, y)
    assert float(loss) < float(first)
    _near(loss, ref_loss)
    after = step(params, opt_state, x[:4].at[0, 0].set(jnp.nan), y[:4])
    assert_bitwise(after[:2], (params, opt_state))
