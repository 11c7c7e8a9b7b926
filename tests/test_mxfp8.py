"""Block-scaled float8 (MXFP8) products: ``float8_scaling="mxfp8"``, against NumPy and float32.

The reference quantizer here is written from the OCP MX v1.0 rules the
feature follows, in NumPy, without jaxmp: blocks of 32 consecutive elements
along a product's contracting dimension, each with the scale
``2 ** ceil(log2(amax / 448))``, elements rounded to nearest-even
float8_e4m3fn, products in float32 (here float64).
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmp
from tests.helpers import matmul, rel
from jaxmp._src import float8
from jaxmp._src import jaxprs
from jaxmp._src.float8 import mxfp8

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
F32 = jnp.float32
BLOCK_DOT = "__op$block_scaled_dot"


# --- The NumPy reference -----------------------------------------------------------------------


def _round_e4m3(v):
    """``v`` (``|v| <= 448``) rounded to nearest-even float8_e4m3fn: 3 mantissa bits, normal
    exponents from -6, subnormals below 2**-6 with a spacing of 2**-9."""
    v = np.asarray(v, np.float64)
    mag = np.abs(v)
    exponent = np.maximum(np.floor(np.log2(np.where(mag > 0, mag, 1.0))), -6)
    step = 2.0 ** (exponent - 3)
    return np.round(v / step) * step  # np.round rounds halves to even


def _mx(x, axis=-1):
    """``x`` quantized to MXFP8 along ``axis`` and dequantized (float64): blocks of 32 (the last
    one padded with zeros), scale 2**ceil(log2(amax / 448)), an all-zero block stays zero."""
    x = np.moveaxis(np.asarray(x, np.float64), axis, -1)
    k = x.shape[-1]
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -k % 32)])
    blocks = padded.reshape(*padded.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = np.where(amax > 0, 2.0 ** np.ceil(np.log2(np.where(amax > 0, amax, 1.0) / 448)), 1.0)
    assert np.all(np.abs(blocks / scale) <= 448)  # no element saturates
    dequantized = (_round_e4m3(blocks / scale) * scale).reshape(padded.shape)[..., :k]
    return np.moveaxis(dequantized, -1, axis)


def _close(got, want, magnitude):
    """``got`` equals ``want`` to float32 rounding of sums of products whose absolute values sum
    to ``magnitude`` (elementwise)."""
    got = np.asarray(got, np.float64)
    worst = np.max(np.abs(got - want) / (1e-5 * magnitude + 1e-30))
    assert worst <= 1, f"off by {worst:.3g} times float32's rounding"


def _rows(shape, seed, outliers=()):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    for row in outliers:
        x[row] *= 1e5  # a few rows 1e5 times larger than the rest
    return x


def _mx_fn(fn, compute_dtype=F32, **kw):
    return jax.jit(jaxmp.autocast(fn, compute_dtype, matmul_dtype=E4M3, float8_scaling="mxfp8",
                                  **kw))


# --- The quantizer and the forward product -----------------------------------------------------


def test_reference_rounding_is_float8_e4m3fn():
    # The reference's rounding against ml_dtypes' (what jnp.float8_e4m3fn is), on every
    # e4m3 value and the midpoints between them.
    values = np.asarray(np.arange(256, dtype=np.uint8).view(E4M3), np.float64)
    values = np.sort(values[np.isfinite(values) & (np.abs(values) <= 448)])
    probe = np.concatenate([values, (values[1:] + values[:-1]) / 2])
    np.testing.assert_array_equal(_round_e4m3(probe),
                                  np.asarray(probe.astype(np.float32).astype(E4M3), np.float64))


@pytest.mark.parametrize("k", [64, 40])  # 40: a last block of 8, padded with zeros
def test_quantized_operand_is_the_reference(k):
    x = _rows((6, k), 0, outliers=(2,)) * np.float32(3e-3)
    x[4, :32] = 0.0  # an all-zero block
    elements, scales = jax.jit(float8.mx_quantize)(jnp.asarray(x)[None])
    assert elements.dtype == E4M3 and elements.shape == (1, 6, k)
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (1, 6, -(-k // 32))
    scale = np.repeat(np.asarray(scales[0], np.float64), 32, axis=-1)[:, :k]
    np.testing.assert_array_equal(np.asarray(elements[0], np.float64) * scale, _mx(x))
    assert not np.any(np.asarray(elements[0, 4, :32], np.float64))  # the zero block stays zero


def test_block_scales_from_element_exponents_match_the_reference():
    """A block's scale is the largest of its elements' exponents (one integer max, issue 41
    part 4): the same as 2**ceil(log2(amax / 448)) over magnitudes from 1e-38 to 1e38, in
    bfloat16 and float32, an all-zero block gets 2**-126 and an inf or NaN stays NaN."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 128)) * 10.0 ** rng.integers(-37, 37, (8, 1))
    x[1, 32:64] = 448.0 * 2.0 ** rng.integers(-20, 20, 32)  # powers of two times 448: no carry
    x[2, :32] = 0.0
    for dtype in (np.float32, jnp.bfloat16):
        xd = np.asarray(x.astype(dtype), np.float64)
        elements, scales = jax.jit(float8.mx_quantize)(jnp.asarray(x, dtype))
        scale = np.repeat(np.asarray(scales, np.float64), 32, axis=-1)
        np.testing.assert_array_equal(np.asarray(elements, np.float64) * scale, _mx(xd))
        assert np.asarray(scales, np.float64)[2, 0] == 2.0 ** -126
    bad = np.asarray(x, np.float32)
    bad[0, 3], bad[4, 40] = np.inf, np.nan
    elements, scales = float8.mx_quantize(jnp.asarray(bad))
    elements = np.asarray(elements, np.float64)
    assert np.isnan(elements[0, 3]) and np.isnan(elements[4, 40])
    assert np.isfinite(np.delete(elements.ravel(), [3, 4 * 128 + 40])).all()


