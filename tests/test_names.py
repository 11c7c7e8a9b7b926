"""The user's layer names survive jaxmp: every layer path of the float32 step's products is in
the jaxmp step's (op_name metadata of the program, what a profile shows)."""

import functools
import re

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jaxmp

# Wrappers JAX puts around names (transformations, control flow); what is left is the layer path.
_WRAPPER = re.compile(r"^(jit|pjit|jvp|transpose|vmap|checkpoint|remat|while|cond|scan|body"
                      r"|closed_call|custom_jvp_call|custom_vjp_call|branch_\d+_fun)(\(.*\))?$")
_PRODUCT = ("dot_general", "conv_general_dilated", "convolution")


def _layer_path(name: str) -> str:
    """The layer path of an op name, marked ``backward:`` for a product of the backward pass."""
    path = "/".join(p for p in name.split("/") if not _WRAPPER.match(p))
    return ("backward:" if "transpose(" in name else "forward:") + path


def _product_paths(names) -> set:
    """The layer paths of the products among ``names`` (``jit(step)/jvp(MLP)/encoder/dot_general``
    gives ``encoder/dot_general``)."""
    paths = {_layer_path(n) for n in names}
    return {p for p in paths if p.split("/")[-1] in _PRODUCT}


def _lowered_names(step, *args) -> set:
    text = jax.jit(step).lower(*args).as_text(debug_info=True)
    return _product_paths(re.findall(r'loc\("([^"]+)"', text))


def _compiled_names(step, *args) -> set:
    text = jax.jit(step).lower(*args).compile().as_text()
    return _product_paths(n.split("[")[0] for n in re.findall(r'op_name="([^"]+)"', text))


# --- The models, as each framework's users write them ---------------------------------------


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), name="stem")(x))
        x = jnp.mean(x, axis=(1, 2))
        with jax.named_scope("my_scope"):
            x = nn.relu(nn.Dense(8, name="hidden")(x))
        return nn.Dense(3, name="head")(x)


def _linen():
    model = _LinenNet()
    x = jnp.ones((2, 6, 6, 2))
    params = model.init(jax.random.key(0), x)
    return (lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params, x


def _haiku():
    net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 3], name="mlp")(x)))
    x = jnp.ones((2, 8))
    return (lambda p, x: jnp.sum(net.apply(p, x) ** 2)), net.init(jax.random.key(0), x), x


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(8, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        with jax.named_scope("nnx_block"):
            return self.b(jax.nn.relu(self.a(x)))


def _nnx():
    graphdef, state = nnx.split(_NnxNet(nnx.Rngs(0)))
    return (lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)), state, jnp.ones((2, 8))


def _equinox():
    model = eqx.nn.MLP(8, 3, 8, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(p, x):
        return jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)

    return loss, params, jnp.ones((2, 8))


def _scanned():
    """Named scopes inside a checkpointed scan body and around a nested jit."""

    def loss(w, x):
        def body(h, wi):
            with jax.named_scope("layer"):
                return jnp.tanh(h @ wi), None

        h, _ = jax.lax.scan(jax.checkpoint(body), x, w)
        return jnp.sum(jax.jit(lambda h: h @ w[0])(h) ** 2)

    return loss, jnp.full((3, 8, 8), 0.1), jnp.ones((4, 8))


MODELS = {"linen": _linen, "haiku": _haiku, "nnx": _nnx, "equinox": _equinox,
          "scan": _scanned}
VARIANTS = {
    "default": dict(),
    "cast": dict(autocast=False),
    "float8": dict(compute_dtype=jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn),
    # Block-scaled: each product is chosen per platform when lowered (lax.platform_dependent:
    # JAX's cond/branch_0_fun around it); on CPU an emulation of dot_generals, on CUDA
    # jax.nn.scaled_matmul (cuDNN's block-scaled dot), under the same layer path.
    "mxfp8": dict(compute_dtype=jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
                  float8_scaling="mxfp8"),
}


def _steps(model, options):
    loss, params, x = MODELS[model]()
    grad_fn = jaxmp.mp_value_and_grad(loss, **options)
    return ((lambda p, x: jax.value_and_grad(loss)(p, x)),
            (lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler())), params, x)


@pytest.mark.filterwarnings("ignore::jaxmp.debug.MostlyFloat32Warning",
                            "ignore::jaxmp.experimental.Float8ShortfallWarning")
