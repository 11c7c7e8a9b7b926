"""Tests of jaxmp._src.nonfinite: find_nonfinite names the operation, the pass and the line."""

import importlib.util
import inspect
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
import jaxmp._src.nonfinite

HERE = "test_nonfinite.py"


def _line_of(fn, text):
    """``test_nonfinite.py:N`` for the line of ``fn``'s source that contains ``text``."""
    lines, start = inspect.getsourcelines(fn)
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    return f"{HERE}:{start + offset}"


def _overflows(report):
    return [f for f in report.findings if f.kind == "overflow"]


# The two cases of the issue: a forward exp, a layer norm's backward pass. ---------

def exp_loss(w, x):
    logits = x @ w
    return jnp.mean(jnp.exp(logits))


def test_forward_exp_overflow_names_exp_and_the_line():
    w, x = jnp.full((4,), 3.0), jnp.ones((2, 4))  # exp(12) = 162755 > 65504
    report = jaxmp.debug.find_nonfinite(exp_loss, autocast=False, compute_dtype=jnp.float16)(w, x)
    assert bool(report)
    first = _overflows(report)[0]
    assert (first.phase, first.primitive) == ("forward", "exp")
    assert first.where.startswith(_line_of(exp_loss, "jnp.exp"))
    np.testing.assert_allclose(first.float32_max, np.exp(12.0), rtol=1e-3)  # the float32 reference
    assert first.half_max == np.inf and first.count == 2 and first.size == 2
    assert "float32" in first.hint and "autocast=True" in first.hint
    text = str(report)
    assert "forward" in text and "exp" in text and first.where in text


def layer_norm(x, eps=1e-5):
    # As Haiku's LayerNorm: statistics and normalisation in the input's dtype.
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.var(x, axis=-1, keepdims=True)
    inv = jax.lax.rsqrt(variance + eps)
    return inv * (x - mean)


def ln_loss(params, tokens):
    h = params["embed"][tokens]  # small embeddings (stddev 0.02): variance ~4e-4
    h = layer_norm(h) @ params["w"]
    return jnp.mean(h ** 2)


def _ln_params(stddev=0.02):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"embed": stddev * jax.random.normal(k1, (32, 16)),
            "w": jax.random.normal(k2, (16, 8)) / 4.0}


def test_layer_norm_case_names_the_backward_pass_and_the_rsqrt_line():
    tokens = jnp.arange(12) % 32
    params = _ln_params()
    # The forward pass is fine: the loss agrees with float32.
    report = jaxmp.debug.find_nonfinite(ln_loss, autocast=False,
                                        compute_dtype=jnp.float16)(params, tokens)
    assert bool(report)
    assert not report.forward
    first = _overflows(report)[0]
    assert first.phase == "backward"
    assert first.where.startswith(_line_of(layer_norm, "rsqrt"))
    assert first.primitive == "div" and not first.scale_dependent  # rsqrt(v) / v
    assert "no scale fixes it" in first.hint and "autocast=True" in first.hint
    np.testing.assert_allclose(report.loss, report.loss_float32, rtol=1e-2)
    # Not a matter of the scale: the same at scale 1.
    at_one = jaxmp.debug.find_nonfinite(ln_loss, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            params, tokens, scaler_state=jaxmp.static_scaler(1.0))
    assert _overflows(at_one)[0].where == first.where
    # The fix the hint names removes it.
    assert not jaxmp.debug.find_nonfinite(ln_loss, autocast=True,
                                          compute_dtype=jnp.float16)(params, tokens)


