"""Mixed precision on code written the way framework users write it.

Each pattern below made the cast-the-inputs recipe compute in float32 without a
word. The default (autocast) must run at least 90% of the step's matrix-product
FLOPs in half precision, in float16 and bfloat16; the cast-inputs path
(``autocast=False``) must say, at trace time, that it computes in float32.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxmp

DTYPES = [jnp.float16, jnp.bfloat16]


@pytest.fixture(autouse=True)
def _standard_promotion():
    # The code under test is written as users write it: under JAX's default
    # promotion, not the strict one the rest of the suite uses.
    with jax.numpy_dtype_promotion("standard"):
        yield


class LinenMLP(nn.Module):
    """Layers that fix their dtype to float32, as many public models do."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, dtype=jnp.float32)(x))
        return nn.Dense(4, dtype=jnp.float32)(x)


def _linen_fixed_dtype():
    model = LinenMLP()
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 4))
    params = model.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, (params, x, y)


def _linen_batch_in_closure():
    model = nn.Dense(8)
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 8))
    params = model.init(jax.random.key(0), x)

    def loss(params):  # the batch is captured, not passed
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, (params,)


class Vae(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        mean = nn.Dense(8)(nn.relu(nn.Dense(32)(x)))
        z = mean + jax.random.normal(key, mean.shape)  # float32 noise drawn in the loss
        return nn.Dense(16)(nn.relu(nn.Dense(64)(z)))  # the decoder: most of the FLOPs


def _linen_noise_in_loss():
    model = Vae()
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x, jax.random.key(1))

    def loss(params, x, key):
        return jnp.mean((model.apply(params, x, key) - x) ** 2)

    return loss, (params, x, jax.random.key(2))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 16, rngs=rngs)  # fixes its dtype to the parameters'
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 50, rngs=rngs)

    def __call__(self, tokens):
        return self.out(nnx.relu(self.hidden(self.embed(tokens))))


def _nnx_embed():
    graphdef, params = nnx.split(NnxLM(nnx.Rngs(0)))
    tokens = jnp.arange(16).reshape(2, 8) % 50

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens).mean()

    return loss, (params, tokens)


def _equinox_noise_then_conv():
    conv = eqx.nn.Conv2d(3, 4, 3, padding=1, key=jax.random.key(0))
    params, static = eqx.partition(conv, eqx.is_inexact_array)
    images = jnp.ones((2, 3, 8, 8))

    def loss(params, images, key):
        model = eqx.combine(params, static)
        noisy = images + jax.random.normal(key, images.shape)  # float32 noise
        return jnp.mean(jax.vmap(model)(noisy) ** 2)

    return loss, (params, images, jax.random.key(3))


PATTERNS = {
    "linen_dtype_float32": _linen_fixed_dtype,
    "linen_batch_in_closure": _linen_batch_in_closure,
    "linen_noise_in_loss": _linen_noise_in_loss,
    "nnx_embed": _nnx_embed,
    "equinox_noise_then_conv": _equinox_noise_then_conv,
}


def _half_share(loss, args, **options):
    grad_fn = jaxmp.mp_value_and_grad(loss, **options)
    scaler = jaxmp.scaler_for(options["compute_dtype"])
    return jaxmp.half_matmul_flop_share(lambda *a: grad_fn(*a, scaler_state=scaler)[1], *args)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_the_default_trains_real_code_in_half_precision(pattern, dtype):
    loss, args = PATTERNS[pattern]()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MostlyFloat32Warning)
        share = _half_share(loss, args, compute_dtype=dtype)
    assert share >= 0.9, f"{pattern}: only {share:.0%} of matmul FLOPs in half precision"
    # And the loss agrees with float32's.
    grad_fn = jax.jit(jaxmp.mp_value_and_grad(loss, compute_dtype=dtype))
    value, _, _, finite = grad_fn(*args, scaler_state=jaxmp.scaler_for(dtype))
    assert bool(finite)
    assert abs(float(value) - float(loss(*args))) <= 0.05 * abs(float(loss(*args))) + 1e-3


@pytest.mark.parametrize("pattern", [p for p in sorted(PATTERNS) if p != "equinox_noise_then_conv"])
def test_casting_the_inputs_says_it_computes_in_float32(pattern):
    loss, args = PATTERNS[pattern]()
    with pytest.warns(jaxmp.MostlyFloat32Warning, match="matrix-product FLOPs in half precision") as rec:
        _half_share(loss, args, compute_dtype=jnp.float16, autocast=False)
    message = str(rec[0].message)
    assert "test_real_code.py:" in message  # the user's line, not a library's
    assert "float32" in message and "autocast=True" in message


def test_the_float32_warning_is_said_once_per_gradient_function():
    loss, args = _linen_fixed_dtype()
    grad_fn = jax.jit(jaxmp.mp_value_and_grad(loss, autocast=False))
    scaler = jaxmp.init_scaler()
    with pytest.warns(jaxmp.MostlyFloat32Warning):
        grad_fn(*args, scaler_state=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.MostlyFloat32Warning)
        grad_fn(*args, scaler_state=scaler)  # compiled: nothing
        grad_fn(args[0], args[1][:4], args[2][:4], scaler_state=scaler)  # retraced: said already


def test_equinox_noise_with_cast_inputs_fails_clearly_and_autocast_trains():
    loss, args = _equinox_noise_then_conv()
    with pytest.raises(TypeError):
        jaxmp.mp_value_and_grad(loss, autocast=False)(*args, scaler_state=jaxmp.init_scaler())
    _, grads, _, finite = jax.jit(jaxmp.mp_value_and_grad(loss))(
        *args, scaler_state=jaxmp.init_scaler())
    assert bool(finite) and grads.weight.dtype == jnp.float32
