"""Vision Transformer training-step benchmark: float32 against mixed precision, side by side.

Reproduces the evaluation of the paper behind jaxmp (ViT on CIFAR-100 shapes on
a desktop GPU, ViT-Base on ImageNet shapes) on whatever machine it runs on, and
measures what does not depend on that machine, so a CPU-only run still tracks
what a GPU would see. For every (model config, batch size, variant) it records:

* ``saved_activation_bytes``: bytes the VJP of the loss keeps for the backward
  pass (``jaxmp.debug.saved_activation_bytes``, from ``jax.eval_shape``; backend
  independent);
* ``half_matmul_flop_share``: share of the matmul FLOPs of the whole training
  step, lowered for CUDA, whose operands are float16/bfloat16 (backend
  independent: nothing runs);
* ``xla_*_bytes``: XLA's memory estimate for the compiled step on the backend
  at hand, and on a GPU the measured peak;
* ``step_time_s`` / ``epoch_time_s``: median step time after warm-up, and that
  times the number of steps in an epoch of the dataset;
* ``hlo_ops``: instructions in the optimised HLO of the step (library overhead);
* ``grad_norm_ratio``: gradient norm on a step where the loss scale grows,
  relative to the float32 gradient norm (a correctness probe: should be 1).

Variants: ``float32`` (jax.value_and_grad + optax), ``jaxmp``
(``jaxmp.mp_value_and_grad`` + ``jaxmp.optimizer_update``), ``hand_written``
(the same float16 recipe written out by hand, below), ``autocast`` (when
``jaxmp.autocast`` exists), and the peers ``jmp`` and ``mpx``
(mixed-precision-for-jax) when installed.

Usage::

    python -m benchmarks.vit --out results/ --quick
    python -m benchmarks.vit --out results/ --configs desktop --batch-sizes 128,256
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

import jaxmp
from benchmarks import models

CONFIGS = {"tiny": models.TINY_VIT, "desktop": models.DESKTOP_VIT, "base": models.VIT_BASE}
# Dataset each config stands for: (name, training images per epoch).
DATASETS = {
    "tiny": ("CIFAR-100", 50_000),
    "desktop": ("CIFAR-100", 50_000),
    "base": ("ImageNet", 1_281_167),
}
DEFAULT_BATCH_SIZES = {"tiny": (8, 16), "desktop": (64, 128, 256), "base": (32, 128)}
# Every mixed variant starts at the same scale. 2**12 keeps a float16 loss of
# ~7 times the scale below 65504, so the peers that scale the loss in float16
# do not skip their first steps.
INITIAL_SCALE = 2.0**12
GROWTH_INTERVAL = 2000
LEARNING_RATE = 1e-3
# The large-activation case (``large_activation_check``): images times 1000
# and every layer-norm scale times 4. float32 handles it; in float16 the
# layer-norm variances overflow and the normalised activations collapse.
LARGE_IMAGE_SCALE = 1000.0
LARGE_NORM_SCALE = 4.0


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of writing the training step.

    Attributes:
        name: the variant's name in the results.
        init: ``params -> state``, the training state (params, optimizer, scaler).
        grads: ``(state, images, labels) -> grads``, the float32 gradients of one step.
        step: ``(state, images, labels) -> (state, loss)``, one training step.
        loss: the loss function as the variant's autodiff differentiates it
            (casts included), ``(params, images, labels) -> scalar``: what
            ``saved_activation_bytes`` measures.
    """

    name: str
    init: Callable
    grads: Callable
    step: Callable
    loss: Callable


def _float32_variant(loss_fn, optimizer, initial_scale, growth_interval) -> Variant:
    del initial_scale, growth_interval  # no loss scaling in float32

    def init(params):
        return {"params": params, "opt_state": optimizer.init(params)}

    def grads(state, images, labels):
        return jax.grad(loss_fn)(state["params"], images, labels)

    def step(state, images, labels):
        loss, g = jax.value_and_grad(loss_fn)(state["params"], images, labels)
        with jax.numpy_dtype_promotion("standard"):  # optax promotes internally (Adam's bias correction)
            updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    return Variant("float32", init, grads, step, loss_fn)