def test_report_agrees_with_a_stuck_training_step():
    # What find_nonfinite explains is what mp_value_and_grad sees: non-finite gradients.
    tokens = jnp.arange(12) % 32
    _, grads, _, finite = jaxmp.mp_value_and_grad(ln_loss, autocast=False,
                                                  compute_dtype=jnp.float16)(
        _ln_params(), tokens, scaler_state=jaxmp.static_scaler(1.0))
    assert not bool(finite)
    _, grads, _, finite = jaxmp.mp_value_and_grad(ln_loss, autocast=False,
                                                  compute_dtype=jnp.float16)(
        _ln_params(stddev=1.0), tokens, scaler_state=jaxmp.static_scaler(1.0))
    assert bool(finite)
    assert not jaxmp.debug.find_nonfinite(ln_loss, autocast=False,
                                          compute_dtype=jnp.float16)(_ln_params(stddev=1.0), tokens,
                                                   scaler_state=jaxmp.static_scaler(1.0))


def test_clean_function_gives_an_empty_report():
    def loss_fn(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 3))
    x = jax.random.normal(jax.random.key(1), (5, 4))
    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            w, x, scaler_state=jaxmp.init_scaler(2.0**8))
    assert not report and len(report) == 0 and report.findings == ()
    assert "No operation" in str(report)
    np.testing.assert_allclose(report.loss, float(loss_fn(w, x)), rtol=1e-2)


def test_scaled_backward_overflow_is_blamed_on_the_scale():
    def loss_fn(w):
        return jnp.sum(w * w)  # gradient 2 * 32768 = 65536 > 65504

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(jnp.ones(3))
    first = _overflows(report)[0]
    assert first.phase == "backward" and first.scale_dependent
    assert "smaller loss scale" in first.hint
    assert not jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                          compute_dtype=jnp.float16)(
        jnp.ones(3), scaler_state=jaxmp.static_scaler(2.0**14))


def test_forward_underflow_is_reported_as_such():
    def loss_fn(w, x):
        tiny = (x * 1e-4) * w  # 1e-8 is below float16's smallest subnormal (6e-8)
        return jnp.sum(tiny.astype(jnp.float32)) * 1e4

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(
        jnp.full((3,), 1e-4), jnp.ones(3), scaler_state=jaxmp.static_scaler(1.0))
    assert not report  # no inf or NaN
    (under,) = [f for f in report.findings if f.kind == "underflow" and f.phase == "forward"]
    assert under.primitive == "mul" and under.where.startswith(_line_of(loss_fn, "tiny ="))
    assert under.count == 3 and 0 < under.float32_min < 6e-8 and under.half_max == 0.0
    assert "underflow" in str(report)


def test_backward_underflow_at_a_small_scale():
    def loss_fn(w):
        return 1e-5 * jnp.sum(w) * 1e-3  # gradient 1e-8 per element

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            jnp.ones(4), scaler_state=jaxmp.static_scaler(1.0))
    (under,) = [f for f in report.findings if f.kind == "underflow"]
    assert under.phase == "backward" and under.count == 1 and under.float32_max == pytest.approx(1e-8, rel=1e-2)
    assert "larger loss scale" in report.backward[0].hint
    assert not jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                          compute_dtype=jnp.float16)(
                                              jnp.ones(4)).findings  # 2**15 rescues it


# Through the higher-order primitives. -------------------------------------------------

def _exp_at(x):
    return jnp.exp(x)


@jax.custom_jvp
def _custom_jvp_exp(x):
    return jnp.exp(x)


_custom_jvp_exp.defjvp(lambda p, t: (_custom_jvp_exp(p[0]), _custom_jvp_exp(p[0]) * t[0]))


@jax.custom_vjp
def _loud_identity(x):
    return x


def _loud_fwd(x):
    return x, None


def _loud_bwd(_, g):
    return (g * 4096.0,)  # the custom backward rule overflows: 32768 * 4096 / 4096 ...


_loud_identity.defvjp(_loud_fwd, _loud_bwd)


STRUCTURES = {
    "jit": lambda x: jax.jit(_exp_at)(x),
    "nested_jit": lambda x: jax.jit(lambda y: jax.jit(_exp_at)(y) + 1.0)(x),
    "scan": lambda x: jax.lax.scan(lambda c, _: (c + 4.0, _exp_at(c)), x, None, length=4)[1],
    "cond": lambda x: jax.lax.cond(jnp.sum(x) > 0, _exp_at, jnp.sin, x),
    "checkpoint": lambda x: jax.checkpoint(_exp_at)(x),
    "custom_jvp": lambda x: _custom_jvp_exp(x),
}


