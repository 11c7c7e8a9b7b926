"""Tests of float8_scaling="delayed": scales from an amax history carried as explicit state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp._src.float8 import delayed
from tests import helpers

E4M3 = jnp.float8_e4m3fn
OPTIONS = dict(compute_dtype=jnp.bfloat16, matmul_dtype=E4M3)


def _mlp(seed=0, widths=(32, 64, 64, 10)):
    keys = jax.random.split(jax.random.key(seed), len(widths))
    params = [{"w": jax.random.normal(k, (m, n)) / np.sqrt(m), "b": jnp.zeros(n)}
              for k, m, n in zip(keys, widths[:-1], widths[1:])]
    x = jax.random.normal(keys[-1], (64, widths[0]))
    y = jnp.argmax(x[:, :widths[-1]], axis=-1)
    return params, x, y


def _step(scaling="delayed", tx=optax.adam(1e-2)):
    """A jitted training step: ``(params, opt, scaler, float8_state, x, y) -> (..., loss)``."""
    grad_fn = jaxmp.mp_value_and_grad(helpers.mlp_loss, float8_scaling=scaling, **OPTIONS)

    @jax.jit
    def step(params, opt, scaler, h, x, y):
        extra = {} if h is None else {"float8_state": h}
        loss, grads, scaler, finite, *h_new = grad_fn(params, x, y, scaler_state=scaler, **extra)
        params, opt = jaxmp.optimizer_update(params, tx, opt, grads, finite)
        return params, opt, scaler, (h_new[0] if h_new else None), loss, finite

    return step


def test_init_counts_one_row_per_product_and_window():
    params, x, y = _mlp()
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y, window=5)
    assert h.history.shape == (3, 3, 5) and h.history.dtype == jnp.float32
    assert bool(jnp.all(h.history == delayed.EMPTY))


def test_gradients_match_float32_and_history_records_each_tensor():
    params, x, y = _mlp()
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y)
    grad_fn = jax.jit(jaxmp.mp_value_and_grad(helpers.mlp_loss, float8_scaling="delayed",
                                              **OPTIONS))
    ref_loss, ref = jax.value_and_grad(helpers.mlp_loss)(params, x, y)
    for _ in range(2):  # the first step has an empty history (scale 1), the second a full one
        loss, grads, _, finite, h = grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler(),
                                            float8_state=h)
    assert bool(finite) and abs(float(loss) - float(ref_loss)) < 0.02 * float(ref_loss)
    for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        assert helpers.rel(g, r) < 0.1
    latest = np.asarray(h.history[:, :, 0])
    # Each entry is the scale exponent of that tensor's amax (scaling.scale_exponent).
    w0 = float(jnp.max(jnp.abs(params[0]["w"])))
    assert latest[0, 1] == np.floor(np.log2(w0 / 448)) + 1
    assert np.all(latest > delayed.EMPTY) and np.all(h.history[:, :, 2:] == delayed.EMPTY)


def test_a_spike_saturates_no_inf_reaches_the_weights_and_the_history_adapts():
    params, x, y = _mlp()
    tx = optax.sgd(1e-2)
    step = _step(tx=tx)
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y)
    opt, scaler = tx.init(params), jaxmp.noop_scaler()
    for _ in range(3):
        params, opt, scaler, h, loss, finite = step(params, opt, scaler, h, x, y)
    before = float(h.history[0, 0, 0])
    spike = x.at[0, 0].set(1e4 * float(jnp.max(jnp.abs(x))))  # far beyond the delayed scale
    params, opt, scaler, h, loss, finite = step(params, opt, scaler, h, spike, y)
    assert bool(finite) and np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree_util.tree_leaves(params))
    assert float(h.history[0, 0, 0]) >= before + 13  # 1e4 ~ 2**13.3: the history saw it
    # Unsaturated, e4m3fn's overflow would be NaN; the tensor recipe scales it from itself.
    out = jaxmp.autocast(helpers.matmul, jnp.bfloat16, matmul_dtype=E4M3,
                         float8_scaling="delayed")(params[0]["w"], spike,
                                                   float8_state=delayed.Float8State(
                                                       jnp.zeros((1, 3, 1)), 0))
    assert bool(jnp.all(jnp.isfinite(out)))


def test_a_skipped_step_changes_nothing_and_records_no_inf():
    params, x, y = _mlp()
    tx = optax.adam(1e-2)
    step = _step(tx=tx)
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y)
    opt, scaler = tx.init(params), jaxmp.noop_scaler()
    params, opt, scaler, h, _, _ = step(params, opt, scaler, h, x, y)
    bad = x.at[0, 0].set(jnp.inf)
    new_params, new_opt, scaler, new_h, _, finite = step(params, opt, scaler, h, bad, y)
    assert not bool(finite)
    helpers.assert_bitwise(new_params, params)
    helpers.assert_bitwise(new_opt, opt)
    # The history still records the finite amaxes; the inf one is not recorded.
    assert bool(jnp.all(jnp.isfinite(new_h.history)))
    assert float(new_h.history[0, 0, 0]) == delayed.EMPTY
    assert float(new_h.history[1, 1, 0]) == float(h.history[1, 1, 0])
    params, opt, scaler, h, loss, finite = step(new_params, new_opt, scaler, new_h, x, y)
    assert bool(finite) and np.isfinite(float(loss))


def _train(scaling, steps=30, h=None):
    params, x, y = _mlp()
    tx = optax.adam(1e-2)
    step, opt, scaler = _step(scaling, tx), tx.init(params), jaxmp.noop_scaler()
    for _ in range(steps):
        params, opt, scaler, h, loss, _ = step(params, opt, scaler, h, x, y)
    return float(helpers.mlp_loss(params, x, y))


def test_training_loss_within_two_percent_of_bfloat16_tensor_and_float32():
    params, x, y = _mlp()
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y)
    got = _train("delayed", h=h)
    tensor = _train("tensor")
    bf16 = _train_bf16()
    assert got < 0.5 * float(helpers.mlp_loss(params, x, y))  # it trains
    for other in (tensor, bf16):
        assert abs(got - other) <= 0.02 * other + 1e-3, (got, tensor, bf16)


def _train_bf16(steps=30):
    params, x, y = _mlp()
    tx = optax.adam(1e-2)
    grad_fn = jaxmp.mp_value_and_grad(helpers.mlp_loss, compute_dtype=jnp.bfloat16)

    @jax.jit
    def step(params, opt):
        _, grads, _, finite = grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler())
        return jaxmp.optimizer_update(params, tx, opt, grads, finite)

    opt = tx.init(params)
    for _ in range(steps):
        params, opt = step(params, opt)
    return float(helpers.mlp_loss(params, x, y))


def test_history_in_a_lax_scan_carry_over_steps():
    params, x, y = _mlp()
    tx = optax.adam(1e-2)
    grad_fn = jaxmp.mp_value_and_grad(helpers.mlp_loss, float8_scaling="delayed", **OPTIONS)
    h = jaxmp.experimental.init_float8_state(helpers.mlp_loss, params, x, y, window=4)

    def body(carry, _):
        params, opt, h = carry
        loss, grads, _, finite, h = grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler(),
                                            float8_state=h)
        params, opt = jaxmp.optimizer_update(params, tx, opt, grads, finite)
        return (params, opt, h), loss

    (params, _, h), losses = jax.jit(lambda c: jax.lax.scan(body, c, length=6))(
        (params, tx.init(params), h))
    assert type(h) is delayed.Float8State and h.history.shape == (3, 3, 4)
    assert bool(jnp.all(h.history > delayed.EMPTY))  # 6 steps filled the window of 4
    assert float(losses[-1]) < float(losses[0])


def test_the_history_round_trips_through_flax_serialization():
    from flax import serialization

    h = delayed.empty_state(3, window=4, margin=2)
    h = h.replace(history=h.history.at[1, 2, 0].set(-7.0))
    back = serialization.from_bytes(delayed.empty_state(3, window=4, margin=2),
                                    serialization.to_bytes(h))
    helpers.assert_bitwise(back, h)
    assert back.margin == 2


def test_missing_or_mis_sized_history_errors_name_the_fix():
    params, x, y = _mlp()
    grad_fn = jaxmp.mp_value_and_grad(helpers.mlp_loss, float8_scaling="delayed", **OPTIONS)
    with pytest.raises(TypeError, match="init_float8_state"):
        grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler())
    small = delayed.empty_state(2)
    with pytest.raises(ValueError, match="(?s)has 2 rows.*more float8 products.*init_float8_state"):
        grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler(), float8_state=small)
    big = delayed.empty_state(4)
    with pytest.raises(ValueError, match="(?s)has 4 rows.*3 float8 products"):
        grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler(), float8_state=big)
    with pytest.raises(TypeError, match="float8_state="):
        jaxmp.autocast(helpers.matmul, matmul_dtype=E4M3, float8_scaling="delayed")(
            params[0]["w"], x)


def test_products_inside_a_scan_scale_from_themselves_said_once():
    w = jnp.ones((3, 16, 16)) / 16

    def loss(w, x):
        x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)
        return jnp.mean(x @ w[0])

    x = jnp.ones((8, 16))
    with pytest.warns(UserWarning, match="inside a loop"):
        h = jaxmp.experimental.init_float8_state(loss, w, x)
    assert h.history.shape[0] == 1  # the product after the loop only


def test_flax_linen_model_trains_with_delayed_scaling():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.gelu(nn.Dense(64)(x)))

    model = MLP()
    _, x, y = _mlp()
    params = model.init(jax.random.key(0), x)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    tx = optax.adam(1e-2)
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, float8_scaling="delayed", **OPTIONS)
    h = jaxmp.experimental.init_float8_state(loss_fn, params, x, y)
    assert h.history.shape[0] == 2

    @jax.jit
    def step(params, opt, h):
        loss, grads, _, finite, h = grad_fn(params, x, y, scaler_state=jaxmp.noop_scaler(),
                                            float8_state=h)
        params, opt = jaxmp.optimizer_update(params, tx, opt, grads, finite)
        return params, opt, h, loss

    opt, first = tx.init(params), float(loss_fn(params, x, y))
    for _ in range(20):
        params, opt, h, loss = step(params, opt, h)
    assert float(loss_fn(params, x, y)) < 0.7 * first


# --- The compiled H100 program: quantising fused into the producing kernel ----------------------


def _norm_mlp(w, x):
    """A residual block and an RMS norm, whose output is the next product's operand."""
    h = x + jnp.tanh(x @ w["a"])
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return jnp.mean(h @ w["b"])


