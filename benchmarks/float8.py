"""Float8 matrix products through autocast, against bfloat16 autocast: FLOP shares, memory, loss.

For each model (the tiny and desktop ViT of ``benchmarks/models.py`` and the
Haiku transformer language model of ``examples/haiku/transformer.py``) and
each variant,

* ``bfloat16``: ``mp_value_and_grad(loss, compute_dtype=jnp.bfloat16, autocast=True)``,
* ``float8``: the same with ``matmul_dtype=jnp.float8_e4m3fn``,
* ``float8_head_bf16``: float8 but for the output projection, kept in
  bfloat16 by a ``jaxmp.experimental.Float8Rules`` (the loss under ``jaxmp.autocast(...,
  float8_rules=)`` given to ``mp_value_and_grad(..., autocast=True)``),
* ``mxfp8``: ``float8`` with ``float8_scaling="mxfp8"`` (one power-of-two
  scale per block of 32 elements along each product's contracting
  dimension, forward and backward, OCP MXFP8),
* ``nvfp4``: ``matmul_dtype=jnp.float4_e2m1fn`` with
  ``float8_scaling=jaxmp.experimental.NVFP4(...)`` (NVIDIA's 4-bit recipe:
  e4m3 scales per 16 elements, a float32 scale per tensor), every switch on
  and the output projection kept in bfloat16 with attention's batched
  products (``NVFP4.keep``, by the output width, as ``float8_head_bf16``
  finds it: the Haiku model has no ``head`` scope); and the same with one
  switch off each: ``nvfp4_1d_weights`` (``weight_blocks_2d=False``),
  ``nvfp4_no_hadamard``, ``nvfp4_nearest`` (``stochastic_rounding=False``)
  and ``nvfp4_keep_none`` (``keep=Float8Rules()``: every product in float4),

it records, for the whole training step (gradient + ``jaxmp.optimizer_update``
with Adam):

* the share of matmul FLOPs in float8 and in low precision (bfloat16 or
  float8) in the program lowered for CUDA (``jaxmp.debug.matmul_flops``; nothing
  runs, no GPU needed), for the forward pass (the loss alone) and for the
  backward pass (the step less the forward pass);
* ``jaxmp.debug.saved_activation_bytes`` of the autocast loss;
* XLA's memory estimate of the step compiled for the backend at hand;
* the step time on the backend at hand (median over interleaved rounds). On a
  CPU float8 is emulated: the ratio says nothing about a GPU.

The products of ``mxfp8`` are cuDNN's block-scaled dot in the CUDA program
(a custom call, which ``jaxmp.debug.matmul_flops`` counts by its float8 operands,
padding to whole blocks included).

It also measures, without training, the relative error of each row of one
product whose left operand has a few rows 1e5 times larger than the others
(``outlier_rows``): per-tensor float8 scales every row by the large ones',
MXFP8 each block of 32 by its own.

and, unless ``--no-train``, trains the tiny ViT on scikit-learn's digits (8x8,
tiled to 3 channels) and the language model on Python's help topics, both
variants from the same initialisation over the same batches, and compares the
final training loss (mean of the last 20 steps) and the float32 test loss.

Usage::

    python -m benchmarks.float8 --out results/float8
    python -m benchmarks.float8 --out results/float8-quick --quick
    python -m benchmarks.float8 --out results/mxfp8 --models vit_tiny,transformer_lm \
        --variants bfloat16,float8,mxfp8 --repeats 3
    python -m benchmarks.float8 --out results/nvfp4 --models transformer_lm --no-static \
        --variants float8,mxfp8,nvfp4,nvfp4_1d_weights,nvfp4_no_hadamard,nvfp4_nearest,\
nvfp4_keep_none
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from benchmarks import models
from benchmarks import vit as vit_bench

# NVFP4 with all its switches, then with each turned off in turn: NVFP4's options per variant.
NVFP4_SWITCHES = {"nvfp4": {}, "nvfp4_1d_weights": {"weight_blocks_2d": False},
                  "nvfp4_no_hadamard": {"hadamard": False},
                  "nvfp4_nearest": {"stochastic_rounding": False},
                  "nvfp4_keep_none": {"keep": None}}
VARIANTS = ("bfloat16", "float8", "float8_head_bf16", "mxfp8") + tuple(NVFP4_SWITCHES)
TRAIN_VARIANTS = ("float32",) + VARIANTS
COMPUTE_DTYPE = jnp.bfloat16
E4M3 = jnp.float8_e4m3fn
F4 = jnp.float4_e2m1fn


class Model(NamedTuple):
    """One model of the benchmark: a float32 loss ``loss(params, *batch)`` and its inputs."""

    name: str
    loss: Callable
    params: Any
    batch: tuple  # one batch of arrays (timing and shapes)
    optimizer: Any
    outputs: int  # classes or vocabulary: the output projection's width


def is_head(model: Model) -> Callable:
    """Whether a product is the output projection: a weight whose width is the model's output."""
    return lambda p: p.rhs_shape[-1] == model.outputs and len(p.rhs_shape) == 2