@pytest.mark.parametrize("name", sorted(STRUCTURES))
def test_found_inside_higher_order_primitives(name):
    structure = STRUCTURES[name]

    def loss_fn(w):
        return jnp.mean(structure(w))

    # exp(11) = 59874 fits; exp(12) does not. The scan reaches 12 at its 2nd iteration.
    w = jnp.full((3,), 8.0 if name == "scan" else 12.0)
    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            w, scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "exp"
    if name != "custom_jvp":
        assert first.where.startswith(_line_of(_exp_at, "jnp.exp"))
    else:
        assert first.where.startswith(HERE)


def test_found_inside_a_loop_too_long_to_run_one_iteration_at_a_time(monkeypatch):
    # Past the budget the scan is compiled whole and its findings come back by callback.
    from jaxmp._src import interpret
    monkeypatch.setattr(interpret, "EAGER_LOOP_BUDGET", 0)

    def loss_fn(w):
        return jnp.mean(STRUCTURES["scan"](w))

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False, compute_dtype=jnp.float16)(
        jnp.full((3,), 8.0), scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "exp"
    assert first.where.startswith(_line_of(_exp_at, "jnp.exp"))


def test_custom_vjp_backward_rule_overflow_is_backward():
    def loss_fn(w):
        return jnp.sum(_loud_identity(w * 2.0))

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(
                                            jnp.ones(3), scaler_state=jaxmp.static_scaler(32.0))
    first = _overflows(report)[0]
    # JAX records the backward rule's operations at the line that calls the function.
    assert first.phase == "backward" and first.primitive == "mul"
    assert first.where.startswith(_line_of(loss_fn, "_loud_identity"))
    assert not jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                          compute_dtype=jnp.float16)(
                                              jnp.ones(3), scaler_state=jaxmp.static_scaler(1.0))


# Options, inputs and what it must not do. -----------------------------------------------

def test_has_aux_argnums_and_kwargs():
    def loss_fn(scale_arg, w, *, offset):
        return jnp.mean(jnp.exp(w * scale_arg + offset)), {"aux": w}

    report = jaxmp.debug.find_nonfinite(loss_fn, argnums=1, has_aux=True, autocast=False,
                                        compute_dtype=jnp.float16)(
        jnp.asarray(4.0), jnp.ones(3), offset=jnp.asarray(8.0), scaler_state=jaxmp.static_scaler(1.0))
    assert _overflows(report)[0].primitive == "exp"


def test_bfloat16_overflows_only_where_float32_does():
    def loss_fn(w):
        return jnp.mean(jnp.exp(w))

    find = jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=jnp.bfloat16, autocast=False)
    report = find(jnp.full((2,), 12.0))
    assert not report and report.loss_scale == 1.0
    huge = find(jnp.full((2,), 100.0))
    assert not huge and [f.kind for f in huge.forward] == ["float32 too"]


def test_does_not_change_the_training_step():
    params, tokens = _ln_params(stddev=1.0), jnp.arange(12) % 32
    scaler = jaxmp.init_scaler(initial_scale=256.0)
    step = jax.jit(jaxmp.mp_value_and_grad(ln_loss, compute_dtype=jnp.float16))
    before = step(params, tokens, scaler_state=scaler)
    jaxmp.debug.find_nonfinite(ln_loss, autocast=False,
                               compute_dtype=jnp.float16)(params, tokens, scaler_state=scaler)
    after = step(params, tokens, scaler_state=scaler)
    for a, b in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert float(scaler.scale) == 256.0 and int(scaler.skipped_steps) == 0


