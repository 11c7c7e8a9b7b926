"""4-bit products (NVFP4): ``float8_scaling="nvfp4"``, against NumPy and float32.

The reference quantizer here is written in NumPy from NVIDIA's NVFP4 rules,
without jaxmp: float4_e2m1fn elements (0, 0.5, 1, 1.5, 2, 3, 4, 6), one
float8_e4m3fn scale per block of 16 (``amax_block / 6`` over the tensor's
scale), one float32 scale per tensor (``amax / (6 * 448)``).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp
from jaxmp._src import float8
from jaxmp._src.float8 import nvfp4
from tests.helpers import matmul, rel
from tests.test_mxfp8 import _on, _round_e4m3

F4 = jnp.float4_e2m1fn
E4M3 = jnp.float8_e4m3fn
F32 = jnp.float32
BLOCK_DOT = "__op$block_scaled_dot"
# No padding, no Hadamard switch, no kept products: the recipe's plain numbers.
PLAIN = jaxmp.experimental.NVFP4(hadamard=False, stochastic_rounding=False,
                                 weight_blocks_2d=False)


def _round_e2m1(v):
    """``v`` rounded to nearest-even float4_e2m1fn, saturating at 6: spacing 0.5 below 2,
    1 below 4, 2 up to 6."""
    v = np.asarray(v, np.float64)
    mag = np.abs(v)
    step = np.where(mag < 2, 0.5, np.where(mag < 4, 1.0, 2.0))
    return np.sign(v) * np.minimum(np.round(mag / step) * step, 6.0)  # halves to even


def _reference(x, axis=-1):
    """``(elements, scales, g)`` of ``x`` (float32) in NVFP4 blocks of 16 along ``axis``."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    g = np.float32(np.abs(x).max() / np.float32(6 * 448))
    blocks = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % 16)])
    blocks = blocks.reshape(*blocks.shape[:-1], -1, 16)
    scales = _round_e4m3(np.abs(blocks).max(-1, keepdims=True) / np.float32(6) / g)
    decode = scales.astype(np.float32) * g
    v = np.where(decode > 0, blocks / np.where(decode > 0, decode, 1), 0).astype(np.float32)
    elements = _round_e2m1(v).reshape(*x.shape[:-1], -1)[..., :x.shape[-1]]
    return np.moveaxis(elements, -1, axis), np.moveaxis(scales[..., 0], -1, axis), g


def _normal(shape, seed, outliers=()):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    for row in outliers:
        x[row] *= 1e4
    return jnp.asarray(x)


def _fn(fn, compute_dtype=F32, scaling="nvfp4", **kw):
    return jaxmp.autocast(fn, compute_dtype, matmul_dtype=F4, float8_scaling=scaling, **kw)


# --- The format ---------------------------------------------------------------------------------


def test_reference_rounding_is_jax_float4_e2m1fn():
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
    ties = (grid[1:] + grid[:-1]) / 2
    v = np.concatenate([grid, ties, np.linspace(-7, 7, 4001), np.nextafter(ties, 0),
                        np.nextafter(ties, 9)]).astype(np.float32)
    v = np.concatenate([v, -v])
    jax_values = np.asarray(jnp.asarray(v).astype(F4).astype(F32))
    np.testing.assert_array_equal(jax_values, _round_e2m1(v))


