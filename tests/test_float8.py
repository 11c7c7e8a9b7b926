"""Tests of float8 matrix products through jaxmp.autocast (matmul_dtype), against float32."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxmp
from tests.helpers import matmul, mlp_loss, rel
from jaxmp._src import float8
from jaxmp._src import jaxprs

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
BF16 = jnp.bfloat16
# Convolutions stay in the compute dtype by default (float8 does not pay for them): asked for.
CONV8 = jaxmp.experimental.Float8Rules(include={"convolution"})


def _operand_dtypes(fn, *args, prim="dot_general"):
    """``(lhs dtype, rhs dtype)`` of every ``prim`` equation in the jaxpr of ``fn``, nested included."""
    return [tuple(str(v.aval.dtype) for v in eqn.invars[:2])
            for eqn, _, _ in jaxprs.walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name == prim]


def _operands(magnitude, seed=0, shape=(32, 128), out=64):
    kw, kx = jax.random.split(jax.random.key(seed))
    w = jax.random.normal(kw, (shape[1], out)) / np.sqrt(shape[1])
    x = magnitude * jax.random.normal(kx, shape)
    return w, x


def _f8(fn, compute_dtype=BF16, **kw):
    return jaxmp.autocast(fn, compute_dtype, matmul_dtype=E4M3, **kw)


# --- Scaling -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("amax", [1e-30, 3e-5, 1.0, 448.0, 449.0, 7e4, 3e38])
def test_scale_is_the_largest_power_of_two_that_fits(dtype, amax):
    top = float(jnp.finfo(dtype).max)
    scale = float(float8.scale_for(jnp.float32(amax), dtype))
    assert np.log2(scale) == int(np.log2(scale))  # a power of two: scaling is exact
    assert amax * scale <= top < 2 * amax * scale


@pytest.mark.parametrize("amax", [0.0, np.inf, np.nan])
def test_scale_of_zero_or_nonfinite_amax_is_one(amax):
    assert float(float8.scale_for(jnp.float32(amax), E4M3)) == 1.0


# --- Accuracy across magnitudes ---------------------------------------------------------------


def test_relative_error_is_the_same_at_every_magnitude():
    errors = {}
    for magnitude in (1e4, 1.0, 1e-5):
        w, x = _operands(magnitude)
        out = _f8(matmul, jnp.float32)(w, x)
        errors[magnitude] = rel(out, matmul(w, x))
    # e4m3 keeps 3 mantissa bits: a few percent, and the same at every magnitude.
    assert max(errors.values()) < 0.05, errors
    assert max(errors.values()) < 1.3 * min(errors.values()), errors


def test_without_scaling_small_and_large_tensors_are_lost():
    # What the per-tensor scale prevents: a plain cast flushes 1e-5 to zero
    # and turns 1e4 into NaN (e4m3fn has no inf; its largest value is 448).
    w, x = _operands(1e-5)
    assert not np.any(np.asarray(x.astype(E4M3), np.float32))
    w, x = _operands(1e4)
    assert np.isnan(np.asarray(x.astype(E4M3), np.float32)).any()


@pytest.mark.parametrize("magnitude", [1e4, 1.0, 1e-5])
def test_gradients_are_accurate_at_every_magnitude(magnitude):
    w, x = _operands(magnitude)

    def loss(w, x):
        return jnp.sum(jnp.tanh(matmul(w, x) / magnitude) * jnp.arange(64.0) / 64)

    ref = jax.grad(loss, argnums=(0, 1))(w, x)
    got = jax.grad(_f8(loss, jnp.float32), argnums=(0, 1))(w, x)
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype
        assert rel(g, r) < 0.1  # e5m2 cotangents: 2 mantissa bits


def test_nonfinite_operands_and_cotangents_stay_nonfinite():
    w, x = _operands(1.0)
    out = _f8(matmul)(w, x.at[0, 0].set(jnp.inf))
    assert not np.isfinite(np.asarray(out[0], np.float32)).any()
    assert np.isfinite(np.asarray(out[1:], np.float32)).all()
    _, vjp = jax.vjp(_f8(matmul), w, x)
    ct = jnp.ones((32, 64)).at[3, 4].set(jnp.inf)
    dw, dx = vjp(ct)
    assert not np.isfinite(dw).all() and not np.isfinite(dx).all()  # the scaler sees it


def test_zero_operand_gives_zero_product():
    w, x = _operands(1.0)
    out = _f8(matmul)(w, jnp.zeros_like(x))
    assert not np.any(np.asarray(out, np.float32))


# --- Which dtypes the program runs in ----------------------------------------------------------


def test_jaxpr_has_float8_operands_forward_and_e5m2_cotangents_backward():
    w, x = _operands(1.0)
    fwd = _operand_dtypes(_f8(matmul), w, x)
    assert fwd == [("float8_e4m3fn", "float8_e4m3fn")]

    def loss(w, x):
        return jnp.sum(matmul(w, x) ** 2)

    both = _operand_dtypes(jax.grad(_f8(loss), argnums=(0, 1)), w, x)
    assert ("float8_e4m3fn", "float8_e4m3fn") in both
    backward = [d for d in both if "float8_e5m2" in d]
    assert len(backward) == 2 and all("float8_e4m3fn" in d for d in backward)
    assert len(both) == 3


def test_result_is_in_compute_dtype_and_outputs_keep_their_dtypes():
    w, x = _operands(1.0)

    def two(w, x):
        h = matmul(w, x)
        return h, jnp.sum(h)

    inner = jax.make_jaxpr(_f8(lambda w, x: jnp.tanh(matmul(w, x))))(w, x)
    assert "bf16[32,64] = custom_vjp_call" in str(inner)  # the product, in bfloat16
    h, s = _f8(two)(w, x)
    assert h.dtype == jnp.float32 and s.dtype == jnp.float32


def _dot_eqns(fn, *args):
    return [eqn for eqn, _, _ in jaxprs.walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name == "dot_general"]


@pytest.mark.parametrize("compute, product", [(BF16, "bfloat16"), (jnp.float32, "float32"),
                                              (jnp.float16, "float32")])
def test_products_write_the_compute_dtype_and_are_unscaled_by_one_scalar(compute, product):
    """Forward and backward, each float8 product asks for its result in the compute dtype
    (float32 under float16, whose range cannot hold an unscaled product) and is multiplied
    by one scalar: the pattern XLA turns into one float8 GEMM that applies the scale and
    writes that dtype. A float32 weight still gets a float32 gradient."""
    w, x = _operands(1.0)
    loss = _f8(lambda w, x: jnp.sum(matmul(w, x).astype(jnp.float32) ** 2), compute)
    grad = jax.grad(loss, argnums=(0, 1))
    eqns = _dot_eqns(grad, w, x)
    assert len(eqns) == 3
    assert {str(e.params["preferred_element_type"]) for e in eqns} == {product}
    jaxpr = jax.make_jaxpr(grad)(w, x)
    for eqn in eqns:  # the product's one consumer multiplies it by a broadcast scalar
        users = [u for u, _, _ in jaxprs.walk(jaxpr.jaxpr)
                 if any(v is eqn.outvars[0] for v in u.invars)]
        assert [u.primitive.name for u in users] == ["mul"]
    assert all(g.dtype == jnp.float32 for g in grad(w, x))


def test_amax_reductions_and_scalars_per_product():
    """Each quantized tensor gets one amax (two reductions: along the minor dimension,
    then the rest) and each product's scalars one optimization barrier: the forward product
    quantizes two operands, the backward products one cotangent."""
    w, x = _operands(1.0)
    loss = _f8(lambda w, x: jnp.sum(matmul(w, x).astype(jnp.float32) ** 2))
    names = lambda fn: [e.primitive.name for e, _, _ in jaxprs.walk(
        jax.make_jaxpr(fn)(w, x).jaxpr)]
    fwd = names(_f8(matmul))
    assert fwd.count("reduce_max") == 4 and fwd.count("optimization_barrier") == 1
    both = names(jax.grad(loss, argnums=(0, 1)))
    # the model's own loss has no reduce_max; the backward quantizes the cotangent once
    assert both.count("reduce_max") == 6 and both.count("optimization_barrier") == 2


def test_operands_whose_amaxes_multiply_below_float32_range_keep_their_product():
    """Amaxes of ~3e-17 and ~3e-18 get scales of about 2**63 and 2**67, whose unscaling
    factor 2**-130 is not a normal float32 (flushed to zero): the second operand is then
    quantized a little below its full range instead, and the product (~1e-33, a normal
    float32) matches float32's."""
    w, x = _operands(1e-17)
    w = w * 1e-17
    out = _f8(matmul, jnp.float32)(w, x)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert np.all(np.isfinite(out)) and np.all(np.abs(ref) < 1e-30)
    assert rel(out, ref) < 0.05