def _jaxmp_variant(loss_fn, optimizer, initial_scale, growth_interval, *, autocast=False,
                   compute_dtype=jnp.float16, matmul_dtype=None, float8_scaling="tensor",
                   name=None) -> Variant:
    """``mp_value_and_grad`` + ``optimizer_update``; a dynamic loss scale for float16, none for
    bfloat16 (``matmul_dtype``/``float8_scaling``: float8 products, bfloat16 compute)."""
    value_and_grad = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=compute_dtype, autocast=autocast,
                                             matmul_dtype=matmul_dtype, float8_scaling=float8_scaling)

    def init(params):
        if compute_dtype == jnp.float16:
            scaler = jaxmp.init_scaler(initial_scale=initial_scale, growth_interval=growth_interval)
        else:
            scaler = jaxmp.noop_scaler()
        return {"params": params, "opt_state": optimizer.init(params), "scaler": scaler}

    def grads(state, images, labels):
        return value_and_grad(state["params"], images, labels, scaler_state=state["scaler"])[1]

    def step(state, images, labels):
        loss, g, scaler, finite = value_and_grad(
            state["params"], images, labels, scaler_state=state["scaler"]
        )
        params, opt_state = jaxmp.optimizer_update(
            state["params"], optimizer, state["opt_state"], g, finite
        )
        return {"params": params, "opt_state": opt_state, "scaler": scaler}, loss

    if autocast:
        differentiated = jaxmp.autocast(loss_fn, compute_dtype=compute_dtype, matmul_dtype=matmul_dtype,
                                        float8_scaling=float8_scaling)
    else:
        differentiated = jaxmp.cast_function(loss_fn, compute_dtype, return_dtype=jnp.float32)
    name = name or ("autocast" if autocast else "jaxmp")
    return Variant(name, init, grads, step, differentiated)


def _autocast_no_recompute_variant(loss_fn, optimizer, initial_scale, growth_interval) -> Variant:
    """``jaxmp.autocast(..., recompute_float32=False)`` with jaxmp's loss-scaling functions.

    ``mp_value_and_grad(autocast=True)`` always recomputes, so this step is
    written with ``jaxmp.scale``/``unscale``/``all_finite``/``adjust``.
    """
    fn = jaxmp.autocast(loss_fn, compute_dtype=jnp.float16, recompute_float32=False)

    def init(params):
        scaler = jaxmp.init_scaler(initial_scale=initial_scale, growth_interval=growth_interval)
        return {"params": params, "opt_state": optimizer.init(params), "scaler": scaler}

    def value_and_grads(state, images, labels):
        def scaled(p):
            loss = fn(p, images, labels)
            return jaxmp.scale(state["scaler"], loss), loss

        (_, loss), g = jax.value_and_grad(scaled, has_aux=True)(state["params"])
        return loss, jaxmp.unscale(state["scaler"], g)

    def grads(state, images, labels):
        return value_and_grads(state, images, labels)[1]

    def step(state, images, labels):
        loss, g = value_and_grads(state, images, labels)
        finite = jaxmp.all_finite(g)
        params, opt_state = jaxmp.optimizer_update(state["params"], optimizer, state["opt_state"], g, finite)
        return {"params": params, "opt_state": opt_state,
                "scaler": jaxmp.adjust(state["scaler"], finite)}, loss

    return Variant("autocast_no_recompute", init, grads, step, fn)


def _hand_written_variant(loss_fn, optimizer, initial_scale, growth_interval) -> Variant:
    """Float16 compute, float32 params, dynamic loss scaling: written out by hand."""

    def half_loss(params, images, labels):
        # Floating leaves only (a language model's tokens stay integers).
        params, images = jax.tree_util.tree_map(
            lambda x: x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            (params, images))
        return loss_fn(params, images, labels).astype(jnp.float32)

    def scaled_grads(params, images, labels, scale):
        def scaled_loss(p):
            loss = half_loss(p, images, labels)
            return loss * scale, loss

        (_, loss), g = jax.value_and_grad(scaled_loss, has_aux=True)(params)
        g = jax.tree_util.tree_map(lambda x: x / scale, g)  # unscale with this step's scale
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(g)]))
        return loss, g, finite

    def init(params):
        scaler = {"scale": jnp.asarray(initial_scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32)}
        return {"params": params, "opt_state": optimizer.init(params), "scaler": scaler}

    def grads(state, images, labels):
        return scaled_grads(state["params"], images, labels, state["scaler"]["scale"])[1]

    def step(state, images, labels):
        scale, good_steps = state["scaler"]["scale"], state["scaler"]["good_steps"]
        loss, g, finite = scaled_grads(state["params"], images, labels, scale)
        good_steps = jnp.where(finite, good_steps + 1, 0)
        grow = finite & (good_steps % growth_interval == 0)
        new_scale = jnp.where(grow, scale * 2.0, jnp.where(finite, scale, jnp.maximum(scale * 0.5, 1.0)))
        with jax.numpy_dtype_promotion("standard"):  # optax promotes internally (Adam's bias correction)
            updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
        return {
            "params": keep(params, state["params"]),
            "opt_state": keep(opt_state, state["opt_state"]),
            "scaler": {"scale": new_scale, "good_steps": good_steps},
        }, loss

    return Variant("hand_written", init, grads, step, half_loss)