def test_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        jaxmp.debug.find_nonfinite(exp_loss, compute_dtype=jnp.float32, autocast=False)
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        jaxmp.debug.find_nonfinite(exp_loss, compute_dtype=jnp.int32, autocast=False)
    with pytest.raises(TypeError, match="argnums"):
        jaxmp.debug.find_nonfinite(exp_loss, argnums="w", autocast=False, compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="refers to argument 3"):
        jaxmp.debug.find_nonfinite(exp_loss, argnums=3, autocast=False,
                                   compute_dtype=jnp.float16)(jnp.ones(4), jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="The loss must be a scalar"):
        jaxmp.debug.find_nonfinite(lambda w: w * 2.0, autocast=False,
                                   compute_dtype=jnp.float16)(jnp.ones(3))
    with pytest.raises(TypeError, match="pair"):
        jaxmp.debug.find_nonfinite(lambda w: jnp.sum(w), has_aux=True, autocast=False,
                                   compute_dtype=jnp.float16)(jnp.ones(3))
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):  # as the step's
        jaxmp.debug.find_nonfinite(exp_loss, reduce_dtype=jnp.int32, compute_dtype=jnp.float16)
    with pytest.raises(TypeError, match="positional"):  # the step's options are keywords
        jaxmp.debug.find_nonfinite(exp_loss, jnp.float16, 0, False, True, (), "batch")
    with pytest.raises(TypeError, match="jaxmp.ScalerState"):
        jaxmp.debug.find_nonfinite(exp_loss, autocast=False,
                                   compute_dtype=jnp.float16)(
                                       jnp.ones(4), jnp.ones((2, 4)), scaler_state=1.0)


