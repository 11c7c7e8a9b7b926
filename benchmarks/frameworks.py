"""Every feature on every framework: a feature x framework matrix of tiny training runs.

Rows are jaxmp's features, columns the frameworks, each written the way its users write a
training step (issue 24, part 6):

* features: ``float16`` and ``bfloat16`` (``mp_value_and_grad``'s default, dynamic loss
  scaling for float16), half-byte optimizer state with ``stochastic`` or ``kahan`` rounding
  (``jaxmp.experimental.low_precision_optimizer``, bfloat16 parameters and state, as
  ``docs/low_precision.md`` writes it), ``float8`` (``matmul_dtype=jnp.float8_e4m3fn``,
  bfloat16 compute), ``find_nonfinite`` (finds an overflow injected into the first product
  and names its line) and ``flop_share`` (``half_matmul_flop_share`` and
  ``float8_matmul_flop_share`` called on the whole step as it is written: framework objects
  in and out);
* frameworks: ``linen`` (``TrainState`` with a ``batch_stats`` field, a BatchNorm conv net),
  ``nnx`` (``nnx.Dropout``, ``nnx.Optimizer``), ``haiku`` (``hk.transform_with_state``, a
  ``hk.BatchNorm`` conv net), ``equinox`` (a conv net holding ``jax.nn.gelu`` as a field,
  noise drawn inside the loss), ``scan_remat`` (a plain-JAX transformer whose blocks run
  under ``lax.scan`` and ``jax.checkpoint``) and ``multisteps`` (``optax.MultiSteps``
  gradient accumulation on a small MLP).

Each training cell runs ``STEPS`` steps from the same initialisation and batches as a float32
run of the same code (``use_mixed_precision=False``, plain Adam) and measures

* ``share``: the share of the matrix-product and convolution FLOPs of the whole training step
  (forward, backward and update) whose operands are in the requested dtype (``float16``,
  ``bfloat16``, or float8 for ``float8``), counted by ``jaxmp.debug.matmul_flops`` in the program
  lowered for a GPU (nothing runs; the step's outputs are reduced to their arrays, so that
  the count does not depend on what the FLOP tools accept, which ``flop_share`` checks);
* ``gap``: the relative gap between the last step's loss and the float32 run's;
* for half-byte state, ``bytes_per_param``: the bytes of the parameters and optimizer state
  (floating arrays of at least one dimension) per parameter.

A cell passes when every check of its target holds and jaxmp warns of nothing, except the
float8 conv nets (``CONV_NETS``): XLA runs only forward convolutions in float8, so their kernel
gradients run in bfloat16, their target share is lower (``CONV_NET_FLOAT8``) and their step
must say so once (a ``Float8ShortfallWarning``). A combination
that is not supported passes only by raising a clear error while the step is traced
(``UNSUPPORTED``, empty today: the exception type and a pattern its message must match).
Steps are compiled with ``QUICK_XLA`` (XLA's optimisations off): compiling is nearly all the
work of a four-step run. The matrix prints as a table, and is saved with its figures::

    python -m benchmarks.frameworks --out results/frameworks
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import time
import traceback
import warnings
from typing import Any, Callable, NamedTuple

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import jaxmp

STEPS = 4
LEARNING_RATE = 1e-2
BATCH = 4
CLASSES = 10
FLOAT8 = jnp.float8_e4m3fn

FEATURES = ("float16", "bfloat16", "stochastic", "kahan", "float8", "find_nonfinite", "flop_share")
FEATURE_TITLES = {
    "float16": "default float16",
    "bfloat16": "default bfloat16",
    "stochastic": "half-byte state, stochastic",
    "kahan": "half-byte state, Kahan",
    "float8": "float8 (e4m3, bfloat16 compute)",
    "find_nonfinite": "find_nonfinite",
    "flop_share": "FLOP share tools",
}
FRAMEWORKS = ("linen", "nnx", "haiku", "equinox", "scan_remat", "multisteps")


class Target(NamedTuple):
    """What a training cell must reach: the share in ``dtype`` and the loss gap to float32."""

    dtype: str  # "float16", "bfloat16" or "float8"
    min_share: float
    max_gap: float
    max_bytes_per_param: float | None = None  # half-byte state; MultiSteps adds its accumulator


TARGETS = {
    "float16": Target("float16", 1.0, 0.02),
    "bfloat16": Target("bfloat16", 1.0, 0.02),
    "stochastic": Target("bfloat16", 1.0, 0.02, max_bytes_per_param=6.0),
    "kahan": Target("bfloat16", 1.0, 0.02, max_bytes_per_param=8.0),
    "float8": Target("float8", 0.99, 0.05),
}
# XLA's GPU compiler gives cuDNN float8 graphs to forward convolutions only (docs/float8.md):
# autocast runs a convolution's kernel gradient (and a strided one's input gradient) in the
# compute dtype, and says so once while tracing (a Float8ShortfallWarning naming "forward
# convolutions only"). The conv nets' kernel gradients are a third of their product FLOPs.
CONV_NETS = ("linen", "haiku", "equinox")
CONV_NET_FLOAT8 = Target("float8", 0.6, 0.05)
CONV_BACKWARD_WARNING = "forward convolutions only"


def target_of(feature: str, framework: str) -> Target | None:
    """The target of a training cell (``None``: not a training cell)."""
    if feature == "float8" and framework in CONV_NETS:
        return CONV_NET_FLOAT8
    return TARGETS.get(feature)


def _expected_warning(feature: str, framework: str, warning) -> bool:
    """Whether a jaxmp warning is the one a cell must give: a float8 conv net's step says
    that its kernel gradients run in bfloat16."""
    return (feature in ("float8", "flop_share") and framework in CONV_NETS
            and warning.category is jaxmp.experimental.Float8ShortfallWarning
            and CONV_BACKWARD_WARNING in str(warning.message))


# optax.MultiSteps keeps one more parameter-sized buffer, the accumulated gradients, in the
# state's dtype (bfloat16): 2 more bytes per parameter than Adam alone.
MULTISTEPS_EXTRA_BYTES = 2.0
# (feature, framework) -> (exception type, regex its message must match while tracing).
UNSUPPORTED: dict[tuple[str, str], tuple[type, str]] = {}


class Variant(NamedTuple):
    """How a step is built: precision, float8 products, half-byte state."""

    compute_dtype: Any = None  # None: float32, no mixed precision
    matmul_dtype: Any = None
    rounding: str | None = None  # low_precision_optimizer's param_rounding


VARIANTS = {
    "float32": Variant(),
    "float16": Variant(jnp.float16),
    "bfloat16": Variant(jnp.bfloat16),
    "stochastic": Variant(jnp.bfloat16, rounding="stochastic"),
    "kahan": Variant(jnp.bfloat16, rounding="kahan"),
    "float8": Variant(jnp.bfloat16, matmul_dtype=FLOAT8),
}


# The steps are tiny and run four times: compiling them is nearly all the work. XLA:CPU
# compiles them about five times faster without its optimisations and fusion emitters (1.8 s
# against 0.3 s for the linen step with half-byte state). The programs, and so the dtypes
# counted and the losses compared, are the same. An option the installed XLA does not know
# is left out (jaxlib 0.12's XLA:CPU has no fusion emitters flag: it refuses to compile).
def _known_options(options: dict) -> dict:
    known = {}
    for key, value in options.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={key: value}).lower(1.0).compile()
        except jax.errors.JaxRuntimeError:
            continue
        known[key] = value
    return known


QUICK_XLA = _known_options({"xla_backend_optimization_level": 0,
                            "xla_llvm_disable_expensive_passes": True,
                            "xla_cpu_use_fusion_emitters": False})
JIT = functools.partial(jax.jit, compiler_options=QUICK_XLA)
FILTER_JIT = functools.partial(eqx.filter_jit, compiler_options=QUICK_XLA)


class Setup(NamedTuple):
    """One framework's training step in one variant, as its users write it.

    Attributes:
        step: ``step(state, batch) -> (state, loss)``, not compiled.
        jit: how users compile it (``jax.jit``, ``eqx.filter_jit``; with ``QUICK_XLA``).
        state: the initial training state (parameters, optimizer and framework state, scaler).
        batches: one batch per step.
        loss_fn: the loss given to ``mp_value_and_grad``.
        grad_options: ``has_aux`` / ``no_cast_argnums`` given with it.
        loss_args: ``loss_args(state, batch)``: the arguments the step gives the loss.
        persistent: ``persistent(state) -> (params, opt_state)``.
        inject: ``inject(state, batch) -> (state, batch)`` whose first product overflows float16.
        marker: the comment that marks the line of that product in this file.
    """

    step: Callable
    jit: Callable
    state: Any
    batches: list
    loss_fn: Callable
    grad_options: dict
    loss_args: Callable
    persistent: Callable
    inject: Callable
    marker: str


# ---------------------------------------------------------------------------
# What every column shares: gradient function, optimizer, scaler, casts.
# ---------------------------------------------------------------------------


# The float8 cells ask for every product in float8, the convolutions and attention's scores
# and probabilities too, which autocast keeps in the compute dtype by default (float8 does not
# pay for them on an H100, docs/float8.md): the cells check that each framework's products can
# all run in float8 (tests/test_float8.py checks the default placement).
FLOAT8_EVERYWHERE = jaxmp.experimental.Float8Rules(include={"attention", "convolution"})


def _grad_fn(loss_fn, variant: Variant, **options):
    if variant.compute_dtype is None:
        return jaxmp.mp_value_and_grad(loss_fn, use_mixed_precision=False, **options)
    if variant.matmul_dtype is not None:
        options["float8_rules"] = FLOAT8_EVERYWHERE
    return jaxmp.mp_value_and_grad(loss_fn, compute_dtype=variant.compute_dtype,
                                   matmul_dtype=variant.matmul_dtype, **options)


def _optimizer(variant: Variant, every_k: int | None = None):
    tx = optax.adam(LEARNING_RATE)
    if every_k is not None:
        tx = optax.MultiSteps(tx, every_k_schedule=every_k)
    if variant.rounding is not None:
        tx = jaxmp.experimental.low_precision_optimizer(tx, state_dtype=jnp.bfloat16,
                                                        param_rounding=variant.rounding, seed=0)
    return tx


def _scaler(variant: Variant):
    return jaxmp.scaler_for(variant.compute_dtype or jnp.float32)


def _narrow(tree, variant: Variant):
    """Half-byte state: parameters (and the batch) in bfloat16, as docs/low_precision.md does."""
    return jaxmp.cast_tree(tree, jnp.bfloat16) if variant.rounding is not None else tree


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _images(seed: int, shape):
    """Random inputs and labels, one batch per step (NumPy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    return [(jnp.asarray(rng.standard_normal(shape), jnp.float32),
             jnp.asarray(rng.integers(0, CLASSES, shape[0]), jnp.int32)) for _ in range(STEPS)]


def _overflowing(x, value):
    """An array like ``x`` full of ``value``: products of such operands overflow float16."""
    return jnp.full_like(x, value)


# ---------------------------------------------------------------------------
# Flax linen: TrainState with batch_stats, a BatchNorm conv net.
# ---------------------------------------------------------------------------


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)  # first product: linen
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
        x = nn.relu(nn.Conv(8, (3, 3), use_bias=False)(x))
        return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class LinenState(train_state.TrainState):
    batch_stats: Any