def _h100_kernels(variant):
    """``{kernel name: (opcodes, float8 converts)}`` of the H100 program of a training step."""
    import warnings

    from benchmarks import gpu_program as bench
    from jaxmp._src import gpu_program as gp

    if not gp.plugin_installed():
        pytest.skip("needs JAX's CUDA plugin: pip install -e '.[gpu-compile]'")
    s = jax.ShapeDtypeStruct
    w = {"a": s((256, 256), jnp.float32), "b": s((256, 256), jnp.float32)}
    x = s((128, 256), jnp.float32)
    init, step = bench.make_step(_norm_mlp, variant, batch=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = jaxmp.debug.gpu_program(jax.jit(step, donate_argnums=0), jax.eval_shape(
            init, w), x, target="h100")
    ops = bench.kernel_ops(program.text)
    return {k.name: ({o.opcode for o in ops.get(k.name, [])},
                     [o.type for o in ops.get(k.name, []) if o.opcode == "convert"
                      and "f8e" in o.type]) for k in program.kernels if not k.products}


@pytest.mark.gpu_program
def test_delayed_quantise_and_amax_run_in_the_kernel_producing_the_activation():
    delayed_kernels, tensor_kernels = _h100_kernels("fp8_delayed_jaxmp"), _h100_kernels(
        "fp8_jaxmp")
    # The normalised activation [128, 256]: normalised, quantised and its amax taken in one
    # kernel; no other kernel converts it to float8.
    act = [codes for codes, f8 in delayed_kernels.values()
           if any(t.startswith("f8e4m3fn[128,256]") for t in f8)]
    assert len(act) == 2  # x (an input) and the activation
    assert sum({"rsqrt", "tanh", "abs", "reduce"} <= codes for codes in act) == 1, act

    def amax_only(kernels):  # kernels that take an amax and quantise nothing
        return sum(1 for codes, f8 in kernels.values() if {"abs", "reduce"} <= codes and not f8)

    def quantise(kernels):
        return sum(1 for _, f8 in kernels.values() if f8)

    # "tensor": 4 amax kernels (each re-reading its tensor) and 5 quantise kernels.
    assert amax_only(delayed_kernels) <= amax_only(tensor_kernels) - 2
    assert quantise(delayed_kernels) <= quantise(tensor_kernels)
    assert len(delayed_kernels) < len(tensor_kernels)
