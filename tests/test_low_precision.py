"""low_precision_optimizer: half-precision state, and parameter rounding that keeps small updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
from tests.helpers import assert_bitwise
from jaxmp._src import low_precision

BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
ROUNDINGS = ("nearest", "stochastic", "kahan")
TRUE, FALSE = jnp.asarray(True), jnp.asarray(False)


def _params(dtype=jnp.bfloat16, n=64):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": (jax.random.normal(k1, (n, 4)) * 0.5).astype(dtype),
            "b": (1.0 + jax.random.uniform(k2, (4,))).astype(dtype)}


def _grads(params, step=0):
    key = jax.random.fold_in(jax.random.key(7), step)
    return jax.tree_util.tree_map(
        lambda p: jax.random.normal(jax.random.fold_in(key, p.size), p.shape).astype(p.dtype),
        params)


def _apply(params, updates):
    # float32 updates on half-precision parameters: strict promotion refuses the sum.
    with jax.numpy_dtype_promotion("standard"):
        return optax.apply_updates(params, updates)


def _standard(fn, *args):
    # optax itself relies on standard promotion (jaxmp.optimizer_update allows it too).
    with jax.numpy_dtype_promotion("standard"):
        return fn(*args)


def _float_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


# --- The inner state: state_dtype, float32 arithmetic -------------------------------------------

INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-4),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "chain": lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                 optax.adam(optax.warmup_cosine_decay_schedule(0, 1e-3, 2, 10))),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2),
    "inject": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4),
}


@pytest.mark.parametrize("name", sorted(INNERS))
def test_state_dtype_applies_to_every_floating_leaf_with_a_shape(name):
    params = _params(jnp.bfloat16)
    tx = jaxmp.experimental.low_precision_optimizer(INNERS[name](), state_dtype=jnp.bfloat16,
                                                    param_rounding="nearest")
    reference = _standard(INNERS[name]().init, jaxmp.cast_tree(params, jnp.float32))
    state = tx.init(params)
    updates, new_state = jax.jit(tx.update)(_grads(params), state, params)
    for s in (state, new_state):
        ref_leaves = jax.tree_util.tree_leaves(reference)
        leaves = jax.tree_util.tree_leaves(s.inner)
        assert len(leaves) == len(ref_leaves)
        for x, r in zip(leaves, ref_leaves):
            if jnp.issubdtype(r.dtype, jnp.floating) and r.ndim >= 1:
                assert x.dtype == BF16
            else:  # counts stay integers, scalar hyperparameters stay float32
                assert x.dtype == r.dtype
    # The state has the same types after a step as after init (lax.scan/cond need it).
    assert jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(state)
    assert [x.dtype for x in jax.tree_util.tree_leaves(new_state)] == [
        x.dtype for x in jax.tree_util.tree_leaves(state)]
    assert all(u.dtype == F32 for u in jax.tree_util.tree_leaves(updates))  # exact differences


def test_inject_hyperparams_keeps_the_learning_rate_in_float32():
    tx = jaxmp.experimental.low_precision_optimizer(
        optax.inject_hyperparams(optax.adam)(learning_rate=3e-4))
    state = tx.init(_params())
    lr = state.inner.hyperparams["learning_rate"]
    assert lr.dtype == F32 and float(lr) == float(np.float32(3e-4))
    # Why: bfloat16 would change the learning rate itself, for every step.
    assert float(jnp.asarray(3e-4, jnp.bfloat16)) != float(np.float32(3e-4))
    _, state = tx.update(_grads(_params()), state, _params())
    assert float(state.inner.hyperparams["learning_rate"]) == float(np.float32(3e-4))


def test_the_state_forwards_reads_of_the_wrapped_states_fields():
    # Issue 34: nanodo reads state.opt_state.gradient_step (optax.MultiSteps); the wrapper hid it.
    params, grads = _params(), _grads(_params())
    multi = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
    wrapped = jaxmp.experimental.low_precision_optimizer(multi)
    plain_state, state = multi.init(jaxmp.cast_tree(params, jnp.float32)), wrapped.init(params)
    plain_update, update = jax.jit(multi.update), jax.jit(wrapped.update)
    with jax.numpy_dtype_promotion("standard"):  # optax's own arithmetic needs it
        for _ in range(3):
            _, plain_state = plain_update(jaxmp.cast_tree(grads, jnp.float32), plain_state,
                                          jaxmp.cast_tree(params, jnp.float32))
            _, state = update(grads, state, params)
    assert int(state.gradient_step) == int(plain_state.gradient_step) == 1
    assert int(state.mini_step) == int(plain_state.mini_step) == 1
    assert bool(multi.has_updated(state)) == bool(multi.has_updated(plain_state))
    # A schedule's count and inject_hyperparams' hyperparameters, through jit too.
    tx = jaxmp.experimental.low_precision_optimizer(
        optax.inject_hyperparams(optax.adam)(learning_rate=3e-4))
    state = jax.jit(lambda s: tx.update(grads, s, params)[1])(tx.init(params))
    assert int(state.count) == 1
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(3e-4)
    # The fields of the wrapper itself come first; a name neither has says both.
    assert state.key is not None and state.inner.count is state.count
    with pytest.raises(AttributeError, match="nor has the state of the optimizer it wraps"):
        _ = state.gradient_step


def test_inner_update_runs_in_float32_on_narrowed_state():
    # float32 parameters, bfloat16 state: the updates are those of float32 Adam run
    # on moments rounded to bfloat16 between steps (the reference, written out).
    params = _params(jnp.float32)
    adam = optax.adam(1e-2)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-2), state_dtype=jnp.bfloat16)
    state, ref_state = tx.init(params), _standard(adam.init, params)
    for step in range(3):
        grads = _grads(params, step)
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = _standard(adam.update, grads, ref_state, params)
        ref_state = jax.tree_util.tree_map(
            lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim else x, ref_state)
        # float32 parameters pass through: the inner update itself, bit for bit.
        assert_bitwise(updates, ref_updates)
        params = _apply(params, updates)
    # And the moments differ from unrounded float32 Adam's (the narrowing is real).
    mu = state.inner[0].mu["w"].astype(jnp.float32)
    assert not np.array_equal(np.asarray(mu), np.asarray(
        _standard(adam.update, grads, _standard(adam.init, params), params)[1][0].mu["w"]))


def test_float32_state_dtype_leaves_the_state_as_it_is():
    params = _params(jnp.float32)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-2), state_dtype=jnp.float32)
    updates, state = tx.update(_grads(params), tx.init(params), params)
    ref_updates, ref_state = _standard(optax.adam(1e-2).update, _grads(params),
                                       _standard(optax.adam(1e-2).init, params), params)
    assert_bitwise((updates, state.inner), (ref_updates, ref_state))


# --- Parameter rounding: exact updates ----------------------------------------------------------


def _wide_sum(params, updates32):
    """The float32 sum p + u, for every leaf."""
    return jax.tree_util.tree_map(lambda p, u: p.astype(jnp.float32) + u, params, updates32)


def _sgd_case(dtype, lr):
    params = _params(dtype, n=512)
    grads = _grads(params)
    # The float32 reference update of plain SGD on the float32 gradients.
    u32 = jax.tree_util.tree_map(lambda g: -jnp.float32(lr) * g.astype(jnp.float32), grads)
    return params, grads, u32


def _check_applied_exactly(tx, params, grads, state):
    """Under jit, the updates are exactly the parameters' change, and optimizer_update agrees.

    (Eager runs are compared with the float32 reference below; under jit XLA may fuse the
    inner update's multiply with the sum into one fused multiply-add, a more exact sum.)
    """
    def by_hand(p, s, g):
        updates, s = tx.update(g, s, p)
        return _apply(p, updates), updates

    applied, updates = jax.jit(by_hand)(params, state, grads)
    for new, p, d in zip(*(jax.tree_util.tree_leaves(t) for t in (applied, params, updates))):
        assert d.dtype == F32 and new.dtype == p.dtype
        assert_bitwise(new.astype(jnp.float32) - p.astype(jnp.float32), d)
    via_jaxmp, _ = jax.jit(lambda p, s, g: jaxmp.optimizer_update(p, tx, s, g, TRUE))(
        params, state, grads)
    assert_bitwise(via_jaxmp, applied)
    eager, _ = jaxmp.optimizer_update(params, tx, state, grads, TRUE)
    assert_bitwise(eager, _apply(params, tx.update(grads, state, params)[0]))
    return eager


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("lr", [1e-4, 1e-2, 0.3])
def test_nearest_is_round_to_nearest_of_the_float32_sum_bitwise(dtype, lr):
    params, grads, u32 = _sgd_case(dtype, lr)
    tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(lr), param_rounding="nearest")
    state = tx.init(params)
    expected = jax.tree_util.tree_map(lambda t: t.astype(dtype), _wide_sum(params, u32))
    assert_bitwise(_check_applied_exactly(tx, params, grads, state), expected)
    if lr == 1e-4:  # small updates are lost: the stall the other roundings fix
        assert np.mean(np.asarray(expected["b"]) == np.asarray(params["b"])) > 0.5


def _neighbours(t, dtype):
    """The two values of ``dtype`` around float32 ``t`` (equal where ``t`` is representable)."""
    near = t.astype(dtype)
    other = jnp.nextafter(near, jnp.where(near.astype(jnp.float32) > t, -jnp.inf, jnp.inf)
                          .astype(dtype))
    exact = near.astype(jnp.float32) == t
    lo = jnp.where(exact | (near.astype(jnp.float32) < t), near, other)
    hi = jnp.where(exact | (near.astype(jnp.float32) > t), near, other)
    return lo, hi


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("lr", [1e-4, 1e-2, 0.3])
def test_stochastic_lands_on_a_neighbour_of_the_float32_sum_exactly(dtype, lr):
    params, grads, u32 = _sgd_case(dtype, lr)
    tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(lr), param_rounding="stochastic")
    state = tx.init(params)
    applied = _check_applied_exactly(tx, params, grads, state)
    ups = 0
    for new, t in zip(jax.tree_util.tree_leaves(applied),
                      jax.tree_util.tree_leaves(_wide_sum(params, u32))):
        lo, hi = _neighbours(t, dtype)
        new, lo, hi = (np.asarray(x.astype(jnp.float32)) for x in (new, lo, hi))
        assert np.all((new == lo) | (new == hi))
        ups += np.sum((new == hi) & (lo != hi))
    assert ups > 0  # rounded up somewhere, and not everywhere (next line)
    assert ups < sum(p.size for p in jax.tree_util.tree_leaves(params))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("lr", [1e-4, 1e-2, 0.3])
def test_kahan_keeps_exactly_what_rounding_lost(dtype, lr):
    params, grads, u32 = _sgd_case(dtype, lr)
    tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(lr), param_rounding="kahan")
    state = tx.init(params)
    applied = _check_applied_exactly(tx, params, grads, state)
    # The first step has no compensation yet: the parameter is the nearest value ...
    expected = jax.tree_util.tree_map(lambda t: t.astype(dtype), _wide_sum(params, u32))
    assert_bitwise(applied, expected)
    # ... and the buffer holds what that rounding lost (rounded to the buffer's dtype).
    _, new_state = tx.update(grads, state, params)
    for new, c, t in zip(jax.tree_util.tree_leaves(applied),
                         jax.tree_util.tree_leaves(new_state.compensation),
                         jax.tree_util.tree_leaves(_wide_sum(params, u32))):
        assert c.dtype == dtype
        lost = t - new.astype(jnp.float32)
        assert np.any(np.asarray(lost) != 0)
        np.testing.assert_array_equal(np.asarray(c), np.asarray(lost.astype(dtype)))
    # A second step adds the compensation back: p + (u + c), rounded to nearest.
    params2 = applied
    u2, _ = tx.update(grads, new_state, params2)
    expected2 = jax.tree_util.tree_map(
        lambda p, u, c: (p.astype(jnp.float32) + (u + c.astype(jnp.float32))).astype(dtype),
        params2, u32, new_state.compensation)
    assert_bitwise(_apply(params2, u2), expected2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_updates_reach_any_rounded_value_exactly_even_across_zero(dtype):
    # Steps from 1% of a parameter's size to 100 times it, crossing zero for many elements.
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    p = jax.random.normal(k1, (300_000,)).astype(dtype)
    step = jax.random.normal(k2, p.shape) * 10.0 ** jax.random.uniform(k3, p.shape, minval=-2,
                                                                        maxval=2)
    rounded = (p.astype(jnp.float32) + step).astype(dtype)
    assert np.mean(np.sign(np.asarray(rounded, np.float32)) != np.sign(np.asarray(p, np.float32))) > 0.2
    d, new = jax.jit(low_precision._exact_update)(p, rounded)
    assert_bitwise(new, rounded)
    assert_bitwise(_apply(p, d), rounded)
    assert_bitwise(jax.jit(_apply)(p, d), rounded)
    # In the parameters' own dtype the same steps could not be written exactly.
    d_half = (rounded.astype(jnp.float32) - p.astype(jnp.float32)).astype(dtype)
    assert np.mean(np.asarray(_apply(p, d_half) != rounded)) > 0.01


# --- Stochastic rounding: unbiased, subnormals, overflow -----------------------------------------

N_DRAWS = 20_000


def _draws(value, dtype, seed=0):
    t = jnp.full((N_DRAWS,), value, jnp.float32)
    bits = low_precision._random_bits(jax.random.key_data(jax.random.key(seed)), 0, t)
    return low_precision.stochastic_round(t, dtype, bits)


@pytest.mark.parametrize("dtype,value", [
    (jnp.bfloat16, 1.0 + 2.0**-9),           # a quarter of the spacing above 1
    (jnp.bfloat16, -3.14159),
    (jnp.bfloat16, 1e-3 + 1e-6),
    (jnp.bfloat16, 1.3 * 2.0**-130),         # a bfloat16 subnormal
    (jnp.float16, 1.0 + 2.0**-12),           # an eighth of the spacing above 1
    (jnp.float16, -3.14159),
    (jnp.float16, 1e-3 + 1e-7),
    (jnp.float16, 3.7 * 2.0**-24),           # float16 subnormals: spacing 2**-24
    (jnp.float16, 0.3 * 2.0**-24),           # below the smallest subnormal
    (jnp.float16, -(2.0**-14) * 0.99),       # just below the smallest normal
    (jnp.float16, 65500.0),                  # below the largest finite value
])
def test_stochastic_rounding_is_unbiased(dtype, value):
    t = np.float32(value)
    out = _draws(t, dtype)
    assert out.dtype == jnp.dtype(dtype)
    tiny = float(jnp.finfo(dtype).smallest_subnormal)
    if abs(float(t)) < float(jnp.finfo(dtype).smallest_normal):
        # Subnormals are evenly spaced (computed here in float64, whatever the CPU
        # does with float32 denormals in comparisons).
        lo = np.floor(float(t) / tiny) * tiny
        hi = lo + tiny
    else:
        lo, hi = (float(x) for x in _neighbours(jnp.asarray(t), dtype))
    values = np.asarray(out.astype(jnp.float32), np.float64)
    assert set(np.unique(values)) <= {lo, hi}
    frac = (float(t) - lo) / (hi - lo)
    # The mean is the float32 value within 5 standard errors of a Bernoulli mean.
    tolerance = 5 * (hi - lo) * np.sqrt(frac * (1 - frac) / N_DRAWS) + 1e-3 * (hi - lo)
    assert abs(values.mean() - float(t)) < tolerance
    assert 0 < np.mean(values == hi) < 1


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_representable_values_stay_exact(dtype):
    finfo = jnp.finfo(dtype)
    exact = jnp.array([0.0, -0.0, 1.0, -2.5, float(finfo.max), -float(finfo.max),
                       float(finfo.smallest_normal), float(finfo.smallest_subnormal),
                       -3 * float(finfo.smallest_subnormal), 0.1], dtype)
    t = jnp.tile(exact.astype(jnp.float32), 1000)
    bits = low_precision._random_bits(jax.random.key_data(jax.random.key(1)), 0, t)
    out = low_precision.stochastic_round(t, dtype, bits)
    # The expected values tiled by NumPy: XLA:CPU in jax 0.8 flushes bfloat16 subnormals
    # when it tiles them.
    assert_bitwise(out, np.tile(np.asarray(exact), 1000))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_overflow_goes_to_infinity_in_proportion(dtype):
    finfo = jnp.finfo(dtype)
    top = float(finfo.max)
    spacing = top - float(np.nextafter(np.asarray(top, dtype), np.asarray(0, dtype)))
    for sign in (1.0, -1.0):
        # A quarter of a spacing past the largest value: infinity a quarter of the time.
        out = np.asarray(_draws(sign * (top + spacing / 4), dtype).astype(jnp.float32))
        assert set(np.unique(out)) == {sign * top, sign * np.inf}
        assert abs(np.mean(np.isinf(out)) - 0.25) < 0.02
        # A whole spacing past it (or more): always infinity, as round-to-nearest does.
        # (bfloat16: the largest float32 is 2**104 short of that, infinity but 2**-16 of the time.)
        beyond = sign * min(top + spacing, float(np.finfo(np.float32).max))
        share = np.mean(np.asarray(_draws(beyond, dtype).astype(jnp.float32)) == sign * np.inf)
        assert share == 1.0 if dtype == jnp.float16 else share > 0.999
    special = jnp.array([jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
    bits = jnp.array([0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF], jnp.uint32)
    out = np.asarray(low_precision.stochastic_round(special, dtype, bits).astype(jnp.float32))
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])


def test_stochastic_bits_differ_per_element_and_per_step_and_follow_the_seed():
    params = {"w": jnp.ones((4, 256), jnp.bfloat16)}
    grads = {"w": jnp.full((4, 256), 1.0, jnp.bfloat16)}

    def run(seed, steps=2):
        tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(2.0**-10),
                                                        param_rounding="stochastic", seed=seed)
        state, outs = tx.init(params), []
        for _ in range(steps):
            updates, new_state = tx.update(grads, state, params)  # same params every step
            assert not np.array_equal(new_state.key, state.key)  # the key advances
            state = new_state
            outs.append(np.asarray(_apply(params, updates)["w"], np.float32))
        return outs

    first, second = run(0)
    # 1 - 2**-10 is a quarter of the spacing below 1: down a quarter of the time.
    assert 0.15 < np.mean(first < 1) < 0.35
    assert len({row.tobytes() for row in first}) == 4      # per element (rows differ)
    assert not np.array_equal(first, second)               # per step
    again = run(0)
    np.testing.assert_array_equal(again[0], first)         # reproducible from the seed
    np.testing.assert_array_equal(again[1], second)
    assert not np.array_equal(run(1)[0], first)            # and the seed matters


# --- Training: small updates are kept ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_many_small_updates_follow_the_float32_sum(dtype):
    # 200 steps of -1e-4 from 1.0: bfloat16's spacing below 1 is 2**-8, 39 times larger.
    steps, lr = 200, 1e-4
    params = {"w": jnp.ones((2048,), dtype)}
    grads = {"w": jnp.ones((2048,), dtype)}
    reference = float(np.float32(1.0) - np.float32(steps * lr))
    finals = {}
    for rounding in ROUNDINGS:
        tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(lr), param_rounding=rounding)

        def body(carry, _):
            p, s = carry
            p, s = jaxmp.optimizer_update(p, tx, s, grads, TRUE)
            return (p, s), None

        (p, _), _ = jax.jit(lambda p, s: jax.lax.scan(body, (p, s), None, length=steps))(
            params, tx.init(params))
        finals[rounding] = np.asarray(p["w"], np.float64)
    spacing = float(np.float32(1) - np.nextafter(np.asarray(1, dtype), np.asarray(0, dtype)))
    if dtype == jnp.bfloat16:
        assert np.all(finals["nearest"] == 1.0)  # every update lost
    # Unbiased: the mean over 2048 elements is the float32 result within 5 standard errors
    # (each element's rounding errors add up like a random walk of 200 steps).
    spread = finals["stochastic"].std()
    assert 0 < spread < 0.5 * np.sqrt(steps) * spacing
    assert abs(finals["stochastic"].mean() - reference) < 5 * spread / np.sqrt(2048)
    assert np.all(np.abs(finals["kahan"] - reference) <= spacing / 2)


def test_float32_params_pass_through_and_mixed_trees():
    params = {"f32": jnp.ones((8,), jnp.float32), "bf16": jnp.ones((8,), jnp.bfloat16),
              "step": jnp.array(3)}
    floats, _ = jaxmp._src.casting.partition(params)
    grads = {"f32": jnp.full((8,), 1e-2, jnp.float32), "bf16": jnp.full((8,), 1e-2, jnp.bfloat16),
             "step": None}
    for rounding in ROUNDINGS:
        tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(1e-2), param_rounding=rounding)
        state = tx.init(floats)
        if rounding == "kahan":
            assert state.compensation["f32"] is None
            assert state.compensation["bf16"].dtype == BF16
        updates, _ = tx.update(grads, state, floats)
        assert updates["f32"].dtype == F32 and updates["bf16"].dtype == F32
        np.testing.assert_array_equal(updates["f32"], np.full(8, -1e-4, np.float32))
        new, _ = jaxmp.optimizer_update(params, tx, state, grads, TRUE)
        assert int(new["step"]) == 3


# --- Skipped steps, jit, scan, accumulation, extra arguments -------------------------------------


def _train(tx, params, steps, start=0):
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: jaxmp.optimizer_update(p, tx, s, g, TRUE))
    for i in range(start, start + steps):
        params, state = step(params, state, _grads(params, i))
    return params, state


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_skipped_step_changes_nothing(rounding):
    tx = jaxmp.experimental.low_precision_optimizer(optax.adamw(1e-3), param_rounding=rounding)
    params, state = _train(tx, _params(), 3)
    grads = _grads(params, 99)
    skip = jax.jit(lambda p, s, g, f: jaxmp.optimizer_update(p, tx, s, g, f, return_applied=True))
    new_params, new_state, applied = skip(params, state, grads, FALSE)
    assert not bool(applied)
    assert_bitwise((new_params, new_state), (params, state))
    # Finite gradients claimed, NaN given: bfloat16 parameters are checked, so the step
    # is skipped (the message is said from the step only for float16 values).
    nan_grads = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), grads)
    new_params, new_state, applied = skip(params, state, nan_grads, TRUE)
    assert not bool(applied)
    assert_bitwise((new_params, new_state), (params, state))
    # The same step applied does change the parameters and the state it keeps.
    applied_params, applied_state, applied = skip(params, state, grads, TRUE)
    assert bool(applied)
    assert not np.array_equal(applied_params["w"], params["w"])
    if rounding == "stochastic":
        assert not np.array_equal(applied_state.key, state.key)
    if rounding == "kahan":
        assert not np.array_equal(applied_state.compensation["w"], state.compensation["w"])


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_scan_equals_a_loop_of_jitted_steps(rounding):
    inner = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    tx = jaxmp.experimental.low_precision_optimizer(inner, param_rounding=rounding)
    params = _params()
    grads = jax.random.normal(jax.random.key(9), (6, 4))

    def step(carry, g):
        p, s = carry
        g = {"w": jnp.broadcast_to(g, p["w"].shape).astype(p["w"].dtype), "b": g.astype(p["b"].dtype)}
        p, s = jaxmp.optimizer_update(p, tx, s, g, TRUE)
        return (p, s), p

    (scanned, _), history = jax.jit(lambda c: jax.lax.scan(step, c, grads))((params, tx.init(params)))
    carry = (params, tx.init(params))
    jstep = jax.jit(step)
    for i in range(6):
        carry, _ = jstep(carry, grads[i])
    assert_bitwise(scanned, carry[0])
    # MultiSteps' first mini-step returns zero updates: the parameters do not move ...
    assert_bitwise(jax.tree_util.tree_map(lambda v: v[0], history), params)
    # ... and the second applies the window's update.
    assert not np.array_equal(history["b"][1], params["b"])
    if rounding != "kahan":  # (Kahan adds its compensation back on every step)
        assert_bitwise(jax.tree_util.tree_map(lambda v: v[2], history),
                        jax.tree_util.tree_map(lambda v: v[1], history))


def test_gradient_accumulation():
    def loss(p, x, y):
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    k1, k2 = jax.random.split(jax.random.key(5))
    x, y = jax.random.normal(k1, (16, 64)), jax.random.normal(k2, (16, 4))
    params = _params(jnp.bfloat16)
    ref_params = jaxmp.cast_tree(params, jnp.float32)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-2), param_rounding="kahan")
    # autocast=False: the float32 batch is cast to the parameters' bfloat16 (under the
    # suite's strict promotion the loss cannot mix them itself).
    grad_fn = jaxmp.accumulate_value_and_grad(loss, 4, batch_argnums=(1, 2),
                                              compute_dtype=jnp.bfloat16, autocast=False)
    scaler = jaxmp.noop_scaler()
    _, grads, scaler, finite = jax.jit(grad_fn)(params, x, y, scaler_state=scaler)
    new, state = jaxmp.optimizer_update(params, tx, tx.init(params), grads, finite)
    ref_grads = jax.grad(loss)(ref_params, x, y)
    adam = optax.adam(1e-2)
    ref_new = _apply(ref_params, _standard(adam.update, ref_grads, adam.init(ref_params))[0])
    for a, b in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(ref_new)):
        assert a.dtype == BF16
        # One bfloat16 rounding of the float32 result (first Adam step: +-lr per element).
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=2**-8, atol=1e-6)


def test_extra_arguments_reach_the_inner_optimizer():
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=0, factor=0.5))
    tx = jaxmp.experimental.low_precision_optimizer(inner, param_rounding="nearest")
    params = {"w": jnp.ones((2,), jnp.float32)}
    state = tx.init(params)
    for value in (1.0, 2.0, 3.0):  # the loss does not improve: the scale halves
        _, state = tx.update({"w": jnp.ones(2)}, state, params, value=jnp.float32(value))
    assert float(state.inner[1].scale) < 1.0


# --- Several devices -----------------------------------------------------------------------------

NUM = 4


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < NUM:
        pytest.skip(f"needs {NUM} devices")
    return jax.make_mesh((NUM,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_jit_sharding_gives_the_unsharded_result_bitwise(mesh, rounding):
    params = {"w": jnp.ones((32, 8), jnp.bfloat16), "b": jnp.ones((8,), jnp.bfloat16)}
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(2.0**-10), param_rounding=rounding)
    step = jax.jit(lambda p, s, g: jaxmp.optimizer_update(p, tx, s, g, TRUE))
    grads = _grads(params)
    single = step(params, tx.init(params), grads)
    specs = {"w": P("data"), "b": P()}
    shard = lambda t: jax.device_put(t, {k: NamedSharding(mesh, s) for k, s in specs.items()})
    sharded = step(shard(params), tx.init(shard(params)), shard(grads))
    assert len(sharded[0]["w"].sharding.device_set) == NUM
    assert sharded[0]["w"].sharding.spec == P("data")
    assert_bitwise(jax.device_get(sharded), jax.device_get(single))
    if rounding == "stochastic":  # each shard rounded differently (the rows are alike)
        rows = np.asarray(sharded[0]["w"], np.float32)
        assert len({rows[i * 8:(i + 1) * 8].tobytes() for i in range(NUM)}) == NUM


def test_shard_map_data_parallel_equals_unsharded(mesh):
    params = _params()
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(2.0**-10),
                                                    param_rounding="stochastic")
    x = jax.random.normal(jax.random.key(2), (16, 64))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]))

    def step(p, s, x):
        _, grads, _, finite = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16,
                                                      axis_name="data", autocast=False)(
            p, x, scaler_state=jaxmp.noop_scaler())
        return jaxmp.optimizer_update(p, tx, s, grads, finite)

    single = jax.jit(lambda p, s, x: jaxmp.optimizer_update(
        p, tx, s, jax.grad(lambda q: loss(jaxmp.cast_tree(q, jnp.float32), x))(p), TRUE))(
        params, tx.init(params), x)
    per_device = jax.jit(jax.shard_map(
        lambda p, s, x: jax.tree_util.tree_map(lambda v: v[None], step(p, s, x)),
        mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data")))(
        params, tx.init(params), jax.device_put(x, NamedSharding(mesh, P("data"))))
    for d in range(NUM):  # every replica the same, and the same as one device
        replica = jax.tree_util.tree_map(lambda v: v[d], per_device)
        for a, b in zip(jax.tree_util.tree_leaves(replica[0]), jax.tree_util.tree_leaves(single[0])):
            # The gradients are reduced in a different order: allow one spacing on a few.
            diff = np.asarray(a, np.float32) != np.asarray(b, np.float32)
            assert diff.mean() < 0.05
        assert_bitwise(replica, jax.tree_util.tree_map(lambda v: v[0], per_device))


def test_shard_map_sharded_parameters_get_their_own_bits(mesh):
    params = {"w": jnp.ones((NUM * 64,), jnp.bfloat16)}
    tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(2.0**-10),
                                                    param_rounding="stochastic")
    grads = {"w": jnp.ones_like(params["w"])}

    def step(p, s, g):
        updates, _ = tx.update(g, s, p)
        return _apply(p, updates)

    state = tx.init(params)
    spec = NamedSharding(mesh, P("data"))
    out = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data")),
                                out_specs=P("data")))(
        jax.device_put(params, spec), state, jax.device_put(grads, spec))
    blocks = np.asarray(out["w"], np.float32).reshape(NUM, 64)
    assert len({b.tobytes() for b in blocks}) == NUM  # not the same pattern on every shard
    assert 0.1 < np.mean(blocks < 1) < 0.4            # a quarter spacing: down 1/4 of the time


# --- Checkpoints ---------------------------------------------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_orbax_restart_is_bit_identical(tmp_path, rounding):
    inner = optax.chain(optax.clip_by_global_norm(1.0),
                        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3))
    tx = jaxmp.experimental.low_precision_optimizer(inner, param_rounding=rounding, seed=3)
    uninterrupted = _train(tx, _params(), 6)
    params, state = _train(tx, _params(), 3)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", (params, state))
    checkpointer.wait_until_finished()
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct,
                                    (_params(), tx.init(_params())))
    params, state = checkpointer.restore(tmp_path / "ckpt", target)
    checkpointer.close()
    assert isinstance(state, jaxmp.experimental.LowPrecisionState)
    step = jax.jit(lambda p, s, g: jaxmp.optimizer_update(p, tx, s, g, TRUE))
    for i in range(3, 6):
        params, state = step(params, state, _grads(params, i))
    assert_bitwise((params, state), uninterrupted)


# --- Errors --------------------------------------------------------------------------------------


def test_clear_errors():
    with pytest.raises(ValueError, match="state_dtype must be a floating-point dtype.*int32"):
        jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3), state_dtype=jnp.int32)
    with pytest.raises(ValueError, match="state_dtype.*None"):
        jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3), state_dtype=None)
    with pytest.raises(ValueError, match="param_rounding must be one of.*'nearest'.*'round'"):
        jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3), param_rounding="round")
    with pytest.raises(TypeError, match="seed must be an integer"):
        jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3), seed=0.5)
    with pytest.raises(TypeError, match="wraps an optax transformation.*function"):
        jaxmp.experimental.low_precision_optimizer(optax.adam)
    tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3), param_rounding="kahan")
    state = tx.init(_params())
    with pytest.raises(ValueError, match="needs the parameters"):
        tx.update(_grads(_params()), state)
    with pytest.raises(ValueError, match="Kahan compensation buffer.*dtype"):
        tx.update(_grads(_params()), state, _params(jnp.float32))
    with pytest.raises(TypeError, match="not a LowPrecisionState"):
        tx.update(_grads(_params()), optax.adam(1e-3).init(_params()), _params())
