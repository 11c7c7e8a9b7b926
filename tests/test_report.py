"""jaxmp.debug.precision_report: FLOPs per layer path and pass by dtype, and why a product is wider.

Tiny models, traced only (nothing compiled). The page docs/precision_report.md runs here, as
"precision_report.md", and its shown output is checked against what its code prints.
"""

import contextlib
import io
import pathlib
import re
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = "precision_report.md"
# The models are user code, written under JAX's default promotion (a float32 layer meets
# bfloat16 inputs), traced here under it.
pytestmark = [pytest.mark.filterwarnings("ignore::jaxmp.debug.MostlyFloat32Warning",
                                         "ignore::jaxmp.experimental.Float8ShortfallWarning"),
              pytest.mark.usefixtures("standard_promotion")]


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), name="stem")(x))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.relu(nn.Dense(8, name="hidden")(x))
        x = nn.Dense(8, dtype=jnp.float32, name="wide")(x)  # WIDE LINE
        with jax.named_scope("head"):
            return nn.Dense(3, name="out")(x)


_WIDE_LINE = next(i for i, line in enumerate(pathlib.Path(__file__).read_text().splitlines(), 1)
                  if line.endswith("# WIDE LINE"))
_MODEL = _Net()
_X = jnp.ones((2, 6, 6, 2))
_PARAMS = jax.eval_shape(_MODEL.init, jax.random.key(0), _X)  # shapes: nothing compiled


def _loss(params, x):
    return jnp.sum(_MODEL.apply(params, x) ** 2)


def _step(loss=_loss, **options):
    grad_fn = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, **options)
    return jax.jit(lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler()))


def _float8_loss():
    return jaxmp.autocast(_loss, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
                          float8_rules=jaxmp.experimental.Float8Rules(keep_scopes={"head"}))


@pytest.mark.parametrize("variant", ["default", "cast", "float8"])
def test_per_layer_flops_sum_to_matmul_flops(variant):
    step = {"default": lambda: _step(), "cast": lambda: _step(autocast=False),
            "float8": lambda: _step(_float8_loss())}[variant]()
    report = jaxmp.debug.precision_report(step, _PARAMS, _X, compute_dtype=jnp.bfloat16)
    assert report.totals == jaxmp.debug.matmul_flops(step, _PARAMS, _X)
    assert {row.layer for row in report.layers} == {
        "_Net/stem", "_Net/hidden", "_Net/wide", "_Net/head/out"}


def test_a_float32_layer_is_named_with_its_line_and_reason():
    report = jaxmp.debug.precision_report(_step(autocast=False), _PARAMS, _X,
                                          compute_dtype=jnp.bfloat16)
    rows = {(r.layer, r.phase): r.flops for r in report.layers}
    assert set(rows["_Net/wide", "forward"]) == {"float32"}
    assert set(rows["_Net/hidden", "forward"]) == {"bfloat16"}
    wide = [w for w in report.wider if w.layer == "_Net/wide"]
    assert {w.phase for w in wide} == {"forward", "backward"}
    for w in wide:
        assert (w.dtype, w.reason) == ("float32", "user")
        assert w.where == f"test_report.py:{_WIDE_LINE} (_Net.__call__)"
        assert "converted to float32 on that line" in w.says
    text = str(report)
    assert f"_Net/wide, forward and backward: 768 FLOPs in float32 at test_report.py:{_WIDE_LINE}" \
        in text
    # The layer after it is float32 because its input is: said with the line that made it.
    out = next(w for w in report.wider if w.layer == "_Net/head/out" and w.phase == "forward")
    assert f"earlier operation at test_report.py:{_WIDE_LINE}" in out.says
    # Under autocast (the default) the same layer runs in bfloat16.
    default = jaxmp.debug.precision_report(_step(), _PARAMS, _X, compute_dtype=jnp.bfloat16)
    assert default.wider == () and set(default.totals) == {"bfloat16"}


