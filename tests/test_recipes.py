"""The recipes of docs/recipes.md, run as written and checked.

Each recipe is the code of one section of the page, executed in a fresh
namespace as a user would paste it (under JAX's default, standard, dtype
promotion: optax's Adam relies on it). The tests then take the recipe's own
step function and state from that namespace and check what the page promises:
at least 90% of the step's matrix-product FLOPs in half precision (lowered for
a GPU, on this CPU), a loss and an update that agree with float32's, and a
skipped step that changes nothing, bit for bit.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "recipes.md"
LINEN = "Flax linen with `TrainState`"
NNX = "Flax nnx with dropout"
EQUINOX = "Equinox with random draws in the loss"


def _run_recipe(title):
    sections = re.split(r"^## ", PAGE.read_text(), flags=re.M)
    (section,) = [s for s in sections if s.startswith(title + "\n")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, title
    namespace = {}
    with jax.numpy_dtype_promotion("standard"):
        for index, block in enumerate(blocks):
            exec(compile(block, f"docs/recipes.md[{title}, block {index}]", "exec"), namespace)
    return namespace


# The recipes are user code, written under JAX's default promotion; their
# jitted steps were traced under it, so they are called under it too.
pytestmark = pytest.mark.usefixtures("standard_promotion")


def _assert_bitwise_equal(new, old):
    new_leaves, new_def = jax.tree_util.tree_flatten(new)
    old_leaves, old_def = jax.tree_util.tree_flatten(old)
    assert new_def == old_def
    for a, b in zip(new_leaves, old_leaves):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        a, b = (np.atleast_1d(np.asarray(v)).view(np.uint8) for v in (a, b))
        np.testing.assert_array_equal(a, b)


def _with_nan(x):
    return x.at[0, 0].set(jnp.nan)


def _leaves_close(a, b, atol):
    for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=0, atol=atol)


def _grads_close(grads, reference):
    # Within 5% of float32's, array by array. A float16 forward and backward
    # pass puts the first layers' gradients of these MLPs 2-3% away from
    # float32's; casting the whole loss to float16 by hand does the same.
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(reference)):
        assert g.dtype == jnp.float32
        assert float(jnp.linalg.norm(g - r)) <= 0.05 * float(jnp.linalg.norm(r))


def _half_share_at_least_90_percent(step, *args):
    share = jaxmp.debug.half_matmul_flop_share(step, *args)
    assert share >= 0.9, f"only {share:.0%} of the matmul FLOPs in half precision"


def test_flax_linen_trainstate():
    ns = _run_recipe(LINEN)
    state, scaler, x, y, loss_fn = ns["state"], ns["scaler"], ns["x"], ns["y"], ns["loss_fn"]
    _half_share_at_least_90_percent(ns["train_step"], state, scaler, x, y)

    # The page's loop trained: every step applied, the loss went down.
    assert int(state.step) == 20 and bool(ns["finite"])
    initial = jax.jit(loss_fn)(ns["model"].init(jax.random.key(1), x)["params"], x, y)
    assert float(ns["loss"]) < 0.8 * float(initial)

    # One more step against float32's: the same loss, gradients and update.
    @jax.jit
    def reference_step(state):
        loss, grads = jax.value_and_grad(loss_fn)(state.params, x, y)
        return loss, grads, state.apply_gradients(grads=grads)

    new, _, loss, finite = ns["train_step"](state, scaler, x, y)
    reference_loss, reference_grads, reference = reference_step(state)
    assert bool(finite) and int(new.step) == int(state.step) + 1
    np.testing.assert_allclose(float(loss), float(reference_loss), rtol=1e-2)
    _, grads, _, _ = jax.jit(ns["grad_fn"])(state.params, x, y, scaler_state=scaler)
    _grads_close(grads, reference_grads)
    # Adam moves a parameter by about the learning rate (1e-3), whatever the
    # gradient's size, so a tiny gradient's rounding can change its move a little.
    _leaves_close(new.params, reference.params, atol=2.5e-4)

    # A step with a NaN in the batch changes nothing, the step count included.
    skipped, new_scaler, _, finite = ns["train_step"](state, scaler, _with_nan(x), y)
    assert not bool(finite)
    _assert_bitwise_equal(skipped, state)
    assert skipped.apply_fn is state.apply_fn and skipped.tx is state.tx
    assert float(new_scaler.scale) < float(scaler.scale)  # while the scaler reacts

    # The page's alternative, optimizer_update then replace, gives the same states.
    @jax.jit
    def alternative_step(state, scaler, x, y):
        loss, grads, scaler, finite = ns["grad_fn"](state.params, x, y, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(
            state.params, state.tx, state.opt_state, grads, finite)
        return state.replace(params=params, opt_state=opt_state, step=state.step + finite)

    _assert_bitwise_equal(alternative_step(state, scaler, x, y), new)
    _assert_bitwise_equal(alternative_step(state, scaler, _with_nan(x), y), state)


def _rng_count(rest):
    return int(rest["dropout"]["rngs"]["count"][...])  # flax 0.12.12 deprecates .value


def test_flax_nnx_dropout():
    from flax import nnx

    ns = _run_recipe(NNX)
    x, y, train_step, loss_fn = ns["x"], ns["y"], ns["train_step"], ns["loss_fn"]
    _, params, rest = nnx.split(ns["Classifier"](nnx.Rngs(0, dropout=1)), nnx.Param, ...)
    opt_state, scaler = ns["optimizer"].init(params), jaxmp.scaler_for(jnp.float16)
    _half_share_at_least_90_percent(train_step, params, rest, opt_state, scaler, x, y)

    # The page's loop trained, and each of its 20 steps drew a new dropout mask.
    initial, _ = jax.jit(loss_fn)(params, rest, x, y)
    assert bool(ns["finite"]) and float(ns["loss"]) < 0.8 * float(initial)
    assert _rng_count(ns["rest"]) == _rng_count(rest) + 20

    # A first step against float32's, with the same dropout mask (the same RNG state).
    new_params, new_rest, _, _, loss, finite = train_step(params, rest, opt_state, scaler, x, y)
    (reference_loss, reference_rest), reference_grads = jax.jit(jax.value_and_grad(
        loss_fn, has_aux=True))(params, rest, x, y)
    assert bool(finite)
    np.testing.assert_allclose(float(loss), float(reference_loss), rtol=1e-2)
    (_, _), grads, _, _ = jax.jit(ns["grad_fn"])(params, rest, x, y, scaler_state=scaler)
    _grads_close(grads, reference_grads)
    assert _rng_count(new_rest) == _rng_count(rest) + 1
    _assert_bitwise_equal(new_rest, reference_rest)
    # The next step draws another mask: the same batch gives another loss.
    *_, second_loss, _ = train_step(params, new_rest, opt_state, scaler, x, y)
    assert float(second_loss) != float(loss)

    # A step with a NaN in the batch changes nothing: parameters, optimizer and RNG state.
    params, rest, opt_state, scaler = ns["params"], ns["rest"], ns["opt_state"], ns["scaler"]
    new_params, new_rest, new_opt_state, new_scaler, _, finite = train_step(
        params, rest, opt_state, scaler, _with_nan(x), y)
    assert not bool(finite)
    _assert_bitwise_equal(new_params, params)
    _assert_bitwise_equal(new_opt_state, opt_state)
    _assert_bitwise_equal(new_rest, rest)  # the RNG did not advance
    assert float(new_scaler.scale) < float(scaler.scale)


def test_equinox_random_draws_in_the_loss():
    ns = _run_recipe(EQUINOX)
    model, images, loss_fn, grad_fn = ns["model"], ns["images"], ns["loss_fn"], ns["grad_fn"]
    _half_share_at_least_90_percent(
        ns["train_step"], model, ns["opt_state"], ns["scaler"], images, ns["key"])

    # The page's loop trained.
    initial = jax.jit(loss_fn)(ns["Denoiser"](jax.random.key(0)), images, ns["key"])
    assert bool(ns["finite"]) and float(ns["loss"]) < float(initial)

    # One more step against float32's loss, with the same random draws (the same key).
    key = jax.random.key(7)
    *_, loss, finite = ns["train_step"](model, ns["opt_state"], ns["scaler"], images, key)
    assert bool(finite)
    np.testing.assert_allclose(float(loss), float(jax.jit(loss_fn)(model, images, key)), rtol=1e-2)

    # What the page says of casting only the inputs: the float32 noisy image
    # meets float16 weights at the first convolution.
    cast_inputs = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16, autocast=False)
    with pytest.raises(TypeError):
        cast_inputs(model, images, key, scaler_state=ns["scaler"])


def test_every_code_block_of_the_page_is_in_a_tested_recipe():
    intro, *sections = re.split(r"^## ", PAGE.read_text(), flags=re.M)
    assert "```python" not in intro
    assert {s.splitlines()[0] for s in sections if "```python" in s} == {LINEN, NNX, EQUINOX}