@functools.lru_cache(maxsize=None)
def _linen_init():
    images = _images(1, (BATCH, 8, 8, 3))
    return images, JIT(LinenNet().init, static_argnames="train")(
        jax.random.key(0), images[0][0], train=True)


def _linen(variant: Variant) -> Setup:
    model = LinenNet()
    images, variables = _linen_init()
    batches = [(_narrow(x, variant), y) for x, y in images]
    state = LinenState.create(apply_fn=model.apply, params=_narrow(variables["params"], variant),
                              tx=_optimizer(variant), batch_stats=variables["batch_stats"])

    def loss_fn(params, batch_stats, x, y):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                      train=True, mutable=["batch_stats"])
        return _cross_entropy(logits, y), updates["batch_stats"]

    options = {"has_aux": True, "no_cast_argnums": 1}
    grad_fn = _grad_fn(loss_fn, variant, **options)

    def step(carry, batch):
        state, scaler = carry
        (loss, batch_stats), grads, scaler, finite = grad_fn(
            state.params, state.batch_stats, *batch, scaler_state=scaler)
        new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
        return (jaxmp.select_tree(finite, new_state, state), scaler), loss

    def inject(carry, batch):
        state, scaler = carry
        params = dict(state.params, Conv_0=jax.tree_util.tree_map(
            lambda p: _overflowing(p, 3000.0), state.params["Conv_0"]))
        return (state.replace(params=params), scaler), (_overflowing(batch[0], 10.0), batch[1])

    return Setup(step, JIT, (state, _scaler(variant)), batches, loss_fn, options,
                 lambda c, b: (c[0].params, c[0].batch_stats, *b),
                 lambda c: (c[0].params, c[0].opt_state), inject, "# first product: linen")