def test_a_batch_captured_by_a_closure_is_named_so():
    grad_fn = jaxmp.mp_value_and_grad(lambda p: _loss(p, _X), compute_dtype=jnp.bfloat16,
                                      autocast=False)
    report = jaxmp.debug.precision_report(grad_fn, _PARAMS, scaler_state=jaxmp.noop_scaler(),
                                          compute_dtype=jnp.bfloat16)
    stem = next(w for w in report.wider if w.layer == "_Net/stem" and w.phase == "forward")
    assert stem.reason == "user" and "captured by a closure" in stem.says


def test_products_outside_the_jaxmp_function_are_named_so():
    # Issue 34: the rollout's policy forward, beside the loss of mp_value_and_grad in a PPO
    # step, was blamed on a dtype=jnp.float32 layer with the fix "run the step under autocast".
    grad_fn = jaxmp.mp_value_and_grad(_loss, compute_dtype=jnp.bfloat16)

    def step(params, x):
        with jax.named_scope("rollout"):
            acted = _MODEL.apply(params, x)  # outside the loss: as written, float32
        _, grads, _, _ = grad_fn(params, x * jnp.sum(acted), scaler_state=jaxmp.noop_scaler())
        return grads

    report = jaxmp.debug.precision_report(step, _PARAMS, _X, compute_dtype=jnp.bfloat16)
    outside = [w for w in report.wider if w.layer.startswith("rollout")]
    assert outside and {w.reason for w in report.wider} == {"outside"}
    assert {w.phase for w in outside} == {"forward"}
    assert all("outside the functions jaxmp runs under autocast" in w.says for w in outside)
    assert all("jaxmp.autocast(fn, compute_dtype)" in w.fix and "run the step under autocast"
               not in w.fix for w in outside)
    # Its layers' products inside the loss run in bfloat16: only the rollout is listed.
    assert sum(w.flops for w in report.wider) == report.totals["float32"]
    assert "outside the functions jaxmp runs" in str(report)


def test_float8_products_kept_by_the_rules_are_reported_as_kept():
    step = _step(_float8_loss())
    report = jaxmp.debug.precision_report(step, _PARAMS, _X, compute_dtype=jnp.bfloat16,
                                          matmul_dtype=jnp.float8_e4m3fn)
    assert report.requested == "float8"
    assert {(w.layer, w.phase, w.dtype, w.reason) for w in report.wider} == {
        ("_Net/head/out", "forward", "bfloat16", "kept"),
        ("_Net/head/out", "backward", "bfloat16", "kept"),
        # the convolution, kept by default: float8 does not pay for it (float8.COSTLY)
        ("_Net/stem", "forward", "bfloat16", "kept"),
        ("_Net/stem", "backward", "bfloat16", "kept")}
    rows = {(r.layer, r.phase): r.flops for r in report.layers}
    assert set(rows["_Net/wide", "forward"]) == {"float8_e4m3fn"}
    assert set(rows["_Net/wide", "backward"]) == {"float8_e4m3fn+float8_e5m2"}
    assert "it runs in bfloat16: your jaxmp.experimental.Float8Rules keep it there" in str(report)
    assert "a convolution: kept by default" in str(report)


def test_a_primitive_left_out_of_the_autocast_rules():
    loss = jaxmp.autocast(_loss, jnp.bfloat16, low_precision={"dot_general"})
    report = jaxmp.debug.precision_report(jax.value_and_grad(loss), _PARAMS, _X,
                                          compute_dtype=jnp.bfloat16)
    assert {(w.layer, w.phase, w.dtype, w.reason) for w in report.wider} == {
        ("_Net/stem", "forward", "float32", "rules"), ("_Net/stem", "backward", "float32", "rules")}
    assert "conv_general_dilated is not in the autocast rules' low_precision" in str(report)


def test_forward_and_backward_products_are_told_apart():
    def loss(w, x):
        with jax.named_scope("encoder"):
            return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((16, 32)), jnp.ones((8, 16))
    forward = 2 * 8 * 16 * 32
    report = jaxmp.debug.precision_report(jax.value_and_grad(loss), w, x)
    assert [(r.layer, r.phase, r.flops) for r in report.layers] == [
        ("encoder", "forward", {"float32": forward}), ("encoder", "backward", {"float32": forward})]
    both = jaxmp.debug.precision_report(jax.grad(loss, argnums=(0, 1)), w, x)
    assert both.layers[1].flops == {"float32": 2 * forward}
    assert all(w.reason == "user" for w in report.wider)  # float32 arguments, no compute dtype


