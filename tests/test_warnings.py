"""Trace-time warnings: said once per place in the user's code, and the float8 shortfall."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jaxmp

F8 = jnp.float8_e4m3fn
W_OUT = jnp.ones((8, 16))


def _make_float32_loss():
    """A new closure at each call, of the same code: as a loss built inside a step."""

    def loss_fn(w, x):
        h = (x @ w).astype(jnp.float32)  # a layer that fixes its own dtype
        return jnp.mean(h @ W_OUT)  # captured float32 weight: the first float32 product

    return loss_fn


def _step(w, x, state):
    grad_fn = jaxmp.mp_value_and_grad(_make_float32_loss(), autocast=False,
                                      compute_dtype=jnp.float16)
    return grad_fn(w, x, scaler_state=state)


def _said(caught, category):
    return [c for c in caught if c.category is category]


def test_mostly_float32_is_said_once_across_retraces_new_closures_and_flop_tools():
    w, state = jnp.ones((8, 8)), jaxmp.init_scaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(_step)(w, jnp.ones((2, 8)), state)
        # Traced again (nothing is run): at a new shape, by a new jit; each a new closure.
        jax.eval_shape(jax.jit(_step), w, jnp.ones((4, 8)), state)
        jax.eval_shape(jax.jit(lambda *a: _step(*a)), w, jnp.ones((4, 8)), state)
        jaxmp.debug.half_matmul_flop_share(_step, w, jnp.ones((2, 8)), state)
        jaxmp.debug.matmul_flops(_step, w, jnp.ones((3, 8)), state)
    said = _said(caught, jaxmp.debug.MostlyFloat32Warning)
    assert len(said) == 1
    assert "test_warnings.py:" in str(said[0].message)


def test_a_new_warnings_context_says_it_again():
    w, x, state = jnp.ones((8, 8)), jnp.ones((2, 8)), jaxmp.init_scaler()
    for _ in range(2):  # as two tests counting what the step says
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.eval_shape(lambda *a: _step(*a), w, x, state)  # a new function: traced again
            jax.eval_shape(lambda *a: _step(*a), w, x[:1], state)
        assert len(_said(caught, jaxmp.debug.MostlyFloat32Warning)) == 1


def test_a_block_that_only_changes_filters_does_not_say_it_again():
    # As equinox.filter_jit (with donation) wraps each call: a new list of filters.
    w, x, state = jnp.ones((8, 8)), jnp.ones((2, 8)), jaxmp.init_scaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(lambda *a: _step(*a), w, x, state)
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Some donated buffers")
                jax.eval_shape(lambda *a: _step(*a), w, x, state)
    assert len(_said(caught, jaxmp.debug.MostlyFloat32Warning)) == 1


def test_a_warning_turned_into_an_error_is_raised_every_time():
    w, x, state = jnp.ones((8, 8)), jnp.ones((2, 8)), jaxmp.init_scaler()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.debug.MostlyFloat32Warning)
        for _ in range(2):
            with pytest.raises(jaxmp.debug.MostlyFloat32Warning):
                jax.eval_shape(lambda *a: _step(*a), w, x, state)  # traced each time


def test_two_losses_with_different_first_products_each_say_it():
    def other_loss(w, x):
        h = (x @ w).astype(jnp.float32)
        return jnp.mean(jnp.tanh(h) @ W_OUT)  # another line: another warning

    w, x, state = jnp.ones((8, 8)), jnp.ones((2, 8)), jaxmp.init_scaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for loss_fn in (_make_float32_loss(), other_loss, other_loss):
            grad_fn = jaxmp.mp_value_and_grad(loss_fn, autocast=False, compute_dtype=jnp.float16)
            jax.eval_shape(lambda *a: grad_fn(*a, scaler_state=state), w, x)
    said = _said(caught, jaxmp.debug.MostlyFloat32Warning)
    assert len(said) == 2
    assert str(said[0].message) != str(said[1].message)


# --- float8 ------------------------------------------------------------------------------


@jax.custom_vjp
def _project(x, w):
    return x @ w


_project.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))


def _make_custom_rule_loss():
    def loss_fn(w, x):
        h = jnp.tanh(x @ w)  # float8, forward and backward
        return jnp.mean(_project(h, w) ** 2)  # backward as the custom rule writes it

    return loss_fn


def _float8_step(w, x, state):
    grad_fn = jaxmp.mp_value_and_grad(_make_custom_rule_loss(), compute_dtype=jnp.bfloat16,
                                      matmul_dtype=F8)
    return grad_fn(w, x, scaler_state=state)


def test_float8_shortfall_is_said_once_with_share_place_and_reason():
    w, state = jnp.ones((16, 16)), jaxmp.noop_scaler()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(_float8_step, w, jnp.ones((4, 16)), state)
        jax.eval_shape(_float8_step, w, jnp.ones((8, 16)), state)  # retraced, new closure
        share = jaxmp.debug.float8_matmul_flop_share(_float8_step, w, jnp.ones((4, 16)), state)
    said = _said(caught, jaxmp.experimental.Float8ShortfallWarning)
    assert len(said) == 1
    message = str(said[0].message)
    # Two products of equal size. The first, x @ w, has one backward product: x is not
    # differentiated, so its gradient is never computed (issue 34: counting it made the
    # figure disagree with the FLOP tools). Forward and weight gradient in float8 (2 parts);
    # the second's forward (1 part) in float8 and its two backward products not: 3 of 5.
    assert "runs 60% of the matrix-product FLOPs" in message
    assert "test_warnings.py:" in message and "(_project)" in message
    assert "jax.custom_vjp" in message and "float32 x float32" in message
    assert share == pytest.approx(0.6)  # the lowered step agrees


def test_no_float8_shortfall_warning_for_products_the_users_rules_keep():
    keep_project = jaxmp.experimental.Float8Rules(keep_scopes={"projection"})

    def loss_fn(w, x):
        h = jnp.tanh(x @ w)
        with jax.named_scope("projection"):
            return jnp.mean(_project(h, w) ** 2)

    w, x = jnp.ones((16, 16)), jnp.ones((4, 16))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        for rules in (keep_project,
                      jaxmp.experimental.Float8Rules(primitives={"conv_general_dilated"}),
                      jaxmp.experimental.Float8Rules(
                          keep_if=lambda p: p.scope.endswith("projection"))):
            f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=F8, float8_rules=rules)
            jax.eval_shape(jax.grad(f8), w, x)
    # And without the rule, it is said.
    with pytest.warns(jaxmp.experimental.Float8ShortfallWarning):
        jax.eval_shape(jax.grad(jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=F8)), w, x)


def test_no_float8_shortfall_warning_when_everything_runs_in_float8():
    def loss_fn(params, x):
        return jnp.mean(jnp.tanh(x @ params["k"]) @ params["w"])

    params = {"k": jnp.ones((8, 16)) * 0.1, "w": jnp.ones((16, 3)) * 0.1}
    f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=F8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        jax.eval_shape(jax.grad(f8), params, jnp.ones((2, 8)))


def test_float8_shortfall_says_a_convolution_runs_its_kernel_gradient_in_the_compute_dtype():
    """XLA runs only forward convolutions as cuDNN float8 graphs: a convolution's kernel
    gradient (and a strided one's input gradient) run in the compute dtype, said once at
    trace time with the share."""
    def loss_fn(params, img):
        y = lax.conv_general_dilated(img, params["k"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = lax.conv_general_dilated(y, params["k2"], (2, 2), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jnp.tanh(y))

    params = {"k": jnp.ones((3, 3, 2, 4)) * 0.1, "k2": jnp.ones((3, 3, 4, 4)) * 0.1}
    img = jnp.ones((2, 8, 8, 2))
    f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=F8,  # float8 convolutions, asked for
                        float8_rules=jaxmp.experimental.Float8Rules(include={"convolution"}))
    with pytest.warns(jaxmp.experimental.Float8ShortfallWarning) as record:
        jax.eval_shape(jax.grad(f8), params, img)
    assert len(record) == 1
    message = str(record[0].message)
    assert "forward convolutions only" in message and "kernel gradient" in message
    assert "bfloat16" in message
    # FLOPs of the forward products; the census counts a backward product (each as many) for
    # each operand the step differentiates: both kernels, the second's input (the first's is
    # the image, not differentiated). In float8: the forward products alone, since the second,
    # strided, runs its input gradient in bfloat16.
    first, second = 2 * (2 * 8 * 8 * 4) * (3 * 3 * 2), 2 * (2 * 4 * 4 * 4) * (3 * 3 * 4)
    share = (first + second) / (2 * first + 3 * second)
    assert f"runs {share:.0%} of the matrix-product FLOPs" in message
    # The program: no input gradient of the first (d/dimg is not asked for); the second's,
    # strided, in bfloat16. JAX writes it as a convolution of the zero-dilated cotangent, whose
    # zeros (three quarters of it) are not counted, as cuDNN's backward-data kernel does not
    # spend them: the program's share is the trace-time one (issue 41, part 6).
    assert jaxmp.debug.float8_matmul_flop_share(jax.grad(f8), params, img) == pytest.approx(share)


def test_float8_shortfall_names_an_integer_operand():
    def loss_fn(w, x):
        counts = x.astype(jnp.int8)  # the user's own integer operand
        y = lax.dot_general(counts, w, (((1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
        return jnp.mean(y ** 2)

    f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, matmul_dtype=F8)
    with pytest.warns(jaxmp.experimental.Float8ShortfallWarning, match="runs 0% of") as record:
        jax.eval_shape(jax.grad(f8), jnp.ones((8, 4)), jnp.ones((2, 8)))
    message = str(record[0].message)
    assert "int8 x float32" in message and "two floating-point operands" in message


def test_float8_shortfall_names_a_product_the_autocast_rules_leave_out():
    def loss_fn(w, x):
        return jnp.mean(jnp.tanh(x @ w) @ w)

    rules = jaxmp.AutocastRules(low_precision={"conv_general_dilated"})
    f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, rules=rules, matmul_dtype=F8)
    with pytest.warns(jaxmp.experimental.Float8ShortfallWarning, match="low_precision"):
        jax.eval_shape(jax.grad(f8), jnp.ones((8, 8)), jnp.ones((2, 8)))
    # Unless the user's Float8Rules keep it too: then it is the user's choice.
    keep = jaxmp.experimental.Float8Rules(primitives={"conv_general_dilated"})
    f8 = jaxmp.autocast(loss_fn, jnp.bfloat16, rules=rules, matmul_dtype=F8, float8_rules=keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.experimental.Float8ShortfallWarning)
        jax.eval_shape(jax.grad(f8), jnp.ones((8, 8)), jnp.ones((2, 8)))


def test_shares_read_100_or_0_percent_only_when_exact():
    from jaxmp._src import messages

    assert [messages.percent(s) for s in (0.0, 0.001, 0.5, 0.999, 1.0)] == [
        "0%", "<1%", "50%", ">99%", "100%"]