def test_elements_given_scales_are_the_quantizer_s():
    x = jnp.asarray(_rows((2, 40, 64), 4, outliers=(1,)))
    elements, scales = float8.mx_quantize(x, axis=1)  # blocks along 40 tokens: padded to 64
    moved = jnp.moveaxis(x, 1, -1)
    given = mxfp8.mx_elements(moved, jnp.moveaxis(scales, 1, -1))
    np.testing.assert_array_equal(np.asarray(given, np.float32),
                                  np.asarray(jnp.moveaxis(elements, 1, -1), np.float32))


# Products as models write them: (einsum, lhs shape, rhs shape).
PRODUCTS = [
    ("mk,kn->mn", (16, 64), (64, 32)),
    ("mk,kn->mn", (16, 40), (40, 32)),  # not a multiple of 32: padded with zeros
    ("btk,kn->btn", (2, 8, 64), (64, 16)),
    ("bqk,bnk->bqn", (2, 8, 96), (2, 16, 96)),  # attention scores: a batch dimension
]


def test_forward_products_match_the_reference():
    operands = [(_rows(a, 1, outliers=(1,)), _rows(b, 2)) for _, a, b in PRODUCTS]
    outs = _mx_fn(lambda ops: [jnp.einsum(spec, a, b)
                               for (spec, _, _), (a, b) in zip(PRODUCTS, ops)])(operands)
    for (spec, _, _), (a, b), out in zip(PRODUCTS, operands, outs):
        assert out.dtype == F32
        # Each operand quantized along its contracting dimension k, then the float64 product.
        lhs, rhs = spec.split("->")[0].split(",")
        want = np.einsum(spec, _mx(a, lhs.index("k")), _mx(b, rhs.index("k")))
        _close(out, want, np.einsum(spec, np.abs(a), np.abs(b)))


def test_outlier_rows_cost_the_other_rows_nothing():
    w, x = _rows((64, 32), 3), _rows((32, 64), 4, outliers=(0, 5))
    exact = x.astype(np.float64) @ w
    errors = {scaling: rel(jax.jit(jaxmp.autocast(matmul, F32, matmul_dtype=E4M3,
                                                   float8_scaling=scaling))(w, x), exact, axis=1)
              for scaling in ("tensor", "mxfp8")}
    assert errors["mxfp8"].max() < 0.1  # every row keeps e4m3's precision
    assert errors["tensor"].max() > 0.5  # one scale for all: the small rows flush to zero