def test_an_equinox_step_returning_the_module():
    model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))  # holds its activation functions
    optimizer = optax.sgd(0.1)
    grad_fn = jaxmp.mp_value_and_grad(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2),
                                      compute_dtype=jnp.bfloat16)

    @eqx.filter_jit
    def step(model, opt_state, x):
        loss, grads, _, _ = grad_fn(model, x, scaler_state=jaxmp.noop_scaler())
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss, None

    args = (model, optimizer.init(eqx.filter(model, eqx.is_array)), jnp.ones((3, 4)))
    report = jaxmp.debug.precision_report(step, *args, compute_dtype=jnp.bfloat16)
    assert report.totals == jaxmp.debug.matmul_flops(step, *args)
    assert set(report.totals) == {"bfloat16"}
    assert {r.phase for r in report.layers} == {"forward", "backward"} and report.wider == ()


def test_unsupported_products_integer_operands_and_custom_rules():
    @jax.custom_vjp
    def project(x, w):
        return x @ w

    project.defvjp(lambda x, w: (x @ w, (x, w)), lambda res, g: (g @ res[1].T, res[0].T @ g))

    def loss(w, x):
        with jax.named_scope("proj"):
            h = project(x, w)
        return jnp.mean(h ** 2) + jnp.sum(jnp.arange(4) @ jnp.arange(4))

    step = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16)
    report = jaxmp.debug.precision_report(step, jnp.ones((16, 16)), jnp.ones((8, 16)),
                                          scaler_state=jaxmp.noop_scaler(),
                                          compute_dtype=jnp.bfloat16)
    reasons = {(w.dtype, w.reason) for w in report.wider}
    assert reasons == {("int32", "operand"), ("float32", "custom_rule")}


def test_plot_draws_stacked_bars_and_says_when_matplotlib_is_missing(tmp_path, monkeypatch):
    report = jaxmp.debug.precision_report(_step(autocast=False), _PARAMS, _X,
                                          compute_dtype=jnp.bfloat16)
    path = tmp_path / "flops.png"
    figure = report.plot(str(path))
    assert path.stat().st_size > 0
    assert len(figure.axes[0].get_yticklabels()) == len(report.layers)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        report.plot()


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="compute_dtype"):
        jaxmp.debug.precision_report(lambda x: x @ x, jnp.ones((2, 2)), compute_dtype=jnp.int8)
    with pytest.raises(ValueError, match="matmul_dtype"):
        jaxmp.debug.precision_report(lambda x: x @ x, jnp.ones((2, 2)), matmul_dtype=jnp.int8)


def test_the_page_prints_what_it_shows():
    """docs/precision_report.md: its code, saved as train.py, prints its text blocks exactly."""
    text = (ROOT / "docs" / PAGE).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    shown = re.findall(r"```text\n(.*?)```", text, flags=re.S)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile("".join(blocks), "train.py", "exec"), {"__name__": "train"})
    assert printed.getvalue() == "".join(shown)


def test_a_product_of_two_operand_dtypes_counts_in_the_dtype_it_runs_in():
    # autocast=False: the first product returns float32 (preferred_element_type), so the
    # gradient of its weight multiplies a float32 cotangent by the bfloat16 input. JAX lowers it
    # with both operands converted to float32, as matmul_flops counts it; the report said
    # "mixed".
    def loss(params, x):
        h = jnp.tanh(jnp.dot(x, params["w1"], preferred_element_type=jnp.float32))
        return jnp.mean(h.astype(x.dtype) @ params["w2"])

    params, x = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 4))}, jnp.ones((8, 16))
    grad_fn = jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, autocast=False)
    step = jax.jit(lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler()))
    report = jaxmp.debug.precision_report(step, params, x, compute_dtype=jnp.bfloat16)
    first, second = 2 * 8 * 16 * 32, 2 * 8 * 32 * 4
    assert report.totals == jaxmp.debug.matmul_flops(step, params, x) == {
        "bfloat16": first + 3 * second, "float32": first}
    (wide,) = report.wider
    assert (wide.phase, wide.dtype, wide.flops) == ("backward", "float32", first)