def test_under_autocast_the_line_is_still_the_users():
    def loss_fn(w, x):
        h = x @ w  # a float16 matrix product under autocast: 128000 > 65504
        return jnp.mean(h)

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=True, compute_dtype=jnp.float16)(
        jnp.full((64, 4), 100.0), jnp.full((2, 64), 20.0), scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert (first.phase, first.primitive) == ("forward", "dot_general")
    assert first.where.startswith(_line_of(loss_fn, "x @ w"))
    assert "autocast=True" not in first.hint  # already on


def test_equinox_module_with_static_leaves():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(4, 2, 8, 1, activation=jnp.exp, key=jax.random.key(0))  # functions as leaves
    model = eqx.tree_at(lambda m: m.layers[0].bias, model, jnp.full((8,), 12.0))  # exp(12) > 65504

    def loss_fn(model, x):
        return jnp.mean(jax.vmap(model)(x))

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False,
                                        compute_dtype=jnp.float16)(model, jnp.zeros((3, 4)),
                                                 scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert (first.phase, first.primitive) == ("forward", "exp")


def test_user_code_in_a_folder_named_jaxmp_is_not_taken_for_library_code(tmp_path):
    # A user's project (or a CI clone) may well live in a folder called "jaxmp":
    # the overflow is inside Equinox's Linear, called from the user's line.
    eqx = pytest.importorskip("equinox")
    folder = tmp_path / "jaxmp" / "project"
    folder.mkdir(parents=True)
    (folder / "user_model.py").write_text(
        "import jax.numpy as jnp\n\n"
        "def loss_fn(model, x):\n"
        "    return jnp.mean(model(x))\n")
    spec = importlib.util.spec_from_file_location("user_model", folder / "user_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = eqx.nn.Linear(4, 2, key=jax.random.key(0))
    model = eqx.tree_at(lambda m: m.weight, model, jnp.full((2, 4), 300.0))
    finding = jaxmp.debug.find_nonfinite(module.loss_fn, autocast=False,
                                         compute_dtype=jnp.float16)(
                                             model, jnp.full((4,), 300.0)).findings[0]
    assert finding.primitive == "dot_general" and finding.called_from.startswith("user_model.py:4")


# Naming the user's code, never jaxmp's: argument paths and autocast's conversions. -----

_JAXMP_FILES = sorted(name for name in os.listdir(os.path.dirname(jaxmp._src.nonfinite.__file__))
                      if name.endswith(".py") and name != "__init__.py")


def _assert_no_jaxmp_file(report):
    text = str(report)
    for finding in report.findings:
        text += finding.where + finding.called_from + finding.hint
    named = [name for name in _JAXMP_FILES if re.search(rf"(?<![\w.]){re.escape(name)}:\d", text)]
    assert not named, f"jaxmp's own files named: {named}\n{text}"


def dense_loss(params, x):
    h = x @ params["dense"]["kernel"]
    return jnp.mean(h * 1e4)


@pytest.mark.parametrize("autocast", [False, True])
def test_a_parameter_flushed_to_zero_by_the_cast_is_named_by_its_path(autocast):
    params = {"dense": {"kernel": jnp.full((4, 2), 1e-9)}}  # below float16's 6e-8
    report = jaxmp.debug.find_nonfinite(dense_loss, autocast=autocast, compute_dtype=jnp.float16)(
        params, jnp.ones((3, 4)), scaler_state=jaxmp.static_scaler(1.0))
    (under,) = [f for f in report.forward if f.kind == "underflow"]
    assert under.where == "params['dense']['kernel']" and under.called_from == ""
    assert under.primitive == "convert_element_type" and under.count == under.size == 8
    np.testing.assert_allclose(under.float32_min, 1e-9, rtol=1e-6)  # the float32 parameter
    assert under.half_max == 0.0
    assert "params['dense']['kernel']" in under.hint and "become zero" in under.hint
    assert "params['dense']['kernel']" in str(report)
    _assert_no_jaxmp_file(report)
    # The float32 reference: the loss the float32 shadow reports is float32's.
    np.testing.assert_allclose(report.loss_float32, float(dense_loss(params, jnp.ones((3, 4)))),
                               rtol=1e-3)
    assert report.loss == 0.0


def test_a_batch_that_overflows_the_input_cast_is_named_by_its_path():
    def loss_fn(w, batch, *, shift):
        return jnp.mean((batch["x"] - shift) @ w)

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False, compute_dtype=jnp.float16)(
        jnp.ones((3, 2)), {"x": jnp.full((2, 3), 1e5)}, shift=jnp.full((3,), 7e4),
        scaler_state=jaxmp.static_scaler(1.0))
    wheres = [f.where for f in _overflows(report)]
    assert wheres[:2] == ["batch['x']", "shift"]  # both beyond 65504 when cast
    assert all(f.primitive == "convert_element_type" for f in _overflows(report)[:2])
    np.testing.assert_allclose(_overflows(report)[0].float32_max, 1e5)
    _assert_no_jaxmp_file(report)


def test_a_float32_value_narrowed_by_autocast_is_named_at_the_users_product():
    def loss_fn(w, x):
        s = jnp.sum(x, axis=0, keepdims=True) * 1000.0  # float32 under autocast: 1e5
        h = s @ w  # narrowed to float16 for the product: inf
        return jnp.mean(h)

    x = jnp.ones((100, 4))
    report = jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=jnp.float16)(jnp.ones((4, 2)), x,
                                           scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "convert_element_type"
    assert first.where.startswith(_line_of(loss_fn, "s @ w"))
    assert _line_of(loss_fn, "* 1000.0") in first.hint and "dot_general" in first.hint
    np.testing.assert_allclose(first.float32_max, float(jnp.sum(x[:, 0])) * 1000.0)  # float32
    _assert_no_jaxmp_file(report)


def test_the_table_says_what_its_columns_are():
    report = jaxmp.debug.find_nonfinite(exp_loss, autocast=False,
                                        compute_dtype=jnp.float16)(
        jnp.full((4,), 3.0), jnp.ones((2, 4)))
    text = str(report)
    header = next(line for line in text.splitlines() if line.startswith("pass"))
    for column in ("wrong/size", "float16 max|x|", "float32 max|x|", "float32 min|x|", "where"):
        assert column in header
    legend = " ".join(text.split())
    assert "as computed in float16" in legend and "float32 shadow" in legend
    assert "float16 holds 5.96e-08 to 65504" in legend
    assert "Backward values include the loss scale" in legend
    bf16 = jaxmp.debug.find_nonfinite(exp_loss, compute_dtype=jnp.bfloat16, autocast=False)(
        jnp.full((4,), 30.0), jnp.ones((2, 4)))
    assert "bfloat16 max|x|" in str(bf16)


# Steps whose model uses collectives: axis_name= and mapped= (vmap, pmap, shard_map). --

def _batchnorm_model():
    nn = pytest.importorskip("flax.linen")

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)  # the line the overflow is reported at (inside flax's Dense)
            return nn.BatchNorm(use_running_average=False, axis_name="batch")(h)

    model = Model()
    x = jnp.arange(6.0).reshape(2, 3) * 100.0  # two examples; the second's x @ kernel is 72000
    variables = jax.vmap(model.init, in_axes=(None, 0), out_axes=None, axis_name="batch")(
        jax.random.key(0), x)
    params = jax.tree_util.tree_map(lambda p: p * 0 + 60.0, variables["params"])

    def loss_fn(params, x):
        out, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]}, x,
                             mutable=["batch_stats"])
        return jnp.mean(out ** 2)

    return Model, loss_fn, params, x