# ---------------------------------------------------------------------------
# Flax nnx: a module with Dropout, nnx.Optimizer.
# ---------------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(32, CLASSES, rngs=rngs)

    def __call__(self, x):
        x = self.hidden(x)  # first product: nnx
        return self.out(self.dropout(nnx.relu(x)))


@functools.lru_cache(maxsize=None)
def _nnx_init():
    return NnxNet(nnx.Rngs(0, dropout=1)), _images(2, (BATCH, 16))


def _nnx(variant: Variant) -> Setup:
    model, images = _nnx_init()
    model = nnx.clone(model)  # each variant trains its own copy
    if variant.rounding is not None:
        nnx.update(model, _narrow(nnx.state(model, nnx.Param), variant))
    optimizer = nnx.Optimizer(model, _optimizer(variant), wrt=nnx.Param)
    model_def = nnx.graphdef(model)
    graphdef, state = nnx.split((model, optimizer))
    batches = [(_narrow(x, variant), y) for x, y in images]

    def loss_fn(params, rest, x, y):
        model = nnx.merge(model_def, params, rest, copy=True)  # fresh Variables for this trace
        loss = _cross_entropy(model(x), y)
        return loss, nnx.state(model, nnx.Not(nnx.Param))  # the advanced dropout stream

    options = {"has_aux": True, "no_cast_argnums": 1}
    grad_fn = _grad_fn(loss_fn, variant, **options)

    def split_model(state):
        model, _ = nnx.merge(graphdef, state)
        return nnx.state(model, nnx.Param, ...)

    def step(carry, batch):
        state, scaler = carry
        model, optimizer = nnx.merge(graphdef, state)
        params, rest = nnx.state(model, nnx.Param, ...)
        (loss, new_rest), grads, scaler, finite = grad_fn(params, rest, *batch, scaler_state=scaler)
        optimizer.update(model, grads)
        nnx.update(model, new_rest)
        return (jaxmp.select_tree(finite, nnx.state((model, optimizer)), state), scaler), loss

    def persistent(carry):
        model, optimizer = nnx.merge(graphdef, carry[0])
        return nnx.state(model, nnx.Param), nnx.state(optimizer.opt_state)

    def inject(carry, batch):
        model, optimizer = nnx.merge(graphdef, carry[0], copy=True)  # the setup's state stays
        model.hidden.kernel[...] = _overflowing(model.hidden.kernel[...], 1000.0)
        return (nnx.state((model, optimizer)), carry[1]), (_overflowing(batch[0], 10.0), batch[1])

    return Setup(step, JIT, (state, _scaler(variant)), batches, loss_fn, options,
                 lambda c, b: (*split_model(c[0]), *b), persistent, inject, "# first product: nnx")