def float8_options(model: Model, variant: str) -> tuple[Any, Any]:
    """``(matmul_dtype, float8_rules)`` of a variant; ``float8_head_bf16`` keeps the output
    projection (the product whose result has the model's output width) in bfloat16."""
    if variant in ("bfloat16", "float32"):
        return None, None
    if variant in ("float8", "mxfp8"):
        return E4M3, None
    if variant in NVFP4_SWITCHES:  # the products kept: NVFP4.keep's rules
        return F4, None
    return E4M3, jaxmp.experimental.Float8Rules(keep_if=is_head(model))


def vit_model(config_name: str, batch_size: int, seed: int = 0) -> Model:
    config = vit_bench.CONFIGS[config_name]
    params = models.init_vit(jax.random.key(seed), config)
    batch = vit_bench.random_batch(jax.random.key(seed + 1), config, batch_size)
    loss = functools.partial(models.vit_loss, config=config)
    return Model(f"vit_{config_name}", loss, params, batch, optax.adam(1e-3), config.num_classes)


def _transformer_example():
    from examples.haiku import transformer  # pylint: disable=g-import-not-at-top

    return transformer


def transformer_model(batch_size: int, seq_len: int, width: int, layers: int, heads: int,
                      steps: int, seed: int = 0):
    """The language model of examples/haiku/transformer.py, with its optimizer; and its corpus."""
    ex = _transformer_example()
    corpus = ex.load_corpus()
    model = ex.make_model(len(corpus.vocab), width, layers, heads)
    loss = ex.make_loss_fn(model)
    params = model.init(jax.random.key(seed), np.zeros((1, seq_len), np.int32))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(
        optax.warmup_cosine_decay_schedule(0.0, 2e-3, steps // 10 + 1, steps)))
    batch = next(ex.batches(corpus.train, batch_size, seq_len, 1, seed))
    return Model("transformer_lm", loss, params, tuple(jnp.asarray(b) for b in batch),
                 optimizer, len(corpus.vocab)), corpus


def float8_scaling(variant: str, model: Model | None = None) -> Any:
    """The ``float8_scaling`` of a variant: ``"mxfp8"`` for ``mxfp8``, an ``NVFP4`` for the
    ``nvfp4`` variants, else ``"tensor"``.

    NVFP4 keeps attention's batched products and ``model``'s output projection in bfloat16
    (the recipe's rule; the Haiku model's head has no ``head`` scope to name), but for
    ``nvfp4_keep_none``, which keeps none.
    """
    if variant in NVFP4_SWITCHES:
        options = dict(NVFP4_SWITCHES[variant])
        if "keep" in options:
            options["keep"] = jaxmp.experimental.Float8Rules()
        elif model is not None:
            head = is_head(model)
            options["keep"] = jaxmp.experimental.Float8Rules(
                keep_if=lambda p: p.batched or head(p))
        return jaxmp.experimental.NVFP4(**options)
    return "mxfp8" if variant == "mxfp8" else "tensor"


def autocast_loss(model: Model, variant: str) -> Callable:
    matmul_dtype, rules = float8_options(model, variant)
    return jaxmp.autocast(model.loss, COMPUTE_DTYPE, matmul_dtype=matmul_dtype,
                          float8_rules=rules, float8_scaling=float8_scaling(variant, model))


def make_step(model: Model, variant: str) -> tuple[Callable, Callable]:
    """``(init, step)``: a jaxmp training step with bfloat16 autocast and the variant's products.

    ``float8`` goes through ``mp_value_and_grad(..., matmul_dtype=)``; a variant
    with rules gives ``mp_value_and_grad`` a loss already under
    ``jaxmp.autocast(..., float8_rules=)`` (the outer autocast keeps its
    float8 products).
    """
    optimizer = model.optimizer
    matmul_dtype, rules = float8_options(model, variant)
    if variant == "float32":  # the reference: no casts, no scaling
        grad_fn = jaxmp.mp_value_and_grad(model.loss, use_mixed_precision=False,
                                          compute_dtype=jnp.float16)
    elif rules is None:
        grad_fn = jaxmp.mp_value_and_grad(model.loss, compute_dtype=COMPUTE_DTYPE, autocast=True,
                                          matmul_dtype=matmul_dtype,
                                          float8_scaling=float8_scaling(variant, model))
    else:
        grad_fn = jaxmp.mp_value_and_grad(autocast_loss(model, variant),
                                          compute_dtype=COMPUTE_DTYPE, autocast=True)

    def init(params):
        return {"params": params, "opt_state": optimizer.init(params),
                "scaler": jaxmp.noop_scaler()}

    def step(state, *batch):
        value, grads, scaler, finite = grad_fn(state["params"], *batch,
                                               scaler_state=state["scaler"])
        params, opt_state = jaxmp.optimizer_update(state["params"], optimizer,
                                                   state["opt_state"], grads, finite)
        return {"params": params, "opt_state": opt_state, "scaler": scaler}, value

    return init, step


def share_totals(flops: dict[str, int]) -> dict[str, float]:
    """Total, float8 (float4 included) and low-precision (those, bfloat16, float16) FLOPs of
    ``matmul_flops`` counts."""
    total = sum(flops.values())
    float8 = sum(v for k, v in flops.items()
                 if all(p.startswith(("float8", "float4")) for p in k.split("+")))
    low = float8 + flops.get("bfloat16", 0) + flops.get("float16", 0)
    return {"total": total, "float8": float8, "low": low}


def static_figures(model: Model, variant: str) -> tuple[dict, Any, Any]:
    """FLOP shares, saved activations and XLA memory of one variant; its compiled step."""
    loss = autocast_loss(model, variant)
    init, step = make_step(model, variant)
    state = init(model.params)
    platform = "cuda"  # mxfp8's products: cuDNN's block-scaled dot, counted by matmul_flops
    flops = jaxmp.debug.matmul_flops(step, state, *model.batch, platform=platform)
    fwd = share_totals(jaxmp.debug.matmul_flops(loss, model.params, *model.batch, platform=platform))
    both = share_totals(flops)
    bwd = {k: both[k] - fwd[k] for k in fwd}
    row = {
        "matmul_flops": flops,
        "flops_platform": platform,
        "float8_share_forward": fwd["float8"] / fwd["total"],
        "float8_share_backward": bwd["float8"] / bwd["total"] if bwd["total"] else 0.0,
        "float8_share_step": both["float8"] / both["total"],
        "low_precision_share_step": both["low"] / both["total"],
        "saved_activation_bytes": jaxmp.debug.saved_activation_bytes(loss, model.params, *model.batch),
    }
    compiled = jax.jit(step, donate_argnums=0).lower(state, *model.batch).compile()
    row.update(vit_bench.xla_memory(compiled))
    return row, compiled, init


def time_steps(compiled: dict, inits: dict, model: Model, repeats: int, warmup: int = 2
               ) -> dict[str, float]:
    """Median step time per variant, rounds interleaved so that background load hits all alike."""
    states = {name: inits[name](jax.tree_util.tree_map(jnp.copy, model.params))
              for name in compiled}
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for i in range(warmup + repeats):
        for name, exe in compiled.items():
            start = time.perf_counter()
            states[name], loss = exe(states[name], *model.batch)
            jax.block_until_ready((states[name], loss))
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def outlier_rows(rows: int = 256, depth: int = 512, outputs: int = 256, large: int = 4,
                 factor: float = 1e5, seed: int = 0) -> dict[str, Any]:
    """Relative error of each row of ``x @ w`` where ``large`` rows of ``x`` are ``factor`` times
    larger than the others, against float64: worst row, median row, the large rows' worst.

    Variants: bfloat16 autocast, per-tensor float8 and MXFP8 (bfloat16 compute).
    """
    kx, kw = jax.random.split(jax.random.key(seed))
    x = np.array(jax.random.normal(kx, (rows, depth)), np.float32)
    w = np.asarray(jax.random.normal(kw, (depth, outputs)) / np.sqrt(depth), np.float32)
    big = np.arange(large) * (rows // large)  # spread over the rows
    x[big] *= factor
    exact = x.astype(np.float64) @ w.astype(np.float64)
    product = lambda w, x: x @ w
    out: dict[str, Any] = {"shape": [rows, depth, outputs], "large_rows": large,
                           "factor": factor}
    for variant in ("bfloat16", "float8", "mxfp8"):
        matmul_dtype = None if variant == "bfloat16" else E4M3
        fn = jaxmp.autocast(product, COMPUTE_DTYPE, matmul_dtype=matmul_dtype,
                            float8_scaling=float8_scaling(variant))
        got = np.asarray(jax.jit(fn)(w, x), np.float64)
        err = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
        out[variant] = {"worst_row": float(err.max()), "median_row": float(np.median(err)),
                        "worst_large_row": float(err[big].max())}
    out["worst_row_ratio_float8_to_mxfp8"] = (out["float8"]["worst_row"]
                                              / out["mxfp8"]["worst_row"])
    return out


# --- Training: the same steps in both variants ---------------------------------------------------


def digits_batches(steps: int, batch_size: int, seed: int = 0, upsample: int = 1):
    """scikit-learn's digits, 8x8 tiled to 3 channels (and upsampled ``upsample`` times in
    each direction: 4 for the desktop ViT's 32x32); and the test split."""
    from examples import digits  # pylint: disable=g-import-not-at-top

    train, test = digits.load()
    ones = np.ones((1, upsample, upsample, 1), np.float32)
    tile = lambda images: np.kron(np.repeat(images, 3, axis=-1), ones)
    stacked = digits.epoch_batches(train, batch_size, steps, seed)
    data = [(tile(stacked.images[i]), stacked.labels[i]) for i in range(steps)]
    return data, (tile(test.images), test.labels)


def train(model: Model, variant: str, data, test_batches) -> dict[str, Any]:
    init, step = make_step(model, variant)
    step = jax.jit(step)
    state = init(model.params)
    losses = []
    start = time.perf_counter()
    for batch in data:
        state, loss = step(state, *batch)
        losses.append(loss)
    losses = np.asarray(jax.device_get(losses), np.float64)
    seconds = time.perf_counter() - start
    evaluate = jax.jit(model.loss)  # float32
    test = float(np.mean([float(evaluate(state["params"], *b)) for b in test_batches]))
    return {"final_train_loss": float(np.mean(losses[-20:])), "first_loss": float(losses[0]),
            "test_loss_float32": test, "seconds": seconds, "steps": len(data),
            "nonfinite_losses": int(np.sum(~np.isfinite(losses)))}


def run(args) -> dict[str, Any]:
    results: dict[str, Any] = {"machine": vit_bench.machine_info(),
                               "command": "python -m benchmarks.float8 " + " ".join(args.argv),
                               "static": {}, "training": {}, "outlier_rows": outlier_rows()}
    print("outlier rows: " + json.dumps(results["outlier_rows"]), flush=True)
    lm, corpus = transformer_model(args.lm_batch, args.lm_seq_len, args.lm_width,
                                   args.lm_layers, args.lm_heads, args.lm_steps)
    chosen = {"vit_tiny": lambda: vit_model("tiny", args.tiny_batch),
              "vit_desktop": lambda: vit_model("desktop", args.desktop_batch),
              "transformer_lm": lambda: lm}
    for name in args.models if args.static else ():
        model = chosen[name]()
        rows, compiled, inits = {}, {}, {}
        for variant in args.variants:
            rows[variant], compiled[variant], inits[variant] = static_figures(model, variant)
        if args.repeats:
            for variant, t in time_steps(compiled, inits, model, args.repeats).items():
                rows[variant]["step_time_s"] = t
        results["static"][name] = rows
        print(f"{name}: " + json.dumps({v: {k: r[k] for k in r if k != "matmul_flops"}
                                        for v, r in rows.items()}), flush=True)
        del compiled

    if args.train:
        results["training"] = training(args, corpus)
    return results


def training(args, corpus) -> dict[str, Any]:
    """Trains every variant (and float32) per seed on the same batches; mean final losses."""
    ex = _transformer_example()
    names = [n for n, m in (("vit_tiny_digits", "vit_tiny"), ("transformer_lm", "transformer_lm"))
             if m in args.models]
    if args.desktop_train_steps:
        names.append("vit_desktop_digits")
    out = {}
    for name in names:
        per_seed = []
        for seed in range(args.seeds):
            if name == "vit_tiny_digits":
                model = vit_model("tiny", args.tiny_batch, seed=seed)
                data, (tx, ty) = digits_batches(args.vit_steps, args.tiny_batch, seed=seed)
                test = [(tx[i:i + 120], ty[i:i + 120]) for i in range(0, len(ty) - 119, 120)]
            elif name == "vit_desktop_digits":
                model = vit_model("desktop", args.desktop_train_batch, seed=seed)
                data, (tx, ty) = digits_batches(args.desktop_train_steps,
                                                args.desktop_train_batch, seed=seed, upsample=4)
                test = [(tx[i:i + 60], ty[i:i + 60]) for i in range(0, 240, 60)]
            else:
                model, _ = transformer_model(args.lm_batch, args.lm_seq_len, args.lm_width,
                                             args.lm_layers, args.lm_heads, args.lm_steps, seed)
                data = [tuple(b) for b in ex.batches(corpus.train, args.lm_batch,
                                                     args.lm_seq_len, args.lm_steps, seed=seed)]
                test = list(ex.batches(corpus.test, args.lm_batch, args.lm_seq_len, 8, seed=1234))
            variants = [v for v in (TRAIN_VARIANTS if name != "vit_desktop_digits" else VARIANTS)
                        if v in args.variants or v == "float32" and args.train_float32]
            per_seed.append({v: train(model, v, data, test) for v in variants})
            print(f"{name} seed {seed}: " + json.dumps(per_seed[-1]), flush=True)
        mean = {v: float(np.mean([r[v]["final_train_loss"] for r in per_seed]))
                for v in variants}
        out[name] = {
            "steps": len(data), "seeds": per_seed, "mean_final_train_loss": mean,
            "ratio_to_bfloat16": {v: mean[v] / mean["bfloat16"] for v in variants},
            "per_seed_ratio_to_bfloat16": {
                v: [r[v]["final_train_loss"] / r["bfloat16"]["final_train_loss"] for r in per_seed]
                for v in variants},
            "nonfinite_losses": sum(r[v]["nonfinite_losses"] for r in per_seed
                                    for v in variants),
        }
    return out


def markdown(results: dict[str, Any]) -> str:
    outliers = results["outlier_rows"]
    lines = [f"Product {'x'.join(map(str, outliers['shape']))} with {outliers['large_rows']} "
             f"rows {outliers['factor']:g} times larger: relative error per row",
             "", "| variant | worst row | median row | worst large row |", "|---|---|---|---|"]
    for v in ("bfloat16", "float8", "mxfp8"):
        r = outliers[v]
        lines.append(f"| {v} | {r['worst_row']:.4f} | {r['median_row']:.4f} | "
                     f"{r['worst_large_row']:.4f} |")
    lines += ["", "| model | variant | float8 share fwd / bwd / step | low-precision share | "
              "saved activations (MiB) | XLA estimate (MiB) | step time (ms) |",
              "|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2**20:.2f}" if b is not None else "-"
    for name, rows in results["static"].items():
        for variant, r in rows.items():
            t = r.get("step_time_s")
            lines.append(
                f"| {name} | {variant} | {100 * r['float8_share_forward']:.2f}% / "
                f"{100 * r['float8_share_backward']:.2f}% / {100 * r['float8_share_step']:.2f}% | "
                f"{100 * r['low_precision_share_step']:.2f}% | {mib(r['saved_activation_bytes'])} | "
                f"{mib(r.get('xla_total_bytes'))} | {'-' if t is None else f'{1e3 * t:.1f}'} |")
    if results["training"]:
        lines += ["", "| run | steps x seeds | variant | final train loss (mean of last 20 "
                  "steps, mean over seeds) | ratio to bfloat16 | per seed | test loss "
                  "(float32 eval, mean) |", "|---|---|---|---|---|---|---|"]
        for name, out in results["training"].items():
            for v in out["mean_final_train_loss"]:
                per = ", ".join(f"{r:.3f}" for r in out["per_seed_ratio_to_bfloat16"][v])
                test = np.mean([r[v]["test_loss_float32"] for r in out["seeds"]])
                lines.append(f"| {name} | {out['steps']} x {len(out['seeds'])} | {v} | "
                             f"{out['mean_final_train_loss'][v]:.4f} | "
                             f"{out['ratio_to_bfloat16'][v]:.4f} | {per} | {test:.4f} |")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--models", default="vit_tiny,vit_desktop,transformer_lm")
    parser.add_argument("--tiny-batch", type=int, default=64)
    parser.add_argument("--desktop-batch", type=int, default=64)
    parser.add_argument("--vit-steps", type=int, default=100,
                        help="tiny-ViT training steps (past ~200 the digits loss is near 0)")
    parser.add_argument("--seeds", type=int, default=3, help="training runs per model")
    parser.add_argument("--desktop-train-steps", type=int, default=0,
                        help="also train the desktop ViT on digits upsampled to 32x32 (slow)")
    parser.add_argument("--desktop-train-batch", type=int, default=16)
    parser.add_argument("--no-static", dest="static", action="store_false",
                        help="training only: no FLOP shares, memory or timing")
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument("--lm-batch", type=int, default=16)
    parser.add_argument("--lm-seq-len", type=int, default=64)
    parser.add_argument("--lm-width", type=int, default=128)
    parser.add_argument("--lm-layers", type=int, default=2)
    parser.add_argument("--lm-heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps (0: no timing)")
    parser.add_argument("--no-train", dest="train", action="store_false")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {','.join(VARIANTS)} (bfloat16 is always run)")
    parser.add_argument("--no-float32", dest="train_float32", action="store_false",
                        help="do not train the float32 reference")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny ViT and a 1-layer LM, 25 training steps each")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    args.variants = ["bfloat16"] + [v for v in VARIANTS[1:] if v in args.variants.split(",")]
    if args.quick:
        args.models = [m for m in args.models if m != "vit_desktop"]
        args.vit_steps = 25
        args.lm_steps = min(args.lm_steps, 25)
        args.seeds = 1
        args.tiny_batch, args.lm_batch, args.lm_seq_len = 32, 8, 32
        args.lm_width, args.lm_layers, args.lm_heads = 32, 1, 2
        args.repeats = min(args.repeats, 2)
    return args


def main(argv=None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    table = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    print(table)
    return results


if __name__ == "__main__":
    main()