@pytest.mark.parametrize("k", [64, 40])  # 40: a last block of 8, padded with zeros
def test_quantized_operand_is_the_reference(k):
    x = _normal((8, k), 1, outliers=(3,))
    g = nvfp4.global_scale(jnp.max(jnp.abs(x)))
    elements, scales = nvfp4.nv_quantize(x, g)
    assert elements.dtype == F4 and scales.dtype == E4M3 and scales.shape == (8, -(-k // 16))
    want_elements, want_scales, want_g = _reference(x)
    assert float(g) == want_g
    np.testing.assert_array_equal(np.asarray(elements.astype(F32)), want_elements)
    np.testing.assert_array_equal(np.asarray(scales.astype(F32)), want_scales)
    # The outlier row keeps its own scales: every row is within a float4 step of itself.
    dequantized = np.asarray(elements.astype(F32)) * np.repeat(
        np.asarray(scales.astype(F32)), 16, axis=1)[:, :k] * float(g)
    assert np.all(rel(dequantized[i], x[i]) < 0.2 for i in range(8))


def test_zero_and_nonfinite_tensors():
    zeros = jnp.zeros((2, 32))
    elements, scales = nvfp4.nv_quantize(zeros, nvfp4.global_scale(jnp.float32(0)))
    assert not np.any(np.asarray(elements.astype(F32))) and not np.any(np.asarray(scales))
    f = _fn(matmul, scaling=PLAIN)
    w = jnp.ones((32, 16))
    assert not np.any(np.asarray(f(w, zeros)))
    assert np.all(np.isnan(np.asarray(f(w, zeros.at[0, 0].set(jnp.inf)))))


# --- The recipe's parts -------------------------------------------------------------------------


def test_weight_tiles_give_the_same_quantized_weight_forward_and_backward():
    w = _normal((40, 48), 2, outliers=(5,))  # (N, K) rows, N not a multiple of 16
    g = nvfp4.global_scale(jnp.max(jnp.abs(w)))
    (q, s), (q_t, s_t) = nvfp4._weight(w, g, (), (0,), (1,))
    forward = np.asarray(q.astype(F32))[0] * np.repeat(np.asarray(s.astype(F32))[0], 16, 1)
    backward = np.asarray(q_t.astype(F32))[0] * np.repeat(
        np.asarray(s_t.astype(F32))[0], 16, 1)[:, :40]
    np.testing.assert_array_equal(forward, backward.T)
    # One scale per 16x16 tile: the forward block scales repeat down the rows of a tile.
    tiles = np.asarray(s.astype(F32))[0]
    np.testing.assert_array_equal(tiles[:16], np.broadcast_to(tiles[:1], (16, 3)))
    assert rel(forward * float(g), w) < 0.2


def test_hadamard_is_orthogonal_reproducible_and_cancels_in_the_product():
    h = nvfp4.hadamard(7)
    np.testing.assert_array_equal(h @ h.T, np.eye(16, dtype=np.float32))
    np.testing.assert_array_equal(h, nvfp4.hadamard(7))
    assert not np.array_equal(h, nvfp4.hadamard(8))
    a, c = _normal((1, 24, 40), 3), _normal((1, 8, 40), 4)  # (B, F, K): K padded to 48
    ta, tc = nvfp4._transformed(a, 7), nvfp4._transformed(c, 7)
    blocks = np.pad(np.asarray(a), [(0, 0), (0, 0), (0, 8)]).reshape(1, 24, 3, 16)
    np.testing.assert_allclose(np.asarray(ta), (blocks @ h.T).reshape(1, 24, 48), atol=1e-5)
    product = np.einsum("bmk,bnk->bmn", np.asarray(ta), np.asarray(tc))
    np.testing.assert_allclose(product, np.einsum("bmk,bnk->bmn", a, c), rtol=1e-5, atol=1e-5)


def test_stochastic_rounding_is_unbiased_and_reproducible():
    x = jnp.full((64, 256), 1.2).at[:, ::16].set(6.0)  # each block's scale: 6 / 6 (about 1)
    g = nvfp4.global_scale(jnp.float32(6.0))
    q, _ = nvfp4.nv_quantize(x, g, seed=0)
    again, _ = nvfp4.nv_quantize(x, g, seed=0)
    other, _ = nvfp4.nv_quantize(x, g, seed=1)
    values = np.asarray(q.astype(F32))[np.asarray(x) == np.float32(1.2)]
    np.testing.assert_array_equal(np.asarray(again.astype(F32)), np.asarray(q.astype(F32)))
    assert not np.array_equal(np.asarray(other.astype(F32)), np.asarray(q.astype(F32)))
    assert set(np.unique(values)) == {1.0, 1.5}
    assert abs(values.mean() - 1.2) < 0.01  # unbiased; to nearest: 1.0
    nearest, _ = nvfp4.nv_quantize(x, g)
    assert set(np.unique(np.asarray(nearest.astype(F32)))) == {1.0, 6.0}
    grid = jnp.tile(jnp.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -6, -1.5], F32), 100)
    bits = nvfp4.stochastic_bits(grid, 3)
    np.testing.assert_array_equal(
        np.asarray(nvfp4._round_float4(grid, bits).astype(F32)), np.asarray(grid))


# --- Products and training ----------------------------------------------------------------------


