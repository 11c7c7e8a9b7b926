"""Tests of jaxmp._src.lowered_flops: the products' FLOPs read from lowered StableHLO text."""

import jax
import jax.numpy as jnp
import pytest

from jaxmp._src import jaxprs
from jaxmp._src import lowered_flops

_DOT = ("%2 = stablehlo.dot_general %0, %1, contracting_dims = [1] x [0] : "
        "(tensor<2x4x{}>, tensor<4x3x{}>) -> tensor<2x3xf32>")


def test_operand_dtypes_name_the_key():
    assert lowered_flops.module_flops(_DOT.format("f16", "f16")) == {"float16": 48}
    assert lowered_flops.module_flops(_DOT.format("f16", "f32")) == {"mixed": 48}
    # Two float8 formats (e4m3 weights times an e5m2 cotangent) are one float8 product.
    both = lowered_flops.module_flops(_DOT.format("f8E4M3FN", "f8E5M2"))
    assert both == {"float8_e4m3fn+float8_e5m2": 48}
    assert lowered_flops.is_float8_key(next(iter(both)))
    assert not lowered_flops.is_float8_key("mixed")


def test_a_product_read_from_a_jaxpr_counts_in_its_result_dtype_when_its_operands_differ():
    # What JAX's lowering for CPU and GPU converts both operands to (two float8 formats stay).
    assert lowered_flops.product_key("float32", "bfloat16", "float32") == "float32"
    assert lowered_flops.product_key("float16", "float32", "float16") == "float16"
    assert lowered_flops.product_key("bfloat16", "bfloat16", "float32") == "bfloat16"
    assert lowered_flops.product_key("float8_e5m2", "float8_e4m3fn", "bfloat16") == (
        "float8_e4m3fn+float8_e5m2")


def test_only_products_count():
    assert lowered_flops.module_flops("%3 = stablehlo.add %1, %2 : tensor<2xf32>") == {}


def test_a_loop_body_counts_once_per_trip():
    def f(w, x):
        return jax.lax.fori_loop(0, 3, lambda i, c: c @ w, x)

    w, x = jnp.ones((4, 4), jnp.bfloat16), jnp.ones((2, 4), jnp.bfloat16)
    text = jax.jit(f).lower(w, x).as_text()
    assert lowered_flops.module_flops(text) == {"bfloat16": 3 * 2 * 2 * 4 * 4}


@pytest.mark.parametrize("totals, low, float8", [
    ({}, 0.0, 0.0),
    ({"float32": 30, "bfloat16": 50, "float8_e4m3fn": 20}, 0.7, 0.2),
    ({"mixed": 10, "float8_e4m3fn+float8_e5m2": 30}, 0.75, 0.75),
])
def test_shares(totals, low, float8):
    assert lowered_flops.low_precision_share(totals) == pytest.approx(low)
    assert lowered_flops.float8_share(totals) == pytest.approx(float8)


def _strided_conv_loss(w, x):
    y = jax.lax.conv_general_dilated(x, w, (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(y * y)


def test_the_zeros_of_a_dilated_input_are_not_counted():
    """The input gradient of a strided convolution convolves an input dilated by the stride;
    its inserted zeros multiply nothing (issue 41, part 6: they were 4x the forward FLOPs here,
    and made gpu_program's requested float8 share of a ResNet 52.5% against the trace-time 61%).
    Forward, input gradient and kernel gradient: three times the forward FLOPs, in both
    counters, as the trace-time census and the GPU program count them."""
    import jaxmp  # pylint: disable=import-outside-toplevel

    w, x = jnp.ones((3, 3, 4, 8)), jnp.ones((2, 16, 16, 4))
    forward = 2 * (2 * 8 * 8 * 8) * (3 * 3 * 4)  # output elements x multiply-adds each
    step = jax.grad(_strided_conv_loss, argnums=(0, 1))
    assert jaxmp.debug.matmul_flops(_strided_conv_loss, w, x) == {"float32": forward}
    assert jaxmp.debug.matmul_flops(step, w, x) == {"float32": 3 * forward}
    assert jaxmp.debug.precision_report(step, w, x).totals == {"float32": 3 * forward}
    assert jaxprs.conv_macs((2, 16, 16, 4), (3, 3, 4, 8), 4, (2, 2)) == forward // 2