def test_matmul_flops_count_float8_products():
    w, x = _operands(1.0)
    loss = _f8(lambda w, x: jnp.sum(matmul(w, x) ** 2))
    fwd = jaxmp.debug.matmul_flops(loss, w, x)
    assert fwd == {"float8_e4m3fn": 2 * 32 * 128 * 64}
    both = jaxmp.debug.matmul_flops(jax.grad(loss, argnums=(0, 1)), w, x)
    assert both == {"float8_e4m3fn": 2 * 32 * 128 * 64,
                    "float8_e4m3fn+float8_e5m2": 2 * 2 * 32 * 128 * 64}
    assert jaxmp.debug.half_matmul_flop_share(jax.grad(loss), w, x) == 1.0
    assert jaxmp.debug.float8_matmul_flop_share(jax.grad(loss), w, x) == 1.0
    plain = jaxmp.autocast(lambda w, x: jnp.sum(matmul(w, x) ** 2), BF16)
    assert jaxmp.debug.float8_matmul_flop_share(jax.grad(plain), w, x) == 0.0
    assert jaxmp.debug.half_matmul_flop_share(jax.grad(plain), w, x) == 1.0


# --- A tiny MLP ---------------------------------------------------------------------------------


def _mlp_params(seed=0, sizes=(32, 128, 128, 10)):
    keys = jax.random.split(jax.random.key(seed), len(sizes))
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])]


