"""Misuse: each mistake gets an error that names it, raised at trace time.

One test per case; each asserts the message. Where it matters, the call is
made under ``jax.jit`` to show that the error comes while tracing, before
anything runs.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp

W = jnp.ones((3,))
X = jnp.ones((4, 3))
SCALER = jaxmp.init_scaler(initial_scale=1024.0)


def loss_fn(w, x):
    return jnp.mean(x @ w)


# --- scaler state ----------------------------------------------------------

@pytest.mark.parametrize("bad", [None, 1024.0, {"scale": 1024.0}], ids=["None", "float", "dict"])
def test_scaler_state_that_is_not_one(bad):
    step = jax.jit(lambda w, x: jaxmp.mp_value_and_grad(loss_fn,
                                                        compute_dtype=jnp.float16)(
                                                            w, x, scaler_state=bad))
    with pytest.raises(TypeError, match=r"scaler_state must be a jaxmp.ScalerState \(from "
                                        r"jaxmp.init_scaler\(\).*got " + type(bad).__name__):
        step(W, X)


def test_scaler_state_that_is_not_one_in_the_free_functions():
    for fn in (lambda s: jaxmp.adjust(s, True), lambda s: jaxmp.scale(s, W),
               lambda s: jaxmp.unscale(s, W), jaxmp.scaler_metrics):
        with pytest.raises(TypeError, match="must be a jaxmp.ScalerState.*got dict"):
            fn({"scale": 1.0})


def test_scaler_state_that_is_not_one_in_accumulation():
    step = jaxmp.accumulate_value_and_grad(loss_fn, 2, compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="scaler_state must be a jaxmp.ScalerState"):
        step(W, X, scaler_state=optax.sgd(0.1).init(W))


# --- loss --------------------------------------------------------------------

def test_loss_that_is_not_a_scalar():
    step = jax.jit(lambda w, x: jaxmp.mp_value_and_grad(lambda w, x: x @ w,
                                                        compute_dtype=jnp.float16)(
        w, x, scaler_state=SCALER))
    with pytest.raises(TypeError, match=r"The loss must be a scalar, got an array of shape "
                                        r"\(4,\)\. Reduce it \(e\.g\. with jnp\.mean\)"):
        step(W, X)


def test_loss_that_is_not_floating_point():
    fn = jaxmp.mp_value_and_grad(lambda w, x: jnp.argmax(x @ w), compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="The loss must have a floating-point dtype, got int32"):
        fn(W, X, scaler_state=SCALER)


def test_loss_that_is_a_tuple_without_has_aux():
    fn = jaxmp.mp_value_and_grad(lambda w, x: (loss_fn(w, x), {"acc": 1.0}),
                                 compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"must return a scalar floating-point array \(or a pair "
                                        r"\(loss, aux\) with has_aux=True\), got tuple"):
        fn(W, X, scaler_state=SCALER)


def test_has_aux_with_a_function_that_returns_a_bare_scalar():
    step = jax.jit(lambda w, x: jaxmp.mp_value_and_grad(loss_fn, has_aux=True,
                                                        compute_dtype=jnp.float16)(
        w, x, scaler_state=SCALER))
    with pytest.raises(TypeError, match=r"With has_aux=True the loss function must return a pair "
                                        r"\(loss, aux\), got a single array of shape \(\); "
                                        r"without aux, use has_aux=False"):
        step(W, X)


def test_has_aux_with_a_function_that_returns_a_triple():
    fn = jaxmp.mp_value_and_grad(lambda w, x: (loss_fn(w, x), 1, 2), has_aux=True,
                                 compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"must return a pair \(loss, aux\), got a tuple of length 3"):
        fn(W, X, scaler_state=SCALER)


# --- what is differentiated --------------------------------------------------

def test_no_floating_point_leaves_to_differentiate():
    fn = jaxmp.mp_value_and_grad(lambda p, x: jnp.mean(x), compute_dtype=jnp.float16)
    params = {"step": jnp.arange(3), "name": None}
    with pytest.raises(TypeError, match=r"No floating-point array leaves to differentiate in the "
                                        r"argument\(s\) argnums=0"):
        fn(params, X, scaler_state=SCALER)


def test_argnums_out_of_range():
    fn = jaxmp.mp_value_and_grad(loss_fn, argnums=2, compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match=r"argnums=2 refers to argument 2, but the function was "
                                        r"called with 2 positional arguments"):
        fn(W, X, scaler_state=SCALER)


# --- dtypes and policies -----------------------------------------------------

@pytest.mark.parametrize("dtype, name", [(jnp.float64, "float64"), (jnp.int8, "int8"),
                                         (jnp.float8_e4m3fn, "float8_e4m3fn")])
def test_compute_dtype_that_is_not_float16_bfloat16_or_float32(dtype, name):
    with pytest.raises(ValueError, match=f"compute_dtype must be one of float16, bfloat16, "
                                         f"float32; got {name}"):
        jaxmp.mp_value_and_grad(loss_fn, compute_dtype=dtype)


def test_compute_dtype_that_is_not_a_dtype():
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got 'fp8'"):
        jaxmp.accumulate_value_and_grad(loss_fn, 2, compute_dtype="fp8")


def test_compute_dtype_short_names_are_those_of_policy_strings():
    # NumPy reads "f16" as float128 (16 bytes); jaxmp reads it as in "p=f32,c=f16".
    seen = []

    def recording_loss(w, x):
        seen.append(x.dtype)
        return loss_fn(w, x)

    jaxmp.mp_value_and_grad(recording_loss, compute_dtype="f16", autocast=False)(
        W, X, scaler_state=SCALER)
    assert seen == [jnp.float16]
    with pytest.raises(ValueError, match="compute_dtype must be one of float16, bfloat16, "
                                         "float32; got float64"):
        jaxmp.mp_value_and_grad(loss_fn, compute_dtype="f8")  # NumPy's 8-byte float


def test_compute_dtype_none_is_not_float64():
    with pytest.raises(ValueError, match="compute_dtype must be a floating-point dtype, got None"):
        jaxmp.mp_value_and_grad(loss_fn, compute_dtype=None)


@pytest.mark.parametrize("spec, message", [
    ("p=f32,c=f8", r"Unknown dtype 'f8' in policy 'p=f32,c=f8'; known dtypes: bf16, bfloat16"),
    ("params=float32,kompute=float16", r"Unknown policy field 'kompute' .*expected params/p, "
                                       r"compute/c or output/o"),
    ("p=f32,p=f16", r"Policy field 'p' is given twice in 'p=f32,p=f16'"),
    ("p=f32,,c=f16", r"Expected name=dtype in policy 'p=f32,,c=f16', got ''"),
    (16, r"A policy must be a string or a Policy, got int"),
], ids=["dtype", "field", "repeated", "empty-part", "not-a-string"])
def test_invalid_policy_string(spec, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.get_policy(spec)


# --- scaler settings ----------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    (dict(initial_scale=0.5), r"initial_scale \(0.5\) must lie in \[min_scale, max_scale\] = "
                              r"\[1.0, 16777216.0\]"),
    (dict(initial_scale=float("nan")), r"initial_scale must be finite, got nan"),
    (dict(initial_scale="1024"), r"initial_scale must be a number, got '1024'"),
    (dict(growth_interval=0), r"growth_interval must be >= 1, got 0"),
    (dict(growth_interval=2.5), r"growth_interval must be a whole number, got 2.5"),
    (dict(growth_factor=1.0), r"growth_factor must be > 1, got 1.0"),
    (dict(backoff_factor=1.0), r"backoff_factor must be in \(0, 1\), got 1.0"),
    (dict(backoff_factor=0.0), r"backoff_factor must be in \(0, 1\), got 0.0"),
    (dict(min_scale=0.0), r"min_scale must be > 0, got 0.0"),
    (dict(max_scale=1e39), r"max_scale must fit in float32 \(<= 3.403e\+38\), got 1e\+39"),
    (dict(min_scale=8.0, max_scale=4.0, initial_scale=4.0),
     r"min_scale \(8.0\) must not exceed max_scale \(4.0\)"),
    (dict(hysteresis=0), r"hysteresis must be >= 1, got 0"),
    (dict(hysteresis=True), r"hysteresis must be a number, got True"),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_invalid_scaler_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.init_scaler(**settings)


def test_scaler_settings_that_are_traced():
    with pytest.raises(ValueError, match="initial_scale must be a concrete Python number, "
                                         "not a traced value"):
        jax.jit(lambda s: jaxmp.init_scaler(initial_scale=s))(jnp.asarray(2.0))


@pytest.mark.parametrize("scale, message", [
    (0.0, r"scale must be positive and fit in float32, got 0.0"),
    (-1.0, r"scale must be positive and fit in float32, got -1.0"),
    (float("inf"), r"scale must be finite, got inf"),
], ids=["zero", "negative", "inf"])
def test_invalid_static_scale(scale, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.static_scaler(scale)


# --- the finite flag -------------------------------------------------------

FINITE_MESSAGE = (r"finite must be a scalar boolean \(as returned by jaxmp.all_finite or "
                  r"jaxmp.mp_value_and_grad\), got ")
BAD_FLAGS = [
    (jnp.array([True, False]), r"an array of shape \(2,\) and dtype bool"),
    (jnp.asarray(1.0), r"an array of shape \(\) and dtype float32"),
    (jnp.asarray(1), r"an array of shape \(\) and dtype int32"),
    (None, r"NoneType"),
]
FLAG_IDS = ["vector", "float", "int", "None"]


@pytest.mark.parametrize("flag, message", BAD_FLAGS, ids=FLAG_IDS)
def test_finite_flag_that_is_not_a_scalar_boolean_to_adjust(flag, message):
    with pytest.raises(ValueError, match=FINITE_MESSAGE + message):
        jaxmp.adjust(SCALER, flag)


@pytest.mark.parametrize("flag, message", BAD_FLAGS, ids=FLAG_IDS)
def test_finite_flag_that_is_not_a_scalar_boolean_to_optimizer_update(flag, message):
    opt = optax.sgd(0.1)
    params = {"w": W}
    with pytest.raises(ValueError, match=FINITE_MESSAGE + message):
        jaxmp.optimizer_update(params, opt, opt.init(params), params, flag)


def test_finite_flag_that_is_not_a_scalar_boolean_under_jit():
    opt = optax.sgd(0.1)
    params = {"w": W}
    update = jax.jit(lambda f: jaxmp.optimizer_update(params, opt, opt.init(params), params, f))
    with pytest.raises(ValueError, match=FINITE_MESSAGE + r"an array of shape \(4,\)"):
        update(jnp.ones((4,), bool))


# --- accumulation ---------------------------------------------------------

def test_accumulation_batch_not_divisible():
    step = jaxmp.accumulate_value_and_grad(loss_fn, 3, compute_dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"leading batch axis divisible by num_microbatches=3; "
                                         r"argument 1 has shape \(4, 3\)"):
        step(W, X, scaler_state=SCALER)


# --- arguments in the wrong place (issue 34) ---------------------------------------

_PARAMS = {"w": jnp.ones(2)}
_OPT = optax.adam(1e-3)
_FN = lambda w: jnp.sum(w)  # noqa: E731
_TRUE = jnp.asarray(True)

MISPLACED = {
    # optimizer and opt_state swapped: was AttributeError: 'tuple' object has no attribute 'update'
    "optimizer_update, optimizer and opt_state swapped": (
        lambda: jaxmp.optimizer_update(_PARAMS, _OPT.init(_PARAMS), _OPT, _PARAMS, _TRUE),
        TypeError, r"second argument must be the optax optimizer .*got a tuple.*optimizer and "
                   r"opt_state are swapped.*optimizer_update\(params, optimizer, opt_state"),
    # opt_state and grads swapped (issue 40): was optax's AttributeError: 'dict' object has
    # no attribute 'mu' (adam), 'hyperparams' (inject_hyperparams), 'trace' (momentum)
    **{f"optimizer_update, opt_state and grads swapped ({name})": (
        lambda opt=opt: jaxmp.optimizer_update(_PARAMS, opt, _PARAMS, opt.init(_PARAMS), _TRUE),
        TypeError, r"opt_state and grads are swapped.*optimizer_update\(params, optimizer, "
                   r"opt_state, grads, finite\)")
       for name, opt in [("adam", _OPT), ("sgd momentum", optax.sgd(0.1, momentum=0.9)),
                         ("inject_hyperparams", optax.inject_hyperparams(optax.adam)(1e-3))]},
    "optimizer_update, optimizer first": (
        lambda: jaxmp.optimizer_update(_OPT, _PARAMS, _OPT.init(_PARAMS), _PARAMS, _TRUE),
        TypeError, r"the parameters come first"),
    "optimizer_update, grads of other parameters": (
        lambda: jaxmp.optimizer_update(_PARAMS, _OPT, _OPT.init(_PARAMS), {"v": jnp.ones(2)},
                                       _TRUE),
        ValueError, r"grads do not have the structure of params"),
    "select_tree, the flag last": (
        lambda: jaxmp.select_tree(_PARAMS, _PARAMS, _TRUE),
        ValueError, r"select_tree\(pred, on_true, on_false\): pred must be a scalar boolean"),
    "cast_tree, the dtype first": (
        lambda: jaxmp.cast_tree(jnp.float16, _PARAMS),
        ValueError, r"dtype must be a floating-point dtype .*wrong order"),
    "cast_function, the dtype first": (
        lambda: jaxmp.cast_function(jnp.float16, _FN), ValueError, r"wrong order"),
    "cast_function, not a function": (
        lambda: jaxmp.cast_function(_PARAMS, jnp.float16),
        TypeError, r"jaxmp.cast_function takes a function first"),
    "force_full_precision, not a function": (
        lambda: jaxmp.force_full_precision(_PARAMS), TypeError, r"takes a function first"),
    "autocast, the dtype first": (
        lambda: jaxmp.autocast(jnp.bfloat16, _FN), ValueError,
        r"compute_dtype must be a floating-point dtype .*wrong order"),
    "autocast, not a function": (
        lambda: jaxmp.autocast(_PARAMS), TypeError, r"jaxmp.autocast takes a function first"),
    "find_nonfinite, the dtype first": (
        lambda: jaxmp.debug.find_nonfinite(jnp.float16, _FN), ValueError, r"wrong order"),
    "matmul_flops, the arguments first": (
        lambda: jaxmp.debug.matmul_flops(_PARAMS, _FN), TypeError, r"takes a function first"),
    "precision_report, the arguments first": (
        lambda: jaxmp.debug.precision_report(_PARAMS, _FN), TypeError, r"takes a function first"),
    "saved_activation_bytes, the arguments first": (
        lambda: jaxmp.debug.saved_activation_bytes(_PARAMS, _FN), TypeError,
        r"takes a function first"),
    "scaler_for, given a scaler": (
        lambda: jaxmp.scaler_for(jaxmp.init_scaler()), ValueError, r"got a ScalerState"),
    "adjust, the flag first": (
        lambda: jaxmp.adjust(True, jaxmp.init_scaler()), TypeError,
        r"must be a jaxmp.ScalerState .*got bool"),
    "low_precision_optimizer, the dtype first": (
        lambda: jaxmp.experimental.low_precision_optimizer(jnp.bfloat16, _OPT), TypeError,
        r"wraps an optax transformation"),
}


@pytest.mark.parametrize("case", sorted(MISPLACED))
def test_arguments_in_the_wrong_place_are_named(case):
    call, error, message = MISPLACED[case]
    with pytest.raises(error, match=message):
        call()