# ---------------------------------------------------------------------------
# Haiku: transform_with_state, a BatchNorm conv net.
# ---------------------------------------------------------------------------


def _haiku_net(images, is_training):
    x = hk.Conv2D(8, kernel_shape=3, with_bias=False)(images)  # first product: haiku
    x = jax.nn.relu(hk.BatchNorm(True, True, decay_rate=0.9)(x, is_training))
    x = jax.nn.relu(hk.Conv2D(8, kernel_shape=3, with_bias=False)(x))
    return hk.Linear(CLASSES)(jnp.mean(x, axis=(1, 2)))


_haiku_forward = hk.without_apply_rng(hk.transform_with_state(_haiku_net))


@functools.lru_cache(maxsize=None)
def _haiku_init():
    images = _images(3, (BATCH, 8, 8, 3))
    return images, JIT(_haiku_forward.init, static_argnums=2)(jax.random.key(0), images[0][0], True)


def _haiku(variant: Variant) -> Setup:
    forward = _haiku_forward
    batches, (params, hk_state) = _haiku_init()
    # Haiku draws the parameters in the dtype of the batch it is given: init with the float32
    # batch (the float32 run's parameters), then narrow the parameters and the BatchNorm
    # statistics as an init with the bfloat16 batch of the half-byte recipe makes them.
    params, hk_state = _narrow((params, hk_state), variant)
    batches = [(_narrow(x, variant), y) for x, y in batches]
    tx = _optimizer(variant)

    def loss_fn(params, hk_state, x, y):
        logits, hk_state = forward.apply(params, hk_state, x, True)
        return _cross_entropy(logits, y), hk_state

    options = {"has_aux": True, "no_cast_argnums": 1}
    grad_fn = _grad_fn(loss_fn, variant, **options)

    def step(carry, batch):
        params, hk_state, opt_state, scaler = carry
        (loss, new_hk_state), grads, scaler, finite = grad_fn(
            params, hk_state, *batch, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        hk_state = jaxmp.select_tree(finite, new_hk_state, hk_state)
        return (params, hk_state, opt_state, scaler), loss

    def inject(carry, batch):
        params = dict(carry[0])
        params["conv2_d"] = {k: _overflowing(v, 3000.0) for k, v in params["conv2_d"].items()}
        return (params, *carry[1:]), (_overflowing(batch[0], 10.0), batch[1])

    return Setup(step, JIT, (params, hk_state, tx.init(params), _scaler(variant)), batches,
                 loss_fn, options, lambda c, b: (c[0], c[1], *b), lambda c: (c[0], c[2]), inject,
                 "# first product: haiku")


# ---------------------------------------------------------------------------
# Equinox: a conv net holding jax.nn.gelu, noise drawn inside the loss.
# ---------------------------------------------------------------------------


class EqxNet(eqx.Module):
    conv1: eqx.nn.Conv2d
    conv2: eqx.nn.Conv2d
    head: eqx.nn.Linear
    activation: Callable  # a function leaf (a custom_jvp)

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(3, 8, 3, padding=1, use_bias=False, key=k1)
        self.conv2 = eqx.nn.Conv2d(8, 8, 3, padding=1, use_bias=False, key=k2)
        self.head = eqx.nn.Linear(8, CLASSES, key=k3)
        self.activation = jax.nn.gelu

    def __call__(self, x):  # one image, channels first
        x = self.activation(self.conv1(x))  # first product: equinox
        x = self.activation(self.conv2(x))
        return self.head(jnp.mean(x, axis=(1, 2)))


@functools.lru_cache(maxsize=None)
def _equinox_init():
    keys = list(jax.random.split(jax.random.key(4), STEPS))
    return FILTER_JIT(EqxNet)(jax.random.key(0)), _images(4, (BATCH, 3, 8, 8)), keys


def _equinox(variant: Variant) -> Setup:
    model, images, keys = _equinox_init()
    model = _narrow(model, variant)
    tx = _optimizer(variant)
    batches = [(_narrow(x, variant), y, k) for (x, y), k in zip(images, keys)]

    def loss_fn(model, images, labels, key):
        noise = 0.1 * jax.random.normal(key, images.shape)  # float32, drawn inside the loss
        logits = jax.vmap(model)(images + noise)
        return _cross_entropy(logits, labels)

    grad_fn = _grad_fn(loss_fn, variant)

    def step(carry, batch):
        model, opt_state, scaler = carry
        loss, grads, scaler, finite = grad_fn(model, *batch, scaler_state=scaler)
        model, opt_state = jaxmp.optimizer_update(model, tx, opt_state, grads, finite)
        return (model, opt_state, scaler), loss

    def inject(carry, batch):
        model = eqx.tree_at(lambda m: m.conv1.weight, carry[0],
                            _overflowing(carry[0].conv1.weight, 3000.0))
        return (model, *carry[1:]), (_overflowing(batch[0], 10.0), *batch[1:])

    params = eqx.filter(model, eqx.is_inexact_array)
    return Setup(step, FILTER_JIT, (model, tx.init(params), _scaler(variant)), batches,
                 loss_fn, {}, lambda c, b: (c[0], *b),
                 lambda c: (eqx.filter(c[0], eqx.is_inexact_array), c[1]), inject,
                 "# first product: equinox")


# ---------------------------------------------------------------------------
# Plain JAX: a transformer whose blocks run under lax.scan and jax.checkpoint.
# ---------------------------------------------------------------------------

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 16, 16, 2, 2, 8


def _rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _block(x, layer):
    b, t, d = x.shape
    qkv = _rms_norm(x, layer["norm1"]) @ layer["wqkv"]  # first product: scan_remat
    q, k, v = (a.reshape(b, t, HEADS, d // HEADS) for a in jnp.split(qkv, 3, axis=-1))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e30)
    attended = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + attended.reshape(b, t, d) @ layer["wo"]
    return x + jax.nn.gelu(_rms_norm(x, layer["norm2"]) @ layer["w1"]) @ layer["w2"]


def _transformer_loss(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(lambda x, layer: (jax.checkpoint(_block)(x, layer), None),
                        x, params["layers"])
    logits = _rms_norm(x, params["norm"]) @ params["unembed"]
    return _cross_entropy(logits, tokens[:, 1:])


def _transformer_params(key):
    k = jax.random.split(key, 6)
    normal = lambda key, shape, fan_in: jax.random.normal(key, shape) / np.sqrt(fan_in)
    return {
        "embed": jax.random.normal(k[0], (VOCAB, WIDTH)),
        "layers": {
            "norm1": jnp.ones((LAYERS, WIDTH)),
            "wqkv": normal(k[1], (LAYERS, WIDTH, 3 * WIDTH), WIDTH),
            "wo": normal(k[2], (LAYERS, WIDTH, WIDTH), WIDTH),
            "norm2": jnp.ones((LAYERS, WIDTH)),
            "w1": normal(k[3], (LAYERS, WIDTH, 4 * WIDTH), WIDTH),
            "w2": normal(k[4], (LAYERS, 4 * WIDTH, WIDTH), 4 * WIDTH),
        },
        "norm": jnp.ones((WIDTH,)),
        "unembed": normal(k[5], (WIDTH, VOCAB), WIDTH),
    }


@functools.lru_cache(maxsize=None)
def _transformer_init():
    return JIT(_transformer_params)(jax.random.key(0))


def _optax_step(loss_fn, variant, tx, grad_options=None):
    """The step of getting_started.md: gradient, then jaxmp.optimizer_update."""
    grad_fn = _grad_fn(loss_fn, variant, **(grad_options or {}))

    def step(carry, batch):
        params, opt_state, scaler = carry
        loss, grads, scaler, finite = grad_fn(params, *batch, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, tx, opt_state, grads, finite)
        return (params, opt_state, scaler), loss

    return step


def _scan_remat(variant: Variant) -> Setup:
    params = _narrow(_transformer_init(), variant)
    tx = _optimizer(variant)
    rng = np.random.default_rng(5)
    batches = [(jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32),)
               for _ in range(STEPS)]

    def inject(carry, batch):
        params = dict(carry[0], embed=jnp.ones_like(carry[0]["embed"]))  # rms_norm: all ones
        params["layers"] = dict(params["layers"],
                                wqkv=_overflowing(params["layers"]["wqkv"], 5000.0))
        return (params, *carry[1:]), batch

    return Setup(_optax_step(_transformer_loss, variant, tx), JIT,
                 (params, tx.init(params), _scaler(variant)), batches, _transformer_loss, {},
                 lambda c, b: (c[0], *b), lambda c: (c[0], c[1]), inject,
                 "# first product: scan_remat")


# ---------------------------------------------------------------------------
# optax.MultiSteps: gradient accumulation over calls, on a small MLP.
# ---------------------------------------------------------------------------


def _mlp_loss(params, x, y):
    # relu, not tanh: the injected overflow's inf must reach the loss for find_nonfinite to
    # report it (tanh(inf) = 1 is float32's tanh of the product, and the gradient is 0 in both).
    h = jax.nn.relu(x @ params["w1"] + params["b1"])  # first product: multisteps
    return _cross_entropy(h @ params["w2"] + params["b2"], y)


def _multisteps(variant: Variant) -> Setup:
    rng = np.random.default_rng(0)
    params = {"w1": rng.standard_normal((16, 32)) / 4, "b1": np.zeros(32),
              "w2": rng.standard_normal((32, CLASSES)) / 6, "b2": np.zeros(CLASSES)}
    params = _narrow(jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params), variant)
    tx = _optimizer(variant, every_k=2)
    batches = [(_narrow(x, variant), y) for x, y in _images(6, (BATCH, 16))]

    def inject(carry, batch):
        params = dict(carry[0], w1=_overflowing(carry[0]["w1"], 1000.0))
        return (params, *carry[1:]), (_overflowing(batch[0], 10.0), batch[1])

    return Setup(_optax_step(_mlp_loss, variant, tx), JIT,
                 (params, tx.init(params), _scaler(variant)), batches, _mlp_loss, {},
                 lambda c, b: (c[0], *b), lambda c: (c[0], c[1]), inject,
                 "# first product: multisteps")


BUILDERS = {"linen": _linen, "nnx": _nnx, "haiku": _haiku, "equinox": _equinox,
            "scan_remat": _scan_remat, "multisteps": _multisteps}


# ---------------------------------------------------------------------------
# Measuring a cell.
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def quick_compilation():
    """XLA with most optimisations off (``jax_disable_most_optimizations``) for what is not
    compiled through ``QUICK_XLA`` (``find_nonfinite`` evaluates operation by operation)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


@functools.lru_cache(maxsize=None)
def setup(framework: str, variant: str) -> Setup:
    """The column's step in one variant, built once (the float32 one serves every row)."""
    with jax.numpy_dtype_promotion("standard"), quick_compilation():
        return BUILDERS[framework](VARIANTS[variant])


@functools.lru_cache(maxsize=None)
def _compiled(framework: str, variant: str) -> Callable:
    return setup(framework, variant).jit(setup(framework, variant).step)


@functools.lru_cache(maxsize=None)
def train(framework: str, variant: str) -> tuple[Any, tuple[float, ...]]:
    """Runs the steps; returns the final state and the losses."""
    s, step = setup(framework, variant), _compiled(framework, variant)
    state, losses = s.state, []
    with jax.numpy_dtype_promotion("standard"):
        for batch in s.batches:
            state, loss = step(state, batch)
            losses.append(float(loss))
    return state, tuple(losses)


def _arrays_out(step):
    """The step with its outputs reduced to their arrays (for ``matmul_flops`` alone)."""
    return lambda *args: [x for x in jax.tree_util.tree_leaves(step(*args)) if eqx.is_array(x)]


@functools.lru_cache(maxsize=None)
def step_flops(framework: str, variant: str) -> dict[str, int]:
    """``jaxmp.debug.matmul_flops`` of the whole step (outputs reduced to arrays), by dtype."""
    s = setup(framework, variant)
    with jax.numpy_dtype_promotion("standard"):
        return jaxmp.debug.matmul_flops(_arrays_out(s.step), s.state, s.batches[0])


def share_of(totals: dict[str, int], dtype: str) -> float:
    """The share of ``matmul_flops`` counts whose operands are all ``dtype`` ("float8": any)."""
    total = sum(totals.values())
    if dtype == "float8":
        wanted = sum(v for k, v in totals.items()
                     if all(part.startswith("float8") for part in k.split("+")))
    else:
        wanted = totals.get(dtype, 0)
    return wanted / total if total else 0.0


def _bytes_per_param(params, opt_state) -> float:
    floating = lambda x: eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
    count = sum(x.size for x in jax.tree_util.tree_leaves(params) if floating(x))
    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((params, opt_state)) if floating(x))
    return nbytes / count


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _marker_line(marker: str) -> int:
    with open(__file__, encoding="utf-8") as f:
        lines = [n for n, line in enumerate(f, 1) if line.rstrip().endswith(marker)]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def max_bytes_per_param(feature: str, framework: str) -> float:
    """The bytes per parameter that half-byte state may keep between steps."""
    extra = MULTISTEPS_EXTRA_BYTES if framework == "multisteps" else 0.0
    return TARGETS[feature].max_bytes_per_param + extra


def _train_cell(feature: str, framework: str, result: dict) -> list[str]:
    target = target_of(feature, framework)
    s = setup(framework, feature)
    totals = step_flops(framework, feature)
    result["flops"] = totals
    result["share"] = share_of(totals, target.dtype)
    state, losses = train(framework, feature)
    _, reference = train(framework, "float32")
    result.update(losses=list(losses), loss=losses[-1], reference_loss=reference[-1])
    result["gap"] = abs(losses[-1] - reference[-1]) / abs(reference[-1])
    failures = []
    if not result["share"] >= target.min_share:
        failures.append(f"{target.dtype} share {result['share']:.2%} < {target.min_share:.0%} "
                        f"(matmul FLOPs by dtype: {totals})")
    if not result["gap"] <= target.max_gap:
        failures.append(f"loss {losses[-1]:.5f} is {result['gap']:.2%} from float32's "
                        f"{reference[-1]:.5f} (bound {target.max_gap:.0%})")
    if target.max_bytes_per_param is not None:
        bound = max_bytes_per_param(feature, framework)
        result["bytes_per_param"] = _bytes_per_param(*s.persistent(state))
        if not result["bytes_per_param"] <= bound:
            failures.append(f"{result['bytes_per_param']:.2f} bytes per parameter > {bound:g}")
    return failures


def _nonfinite_cell(framework: str, result: dict) -> list[str]:
    s = setup(framework, "float16")
    find = jaxmp.debug.find_nonfinite(s.loss_fn, jnp.float16, **s.grad_options)
    scaler = jaxmp.init_scaler()
    with jax.numpy_dtype_promotion("standard"):
        report = find(*s.loss_args(*s.inject(s.state, s.batches[0])), scaler_state=scaler)
    line = f"frameworks.py:{_marker_line(s.marker)}"
    failures = []
    if not np.isfinite(report.loss_float32):  # the overflow is half precision's, not the model's
        failures.append(f"the float32 loss is {report.loss_float32}: float32 overflows too")
    overflows = [f for f in report.findings if f.kind == "overflow"]
    if not report or not overflows:
        failures.append(f"the injected overflow was not found: {report.findings}")
        return failures
    first = overflows[0]
    result["found"] = f"{first.phase} {first.primitive} at {first.where}" + (
        f" from {first.called_from}" if first.called_from else "")
    if first.phase != "forward" or first.primitive not in ("dot_general", "conv_general_dilated"):
        failures.append(f"first overflow is not the first product: {result['found']}")
    if line not in first.where and line not in first.called_from:
        failures.append(f"first overflow does not name {line}: {result['found']}")
    return failures


def _flop_share_cell(framework: str, result: dict) -> list[str]:
    """The FLOP tools on the whole step as written (framework objects in and out).

    They must run and give the shares that ``matmul_flops`` counts on the same step with its
    outputs reduced to arrays (the ``float16`` and ``float8`` rows check what those shares are).
    """
    half, eight = setup(framework, "float16"), setup(framework, "float8")
    with jax.numpy_dtype_promotion("standard"):
        result["share"] = jaxmp.debug.half_matmul_flop_share(half.step, half.state, half.batches[0])
        result["float8_share"] = jaxmp.debug.float8_matmul_flop_share(
            eight.step, eight.state, eight.batches[0])
    failures = []
    for tool, measured, counted in (
            ("half_matmul_flop_share", result["share"],
             _half_or_float8_share(step_flops(framework, "float16"))),
            ("float8_matmul_flop_share", result["float8_share"],
             share_of(step_flops(framework, "float8"), "float8"))):
        if abs(measured - counted) > 1e-12:
            failures.append(f"{tool} gives {measured:.4f}, matmul_flops counts {counted:.4f}")
    return failures


def _half_or_float8_share(totals: dict[str, int]) -> float:
    """What ``half_matmul_flop_share`` documents: float16, bfloat16 or float8 operands."""
    return sum(share_of(totals, dtype) for dtype in ("float16", "bfloat16", "float8"))


def run_cell(feature: str, framework: str) -> dict:
    """Runs one cell of the matrix; ``status`` is ``"pass"`` or ``"fail"`` (see ``failures``)."""
    result: dict[str, Any] = {"feature": feature, "framework": framework}
    start = time.process_time()
    expected = UNSUPPORTED.get((feature, framework))
    with warnings.catch_warnings(record=True) as caught, quick_compilation():
        warnings.simplefilter("always")
        try:
            if expected is not None:
                failures = _unsupported_cell(feature, framework, *expected)
            elif feature == "find_nonfinite":
                failures = _nonfinite_cell(framework, result)
            elif feature == "flop_share":
                failures = _flop_share_cell(framework, result)
            else:
                failures = _train_cell(feature, framework, result)
        except Exception as error:  # pylint: disable=broad-except
            result["error"] = _first_line(error)
            result["traceback"] = traceback.format_exc(limit=-4)
            failures = [f"raised {result['error']}"]
    result["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}"
                                 for w in caught})
    # A cell that meets its targets has nothing to warn about (MostlyFloat32Warning,
    # Float8ShortfallWarning, ...): a jaxmp warning there is a false alarm.
    failures += [f"jaxmp warned: {w.category.__name__}: {str(w.message).splitlines()[0]}"
                 for w in caught if w.category.__module__.startswith("jaxmp")
                 and not _expected_warning(feature, framework, w)]
    if feature == "float8" and framework in CONV_NETS and not any(
            _expected_warning(feature, framework, w) for w in caught):
        failures.append("no warning that the kernel gradients run in bfloat16")
    result["failures"] = failures
    result["status"] = "fail" if failures else "pass"
    result["cpu_s"] = time.process_time() - start
    return result