def _check_batchnorm_report(report, Model, loss_fn, params, x):
    first = _overflows(report)[0]
    assert (first.phase, first.primitive, first.dtype) == ("forward", "dot_general", "float16")
    assert first.where.startswith("linear.py:")  # flax's Dense, called from the model's line
    assert first.called_from.startswith(_line_of(Model.__call__, "nn.Dense(4)"))
    # The batch statistics' psum receives that inf: it is not reported as made there.
    assert not [f for f in report.findings if f.primitive.startswith("psum")]
    # The float32 reference: the mean over the batch axis of the per-example float32 loss.
    reference = jax.vmap(loss_fn, in_axes=(None, 0), axis_name="batch")(params, x)
    np.testing.assert_allclose(report.loss_float32, float(jnp.mean(reference)), rtol=1e-5)
    assert not np.isfinite(report.loss)
    _assert_no_jaxmp_file(report)


def test_a_batchnorm_model_under_vmap():
    Model, loss_fn, params, x = _batchnorm_model()
    find = jaxmp.debug.find_nonfinite(
        loss_fn, axis_name="batch",
        mapped=lambda f: jax.vmap(f, in_axes=(None, 0), axis_name="batch"),
            compute_dtype=jnp.float16)
    _check_batchnorm_report(find(params, x, scaler_state=jaxmp.static_scaler(1.0)),
                            Model, loss_fn, params, x)