def test_forward_product_matches_the_reference():
    w, x = _normal((48, 32), 5), _normal((24, 48), 6, outliers=(2,))
    ex, sx, gx = _reference(x, 1)
    ew, sw, gw = _reference(w, 0)
    deq = lambda e, s, g, axis: e * np.repeat(s, 16, axis).take(range(e.shape[axis]), axis) * g
    want = deq(ex, sx, gx, 1).astype(np.float64) @ deq(ew, sw, gw, 0).astype(np.float64)
    got = np.asarray(jax.jit(_fn(matmul, scaling=PLAIN))(w, x), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _mlp_loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _train(loss, steps=8, lr=0.1):
    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(keys[0], (32, 64)) / 6,
              "w2": jax.random.normal(keys[1], (64, 16)) / 8}
    x = jax.random.normal(keys[2], (64, 32))
    y = jnp.tanh(x[:, :16] * 2)

    def step(params, _):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), value

    _, losses = jax.jit(lambda p: jax.lax.scan(step, p, None, length=steps))(params)
    return np.asarray(losses)


@pytest.fixture(scope="module")
def float32_losses():
    return _train(_mlp_loss)


@pytest.mark.parametrize("scaling", ["nvfp4", PLAIN])
def test_a_small_mlp_trains_as_float32_and_bfloat16_do(scaling, float32_losses):
    losses = _train(_fn(_mlp_loss, jnp.bfloat16, scaling))
    bf16 = _train(jaxmp.autocast(_mlp_loss, jnp.bfloat16))
    assert losses[-1] < 0.8 * losses[0]
    assert abs(losses[-1] - float32_losses[-1]) < 0.05 * float32_losses[-1], (
        losses, float32_losses)
    assert abs(losses[-1] - bf16[-1]) < 0.05 * bf16[-1]


def test_flax_linen_model_keeps_its_head_and_says_so_once():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Dense(64, name="body")(x))
            return nn.Dense(16, name="head")(x)

    model = Model()
    x = _normal((32, 32), 8)
    params = model.init(jax.random.key(0), x)
    loss = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
    f = jax.jit(jax.grad(_fn(loss, jnp.bfloat16)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grads = f(params, x)
        f(params, x + 1)  # traced again: nothing more said
        program = str(jax.make_jaxpr(jax.grad(_fn(loss, jnp.bfloat16)))(params, x))
    said = [str(c.message) for c in caught
            if c.category is jaxmp.experimental.Float8ShortfallWarning]
    assert len(said) == 1 and "keeps" in said[0] and "head" in said[0], said
    want = jax.grad(loss)(params, x)
    errors = [rel(a, b) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want))]
    assert max(errors) < 0.35, errors  # float4, a weight gradient over 32 tokens, rounded at random
    assert program.count("platform_index") == 3  # the body's three products; the head's none
    quiet = _fn(loss, jnp.bfloat16, float8_rules=jaxmp.experimental.Float8Rules())
    program = str(jax.make_jaxpr(jax.grad(quiet))(params, x))
    assert program.count("platform_index") == 6


def test_attention_products_stay_in_the_compute_dtype_by_default():
    w, q, k = _normal((32, 32), 9) / 6, _normal((2, 16, 32), 10), _normal((2, 16, 32), 11)
    loss = lambda w, q, k: jnp.sum(jnp.einsum("bqd,bkd->bqk", q @ w, k) ** 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = str(jax.make_jaxpr(jax.grad(_fn(loss, jnp.bfloat16)))(w, q, k))
    said = [str(c.message) for c in caught
            if c.category is jaxmp.experimental.Float8ShortfallWarning]
    assert len(said) == 1 and "keeps 33%" in said[0] and "keep_if='batched'" in said[0], said
    assert program.count("platform_index") == 3  # q @ w, forward and backward
    every = _fn(loss, jnp.bfloat16, float8_rules=jaxmp.experimental.Float8Rules())
    assert str(jax.make_jaxpr(jax.grad(every))(w, q, k)).count("platform_index") == 6


# --- Where the products run ---------------------------------------------------------------------


def _grad(scaling, matmul_dtype=F4):
    loss = lambda w, x: jnp.sum((x @ w) ** 2)
    return jax.grad(jaxmp.autocast(loss, jnp.bfloat16, matmul_dtype=matmul_dtype,
                                   float8_scaling=scaling), argnums=(0, 1))


def test_cuda_lowering_runs_every_product_as_a_cudnn_float4_dot():
    w, x = jnp.ones((64, 32)), jnp.ones((48, 64))
    step = jax.jit(_grad("nvfp4")).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in step.splitlines() if BLOCK_DOT in line]
    assert len(calls) == 3 and "stablehlo.dot_general" not in step, calls
    assert all("f4E2M1FN" in c and "f8E4M3FN" in c for c in calls)
    assert jaxmp.debug.matmul_flops(_grad("nvfp4"), w, x, platform="cuda") == {
        "float4_e2m1fn": 3 * 2 * 64 * 48 * 32}