def _unsupported_cell(feature, framework, exception, pattern) -> list[str]:
    s = setup(framework, feature)
    try:
        with jax.numpy_dtype_promotion("standard"):
            jax.eval_shape(s.step, s.state, s.batches[0])  # tracing only
    except exception as error:
        if re.search(pattern, str(error)):
            return []
        return [f"the error does not say why: {_first_line(error)}"]
    return [f"no {exception.__name__} while tracing an unsupported combination"]


# ---------------------------------------------------------------------------
# The table.
# ---------------------------------------------------------------------------


def _cell_text(r: dict) -> str:
    mark = "" if r["status"] == "pass" else "**FAIL** "
    if "error" in r:
        return mark + r["error"][:70].replace("|", "/")
    if r["feature"] == "find_nonfinite":  # the primitive and the user's line it names
        found = re.search(r"(\w+) at .*?(frameworks\.py:\d+)", r.get("found", ""))
        return mark + (f"{found[1].split('_')[0]}, {found[2]}" if found else "not found")
    if r["feature"] == "flop_share":
        return mark + f"{r['share']:.0%} / f8 {r['float8_share']:.0%}"
    text = f"{r['share']:.0%} / {r['gap']:.2%}"
    if "bytes_per_param" in r:
        text += f" / {r['bytes_per_param']:.0f} B"
    return mark + text


def markdown(results: list[dict]) -> str:
    cells = {(r["feature"], r["framework"]): r for r in results}
    lines = ["| feature | " + " | ".join(FRAMEWORKS) + " |",
             "|---|" + "---|" * len(FRAMEWORKS)]
    for feature in FEATURES:
        row = [_cell_text(cells[feature, fw]) if (feature, fw) in cells else ""
               for fw in FRAMEWORKS]
        lines.append(f"| {FEATURE_TITLES[feature]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def run_all() -> list[dict]:
    return [run_cell(feature, framework) for framework in FRAMEWORKS for feature in FEATURES]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True,
                        help="directory for frameworks.json and frameworks.md")
    args = parser.parse_args(argv)
    start = time.process_time()
    results = run_all()
    table = markdown(results)
    print(table)
    for r in results:
        if r["failures"]:
            print(f"- {r['feature']} x {r['framework']}: " + "; ".join(r["failures"]))
    print(f"CPU time: {time.process_time() - start:.1f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "frameworks.json"), "w", encoding="utf-8") as f:
        json.dump({"jax": jax.__version__, "steps": STEPS, "results": results}, f, indent=1,
                  default=str)
    with open(os.path.join(args.out, "frameworks.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