def _mx_vjp(fn=matmul, compute_dtype=F32):
    """``(args, ct) -> (fn(*args), its vjp of ct)`` under autocast with mxfp8, jitted."""
    f = jaxmp.autocast(fn, compute_dtype, matmul_dtype=E4M3, float8_scaling="mxfp8")

    @jax.jit
    def run(args, ct):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(ct)

    return run


def test_blocks_within_one_dimension_are_quantized_where_the_operand_lies():
    """When the blocks of 32 along a product's contracting dimensions lie within one dimension
    of the operand (32 tokens per example, 64 features, 96 outputs), each operand is quantized
    in its own layout: no amax is taken of a transposed copy (XLA wrote one, in the operand's
    dtype, for each weight gradient). Same numbers as the reference, forward and backward."""
    w, ct = _rows((64, 96), 12), _rows((2, 32, 96), 13)
    x = _rows((64, 64), 14, outliers=(3, 40)).reshape(2, 32, 64)
    out, (dw, dx) = _mx_vjp()((w, x), jnp.asarray(ct))
    ct2, x2 = ct.reshape(64, 96), x.reshape(64, 64)
    _close(out.reshape(64, 96), _mx(x2) @ _mx(w, 0), np.abs(x2) @ np.abs(w))
    _close(dx.reshape(64, 64), _mx(ct2, 1) @ _mx(w, 1).T, np.abs(ct2) @ np.abs(w).T)
    _close(dw, _mx(x2, 0).T @ _mx(ct2, 0), np.abs(x2).T @ np.abs(ct2))
    f = jaxmp.autocast(matmul, F32, matmul_dtype=E4M3, float8_scaling="mxfp8")
    jaxpr = jax.make_jaxpr(lambda w, x, ct: jax.vjp(f, w, x)[1](ct))(w, x, ct).jaxpr
    eqns = [e for e, _, _ in jaxprs.walk(jaxpr)]
    made_by = {v: e for e in eqns for v in e.outvars}

    def moved(v):  # whether v is a transposed copy, through reshapes
        e = made_by.get(v)
        while e is not None and e.primitive.name in ("reshape", "pad", "convert_element_type"):
            e = made_by.get(e.invars[0])
        return e is not None and e.primitive.name == "transpose"

    amaxes = [e for e in eqns if e.primitive.name == "abs"]
    assert len(amaxes) == 6  # two operands per product, three products
    assert not any(moved(e.invars[0]) for e in amaxes)


def test_zero_blocks_stay_zero_and_nonfinite_values_stay_nonfinite():
    w, x = _rows((64, 32), 5), _rows((16, 64), 6)
    run = _mx_vjp()
    zeros, _ = run((w, np.zeros_like(x)), jnp.ones((16, 32)))
    assert not np.any(np.asarray(zeros))
    x[3, :] = 0.0  # a zero row: zero blocks in the forward and weight-gradient products
    out, (dw, dx) = run((w, x), jnp.ones((16, 32)))
    assert not np.any(np.asarray(out[3])) and np.isfinite(np.asarray(out)).all()
    assert np.isfinite(np.asarray(dw)).all() and np.isfinite(np.asarray(dx)).all()
    # An inf in an operand or a cotangent: non-finite where it reaches (the scaler sees it).
    out, (dw, dx) = run((w, jnp.asarray(x).at[0, 0].set(jnp.inf)),
                        jnp.ones((16, 32)).at[2, 3].set(jnp.inf))
    assert not np.isfinite(np.asarray(out[0])).any() and np.isfinite(np.asarray(out[1:])).all()
    assert not np.isfinite(np.asarray(dw)).all() and not np.isfinite(np.asarray(dx)).all()


# --- The backward products ---------------------------------------------------------------------


