"""Mixed precision on code written the way framework users write it.

Each pattern below made the cast-the-inputs recipe compute in float32 without a
word. The default (autocast) must run at least 90% of the step's matrix-product
FLOPs in half precision, in float16 and bfloat16; the cast-inputs path
(``autocast=False``) must say, at trace time, that it computes in float32.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import pytest

import jaxmp
from benchmarks.real_code import PATTERNS

DTYPES = [jnp.float16, jnp.bfloat16]


# The code under test is written as users write it: under JAX's default
# promotion, not the strict one the rest of the suite uses.
pytestmark = pytest.mark.usefixtures("standard_promotion")


def _half_share(loss, args, **options):
    grad_fn = jaxmp.mp_value_and_grad(loss, **options)
    scaler = jaxmp.scaler_for(options["compute_dtype"])
    return jaxmp.debug.half_matmul_flop_share(lambda *a: grad_fn(*a, scaler_state=scaler)[1], *args)


@functools.cache
def _with_reference(pattern):
    """A pattern's loss, arguments and float32 loss, built once per process for both dtypes."""
    loss, args = PATTERNS[pattern]()
    return loss, args, float(loss(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_the_default_trains_real_code_in_half_precision(pattern, dtype):
    loss, args, reference = _with_reference(pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.debug.MostlyFloat32Warning)
        share = _half_share(loss, args, compute_dtype=dtype)
    assert share >= 0.9, f"{pattern}: only {share:.0%} of matmul FLOPs in half precision"
    # And the loss agrees with float32's.
    grad_fn = jax.jit(jaxmp.mp_value_and_grad(loss, compute_dtype=dtype))
    value, _, _, finite = grad_fn(*args, scaler_state=jaxmp.scaler_for(dtype))
    assert bool(finite)
    assert abs(float(value) - reference) <= 0.05 * abs(reference) + 1e-3


@pytest.mark.parametrize("pattern", [p for p in sorted(PATTERNS) if p != "equinox_noise_then_conv"])
def test_casting_the_inputs_says_it_computes_in_float32(pattern):
    loss, args = PATTERNS[pattern]()
    with pytest.warns(jaxmp.debug.MostlyFloat32Warning,
                      match="matrix-product FLOPs in half precision") as rec:
        _half_share(loss, args, compute_dtype=jnp.float16, autocast=False)
    message = str(rec[0].message)
    assert "real_code.py:" in message  # the user's line (the pattern's model), not a library's
    assert "float32" in message and "autocast=True" in message


def test_the_float32_warning_is_said_once_per_gradient_function():
    loss, args = PATTERNS["linen_dtype_float32"]()
    grad_fn = jax.jit(jaxmp.mp_value_and_grad(loss, autocast=False, compute_dtype=jnp.float16))
    scaler = jaxmp.init_scaler()
    with pytest.warns(jaxmp.debug.MostlyFloat32Warning):
        grad_fn(*args, scaler_state=scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.debug.MostlyFloat32Warning)
        grad_fn(*args, scaler_state=scaler)  # compiled: nothing
        grad_fn(args[0], args[1][:4], args[2][:4], scaler_state=scaler)  # retraced: said already


def test_equinox_noise_with_cast_inputs_fails_clearly_and_autocast_trains():
    loss, args = PATTERNS["equinox_noise_then_conv"]()
    with pytest.raises(TypeError):
        jaxmp.mp_value_and_grad(loss, autocast=False,
                                compute_dtype=jnp.float16)(*args, scaler_state=jaxmp.init_scaler())
    _, grads, _, finite = jax.jit(jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.float16))(
        *args, scaler_state=jaxmp.init_scaler())
    assert bool(finite) and grads.weight.dtype == jnp.float32


def test_the_benchmark_table_has_every_pattern_in_both_dtypes():
    from benchmarks import real_code  # pylint: disable=g-import-not-at-top
    rows = [{"pattern": p, "compute_dtype": d, "autocast_false": 0.0, "default": 1.0}
            for p in sorted(PATTERNS) for d in ("float16", "bfloat16")]
    table = real_code.markdown(rows)
    assert table.count("| 100% |") == 2 * len(PATTERNS) and "| nnx_embed | bfloat16 | 0% |" in table