def _mlp_batch(n=64, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 32)), jax.random.randint(ky, (n,), 0, 10)


@pytest.fixture(scope="module")
def mlp_reference():
    """The tiny MLP, its batch and its float32 loss and gradients, computed once per module."""
    params, (x, y) = _mlp_params(), _mlp_batch()
    ref_loss, ref = jax.value_and_grad(mlp_loss)(params, x, y)
    return params, x, y, ref_loss, ref


def test_tiny_mlp_gradients_close_to_float32(mlp_reference):
    params, x, y, ref_loss, ref = mlp_reference
    loss, got = jax.jit(jax.value_and_grad(_f8(mlp_loss)))(params, x, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=0.02)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert g.dtype == jnp.float32
        assert rel(g, r) < 0.15
    # bfloat16 autocast for scale: float8 is within a few times its error.
    bf16 = jax.jit(jax.grad(jaxmp.autocast(mlp_loss, BF16)))(params, x, y)
    assert rel(jax.tree_util.tree_leaves(bf16)[1], jax.tree_util.tree_leaves(ref)[1]) < 0.02


def test_mp_value_and_grad_and_accumulate_reach_float8(mlp_reference):
    params, x, y, ref_loss, ref = mlp_reference
    opts = dict(compute_dtype=BF16, autocast=True, matmul_dtype=E4M3)
    step = jaxmp.mp_value_and_grad(mlp_loss, **opts)
    acc = jaxmp.accumulate_value_and_grad(mlp_loss, 4, **opts)
    for fn in (step, acc):
        state = jaxmp.noop_scaler()
        loss, grads, _, finite = jax.jit(fn)(params, x, y, scaler_state=state)
        assert bool(finite)
        np.testing.assert_allclose(loss, ref_loss, rtol=0.02)
        for g, r in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
            assert rel(g, r) < 0.15
        dtypes = _operand_dtypes(functools.partial(fn, scaler_state=state), params, x, y)
        assert dtypes and all(d[0].startswith("float8") and d[1].startswith("float8")
                              for d in dtypes)
        assert any("float8_e5m2" in d for d in dtypes)


def test_float16_with_loss_scaling(mlp_reference):
    params, x, y, ref_loss, ref = mlp_reference
    step = jaxmp.mp_value_and_grad(mlp_loss, compute_dtype=jnp.float16, autocast=True,
                                   matmul_dtype=E4M3)
    loss, grads, _, finite = jax.jit(step)(params, x, y, scaler_state=jaxmp.init_scaler())
    assert bool(finite)
    np.testing.assert_allclose(loss, ref_loss, rtol=0.02)
    assert rel(grads[0]["w"], ref[0]["w"]) < 0.12


def test_float8_products_written_in_fn_are_kept_by_an_outer_autocast():
    # E.g. a loss already under autocast(matmul_dtype=...) given to
    # mp_value_and_grad(autocast=True): the outer autocast must not widen it.
    w, x = _operands(1.0)
    loss = _f8(lambda w, x: jnp.sum(matmul(w, x) ** 2),
               float8_rules=jaxmp.experimental.Float8Rules(min_flops=1))
    outer = jaxmp.autocast(loss, BF16)
    assert _operand_dtypes(outer, w, x) == [("float8_e4m3fn", "float8_e4m3fn")]
    assert any("float8_e5m2" in d for d in _operand_dtypes(jax.grad(outer), w, x))
    step = jaxmp.mp_value_and_grad(loss, compute_dtype=BF16, autocast=True)
    value, grads, _, _ = step(w, x, scaler_state=jaxmp.noop_scaler())
    ref_value, ref = jax.value_and_grad(lambda w, x: jnp.sum(matmul(w, x) ** 2))(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=0.05)
    assert rel(grads, ref) < 0.1


# --- Control flow and transformations ---------------------------------------------------------------


def _check(fn, args, rtol=0.06, argnums=0):
    """``fn`` under float8 autocast: close to float32 in value and gradient, float8 in its jaxpr."""
    np.testing.assert_allclose(_f8(fn, jnp.float32)(*args), fn(*args), rtol=rtol)
    got = jax.grad(_f8(fn, jnp.float32), argnums=argnums)(*args)
    ref = jax.grad(fn, argnums=argnums)(*args)
    assert rel(got, ref) < 0.1
    dtypes = _operand_dtypes(jax.grad(_f8(fn), argnums=argnums), *args)
    assert dtypes and all(d[0].startswith("float8") for d in dtypes), dtypes
    assert any("float8_e5m2" in d for d in dtypes)


def test_scan():
    w, x = _operands(1.0, shape=(16, 64), out=64)

    def fn(w, x):
        def body(h, _):
            return jnp.tanh(h @ w), None
        return jnp.sum(jax.lax.scan(body, x, None, length=3)[0] ** 2)

    _check(fn, (w, x))