@pytest.mark.parametrize("model,variant", [
    # MXFP8 on two models, with the slow tests (the suite's time): its layer paths are those
    # of the float8 variant, under JAX's per-platform wrappers.
    pytest.param(m, v, marks=pytest.mark.slow) if v == "mxfp8" else (m, v)
    for v in sorted(VARIANTS) for m in sorted(MODELS) if v != "mxfp8" or m in ("linen", "scan")])
def test_every_layer_path_of_the_float32_step_is_kept(model, variant):
    reference, step, params, x = _steps(model, VARIANTS[variant])
    expected = _lowered_names(reference, params, x)
    got = _lowered_names(step, params, x)
    assert expected - got == set(), f"lost: {sorted(expected - got)}; kept: {sorted(got)}"


def test_the_layer_paths_reach_the_compiled_programs_op_names():
    """In the compiled step (what XProf and Perfetto show), the default and float8 name the
    Flax layers and the user's named_scope, forward and backward, as the float32 step does."""
    reference, _, params, x = _steps("linen", {})
    expected = _compiled_names(reference, params, x)
    assert {"forward:stem/conv_general_dilated", "forward:my_scope/hidden/dot_general",
            "forward:head/dot_general", "backward:head/dot_general"} <= {
                p.replace("_LinenNet/", "") for p in expected}
    for variant in ("default", "float8"):
        _, step, _, _ = _steps("linen", VARIANTS[variant])
        got = _compiled_names(step, params, x)
        assert expected <= got, f"{variant} lost {sorted(expected - got)}"


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::jaxmp.experimental.Float8ShortfallWarning")
def test_the_layer_paths_reach_the_compiled_mxfp8_programs_op_names():
    """Issue 34: MXFP8 products keep their layer paths in the compiled program (on the CPU,
    dot_generals of the emulation under JAX's cond/branch_0_fun)."""
    reference, step, params, x = _steps("linen", VARIANTS["mxfp8"])
    expected = _compiled_names(reference, params, x)
    got = _compiled_names(step, params, x)
    assert expected <= got, f"mxfp8 lost {sorted(expected - got)}"


# --- Layers scanned as MaxText scans them (issue 40) ---------------------------------------

_WIDTH = 32  # a multiple of MXFP8's block of 32: every projection runs block-scaled


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(_WIDTH, name="wo")(nn.relu(nn.DenseGeneral(2 * _WIDTH,
                                                                          name="wi_0")(x)))


class Attention(nn.Module):
    """Self-attention, one head, its products named as MaxText names them."""

    @nn.compact
    def __call__(self, x):
        q, k = (nn.DenseGeneral(_WIDTH, name=n)(x) for n in ("query", "key"))
        weights = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), axis=-1)
        return nn.DenseGeneral(_WIDTH, name="out")(jnp.einsum("bts,bsd->btd", weights, x))


class DecoderLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = x + Attention(name="self_attention")(nn.RMSNorm(name="pre_norm")(x))
        return x + Mlp(name="mlp")(nn.RMSNorm(name="post_norm")(x)), None


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        layers = nn.scan(nn.remat(DecoderLayer), variable_axes={"params": 0},
                         split_rngs={"params": True}, length=2)
        x, _ = layers(name="layers")(x, None)
        return nn.Dense(_WIDTH, name="logits_dense")(nn.RMSNorm(name="decoder_norm")(x))


class Transformer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Decoder(name="decoder")(x)


@functools.cache
def _scanned_decoder():
    model = Transformer()
    x = jnp.ones((2, 16, _WIDTH))
    params = jax.jit(model.init)(jax.random.key(0), x)
    return (lambda p, x: jnp.sum(model.apply(p, x) ** 2)), params, x


# JAX's own segments, dropped: its wrappers, the scan body's eval_jaxpr (closed_call up to jax
# 0.10); jit(...) names a function, the other wrappers keep the module inside them.
_JAX_SEGMENT = re.compile(r"^(jit\(.*\)|while|body|eval_jaxpr|closed_call|cond|branch_\d+_fun"
                          r"|checkpoint)$")
_TRANSFORM = re.compile(r"^(jvp|transpose)\((.*)\)$")
# jax 0.8 writes the op name of a lax.platform_dependent branch inside a loop twice (MXFP8 on
# the CPU: a/cond/a/cond/branch_0_fun/dot_general); jax's own doing, read once.
_TWICE = re.compile(r"^(.+)/cond/\1/cond/")