def test_traced_for_a_hopper_gpu_runs_per_tensor_float8_and_says_so():
    h100 = _on("NVIDIA H100 80GB HBM3", 132, (64, 32), (32, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = str(jax.make_jaxpr(_grad("nvfp4"))(*h100))
    said = [str(c.message) for c in caught
            if c.category is jaxmp.experimental.Float8ShortfallWarning]
    assert len(said) == 1 and "NVIDIA H100 80GB HBM3 (Hopper, sm_90)" in said[0], said
    assert "'tensor' recipe" in said[0] and "float8_e4m3fn" in said[0]
    address = re.compile(r"0x[0-9a-f]+")
    tensor = str(jax.make_jaxpr(_grad("tensor", E4M3))(*h100))
    assert address.sub("", program) == address.sub("", tensor)
    assert "f4_e2m1fn" not in program and "platform_index" not in program
    b200 = _on("NVIDIA B200", 148, (64, 32), (32, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        program = str(jax.make_jaxpr(_grad("nvfp4"))(*b200))
    assert program.count("platform_index") == 3 and "f4_e2m1fn" in program


# --- Arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"matmul_dtype": E4M3, "float8_scaling": "nvfp4"}, "Fix: matmul_dtype=jnp.float4_e2m1fn"),
    ({"matmul_dtype": F4}, "or float8_scaling='nvfp4'"),
    ({"float8_scaling": "nvfp4"}, "Fix: pass matmul_dtype=jnp.float4_e2m1fn"),
    ({"matmul_dtype": E4M3, "float8_scaling": "mxfp4"}, "MXFP4 is not"),
    ({"matmul_dtype": jnp.int4}, "jnp.float4_e2m1fn with float8_scaling='nvfp4'"),
])
def test_invalid_arguments_raise_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        jaxmp.autocast(matmul, jnp.bfloat16, **kwargs)


@pytest.mark.parametrize("kwargs", [{"hadamard": 1}, {"seed": "0"}, {"keep": {"head"}}])
def test_invalid_options_raise(kwargs):
    with pytest.raises(TypeError, match="NVFP4"):
        jaxmp.experimental.NVFP4(**kwargs)


def test_the_recipe_table_has_the_nvfp4_row():
    row = float8.check_scaling("nvfp4", np.dtype(F4))
    assert row is float8.RECIPES["nvfp4"] and row.block == 16 and row.fallback == "tensor"
    assert float8.check_scaling(PLAIN, np.dtype(F4)).name == "nvfp4"


# --- Unchanged float32 model code in each framework, through mp_value_and_grad -------------------

FRAMEWORK_STEPS = 6


def _regression(seed=0):
    """Batches of a small regression task: inputs and targets (32, 16)."""
    keys = jax.random.split(jax.random.key(seed), FRAMEWORK_STEPS)
    xs = [jax.random.normal(k, (32, 16)) for k in keys]
    return [(x, jnp.tanh(2 * x)) for x in xs]


def _fit(loss_fn, params, extra=(), grad_options=None, nvfp4_options="nvfp4", jit=jax.jit,
         trainable=lambda params: params):
    """Trains ``params`` with ``loss_fn(params, *extra, x, y)`` (``has_aux``: new ``extra[0]``)
    through ``mp_value_and_grad`` and ``jaxmp.optimizer_update`` (Adam): float32 without
    ``nvfp4_options``, else NVFP4 products with bfloat16 compute. Returns the losses and the
    share of the step's product FLOPs whose operands are float4 (CUDA program; NVFP4 only).
    ``jit`` and ``trainable`` (the arrays the optimizer sees): as the framework's users write
    them."""
    grad_options = dict(grad_options or {})
    if nvfp4_options is None:
        grad_fn = jaxmp.mp_value_and_grad(loss_fn, use_mixed_precision=False,
                                          compute_dtype=jnp.bfloat16, **grad_options)
    else:
        grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.bfloat16, matmul_dtype=F4,
                                          float8_scaling=nvfp4_options, **grad_options)
    tx = __import__("optax").adam(1e-2)
    has_aux = grad_options.get("has_aux", False)

    def step(carry, x, y):
        params, extra, opt_state, scaler = carry
        value, grads, scaler, finite = grad_fn(params, *extra, x, y, scaler_state=scaler)
        if has_aux:
            value, new_state = value
            extra = (jaxmp.select_tree(finite, new_state, extra[0]),) + tuple(extra[1:])
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        return (params, extra, opt_state, scaler), value

    carry = (params, tuple(extra), tx.init(trainable(params)), jaxmp.noop_scaler())
    batches = _regression()
    share = None  # the float32 run's products: float32, as written
    if nvfp4_options is not None:
        flops = jaxmp.debug.matmul_flops(step, carry, *batches[0], platform="cuda")
        share = sum(v for k, v in flops.items()
                    if set(k.split("+")) == {"float4_e2m1fn"}) / sum(flops.values())
    fast, losses = jit(step), []
    for x, y in batches:
        carry, value = fast(carry, x, y)
        losses.append(float(value))
    return np.asarray(losses), share


def _check_trains_as_float32(fit):
    """NVFP4 from the framework's float32 code: every product float4, the loss within 5% of
    float32's after FRAMEWORK_STEPS Adam steps (measured: 0.7% to 1.7%, jax 0.12)."""
    reference, _ = fit(None)
    losses, share = fit("nvfp4")
    assert share == 1.0, share
    assert losses[-1] < 0.8 * losses[0], losses  # it trains
    assert abs(losses[-1] - reference[-1]) < 0.05 * reference[-1], (losses, reference)
    return losses, reference


def _mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def test_haiku_transform_with_state_model_trains_in_nvfp4():
    hk = pytest.importorskip("haiku")

    def net(x):
        h = jax.nn.relu(hk.Linear(64)(x))
        mean = hk.get_state("mean", [64], init=jnp.zeros)  # a running mean of the features
        hk.set_state("mean", 0.9 * mean + 0.1 * jnp.mean(h, axis=0))
        return hk.Linear(16)(h)

    model = hk.without_apply_rng(hk.transform_with_state(net))
    params, state = model.init(jax.random.key(0), _regression()[0][0])

    def loss_fn(params, state, x, y):
        pred, state = model.apply(params, state, x)
        return _mse(pred, y), state

    _check_trains_as_float32(lambda o: _fit(loss_fn, params, (state,), nvfp4_options=o,
                                            grad_options={"has_aux": True, "no_cast_argnums": 1}))


def test_flax_nnx_model_trains_in_nvfp4():
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(16, 64, rngs=rngs)
            self.out = nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.out(jax.nn.relu(self.hidden(x)))

    graphdef, params = nnx.split(Net(nnx.Rngs(0)))

    def loss_fn(params, x, y):
        return _mse(nnx.merge(graphdef, params)(x), y)

    _check_trains_as_float32(lambda o: _fit(loss_fn, params, nvfp4_options=o))


def test_equinox_model_trains_in_nvfp4():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(16, 16, 64, depth=1, activation=jax.nn.relu, key=jax.random.key(0))

    def loss_fn(model, x, y):
        return _mse(jax.vmap(model)(x), y)

    _check_trains_as_float32(lambda o: _fit(
        loss_fn, model, nvfp4_options=o, jit=eqx.filter_jit,
        trainable=lambda m: eqx.filter(m, eqx.is_inexact_array)))


def test_mp_value_and_grad_runs_the_nvfp4_options_it_is_given():
    # The options object reaches autocast: keep=Float8Rules() runs the "head" scope in float4
    # too, where the default keeps it (mp_value_and_grad used to pass on the recipe's name).
    def loss(params, x):
        h = jax.nn.relu(x @ params["body"])
        with jax.named_scope("head"):
            return jnp.mean((h @ params["head"]) ** 2)

    params = {"body": _normal((32, 32), 12) / 6, "head": _normal((32, 16), 13) / 6}
    x = _normal((32, 32), 14)
    every = jaxmp.experimental.NVFP4(keep=jaxmp.experimental.Float8Rules())
    for scaling, products in (("nvfp4", 3), (every, 6)):
        grad_fn = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, matmul_dtype=F4,
                                          float8_scaling=scaling)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxmp.experimental.Float8ShortfallWarning)
            program = str(jax.make_jaxpr(
                lambda p: grad_fn(p, x, scaler_state=jaxmp.noop_scaler()))(params))
        assert program.count("platform_index") == products, scaling