def test_a_batchnorm_model_under_shard_map():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    Model, loss_fn, params, x = _batchnorm_model()
    mesh = jax.make_mesh((2,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    find = jaxmp.debug.find_nonfinite(
        loss_fn, axis_name="batch",
        mapped=lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()),
            compute_dtype=jnp.float16)
    # Each device holds one example, as each member of the vmap above.
    _check_batchnorm_report(find(params, x, scaler_state=jaxmp.static_scaler(1.0)),
                            Model, lambda p, xi: loss_fn(p, xi[None]), params, x)


def test_a_batchnorm_model_under_pmap():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    Model, loss_fn, params, x = _batchnorm_model()
    find = jaxmp.debug.find_nonfinite(loss_fn, axis_name="batch", mapped=lambda f: jax.pmap(
        f, axis_name="batch", in_axes=(None, 0), devices=jax.devices()[:2]),
            compute_dtype=jnp.float16)
    # One example per device, with the leading device axis pmap takes.
    _check_batchnorm_report(find(params, x[:, None], scaler_state=jaxmp.static_scaler(1.0)),
                            Model, lambda p, xi: loss_fn(p, xi[None]), params, x)


def test_a_batchnorm_model_on_a_batch_captured_in_a_closure():
    Model, loss_fn, params, x = _batchnorm_model()
    # No mapped=: the whole batch is one member of the axis, so BatchNorm's
    # statistics are those of the whole batch, as across the members above.
    find = jaxmp.debug.find_nonfinite(lambda p: loss_fn(p, x), axis_name="batch",
                                      compute_dtype=jnp.float16)
    _check_batchnorm_report(find(params, scaler_state=jaxmp.static_scaler(1.0)),
                            Model, loss_fn, params, x)


def test_collectives_need_axis_name_and_say_so():
    def loss_fn(w, x):
        h = x @ w
        return jnp.mean((h - jax.lax.pmean(h, "batch")) ** 2)

    w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    with pytest.raises(ValueError, match="not bound.*axis_name=.*mapped="):
        jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=jnp.float16)(w, x)
    with pytest.raises(TypeError, match="outside jit, vmap, pmap and shard_map.*mapped="):
        jax.vmap(jaxmp.debug.find_nonfinite(loss_fn,
                                            compute_dtype=jnp.float16),
                                      in_axes=(None, 0), axis_name="batch")(w, x)
    with pytest.raises(TypeError, match="mapped must be a function"):
        jaxmp.debug.find_nonfinite(loss_fn, axis_name="batch", mapped="vmap",
                                   compute_dtype=jnp.float16)
    if jax.device_count() >= 4:  # inside shard_map, the step's own advice: pass axis_name=
        mesh = jax.make_mesh((4,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
        find = jaxmp.debug.find_nonfinite(loss_fn, mapped=lambda f: jax.shard_map(
            f, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P()), compute_dtype=jnp.float16)
        with pytest.raises(ValueError, match="axis_name="):
            find(w, x)


# A causal mask: -inf in float16 by design, not an overflow (issue 33). --------------------

MASK_FILLS = {
    "-1e9": lambda scores: -1e9,
    "finfo.min": lambda scores: jnp.finfo(scores.dtype).min,
    "-inf": lambda scores: -jnp.inf,
}


def _attention_loss(params, x, fill=MASK_FILLS["-1e9"]):
    # One causal self-attention layer, written as users write it.
    q, k, v = x @ params["q"], x @ params["k"], x @ params["v"]
    scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, fill(scores)), axis=-1)
    out = (weights @ v) @ params["o"]
    return jnp.mean(out ** 2)


def _attention_params(o_scale=1.0, qk_scale=1.0):
    keys = jax.random.split(jax.random.key(3), 5)
    params = {n: jax.random.normal(key, (8, 8)) / 3 for n, key in zip("qkvo", keys)}
    params["o"] = params["o"] * o_scale
    params["q"], params["k"] = params["q"] * qk_scale, params["k"] * qk_scale
    return params, jax.random.normal(keys[4], (2, 5, 8))


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("fill", sorted(MASK_FILLS))
def test_a_causal_mask_is_not_an_overflow(fill, autocast):
    params, x = _attention_params()
    loss_fn = lambda p, x: _attention_loss(p, x, MASK_FILLS[fill])
    reference = float(jax.jit(loss_fn)(params, x))  # float32
    report = jaxmp.debug.find_nonfinite(loss_fn, jnp.float16, autocast=autocast)(params, x)
    np.testing.assert_allclose(report.loss, reference, rtol=1e-2)
    np.testing.assert_allclose(report.loss_float32, reference, rtol=1e-5)
    assert not report.findings, str(report)


def test_an_overflow_after_a_causal_mask_is_found_at_its_line_and_the_mask_is_not():
    params, x = _attention_params(o_scale=3e4)  # (weights @ v) @ o passes float16's 65504
    reference = float(jax.jit(_attention_loss)(params, x))
    assert np.isfinite(reference)
    report = jaxmp.debug.find_nonfinite(_attention_loss, jnp.float16)(params, x)
    np.testing.assert_allclose(report.loss_float32, reference, rtol=1e-5)
    assert not np.isfinite(report.loss)
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "dot_general"
    assert first.where.startswith(_line_of(_attention_loss, "params[\"o\"]"))
    assert first.float32_max > 65504
    mask = _line_of(_attention_loss, "jnp.where(causal")
    assert not [f for f in report.findings if f.where.startswith(mask)], str(report)