def _jmp_variant(loss_fn, optimizer, initial_scale, growth_interval) -> Variant:
    """jmp's documented recipe: policy casts, DynamicLossScale, select_tree."""
    import jmp  # pylint: disable=g-import-not-at-top

    policy = jmp.get_policy("params=float32,compute=float16,output=float32")

    def policy_loss(params, images, labels):
        params, images = policy.cast_to_compute((params, images))
        return policy.cast_to_output(loss_fn(params, images, labels))

    def loss_scale_of(state):
        # jmp's DynamicLossScale is kept as its two arrays in the training state
        # and rebuilt here: its pytree unflattening cannot run on jit's
        # abstract arguments (it inspects the scale's dtype).
        loss_scale, counter = state["scaler"]
        return jmp.DynamicLossScale(loss_scale, counter, period=growth_interval)

    def scaled_grads(state, images, labels):
        loss_scale = loss_scale_of(state)

        def scaled_loss(p):
            loss = policy_loss(p, images, labels)
            return loss_scale.scale(loss), loss

        (_, loss), g = jax.value_and_grad(scaled_loss, has_aux=True)(state["params"])
        g = loss_scale.unscale(g)
        return loss, g

    def init(params):
        scaler = (jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32))
        return {"params": params, "opt_state": optimizer.init(params), "scaler": scaler}

    def grads(state, images, labels):
        return scaled_grads(state, images, labels)[1]

    def step(state, images, labels):
        loss, g = scaled_grads(state, images, labels)
        finite = jmp.all_finite(g)
        loss_scale = loss_scale_of(state).adjust(finite)
        updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {
            "params": jmp.select_tree(finite, params, state["params"]),
            "opt_state": jmp.select_tree(finite, opt_state, state["opt_state"]),
            "scaler": (loss_scale.loss_scale, loss_scale.counter),
        }, loss

    return Variant("jmp", init, grads, step, policy_loss)


def _mpx_variant(loss_fn, optimizer, initial_scale, growth_interval) -> Variant:
    """MPX's documented recipe: filter_value_and_grad + optimizer_update."""
    import mpx  # pylint: disable=g-import-not-at-top

    def half_loss(params, images, labels):
        return loss_fn(mpx.cast_to_half_precision(params), mpx.cast_to_half_precision(images), labels)

    def init(params):
        scaler = mpx.DynamicLossScaling(
            loss_scaling=jnp.asarray(initial_scale, jnp.float32),
            min_loss_scaling=jnp.asarray(1.0, jnp.float32),
            period=growth_interval,
        )
        return {"params": params, "opt_state": optimizer.init(params), "scaler": scaler}

    def grads(state, images, labels):
        return mpx.filter_value_and_grad(loss_fn, state["scaler"])(state["params"], images, labels)[3]

    def step(state, images, labels):
        loss, scaler, finite, g = mpx.filter_value_and_grad(loss_fn, state["scaler"])(
            state["params"], images, labels
        )
        params, opt_state = mpx.optimizer_update(state["params"], optimizer, state["opt_state"], g, finite)
        return {"params": params, "opt_state": opt_state, "scaler": scaler}, loss

    return Variant("mpx", init, grads, step, half_loss)


def _installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def available_variants() -> list[str]:
    """Names of the variants that can run here, in reporting order."""
    names = ["float32", "jaxmp", "hand_written"]
    if hasattr(jaxmp, "autocast"):
        names += ["autocast", "autocast_no_recompute"]
    if _installed("jmp"):
        names.append("jmp")
    if _installed("mpx"):
        names.append("mpx")
    return names


def make_variant(
    name: str,
    config: models.ViTConfig,
    *,
    initial_scale: float = INITIAL_SCALE,
    growth_interval: int = GROWTH_INTERVAL,
    model: str = "vit",
) -> Variant:
    """Builds the variant ``name`` for the ViT ``config``, with Adam.

    ``model`` is a key of ``models.LOSSES``: ``"vit"`` (written for any
    dtype) or ``"plain_vit"`` (naive float32 code, see ``models``).
    """
    loss_fn = functools.partial(models.LOSSES[model], config=config)
    optimizer = optax.adam(LEARNING_RATE)
    args = (loss_fn, optimizer, initial_scale, growth_interval)
    if name == "float32":
        return _float32_variant(*args)
    if name == "jaxmp":
        return _jaxmp_variant(*args)
    if name == "autocast":
        return _jaxmp_variant(*args, autocast=True)
    if name == "autocast_no_recompute":
        return _autocast_no_recompute_variant(*args)
    if name == "hand_written":
        return _hand_written_variant(*args)
    if name == "jmp":
        return _jmp_variant(*args)
    if name == "mpx":
        return _mpx_variant(*args)
    raise ValueError(f"Unknown variant {name!r}.")