def _full_path(name: str) -> str:
    """The layer path of an op name with its modules (``jvp(Transformer)/decoder/while/body/
    eval_jaxpr/layers/mlp/wi_0/dot_general`` gives ``Transformer/decoder/layers/mlp/wi_0/
    dot_general``), marked ``backward:`` for a product of the backward pass."""
    backward = "transpose(" in name
    parts = []
    for part in _TWICE.sub(r"\1/cond/", name).split("/"):
        while _TRANSFORM.match(part):
            part = _TRANSFORM.match(part).group(2)
        if part and not _JAX_SEGMENT.match(part):
            parts.append(part)
    return ("backward:" if backward else "forward:") + "/".join(parts)


_IN_A_LAYER = re.compile(r"^(forward|backward):Transformer/decoder/(logits_dense"
                         r"|(rematted_computation/)?layers/(self_attention|mlp)/[^/]+)/")


def _compiled_products(step, *args) -> set:
    text = jax.jit(step).lower(*args).compile().as_text()
    names = {n.split("[")[0] for n in re.findall(r'op_name="([^"]+)"', text)}
    return {_full_path(n) for n in names if n.split("/")[-1] in _PRODUCT}


@pytest.fixture(scope="module")
def scanned_decoder_reference():
    loss, params, x = _scanned_decoder()
    return _compiled_products(jax.value_and_grad(loss), params, x)


@pytest.mark.filterwarnings("ignore::jaxmp.debug.MostlyFloat32Warning",
                            "ignore::jaxmp.experimental.Float8ShortfallWarning")
@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("variant", [  # the control and MXFP8 with the slow tests
    "default", "float8", *(pytest.param(v, marks=pytest.mark.slow) for v in ("cast", "mxfp8"))])
def test_layers_in_a_scan_keep_their_enclosing_module_path(variant, scanned_decoder_reference):
    """Issue 40: the products of layers under nn.scan are named Transformer/decoder/layers/...
    in the compiled step under every recipe, forward and backward, as in the float32 step (they
    were named layers/... relative to the scan body under autocast)."""
    expected = scanned_decoder_reference
    layer = "Transformer/decoder/layers/"
    # The float32 step names them so: the first projection of a layer, its MLP, both passes.
    assert {f"{phase}:{layer}{path}/dot_general" for phase in ("forward", "backward")
            for path in ("self_attention/query", "mlp/wi_0", "mlp/wo")} <= expected
    loss, params, x = _scanned_decoder()
    grad_fn = jaxmp.mp_value_and_grad(loss, **VARIANTS[variant])
    got = _compiled_products(lambda p, x: grad_fn(p, x, scaler_state=jaxmp.noop_scaler()),
                             params, x)
    assert expected <= got, f"lost: {sorted(expected - got)}; kept: {sorted(got)}"
    # No product without its layer (a weight gradient named after no layer, or layers/...
    # relative to the scan body), MXFP8's emulation on the CPU included.
    stray = {p for p in got if not _IN_A_LAYER.match(p)}
    assert not stray, f"products outside any layer path: {sorted(stray)}"


@pytest.mark.filterwarnings("ignore::jaxmp.debug.MostlyFloat32Warning",
                            "ignore::jaxmp.experimental.Float8ShortfallWarning")
@pytest.mark.usefixtures("standard_promotion")
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_precision_reports_rows_of_scanned_layers_carry_the_enclosing_path(variant):
    """Issue 40: precision_report names a scanned layer Transformer/decoder/layers/mlp/wi_0, as
    for the float32 step, not layers/mlp/wi_0 beside Transformer/decoder/logits_dense."""
    loss, params, x = _scanned_decoder()
    reference = jaxmp.debug.precision_report(jax.value_and_grad(loss), params, x)
    expected = {(row.layer, row.phase) for row in reference.layers}
    assert ("Transformer/decoder/layers/mlp/wi_0", "backward") in expected
    grad_fn = jaxmp.mp_value_and_grad(loss, **VARIANTS[variant])
    report = jaxmp.debug.precision_report(grad_fn, params, x, scaler_state=jaxmp.noop_scaler())
    assert {(row.layer, row.phase) for row in report.layers} == expected