def test_an_overflow_before_a_causal_mask_is_found_at_its_line():
    params, x = _attention_params(qk_scale=300.0)  # q and k fit in float16, q @ k.T does not
    reference = float(jax.jit(_attention_loss)(params, x))
    assert np.isfinite(reference)
    report = jaxmp.debug.find_nonfinite(_attention_loss, jnp.float16)(params, x)
    assert not np.isfinite(report.loss)
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "dot_general"
    assert first.where.startswith(_line_of(_attention_loss, "scores = q @"))
    assert all(f.where.startswith(HERE) for f in report.findings), str(report)


def _normalised(w, x):
    h = x @ w
    centred = h - jnp.mean(h, -1, keepdims=True)
    variance = jnp.mean(jnp.square(centred), -1, keepdims=True)  # beyond float16's 65504
    weights = jnp.arange(16.0, dtype=h.dtype)
    return jnp.mean(jnp.tanh(centred / jnp.sqrt(variance + 1e-5)) * weights)


def test_an_overflow_made_finite_but_wrong_is_still_found():
    """A variance that overflows makes the normalised values 0: finite, but not float32's.
    Its overflow reaches the loss through them and is reported at its line."""
    w = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
    x = jnp.full((4, 8), 2000.0)  # centred values up to ~1900: squares beyond 65504
    report = jaxmp.debug.find_nonfinite(_normalised, compute_dtype=jnp.float16, autocast=False,
                                        argnums=(0, 1))(w, x)
    assert np.isfinite(report.loss) and np.isfinite(report.loss_float32)
    assert abs(report.loss - report.loss_float32) > 0.1 * abs(report.loss_float32), str(report)
    overflows = [f for f in report.findings if f.kind == "overflow"]
    assert overflows and overflows[0].phase == "forward", str(report)
    assert "_normalised" in overflows[0].where and "test_nonfinite.py" in overflows[0].where


def test_a_diagnosis_is_not_a_training_step_so_says_nothing_of_the_float32_share():
    # A loss whose products stay float32 when only the inputs are cast: the training step says
    # so (MostlyFloat32Warning), find_nonfinite runs the same step and does not.
    w_out = jnp.ones((8, 64))  # most of the FLOPs

    def loss(w, x):
        return jnp.mean((x @ w).astype(jnp.float32) @ w_out)

    w, x = jnp.ones((8, 8)), jnp.ones((2, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = jaxmp.debug.find_nonfinite(loss, autocast=False, compute_dtype=jnp.float16)(w, x)
    assert not report.findings  # nothing overflows
    assert not [c for c in caught if c.category is jaxmp.debug.MostlyFloat32Warning]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.float16, autocast=False)(
            w, x, scaler_state=jaxmp.init_scaler())
    assert [c for c in caught if c.category is jaxmp.debug.MostlyFloat32Warning]


def test_a_loop_constant_in_a_loop_compiled_whole(monkeypatch):
    # exp of a value the scan body closes over (not carried): its operands are concrete, its
    # results the compiled loop's tracers; found by callback like the carried case above.
    from jaxmp._src import interpret
    monkeypatch.setattr(interpret, "EAGER_LOOP_BUDGET", 0)

    def loss_fn(w):
        c, _ = jax.lax.scan(lambda c, _: (c + jnp.exp(w), None), jnp.zeros_like(w), None,
                            length=3)
        return jnp.mean(c)

    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False, compute_dtype=jnp.float16)(
        jnp.full((3,), 12.0), scaler_state=jaxmp.static_scaler(1.0))
    first = _overflows(report)[0]
    assert first.phase == "forward" and first.primitive == "exp"
    assert not jaxmp.debug.find_nonfinite(loss_fn, autocast=False, compute_dtype=jnp.float16)(
        jnp.full((3,), 1.0), scaler_state=jaxmp.static_scaler(1.0))
