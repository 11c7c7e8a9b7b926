"""The user's layer names survive jaxmp: every layer path of the float32 step's products is in
the jaxmp step's (op_name metadata of the program, what a profile shows)."""

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