def test_checkpoint():
    w, x = _operands(1.0)
    fn = lambda w, x: jnp.sum(jax.checkpoint(lambda w: jnp.tanh(matmul(w, x)))(w) ** 2)
    _check(fn, (w, x))


def test_cond():
    w, x = _operands(1.0)

    def fn(w, x):
        h = jax.lax.cond(jnp.sum(x) > -1e9, lambda: jnp.tanh(x @ w), lambda: x[:, :64])
        return jnp.sum(h ** 2)

    _check(fn, (w, x))


def test_custom_vjp_keeps_its_rule_and_runs_float8_inside():
    @jax.custom_vjp
    def double_grad(h):
        return h

    double_grad.defvjp(lambda h: (h, None), lambda _, g: (2 * g,))
    w, x = _operands(1.0)
    fn = lambda w, x: jnp.sum(double_grad(jnp.tanh(matmul(w, x))) ** 2)
    np.testing.assert_allclose(_f8(fn, jnp.float32)(w, x), fn(w, x), rtol=0.05)
    got, ref = jax.grad(_f8(fn, jnp.float32))(w, x), jax.grad(fn)(w, x)
    assert rel(got, ref) < 0.1  # the factor 2 of the rule is kept
    assert ("float8_e4m3fn", "float8_e4m3fn") in _operand_dtypes(_f8(fn), w, x)


def test_vmap():
    w, x = _operands(1.0)
    xs = jnp.stack([x, 1e-4 * x])  # very different magnitudes per example
    fn = lambda w, x: jnp.sum(matmul(w, x) ** 2)
    got = jax.vmap(_f8(fn, jnp.float32), in_axes=(None, 0))(w, xs)
    np.testing.assert_allclose(got, jax.vmap(fn, in_axes=(None, 0))(w, xs), rtol=0.05)
    g = jax.vmap(jax.grad(_f8(fn, jnp.float32)), in_axes=(None, 0))(w, xs)
    r = jax.vmap(jax.grad(fn), in_axes=(None, 0))(w, xs)
    assert rel(g, r) < 0.1


def test_shard_map():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    w, x = _operands(1.0)
    fn = lambda w, x: jnp.sum(jnp.tanh(matmul(w, x)) ** 2)

    def body(w, x):
        loss, g = jax.value_and_grad(_f8(fn, jnp.float32))(w, x)
        # The gradient of the replicated w is already summed over devices by shard_map.
        return jax.lax.psum(loss, "data"), g

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    loss, g = run(w, jax.device_put(x, NamedSharding(mesh, P("data"))))
    ref_loss, ref = jax.value_and_grad(fn)(w, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=0.05)
    assert rel(g, ref) < 0.1


def test_convolution_forward_in_float8():
    kx, kw = jax.random.split(jax.random.key(0))
    x = 1e3 * jax.random.normal(kx, (2, 8, 8, 4))
    w = jax.random.normal(kw, (3, 3, 4, 8)) / 6

    def fn(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y / 1e3) ** 2)

    assert _operand_dtypes(_f8(fn, float8_rules=CONV8), w, x, prim="conv_general_dilated") == [
        ("float8_e4m3fn", "float8_e4m3fn")]
    np.testing.assert_allclose(jax.jit(_f8(fn, jnp.float32, float8_rules=CONV8))(w, x),
                               fn(w, x), rtol=0.05)
    got, ref = jax.jit(jax.grad(_f8(fn, jnp.float32, float8_rules=CONV8)))(w, x), jax.grad(fn)(w, x)
    assert rel(got, ref) < 0.1
    no_conv = jaxmp.experimental.Float8Rules(primitives={"dot_general"})
    assert _operand_dtypes(_f8(fn, float8_rules=no_conv), w, x, prim="conv_general_dilated") == [
        ("bfloat16", "bfloat16")]
    # by default too: float8 does not pay for convolutions (float8.COSTLY), said once
    with pytest.warns(jaxmp.experimental.Float8PlacementWarning, match="include={'convolution'}"):
        assert _operand_dtypes(_f8(fn), w, x, prim="conv_general_dilated") == [
            ("bfloat16", "bfloat16")]