def test_backward_products_quantize_along_their_own_contracting_dimension():
    # x: (batch, tokens, features) with a few large tokens; ct: (batch, tokens, outputs).
    w, ct = _rows((64, 48), 9), _rows((2, 20, 48), 11)
    x = _rows((40, 64), 10, outliers=(3, 17, 25)).reshape(2, 20, 64)
    _, (dw, dx) = _mx_vjp()((w, x), jnp.asarray(ct))
    ct, x = ct.reshape(40, 48), x.reshape(40, 64)
    # Input gradient ct . w^T: both in blocks along the outputs (w's free dimension).
    _close(dx.reshape(40, 64), _mx(ct, 1) @ _mx(w, 1).T, np.abs(ct) @ np.abs(w).T)
    # Weight gradient x^T . ct: both in blocks along batch and tokens together (the 40
    # tokens of both examples, padded to 64).
    want = _mx(x, 0).T @ _mx(ct, 0)
    _close(dw, want, np.abs(x).T @ np.abs(ct))
    # Not the forward's blocks (along the features), nor per example: other numbers.
    with pytest.raises(AssertionError, match="float32's rounding"):
        _close(dw, _mx(x, 1).T @ _mx(ct, 0), np.abs(x).T @ np.abs(ct))
    per_example = sum(_mx(x[i:i + 20], 0).T @ _mx(ct[i:i + 20], 0) for i in (0, 20))
    with pytest.raises(AssertionError, match="float32's rounding"):
        _close(dw, per_example, np.abs(x).T @ np.abs(ct))


def test_gradients_are_within_ten_percent_of_float32():
    w, x = _rows((64, 32), 15) / 8, _rows((32, 64), 16)

    def loss(w, x):
        return jnp.sum(jnp.tanh(matmul(w, x)) * jnp.linspace(-1.0, 1.0, 32))

    ref = jax.jit(jax.grad(loss, argnums=(0, 1)))(w, x)
    got = jax.grad(_mx_fn(loss, jnp.bfloat16), argnums=(0, 1))(w, x)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype == F32
        assert rel(g, r) < 0.1


# --- Where the products run --------------------------------------------------------------------


def _grad_step(w, x):
    loss = lambda w, x: jnp.sum(_mx_fn(matmul, jnp.bfloat16)(w, x) ** 2)
    return jax.grad(loss, argnums=(0, 1))(w, x)


def test_cuda_lowering_runs_every_product_as_cudnn_block_scaled_dot():
    w, x = jnp.ones((64, 32)), jnp.ones((72, 64))  # 72 tokens: the weight gradient is padded
    text = jax.jit(_mx_fn(matmul)).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if BLOCK_DOT in line]
    assert "f8E4M3FN" in call and "f8E8M0FNU" in call
    step = jax.jit(_grad_step).trace(w, x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in step.splitlines() if BLOCK_DOT in line]
    assert len(calls) == 3 and "stablehlo.dot_general" not in step  # forward and both backward
    # The weight gradient contracts the 72 tokens padded to 96: three blocks of 32.
    assert sum("x96xf8E4M3FN>" in c for c in calls) == 1, calls


def test_cpu_runs_the_emulation_in_float8_dot_generals():
    w, x = jnp.ones((64, 32)), jnp.ones((32, 64))
    text = jax.jit(_grad_step).trace(w, x).lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call" not in text
    assert jaxmp.debug.matmul_flops(_grad_step, w, x, platform="cpu") == {
        "float8_e4m3fn": 3 * 2 * 32 * 64 * 32}


def test_tensor_is_the_default_and_unchanged():
    w, x = _rows((64, 32), 17), _rows((16, 64), 18)
    default = jaxmp.autocast(matmul, jnp.bfloat16, matmul_dtype=E4M3)
    tensor = jaxmp.autocast(matmul, jnp.bfloat16, matmul_dtype=E4M3, float8_scaling="tensor")
    program = str(jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(default(w, x))))(w, x))
    assert str(jax.make_jaxpr(jax.grad(lambda w, x: jnp.sum(tensor(w, x))))(w, x)) == program
    assert "platform_index" not in program and "e5m2" in program  # per-tensor, e5m2 cotangent
    assert float8.check_scaling("tensor", None) is float8.RECIPES[float8.DEFAULT_RECIPE]