def random_batch(key: jax.Array, config: models.ViTConfig, batch_size: int) -> tuple[jax.Array, jax.Array]:
    """Random float32 images and int32 labels of the right shapes (no download)."""
    k1, k2 = jax.random.split(key)
    shape = (batch_size, config.image_size, config.image_size, config.channels)
    images = jax.random.normal(k1, shape, jnp.float32)
    labels = jax.random.randint(k2, (batch_size,), 0, config.num_classes, jnp.int32)
    return images, labels


def batch_shapes(config: models.ViTConfig, batch_size: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    shape = (batch_size, config.image_size, config.image_size, config.channels)
    return jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct((batch_size,), jnp.int32)


_HLO_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*\S")


def count_hlo_ops(hlo_text: str) -> int:
    """Instructions in an HLO module's text, fused computations included."""
    return sum(1 for line in hlo_text.splitlines() if _HLO_INSTRUCTION.match(line))


def machine_info() -> dict[str, Any]:
    """The machine and software a result came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    devices = jax.devices()
    versions = {}
    for dist in ("jax", "jaxlib", "optax", "jmp", "mixed-precision-for-jax"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    versions["jaxmp"] = jaxmp.__version__
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in devices],
        "python": platform.python_version(),
        "jax_version": jax.__version__,
        "versions": versions,
        "xla_python_client_preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
        "xla_flags": os.environ.get("XLA_FLAGS"),
    }


def _tree_norm(tree) -> float:
    leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree_util.tree_leaves(tree)]
    return float(jnp.sqrt(sum(jnp.sum(x * x) for x in leaves)))


def _timed_compile(low) -> tuple[Any, float]:
    start = time.perf_counter()
    exe = low.compile()
    return exe, time.perf_counter() - start


def _compile_all(lowered: dict[str, Any], workers: int) -> tuple[dict[str, Any], dict[str, float]]:
    """Compiles lowered programs; returns the executables and each one's compile time (s).

    With ``workers > 1`` they compile in threads (XLA releases the GIL while
    compiling), and the times overlap: compare compile times from a run with
    ``workers=1`` (the default).
    """
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {name: pool.submit(_timed_compile, low) for name, low in lowered.items()}
        done = {name: future.result() for name, future in futures.items()}
    return {name: d[0] for name, d in done.items()}, {name: d[1] for name, d in done.items()}


def grad_norm_probe(
    config: models.ViTConfig, variant_names, batch_size: int, seed: int = 0, workers: int = 1,
    model: str = "vit",
) -> dict[str, Any]:
    """Gradient norm of each variant relative to float32, on a step where the scale grows.

    Every scaler gets a growth interval of 1, so the scale doubles during the
    probed step itself: a library that unscales with the *new* scale returns
    gradients half as large (ratio 0.5). All start from the same scale: the
    largest power of two up to 2**15 at which the hand-written float16
    gradients are finite (a step that overflows would not grow the scale).
    """
    params = models.init_vit(jax.random.key(seed), config)
    images, labels = random_batch(jax.random.key(seed + 1), config, batch_size)

    def state_for(name, initial_scale):
        return make_variant(name, config, initial_scale=initial_scale, growth_interval=1,
                            model=model).init(params)

    lowered = {
        name: jax.jit(make_variant(name, config, growth_interval=1, model=model).grads).lower(
            state_for(name, 1.0), images, labels
        )
        for name in dict.fromkeys(["float32", "hand_written", *variant_names])
    }
    grads_fns, _ = _compile_all(lowered, workers)
    probe_scale = 1.0
    for k in range(15, -1, -1):
        grads = grads_fns["hand_written"](state_for("hand_written", 2.0**k), images, labels)
        if bool(jaxmp.all_finite(grads)):
            probe_scale = 2.0**k
            break
    reference = _tree_norm(grads_fns["float32"](state_for("float32", 1.0), images, labels))
    ratios = {
        name: _tree_norm(grads_fns[name](state_for(name, probe_scale), images, labels)) / reference
        for name in variant_names
    }
    return {"batch_size": batch_size, "initial_scale": probe_scale, "grad_norm_ratio_vs_float32": ratios}


def large_activation_check(
    config: models.ViTConfig, variants: dict[str, Variant], batch_size: int = 4, seed: int = 0,
) -> dict[str, float]:
    """Each variant's loss (as it differentiates it) on the large-activation case.

    Images are multiplied by ``LARGE_IMAGE_SCALE`` and layer-norm scales by
    ``LARGE_NORM_SCALE``: the float32 loss is finite, while a float16
    layer-norm variance overflows (``inf``, or a finite but wrong loss where
    the normalised activations collapse to the bias). Compare with float32.
    """
    params = models.init_vit(jax.random.key(seed), config)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * LARGE_NORM_SCALE if "scale" in jax.tree_util.keystr(path) else x, params)
    images, labels = random_batch(jax.random.key(seed + 1), config, batch_size)
    return {name: float(jax.jit(v.loss)(params, LARGE_IMAGE_SCALE * images, labels))
            for name, v in variants.items()}


def _memory_stats(device) -> dict[str, Any]:
    try:
        stats = device.memory_stats()
    except Exception:  # pylint: disable=broad-except
        return {}
    return stats or {}


def _static_figures(variant: Variant, params_shape, x_shape, y_shape, backend: str) -> tuple[dict, Any]:
    """Backend-independent figures of one variant, and its lowered step (not yet compiled)."""
    state_shape = jax.eval_shape(variant.init, params_shape)
    row = {
        "variant": variant.name,
        "backend": backend,
        "saved_activation_bytes": jaxmp.debug.saved_activation_bytes(variant.loss, params_shape, x_shape, y_shape),
    }
    flops = jaxmp.debug.matmul_flops(variant.step, state_shape, x_shape, y_shape, platform="cuda")
    row["matmul_flops_cuda"] = flops
    total = sum(flops.values())
    # What jaxmp.debug.half_matmul_flop_share computes, from the counts at hand
    # (lowering once instead of twice).
    row["half_matmul_flop_share"] = (flops.get("float16", 0) + flops.get("bfloat16", 0)) / total if total else 0.0
    lowered = jax.jit(variant.step, donate_argnums=0).lower(state_shape, x_shape, y_shape)
    return row, lowered


def xla_memory(exe) -> dict[str, int]:
    """XLA's memory estimate of a compiled step, as ``xla_*_bytes`` figures (empty if the backend has none).

    ``xla_total_bytes`` is arguments + outputs + temporaries - donated aliases.
    """
    mem = exe.memory_analysis()
    if mem is None:
        return {}
    figures = {"xla_temp_bytes": mem.temp_size_in_bytes, "xla_argument_bytes": mem.argument_size_in_bytes,
               "xla_output_bytes": mem.output_size_in_bytes, "xla_alias_bytes": mem.alias_size_in_bytes}
    figures = {k: int(v) for k, v in figures.items()}
    figures["xla_total_bytes"] = (figures["xla_argument_bytes"] + figures["xla_output_bytes"]
                                  + figures["xla_temp_bytes"] - figures["xla_alias_bytes"])
    return figures


def _compiled_figures(row: dict, exe) -> None:
    row.update(xla_memory(exe))
    row["hlo_ops"] = count_hlo_ops(exe.as_text())


def _time_steps(compiled, states, batch, repeats: int, warmup: int) -> dict[str, list[float]]:
    """Median-ready step times; rounds over all variants, so background load hits all alike."""
    for name, exe in compiled.items():
        for _ in range(warmup):
            states[name], loss = exe(states[name], *batch)
            jax.block_until_ready((states[name], loss))
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, exe in compiled.items():
            start = time.perf_counter()
            states[name], loss = exe(states[name], *batch)
            jax.block_until_ready((states[name], loss))
            times[name].append(time.perf_counter() - start)
    return times


def _relative_figures(rows: dict[str, dict]) -> None:
    base, hand = rows.get("float32"), rows.get("hand_written")
    for row in rows.values():
        if base is not None:
            row["saved_bytes_ratio_vs_float32"] = base["saved_activation_bytes"] / row["saved_activation_bytes"]
            if row["step_time_s"] and base["step_time_s"]:
                row["speedup_vs_float32"] = base["step_time_s"] / row["step_time_s"]
        if hand is not None:
            row["hlo_ops_minus_hand_written"] = row["hlo_ops"] - hand["hlo_ops"]
            if row["step_time_s"] and hand["step_time_s"]:
                row["time_ratio_vs_hand_written"] = row["step_time_s"] / hand["step_time_s"]


def run(
    config_names,
    batch_sizes: dict[str, tuple[int, ...]],
    variant_names,
    *,
    repeats: int,
    warmup: int,
    time_base: bool,
    progress: bool = True,
    seed: int = 0,
    workers: int | None = None,
    partial_path: str | None = None,
    model_names=("vit",),
    probe: bool = True,
    check_finite: bool = True,
) -> dict[str, Any]:
    """Runs the benchmark; returns ``{"machine": ..., "records": [...], "probe": {...}}``.

    With ``partial_path``, the results so far are written there as JSON after
    every batch size, so an interrupted long run still leaves its figures.
    """
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top

    workers = workers or 1
    machine = machine_info()
    device = jax.devices()[0]
    records, probes = [], {}
    total = sum(len(batch_sizes[c]) * len(variant_names) for c in config_names) * len(model_names)
    bar = tqdm(total=total, desc="vit benchmark", unit="run", disable=not progress, file=sys.stderr)
    for config_name in config_names:
        config = CONFIGS[config_name]
        dataset, dataset_size = DATASETS[config_name]
        timed = config_name != "base" or time_base
        init = functools.partial(models.init_vit, config=config)
        params_shape = jax.eval_shape(init, jax.random.key(seed))
        params = init(jax.random.key(seed)) if timed else None
        for model in model_names:
            variants = {name: make_variant(name, config, model=model) for name in variant_names}
            large = large_activation_check(config, variants, seed=seed) if check_finite else {}
            for batch_size in batch_sizes[config_name]:
                x_shape, y_shape = batch_shapes(config, batch_size)
                rows, lowered = {}, {}
                for name, variant in variants.items():
                    bar.set_postfix_str(f"{config_name} {model} bs={batch_size} {name}: lowering")
                    row, lowered[name] = _static_figures(variant, params_shape, x_shape, y_shape,
                                                         machine["backend"])
                    rows[name] = {"config": config_name, "model": model, "dataset": dataset,
                                  "batch_size": batch_size, **row,
                                  "large_activation_loss": large.get(name),
                                  "large_activation_loss_float32": large.get("float32")}
                bar.set_postfix_str(f"{config_name} {model} bs={batch_size}: compiling")
                compiled, compile_s = _compile_all(lowered, workers)
                for name, row in rows.items():
                    _compiled_figures(row, compiled[name])
                    row["compile_s"] = compile_s[name]
                    row["compile_workers"] = workers
                    row["step_time_s"] = row["epoch_time_s"] = None
                if timed:
                    bar.set_postfix_str(f"{config_name} {model} bs={batch_size}: timing")
                    batch = random_batch(jax.random.key(seed + 1), config, batch_size)
                    states = {name: v.init(jax.tree_util.tree_map(jnp.copy, params))
                              for name, v in variants.items()}
                    times = _time_steps(compiled, states, batch, repeats, warmup)
                    del states
                    for name, row in rows.items():
                        row["step_times_s"] = times[name]
                        row["step_time_s"] = statistics.median(times[name])
                        row["epoch_time_s"] = row["step_time_s"] * math.ceil(dataset_size / batch_size)
                    peak = _memory_stats(device).get("peak_bytes_in_use")
                    if peak is not None:
                        # The process's peak so far: for a per-variant figure run
                        # one variant and one batch size per process (--variants).
                        for row in rows.values():
                            row["measured_peak_bytes"] = int(peak)
                del compiled, lowered
                _relative_figures(rows)
                for row in rows.values():
                    records.append(row)
                    bar.update(1)
                if partial_path:
                    with open(partial_path, "w", encoding="utf-8") as f:
                        json.dump({"machine": machine, "records": records, "probe": probes}, f, indent=1)
            if timed and probe and "float32" in variant_names:
                bar.set_postfix_str(f"{config_name} {model}: gradient-norm probe")
                key = config_name if model == "vit" else f"{config_name}/{model}"
                probes[key] = grad_norm_probe(
                    config, variant_names, min(batch_sizes[config_name]), seed, workers, model=model
                )
                ratios = probes[key]["grad_norm_ratio_vs_float32"]
                for row in records:
                    if row["config"] == config_name and row["model"] == model:
                        row["grad_norm_ratio_vs_float32"] = ratios[row["variant"]]
    bar.close()
    return {"machine": machine, "records": records, "probe": probes}


def plot(results: dict[str, Any], out_dir: str) -> list[str]:
    """Writes the paper-style figures: memory and time per epoch against batch size."""
    import matplotlib  # pylint: disable=g-import-not-at-top

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

    records = results["records"]
    backend = results["machine"]["backend"]
    written = []
    for config_name in dict.fromkeys(r["config"] for r in records):
        first_model = next(r.get("model", "vit") for r in records if r["config"] == config_name)
        rows = [r for r in records if r["config"] == config_name and r.get("model", "vit") == first_model]
        names = list(dict.fromkeys(r["variant"] for r in rows))

        def series(name, key):
            pts = sorted((r["batch_size"], r[key]) for r in rows if r["variant"] == name and r.get(key))
            return [p[0] for p in pts], [p[1] for p in pts]

        memory_key = "measured_peak_bytes" if any(r.get("measured_peak_bytes") for r in rows) else "xla_total_bytes"
        memory_title = "measured peak" if memory_key == "measured_peak_bytes" else f"XLA estimate ({backend})"
        # Distinct markers: the mixed variants often coincide exactly.
        markers = dict(zip(names, "osD^vPX*"))
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for name in names:
            style = "--" if name == "float32" else "-"
            for ax, key in zip(axes, ("saved_activation_bytes", memory_key)):
                xs, ys = series(name, key)
                ax.plot(xs, [y / 2**20 for y in ys], style, marker=markers[name], fillstyle="none", label=name)
        axes[0].set_title("Saved activations (backend independent)")
        axes[1].set_title(f"Training-step memory, {memory_title}")
        for ax in axes:
            ax.set_xlabel("batch size")
            ax.set_ylabel("MiB")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"ViT {config_name}: memory vs batch size")
        fig.tight_layout()
        path = os.path.join(out_dir, f"memory_{config_name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

        if any(r.get("epoch_time_s") for r in rows):
            fig, ax = plt.subplots(figsize=(5.5, 4))
            for name in names:
                xs, ys = series(name, "epoch_time_s")
                ax.plot(xs, ys, "--" if name == "float32" else "-", marker=markers[name], fillstyle="none", label=name)
            dataset = rows[0]["dataset"]
            ax.set_title(f"ViT {config_name}: time per epoch ({dataset}), {backend}")
            ax.set_xlabel("batch size")
            ax.set_ylabel("seconds per epoch")
            ax.set_xscale("log", base=2)
            ax.grid(True, alpha=0.3)
            ax.legend()
            fig.tight_layout()
            path = os.path.join(out_dir, f"time_{config_name}.png")
            fig.savefig(path, dpi=120)
            plt.close(fig)
            written.append(path)
    return written


def markdown_table(results: dict[str, Any], config_name: str, batch_sizes=None, model: str = "vit") -> str:
    """A Markdown table of all metrics for one config and model (the README's table)."""
    header = (
        "| batch | variant | saved act. MiB | f32/variant | half matmul share | XLA estimate MiB "
        "| step s | epoch s | vs float32 | vs hand-written | HLO ops | grad-norm ratio |"
    )
    lines = [header, "|" + "---|" * 12]

    def fmt(value, spec):
        return "n/a" if value is None else format(value, spec)

    for r in results["records"]:
        if r["config"] != config_name or (batch_sizes and r["batch_size"] not in batch_sizes):
            continue
        if r.get("model", "vit") != model:
            continue
        lines.append(
            f"| {r['batch_size']} | {r['variant']} | {r['saved_activation_bytes'] / 2**20:.1f} "
            f"| {fmt(r.get('saved_bytes_ratio_vs_float32'), '.2f')} | {r['half_matmul_flop_share']:.3f} "
            f"| {fmt(r.get('xla_total_bytes') and r['xla_total_bytes'] / 2**20, '.1f')} "
            f"| {fmt(r.get('step_time_s'), '.3f')} | {fmt(r.get('epoch_time_s'), '.0f')} "
            f"| {fmt(r.get('speedup_vs_float32'), '.2f')}{'x' if r.get('speedup_vs_float32') else ''} | {fmt(r.get('time_ratio_vs_hand_written'), '.3f')} "
            f"| {r['hlo_ops']} | {fmt(r.get('grad_norm_ratio_vs_float32'), '.3f')} |"
        )
    return "\n".join(lines)


def comparison_table(results: dict[str, Any], config_name: str) -> str:
    """Every model and variant of one config against the hand-written float16 step.

    Step times: the median, and in brackets the range, of the per-round
    ratios to the hand-written step of the same round (rounds interleave the
    variants, so a load spike hits a round's variants alike).
    """
    lines = [
        "| model | batch | variant | saved MiB | f32/variant | half matmul share | XLA MiB | XLA vs hand "
        "| HLO ops | HLO vs hand | step s | time vs hand (range) | compile s | compile vs hand "
        "| large-activation loss (float32) |",
        "|" + "---|" * 15,
    ]
    records = [r for r in results["records"] if r["config"] == config_name]
    hands = {(r.get("model", "vit"), r["batch_size"]): r for r in records if r["variant"] == "hand_written"}
    for r in records:
        hand = hands.get((r.get("model", "vit"), r["batch_size"]))
        xla = hlo = time = compile_ratio = "n/a"
        if hand is not None:
            if r.get("xla_total_bytes") and hand.get("xla_total_bytes"):
                xla = f"{r['xla_total_bytes'] / hand['xla_total_bytes']:.2f}x"
            hlo = f"{r['hlo_ops'] / hand['hlo_ops']:.2f}x"
            if r.get("compile_s") and hand.get("compile_s"):
                compile_ratio = f"{r['compile_s'] / hand['compile_s']:.2f}x"
            if r.get("step_times_s") and hand.get("step_times_s"):
                ratios = sorted(a / b for a, b in zip(r["step_times_s"], hand["step_times_s"]))
                time = f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        xla_mib = "n/a" if not r.get("xla_total_bytes") else f"{r['xla_total_bytes'] / 2**20:.0f}"
        step = "n/a" if r.get("step_time_s") is None else f"{r['step_time_s']:.3f}"
        compile_time = "n/a" if r.get("compile_s") is None else f"{r['compile_s']:.2f}"
        ratio = r.get("saved_bytes_ratio_vs_float32")
        large, large32 = r.get("large_activation_loss"), r.get("large_activation_loss_float32")
        if large is None:
            large = "n/a"
        else:  # float32's loss is there only when float32 is among the variants
            large = f"{large:.3f}" + ("" if large32 is None else f" ({large32:.3f})")
        lines.append(
            f"| {r.get('model', 'vit')} | {r['batch_size']} | {r['variant']} "
            f"| {r['saved_activation_bytes'] / 2**20:.0f} | {'n/a' if ratio is None else f'{ratio:.2f}'} "
            f"| {r['half_matmul_flop_share']:.3f} | {xla_mib} | {xla} | {r['hlo_ops']} | {hlo} "
            f"| {step} | {time} | {compile_time} | {compile_ratio} | {large} |"
        )
    return "\n".join(lines)


def _parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for results.json and the figures")
    parser.add_argument("--quick", action="store_true", help="tiny model, small batches, few repeats")
    parser.add_argument("--configs", default=None, help="comma-separated: tiny, desktop, base")
    parser.add_argument("--batch-sizes", default=None, help="comma-separated, for every config")
    parser.add_argument("--variants", default=None, help="comma-separated subset of " + ",".join(available_variants()))
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps after compilation")
    parser.add_argument("--time-base", action="store_true", help="also time ViT-Base (slow on a CPU)")
    parser.add_argument("--models", default="vit",
                        help="comma-separated: vit (written for any dtype), plain_vit (naive float32 code)")
    parser.add_argument("--no-probe", action="store_true", help="skip the gradient-norm probe")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--workers", type=int, default=None,
                        help="parallel compilations (default 1, so that compile times compare; "
                             "--quick: one per core)")
    args = parser.parse_args(argv)

    if args.quick and "XLA_FLAGS" not in os.environ:
        # Halves CPU compile time, which is most of a quick run; the quick
        # run's timings are then those of less optimised code (recorded in
        # results.json under machine.xla_flags).
        os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0"

    if args.quick:
        config_names = ["tiny"] if args.configs is None else args.configs.split(",")
        repeats = 2 if args.repeats is None else args.repeats
    else:
        config_names = ["desktop", "base"] if args.configs is None else args.configs.split(",")
        repeats = 2 if args.repeats is None else args.repeats
    unknown = [c for c in config_names if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {sorted(CONFIGS)}")
    if args.batch_sizes:
        batch_sizes = {c: _parse_ints(args.batch_sizes) for c in config_names}
    elif args.quick:
        batch_sizes = {c: DEFAULT_BATCH_SIZES["tiny"] for c in config_names}
    else:
        batch_sizes = {c: DEFAULT_BATCH_SIZES[c] for c in config_names}
    variant_names = available_variants()
    if args.variants:
        wanted = args.variants.split(",")
        missing = [v for v in wanted if v not in variant_names]
        if missing:
            parser.error(f"variant(s) {missing} not available here; available: {variant_names}")
        variant_names = [v for v in variant_names if v in wanted]

    model_names = [m for m in args.models.split(",") if m]
    if [m for m in model_names if m not in models.LOSSES]:
        parser.error(f"unknown model(s) in {model_names}; choose from {sorted(models.LOSSES)}")

    os.makedirs(args.out, exist_ok=True)
    results = run(
        config_names,
        batch_sizes,
        variant_names,
        repeats=repeats,
        warmup=args.warmup,
        time_base=args.time_base,
        progress=not args.no_progress,
        # --quick compiles in parallel (its compile times then overlap: not for comparison).
        workers=args.workers or ((os.cpu_count() or 1) if args.quick else 1),
        partial_path=os.path.join(args.out, "results.partial.json"),
        model_names=model_names,
        probe=not args.no_probe,
    )
    results["command"] = " ".join(["python -m benchmarks.vit"] + list(sys.argv[1:] if argv is None else argv))
    results["skipped_peers"] = {
        name: "not installed" for name, module in (("jmp", "jmp"), ("mpx", "mpx")) if not _installed(module)
    }
    if not hasattr(jaxmp, "autocast"):
        results["skipped_peers"]["autocast"] = "jaxmp.autocast not available in this version"
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    if os.path.exists(os.path.join(args.out, "results.partial.json")):
        os.remove(os.path.join(args.out, "results.partial.json"))
    plot(results, args.out)
    for config_name in config_names:
        for model in model_names:
            print(f"\n## {config_name} ({model})\n")
            print(markdown_table(results, config_name, model=model))
        if "hand_written" in variant_names:
            print(f"\n## {config_name}: against the hand-written float16 step\n")
            print(comparison_table(results, config_name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