_CONVS = {
    # name: (x shape, w shape, conv keyword arguments)
    "nhwc_stride2_same": ((2, 9, 9, 4), (3, 3, 4, 8), dict(
        window_strides=(2, 2), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "nchw_rhs_dilation_valid": ((2, 4, 10, 10), (8, 4, 3, 3), dict(
        window_strides=(1, 1), padding="VALID", rhs_dilation=(2, 2),
        dimension_numbers=("NCHW", "OIHW", "NCHW"))),
    "lhs_dilation_asymmetric_padding": ((2, 6, 6, 4), (3, 2, 4, 8), dict(
        window_strides=(1, 2), padding=((1, 2), (0, 1)), lhs_dilation=(2, 1),
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "feature_groups": ((2, 8, 8, 6), (3, 3, 3, 12), dict(
        window_strides=(1, 1), padding="SAME", feature_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "depthwise": ((2, 8, 8, 4), (3, 3, 1, 4), dict(
        window_strides=(2, 1), padding="SAME", feature_group_count=4,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "batch_groups": ((4, 8, 8, 3), (3, 3, 3, 6), dict(
        window_strides=(1, 1), padding="SAME", batch_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC"))),
    "1d_nwc": ((3, 17, 4), (5, 4, 8), dict(
        window_strides=(3,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC"))),
    "3d_ncdhw": ((1, 2, 5, 6, 6), (4, 2, 2, 3, 3), dict(
        window_strides=(1, 2, 1), padding="VALID", dimension_numbers=("NCDHW", "OIDHW", "NCDHW"))),
}


def _np_quantized(x, dtype):
    """``x`` quantized per tensor into float8 ``dtype`` and back, in NumPy: the scale is the
    largest power of two ``s`` with ``amax * s <= max(dtype)``."""
    import ml_dtypes  # NumPy's float8 dtypes

    x = np.asarray(x, np.float32)
    top = float(ml_dtypes.finfo(np.dtype(dtype)).max)
    amax = float(np.max(np.abs(x)))
    s = 2.0 ** np.floor(np.log2(top / amax)) if amax > 0 else 1.0
    while amax * s > top:
        s /= 2
    return (x * s).astype(np.dtype(dtype)), s


@pytest.mark.parametrize("name", sorted(_CONVS))
def test_convolution_products_run_where_xla_runs_them_in_float8(name):
    """XLA's GPU compiler gives cuDNN float8 graphs to forward convolutions only. So the
    forward product is an e4m3 x e4m3 convolution (unless it dilates its input: a transposed
    convolution runs in the compute dtype); the input gradient of a convolution with unit
    strides is one too (the cotangent quantized per tensor into e4m3, the saved e4m3
    kernel), equal to the gradient of an independent NumPy quantization differentiated in
    float32; the kernel gradient, and a strided convolution's input gradient, run in the
    compute dtype (float32 here) on the values themselves: float32's own gradient."""
    x_shape, w_shape, kw = _CONVS[name]
    kx, kw_, kc = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, x_shape)
    w = jax.random.normal(kw_, w_shape) / np.sqrt(np.prod(w_shape[:-1]))
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, **kw)
    c = jax.random.normal(kc, jax.eval_shape(conv, x, w).shape)

    def fn(x, w):
        return jnp.sum(conv(x, w) * c)

    grad = jax.grad(_f8(fn, jnp.float32, float8_rules=CONV8), argnums=(0, 1))
    transposed = any(d != 1 for d in kw.get("lhs_dilation", (1,)))
    float8_input_gradient = (not transposed and all(s == 1 for s in kw["window_strides"])
                             and kw.get("batch_group_count", 1) == 1)
    e4m3, f32 = ("float8_e4m3fn",) * 2, ("float32",) * 2
    dtypes = _operand_dtypes(grad, x, w, prim="conv_general_dilated")
    assert dtypes == [f32 if transposed else e4m3,
                      e4m3 if float8_input_gradient else f32,  # JAX's transposes: d/dx ...
                      f32]  # ... then d/dw

    got_dx, got_dw = jax.jit(grad)(x, w)
    ref_dx, ref_dw = jax.grad(fn, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got_dw, ref_dw, rtol=1e-5, atol=1e-5 * float(jnp.max(abs(ref_dw))))
    if not float8_input_gradient:
        np.testing.assert_allclose(got_dx, ref_dx, rtol=1e-5,
                                   atol=1e-5 * float(jnp.max(abs(ref_dx))))
        return
    # The reference: the e4m3 kernel the forward product saves and the cotangent quantized
    # into e4m3, dequantized and differentiated in float32.
    (w8, sw), (c8, sc) = _np_quantized(w, E4M3), _np_quantized(c, E4M3)
    deq = lambda q, s: jnp.asarray(q.astype(np.float32) / s)
    _, vjp = jax.vjp(lambda x: conv(x, deq(w8, sw)), x)
    (want,) = vjp(deq(c8, sc))
    np.testing.assert_allclose(got_dx, want, rtol=1e-5, atol=1e-5 * float(jnp.max(abs(want))))
    assert rel(got_dx, ref_dx) < 0.1  # ... and near float32's own gradient


def test_convolution_float8_products_say_what_xla_runs():
    """The rule autocast and the census share: forward and unit-stride input gradients."""
    params = lambda **kw: dict(dict(window_strides=(1, 1), lhs_dilation=(1, 1),
                                    batch_group_count=1), **kw)
    assert float8.conv_float8_products(params()) == (True, True, False)
    assert float8.conv_float8_products(params(window_strides=(2, 1))) == (True, False, False)
    assert float8.conv_float8_products(params(lhs_dilation=(2, 2))) == (False, False, False)
    assert float8.conv_float8_products(params(batch_group_count=2)) == (True, False, False)


def test_convolution_backward_under_vmap_and_half_compute():
    """The transposes are traced per call: under ``vmap`` (per-example scales) and with a
    bfloat16 compute dtype the forward product and the input gradient (unit strides) stay
    float8, the kernel gradient bfloat16, and the gradient near float32."""
    x_shape, w_shape = (2, 8, 8, 4), (3, 3, 4, 8)
    kw = dict(window_strides=(1, 1), padding="SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    kx, kw_ = jax.random.split(jax.random.key(2))
    xs = jax.random.normal(kx, (3,) + x_shape)
    w = jax.random.normal(kw_, w_shape) / 6

    def fn(w, x):
        return jnp.sum(jnp.tanh(jax.lax.conv_general_dilated(x, w, **kw)) ** 2)

    per_example = jax.vmap(jax.grad(_f8(fn, float8_rules=CONV8)), in_axes=(None, 0))
    # the forward product in float8, the kernel gradient in bfloat16 (no input gradient is
    # asked for)
    assert jaxmp.debug.float8_matmul_flop_share(per_example, w, xs) == 0.5
    both = jax.vmap(jax.grad(_f8(fn, float8_rules=CONV8), argnums=(0, 1)), in_axes=(None, 0))
    assert jaxmp.debug.float8_matmul_flop_share(both, w, xs) == pytest.approx(2 / 3)
    assert jaxmp.debug.half_matmul_flop_share(per_example, w, xs) == 1.0
    got = jax.jit(per_example)(w, xs)
    assert got.dtype == w.dtype
    ref = jax.vmap(jax.grad(fn), in_axes=(None, 0))(w, xs)
    assert rel(got, ref) < 0.15


# --- Rules: which products stay in compute_dtype ---------------------------------------------------


def _two_products(w, v, x):
    h = jnp.tanh(x @ w)  # 2 * 32 * 128 * 64 FLOPs
    with jax.named_scope("head"):
        return jnp.sum(h[:, :4] @ v)  # 2 * 32 * 4 * 3 FLOPs


def _two_args():
    w, x = _operands(1.0)
    return w, jnp.ones((4, 3)), x


def test_min_flops_keeps_small_products_in_compute_dtype():
    rules = jaxmp.experimental.Float8Rules(min_flops=10_000)
    dtypes = _operand_dtypes(_f8(_two_products, float8_rules=rules), *_two_args())
    assert dtypes == [("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]


@pytest.mark.parametrize("scope", ["head", "outer/head"])
def test_named_scope_keeps_a_layer_in_compute_dtype(scope):
    rules = jaxmp.experimental.Float8Rules(keep_scopes={scope})

    def outer(w, v, x):
        with jax.named_scope("outer"):
            return jax.jit(_two_products)(w, v, x)  # the scope is seen through a nested jit

    dtypes = _operand_dtypes(_f8(outer, float8_rules=rules), *_two_args())
    assert dtypes == [("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]
    other = jaxmp.experimental.Float8Rules(keep_scopes={"hea"})
    assert all(d[0] == "float8_e4m3fn"
               for d in _operand_dtypes(_f8(outer, float8_rules=other), *_two_args()))


def test_predicate_sees_the_product():
    seen = []

    def keep_if(product):
        seen.append(product)
        return product.rhs_shape == (4, 3)

    rules = jaxmp.experimental.Float8Rules(keep_if=keep_if)
    dtypes = _operand_dtypes(_f8(_two_products, float8_rules=rules), *_two_args())
    assert dtypes == [("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]
    assert seen[0].primitive == "dot_general" and seen[0].flops == 2 * 32 * 128 * 64
    assert seen[1].scope == "head" and seen[1].lhs_shape == (32, 4)


# --- Placement by cost: what float8 does not pay for stays in compute_dtype --------------------


def _attention_block():
    """A Flax linen self-attention block (4 projections, scores and weighted values) and its
    parameters, as users write it."""
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    block = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16, out_features=16)
    x = jax.random.normal(jax.random.key(3), (2, 8, 16))
    params = block.init(jax.random.key(4), x)

    def loss(params, x):
        return jnp.mean(block.apply(params, x) ** 2)

    return loss, params, x


def _batched(dtypes_and_shapes):
    return [d for d, batched in dtypes_and_shapes if batched]


def _product_dtypes(fn, *args):
    """``(lhs dtype, whether the product has batch dimensions)`` of every ``dot_general``."""
    from jaxmp._src import compat  # pylint: disable=g-import-not-at-top
    return [(str(eqn.invars[0].aval.dtype), bool(compat.dimension_numbers(eqn)[1][0]))
            for eqn, _, _ in jaxprs.walk(jax.make_jaxpr(fn)(*args).jaxpr)
            if eqn.primitive.name == "dot_general"]


def test_attention_scores_and_probabilities_stay_in_compute_dtype(recwarn):
    """The projections (a weight read from the parameters) run in float8; q @ k.T and
    probs @ v (two activations, batch dimensions) in bfloat16, forward and backward; the
    gradient stays close to float32's."""
    loss, params, x = _attention_block()
    forward = _product_dtypes(_f8(loss), params, x)
    assert [d for d, b in forward if not b] == ["float8_e4m3fn"] * 4  # q, k, v, out
    assert _batched(forward) == ["bfloat16"] * 2  # scores, weighted values
    backward = _product_dtypes(jax.grad(_f8(loss)), params, x)
    assert set(_batched(backward)) == {"bfloat16"} and len(_batched(backward)) == 6
    got = jax.jit(jax.grad(_f8(loss, jnp.float32)))(params, x)
    ref = jax.grad(loss)(params, x)
    flat = lambda tree: jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(tree)])
    assert rel(flat(got), flat(ref)) < 0.15  # float8 projections: 3 mantissa bits
    assert not [w for w in recwarn if w.category is jaxmp.experimental.Float8ShortfallWarning]


def test_kept_products_are_said_once_with_the_fix():
    import warnings  # pylint: disable=g-import-not-at-top
    loss, params, x = _attention_block()
    f8 = _f8(loss)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.make_jaxpr(jax.grad(f8))(params, x)
        jax.make_jaxpr(jax.grad(f8))(params, x)  # traced again: not said again
    said = [w for w in caught if w.category is jaxmp.experimental.Float8PlacementWarning]
    assert len(said) == 1
    text = str(said[0].message)
    assert "2 attention products" in text and "test_float8.py" in text
    assert "Float8Rules(include={'attention'})" in text
    assert not [w for w in caught if w.category is jaxmp.experimental.Float8ShortfallWarning]


def test_include_asks_for_attention_products_in_float8():
    import warnings  # pylint: disable=g-import-not-at-top
    loss, params, x = _attention_block()
    rules = jaxmp.experimental.Float8Rules(include={"attention"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8PlacementWarning)
        forward = _product_dtypes(_f8(loss, float8_rules=rules), params, x)
    assert [d for d, _ in forward] == ["float8_e4m3fn"] * 6


def test_kept_products_count_in_the_share_and_are_no_shortfall():
    """The census counts the kept products outside float8 (the share of what runs in float8)
    and says no shortfall for them."""
    import warnings  # pylint: disable=g-import-not-at-top
    loss, params, x = _attention_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        warnings.simplefilter("ignore", jaxmp.experimental.Float8PlacementWarning)
        share = jaxmp.debug.float8_matmul_flop_share(jax.grad(_f8(loss)), params, x)
        everything = jaxmp.experimental.Float8Rules(include={"attention"})
        share_all = jaxmp.debug.float8_matmul_flop_share(
            jax.grad(_f8(loss, float8_rules=everything)), params, x)
    # 4 projections of 2 * 16 * 16 * 16 FLOPs (q, k, v: forward and weight gradient, x is not
    # differentiated; out: three products), 2 attention products of 2 * 2 * 2 * 8 * 8 * 8
    # (three each)
    projections, attention = 9 * 2 * 16 * 16 * 16, 6 * 2 * 2 * 2 * 8 * 8 * 8
    assert share == projections / (projections + attention) == 0.75
    assert share_all == 1.0


def test_mp_value_and_grad_takes_float8_rules():
    """``float8_rules=`` reaches the autocast of ``mp_value_and_grad`` (the default keeps the
    attention products in bfloat16, ``include`` asks for them), and needs a float8
    ``matmul_dtype``."""
    import warnings  # pylint: disable=g-import-not-at-top
    loss, params, x = _attention_block()
    every = jaxmp.experimental.Float8Rules(include={"attention"})
    shares = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.experimental.Float8PlacementWarning)
        for rules in (None, every):
            step = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16,
                                           matmul_dtype=jnp.float8_e4m3fn, float8_rules=rules)
            shares.append(jaxmp.debug.float8_matmul_flop_share(
                lambda p, x: step(p, x, scaler_state=jaxmp.noop_scaler())[1], params, x))
    assert shares == [0.75, 1.0]
    with pytest.raises(ValueError, match="float8_rules= says which matrix products"):
        jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, float8_rules=every)


def test_stacked_weights_of_a_scan_are_read_from_the_inputs():
    """Under ``lax.scan`` over stacked weights, the sliced weight is still a parameter (its
    product in float8) and the carry an activation (its product with a computed activation,
    batched, in the compute dtype)."""
    def loss(ws, x):
        def layer(h, w):
            q = h @ w
            return h + jnp.einsum("bij,bkj->bik", q, h) @ h * 1e-2, None
        return jnp.sum(jax.lax.scan(layer, x, ws)[0])

    ws, x = jnp.ones((2, 8, 8)) / 8, jnp.ones((2, 4, 8))
    import warnings  # pylint: disable=g-import-not-at-top
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.experimental.Float8PlacementWarning)
        dtypes = _product_dtypes(_f8(loss), ws, x)
    assert dtypes == [("float8_e4m3fn", False), ("bfloat16", True), ("bfloat16", True)]


def test_min_flops_per_element_keeps_products_with_few_flops_per_quantised_element():
    # x @ w: 2 * 32 * 128 * 64 FLOPs over 32 * 128 + 128 * 64 + 32 * 64 elements (~37);
    # h[:, :4] @ v: 2 * 32 * 4 * 3 over 128 + 12 + 96 (~3)
    rules = jaxmp.experimental.Float8Rules(min_flops_per_element=10)
    dtypes = _operand_dtypes(_f8(_two_products, float8_rules=rules), *_two_args())
    assert dtypes == [("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]
    seen = []
    jax.make_jaxpr(_f8(_two_products, float8_rules=jaxmp.experimental.Float8Rules(
        keep_if=seen.append)))(*_two_args())
    assert seen[0].flops_per_element == pytest.approx(
        2 * 32 * 128 * 64 / (32 * 128 + 128 * 64 + 32 * 64))
    assert seen[0].from_inputs == (True, True) and seen[0].batch_dims == 0
    assert seen[1].from_inputs == (False, True)  # h is computed, v a parameter


# --- find_nonfinite ---------------------------------------------------------------------------------


def test_find_nonfinite_with_float8_products():
    params, (x, y) = _mlp_params(sizes=(32, 10)), _mlp_batch(16)  # eager: keep it small
    opts = dict(autocast=True, matmul_dtype=E4M3)
    report = jaxmp.debug.find_nonfinite(mlp_loss, **opts)(params, x, y)
    assert not report and not report.findings  # float8 rounding is not reported as a problem



def _overflowing_product(w, x):
    # x @ w is about 1.3e5: beyond float16's 65504, and its inf reaches the loss (a tanh would
    # saturate it to 1, the float32 value: find_nonfinite does not report an overflow that
    # changes nothing).
    return jnp.mean((x @ w) / 1e4)


def test_find_nonfinite_names_the_line_of_an_overflowing_float8_product():
    w = jnp.ones((128, 64))
    x = 1e3 * jax.random.uniform(jax.random.key(0), (16, 128), minval=0.5, maxval=1.5)
    report = jaxmp.debug.find_nonfinite(_overflowing_product, autocast=True, matmul_dtype=E4M3,
                                        compute_dtype=jnp.float16)(w, x)
    assert report
    first = report.findings[0]
    assert first.phase == "forward" and first.dtype == "float16"
    assert "test_float8.py" in first.where and "_overflowing_product" in first.where
    assert first.float32_max > 1e5 and first.float32_max < 2e5  # the exact product, in float32


# --- Errors ---------------------------------------------------------------------------------------


def test_bad_matmul_dtype():
    with pytest.raises(ValueError, match="set compute_dtype=float16"):
        jaxmp.autocast(matmul, BF16, matmul_dtype=jnp.float16)
    with pytest.raises(ValueError, match="float8_e4m3fn.*got int8"):
        jaxmp.autocast(matmul, BF16, matmul_dtype=jnp.int8)
    with pytest.raises(ValueError, match="fnuz"):
        jaxmp.autocast(matmul, BF16, matmul_dtype=jnp.float8_e4m3fnuz)
    with pytest.raises(ValueError, match="must be a dtype"):
        jaxmp.autocast(matmul, BF16, matmul_dtype="fp8")
    with pytest.raises(ValueError, match="needs autocast=True"):
        jaxmp.mp_value_and_grad(mlp_loss, compute_dtype=BF16, matmul_dtype=E4M3, autocast=False)
    # The compute dtype itself means: no float8.
    w, x = _operands(1.0)
    assert _operand_dtypes(jaxmp.autocast(matmul, BF16, matmul_dtype=BF16), w, x) == [
        ("bfloat16", "bfloat16")]


def test_bad_float8_rules():
    with pytest.raises(TypeError, match="collection of strings"):
        jaxmp.experimental.Float8Rules(keep_scopes="head")
    with pytest.raises(ValueError, match="only"):
        jaxmp.experimental.Float8Rules(primitives={"dot_general", "mul"})
    with pytest.raises(TypeError, match="min_flops"):
        jaxmp.experimental.Float8Rules(min_flops=-1)
    with pytest.raises(TypeError, match="keep_if"):
        jaxmp.experimental.Float8Rules(keep_if="head")
    with pytest.raises(ValueError, match="kept by default are .'attention', 'convolution'."):
        jaxmp.experimental.Float8Rules(include={"softmax"})
    with pytest.raises(TypeError, match="min_flops_per_element"):
        jaxmp.experimental.Float8Rules(min_flops_per_element=0.5)
    with pytest.raises(TypeError, match="float8_rules must be"):
        jaxmp.autocast(matmul, BF16, matmul_dtype=E4M3, float8_rules={"min_flops": 1})


def test_rules_repr():
    assert repr(jaxmp.experimental.Float8Rules()) == "Float8Rules()"
    assert repr(jaxmp.experimental.Float8Rules(include={"convolution", "attention"},
                                               min_flops_per_element=1000)) == (
        "Float8Rules(include={'attention', 'convolution'}, min_flops_per_element=1000)")
    assert repr(jaxmp.experimental.Float8Rules(min_flops=8, keep_scopes={"head"})) == (
        "Float8Rules(min_flops=8, keep_scopes={'head'})")