def test_vmap_scan_and_nested_autocast():
    w, xs = _rows((64, 32), 19), _rows((3, 16, 64), 20, outliers=(0,))
    f = _mx_fn(matmul)
    per_example = jax.jit(jax.vmap(f, in_axes=(None, 0)))(w, xs)
    for x, out in zip(xs, per_example):  # each example gets its own blocks, as alone
        _close(out, _mx(x, 1) @ _mx(w, 0), np.abs(x) @ np.abs(w))
    lowered = jax.jit(jax.vmap(f, in_axes=(None, 0))).trace(w, xs).lower(
        lowering_platforms=("cuda",)).as_text()
    assert BLOCK_DOT in lowered
    _, ys = jax.lax.scan(lambda c, x: (c, f(w, x)), 0.0, xs)
    np.testing.assert_array_equal(np.asarray(ys), np.asarray(per_example))
    # An outer autocast (mp_value_and_grad) keeps an inner mxfp8 autocast's products.
    grad_fn = jaxmp.mp_value_and_grad(lambda w, x: jnp.mean(f(w, x) ** 2),
                                      compute_dtype=jnp.bfloat16)
    step = lambda w, x: grad_fn(w, x, scaler_state=jaxmp.noop_scaler())
    cuda = jax.jit(step).trace(w, xs[0]).lower(lowering_platforms=("cuda",)).as_text()
    # (The outer autocast re-binds the platform choice as a plain switch, so the CUDA text
    # also holds the emulation, in the branch a constant index never takes.)
    assert BLOCK_DOT in cuda


def test_shard_map():
    # Each device quantizes its own shard; the CUDA branch's result is typed as varying over
    # the mesh axis like the emulation's (jax 0.8 refuses branches that disagree).
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    w, x = _rows((64, 32), 31) / 8, _rows((64, 64), 32)
    loss = lambda w, x: jnp.sum(jnp.tanh(matmul(w, x)) ** 2)
    body = lambda w, x: jax.grad(_mx_fn(loss, jnp.bfloat16))(w, x)  # summed over devices
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert rel(run(w, sharded), jax.jit(jax.grad(loss))(w, x)) < 0.1
    assert BLOCK_DOT in run.trace(w, sharded).lower(lowering_platforms=("cuda",)).as_text()


def test_padding_and_per_tensor_convolutions_are_reported():
    def fn(w, k, x, images):
        return jnp.sum(x @ w) + jnp.sum(jax.lax.conv(images, k, (1, 1), "SAME"))

    w, x = jnp.ones((40, 32)), jnp.ones((32, 40))  # contracts 40: padded to 64
    k, images = jnp.ones((4, 3, 3, 3)), jnp.ones((2, 3, 8, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(_mx_fn(fn, jnp.bfloat16, float8_rules=jaxmp.experimental.Float8Rules(
            include={"convolution"})), w, k, x, images)  # float8 convolutions, asked for
    said = [str(c.message) for c in caught
            if c.category is jaxmp.experimental.Float8ShortfallWarning]
    assert len(said) == 2, said  # no backward products are computed: nothing more to say
    assert any("contracts 40 elements, padded to 64" in m and "forward product" in m
               for m in said), said
    assert any("one scale per tensor" in m and "conv_general_dilated" in m for m in said), said
    # Keeping convolutions out of float8 on purpose (or by default) silences the second.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(_mx_fn(fn, jnp.bfloat16,
                              float8_rules=jaxmp.experimental.Float8Rules(
                                  primitives={"dot_general"})),
                       w, k, x, images)
    assert ["padded" in str(c.message) for c in caught] == [True]


def test_the_padding_figure_is_the_flop_tools_figure():
    # Issue 34: on a VAE the warning said 17% and matmul_flops 18.9%: the warning counted the
    # gradient of the data (the first layer's input gradient), which no step computes.
    def loss(p, x):
        h = jnp.tanh(x @ p["w1"])  # contracts 40 (padded to 64); x is not differentiated
        return jnp.mean((h @ p["w2"] - x[:, :24]) ** 2)  # h's gradient: contracts 24

    p, x = {"w1": jnp.ones((40, 24)), "w2": jnp.ones((24, 24))}, jnp.ones((48, 40))

    def step(recipe):
        grad_fn = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, matmul_dtype=E4M3,
                                          float8_scaling=recipe)
        return lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = sum(jaxmp.debug.matmul_flops(step("mxfp8"), p, x).values())
    said = [str(c.message) for c in caught if "pads contracting" in str(c.message)]
    assert len(said) == 1, said
    exact = sum(jaxmp.debug.matmul_flops(step("tensor"), p, x).values())
    assert padded > exact
    assert f"{padded / exact - 1:.1%} more float8 matrix-product FLOPs" in said[0]


def test_convolutions_keep_the_per_tensor_product():
    k, images = _rows((4, 3, 3, 3), 21), _rows((2, 3, 8, 8), 22)
    loss = lambda k, images: jnp.sum(jax.lax.conv(images, k, (1, 1), "SAME") ** 2)
    tensor = jaxmp.autocast(loss, F32, matmul_dtype=E4M3)
    mx = jaxmp.autocast(loss, F32, matmul_dtype=E4M3, float8_scaling="mxfp8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.experimental.Float8ShortfallWarning)
        program = str(jax.make_jaxpr(mx)(k, images))
    assert program == str(jax.make_jaxpr(tensor)(k, images))  # the same program
    assert "conv_general_dilated" in program and "platform_index" not in program


# --- Arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,message", [
    ({"matmul_dtype": E4M3, "float8_scaling": "mxfp4"}, "float8_scaling must be one of"),
    ({"matmul_dtype": E4M3, "float8_scaling": "MXFP8"}, "lower case"),
    ({"matmul_dtype": E4M3, "float8_scaling": None}, "float8_scaling must be one of"),
    ({"float8_scaling": "mxfp8"}, "Fix: pass matmul_dtype=jnp.float8_e4m3fn"),
    ({"matmul_dtype": E5M2, "float8_scaling": "mxfp8"}, "Fix: matmul_dtype=jnp.float8_e4m3fn"),
])
@pytest.mark.parametrize("api", ["autocast", "mp_value_and_grad", "mp_grad",
                                 "accumulate_value_and_grad", "find_nonfinite"])
def test_invalid_float8_scaling_raises_with_the_fix(api, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        if api == "autocast":
            jaxmp.autocast(matmul, jnp.bfloat16, **kwargs)
        elif api == "accumulate_value_and_grad":
            jaxmp.accumulate_value_and_grad(matmul, 2, compute_dtype=jnp.bfloat16, **kwargs)
        else:
            module = jaxmp.debug if api == "find_nonfinite" else jaxmp
            getattr(module, api)(matmul, compute_dtype=jnp.bfloat16, **kwargs)


def test_find_nonfinite_checks_the_mxfp8_step():
    # A product beyond float16's range is found at its line; the float32 shadow of the
    # block-scaled products (quantised with the shadow's own block scales) is exact.
    w = jnp.ones((64, 32))
    big = 1e3 * jax.random.uniform(jax.random.key(0), (8, 64), minval=0.5, maxval=1.5)
    # x @ w is about 6.4e4 .. 9.6e4; its inf reaches the loss (a tanh would saturate it to
    # float32's value, an overflow that changes nothing, which find_nonfinite does not report).
    loss = lambda w, x: jnp.mean((x @ w) / 1e4)
    report = jaxmp.debug.find_nonfinite(loss, matmul_dtype=E4M3, float8_scaling="mxfp8",
                                        compute_dtype=jnp.float16)(w, big)
    first = report.findings[0]
    assert (first.phase, first.kind, first.dtype) == ("forward", "overflow", "float16")
    assert "test_mxfp8.py" in first.where and first.float32_max > 65504
    np.testing.assert_allclose(report.loss_float32, loss(w, big), rtol=1e-6)


# --- Training steps ----------------------------------------------------------------------------


def _loss(params, x, y):
    h = jax.nn.gelu(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


def _params_and_batch():
    params = {"w1": _rows((64, 32), 23) / 8, "w2": _rows((32, 32), 24) / 6}
    return params, _rows((64, 64), 25), _rows((64, 32), 26)


def test_mp_value_and_grad_and_accumulate_run_mxfp8_and_match_float32():
    params, x, y = _params_and_batch()
    ref_loss, ref = jax.jit(jax.value_and_grad(_loss))(params, x, y)
    options = dict(compute_dtype=jnp.bfloat16, matmul_dtype=E4M3, float8_scaling="mxfp8")
    whole = jaxmp.mp_value_and_grad(_loss, **options)
    micro = jaxmp.accumulate_value_and_grad(_loss, 2, **options)
    for grad_fn in (whole, micro):
        step = lambda p, x, y, f=grad_fn: f(p, x, y, scaler_state=jaxmp.noop_scaler())
        loss, grads, _, finite = jax.jit(step)(params, x, y)
        assert bool(finite) and abs(float(loss) / float(ref_loss) - 1) < 0.05
        for name in params:
            assert grads[name].dtype == F32 and rel(grads[name], ref[name]) < 0.1, name
    cuda = jax.jit(step).trace(params, x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert BLOCK_DOT in cuda and "stablehlo.dot_general" not in cuda
    grad_fn = jaxmp.mp_grad(_loss, **options)
    step = lambda p, x, y: grad_fn(p, x, y, scaler_state=jaxmp.noop_scaler())
    assert sum(eqn.primitive.name == "scaled_matmul_wrapper"  # 2 products, forward + backward
               for eqn, _, _ in jaxprs.walk(jax.make_jaxpr(step)(params, x, y).jaxpr)) == 6


def _run_checking_mxfp8(step, *args, layers):
    """Runs ``step`` on CPU, checking that every product is an MXFP8 product, on CPU and CUDA:
    for ``layers`` dense layers, the forward product and its two backward products each."""
    flops = jaxmp.debug.matmul_flops(step, *args, platform="cpu")
    assert list(flops) == ["float8_e4m3fn"], flops
    traced = jax.jit(step).trace(*args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert BLOCK_DOT in cuda and "stablehlo.dot_general" not in cuda
    assert sum(eqn.primitive.name == "scaled_matmul_wrapper"
               for eqn, _, _ in jaxprs.walk(traced.jaxpr.jaxpr)) == 3 * layers
    return traced.lower().compile()(*args)


def _two_layer_step_against_float32(loss, params, x, y):
    """The MXFP8 gradients of a two-layer model's loss (every product checked to be
    block-scaled) and float32's; the losses agree within 5%."""
    grad_fn = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, matmul_dtype=E4M3,
                                      float8_scaling="mxfp8")
    step = lambda p: grad_fn(p, x, y, scaler_state=jaxmp.noop_scaler())
    loss_value, grads, _, finite = _run_checking_mxfp8(step, params, layers=2)
    ref_loss, ref = jax.jit(jax.value_and_grad(loss))(params, x, y)
    assert bool(finite) and abs(float(loss_value) / float(ref_loss) - 1) < 0.05
    return grads, ref


def test_flax_linen_dense_model():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(32)(nn.gelu(nn.Dense(64)(x)))

    model = MLP()
    x, y = _rows((32, 32), 27), _rows((32, 32), 28)
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]

    def loss(params, x, y):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    grads, ref = _two_layer_step_against_float32(loss, params, x, y)
    assert rel(grads["Dense_0"]["kernel"], ref["Dense_0"]["kernel"]) < 0.1


def test_equinox_model():
    import equinox as eqx

    model = eqx.nn.MLP(32, 32, 32, depth=1, activation=jax.nn.gelu, key=jax.random.key(1))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    x, y = _rows((32, 32), 29), _rows((32, 32), 30)

    def loss(params, x, y):
        return jnp.mean((jax.vmap(eqx.combine(params, static))(x) - y) ** 2)

    grads, ref = _two_layer_step_against_float32(loss, params, x, y)
    assert rel(grads.layers[0].weight, ref.layers[0].weight) < 0.1


# --- Where the block-scaled products run --------------------------------------------------------

_H100 = float8.Target("gpu", "NVIDIA H100 80GB HBM3", None)
_B200 = float8.Target("gpu", "NVIDIA B200", None)


@pytest.mark.parametrize("target,native", [
    (_H100, False), (_B200, True),
    (float8.Target("gpu", "NVIDIA H100 80GB HBM3", "9.0"), False),
    (float8.Target("gpu", "NVIDIA GB200", None), True),
    (float8.Target("gpu", "NVIDIA A100-SXM4-80GB", None), False),
    (float8.Target("gpu", "some future GPU", "12.0"), True),
    (float8.Target("gpu", "AMD Instinct MI300X", "gfx942"), False),
    (float8.Target("tpu", "TPU v5 lite", None), False),
    (float8.Target("cpu", "cpu", None), False)])
def test_block_scaled_gemms_are_blackwell_and_later(target, native):
    """XLA gives cuDNN's block-scaled dot to GPUs of compute capability 10.0 and up; the
    recipe runs there natively, emulated on the CPU, and per tensor anywhere else."""
    assert float8.block_scaled_gemms(target) == native
    runs = float8.recipe_on(float8.RECIPES["mxfp8"], target)
    expected = "mxfp8" if native or target.platform == "cpu" else "tensor"
    assert runs is float8.RECIPES[expected]
    assert float8.recipe_on(float8.RECIPES["tensor"], target) is float8.RECIPES["tensor"]


def test_describe_names_the_gpu_generation():
    assert float8.describe(_H100) == "NVIDIA H100 80GB HBM3 (Hopper, sm_90)"
    assert float8.describe(_B200) == "NVIDIA B200 (Blackwell, sm_100)"
    assert float8.describe(float8.Target("gpu", "NVIDIA L4", "8.9")) == (
        "NVIDIA L4 (Ada Lovelace, sm_89)")


def _on(kind, cores, *shapes):
    """Abstract operands whose sharding says they live on a GPU of this kind: what jit's
    arguments carry when compiled for that GPU (deviceless compilation included)."""
    mesh_lib = pytest.importorskip("jax._src.mesh")
    if not hasattr(mesh_lib, "AbstractDevice"):
        pytest.skip("this JAX's abstract meshes carry no device")
    try:
        device = mesh_lib.AbstractDevice(device_kind=kind, num_cores=cores, platform="gpu")
    except TypeError:  # jax < 0.9: an abstract device has a kind, no platform (read from it)
        device = mesh_lib.AbstractDevice(device_kind=kind, num_cores=cores)
    mesh = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return [jax.ShapeDtypeStruct(s, F32, sharding=sharding) for s in shapes]


def test_mxfp8_traced_for_a_hopper_gpu_runs_the_per_tensor_recipe_and_says_so():
    """On a GPU without block-scaled GEMMs (H100) the program is the per-tensor recipe's
    (float8 GEMMs, no float32 loop), said once at trace time naming the GPU generation; on a
    B200 it is the block-scaled one."""
    loss = lambda w, x: jnp.sum((x @ w) ** 2)
    grad = lambda scaling: jax.grad(jaxmp.autocast(loss, jnp.bfloat16, matmul_dtype=E4M3,
                                                   float8_scaling=scaling), argnums=(0, 1))
    h100 = _on("NVIDIA H100 80GB HBM3", 132, (64, 32), (32, 64))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = str(jax.make_jaxpr(grad("mxfp8"))(*h100))
    said = [str(c.message) for c in caught
            if c.category is jaxmp.experimental.Float8ShortfallWarning]
    assert len(said) == 1 and "NVIDIA H100 80GB HBM3 (Hopper, sm_90)" in said[0], said
    assert "'tensor' recipe" in said[0]
    # The same program (jax 0.8 prints the addresses of functions in parameters: not compared).
    address = re.compile(r"0x[0-9a-f]+")
    assert address.sub("", program) == address.sub("", str(jax.make_jaxpr(grad("tensor"))(*h100)))
    assert "platform_index" not in program
    b200 = _on("NVIDIA B200", 148, (64, 32), (32, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        program = str(jax.make_jaxpr(grad("mxfp8"))(*b200))
    assert program.count("platform_index") == 3  # the block-scaled dot, forward and backward
