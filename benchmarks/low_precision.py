"""Half the memory of float32 Adam: bfloat16 parameters and state with three roundings.

Trains two models with the same data, initialisation and optimizer, in five ways:

* ``float32``: float32 master weights and float32 Adam, bfloat16 compute
  (``jaxmp.mp_value_and_grad(compute_dtype=jnp.bfloat16)``): the reference;
* ``bf16_optax``: bfloat16 parameters handed to the optax optimizer as they are
  (bfloat16 state and bfloat16 arithmetic): what people do today, and the
  plain bfloat16 update the others are timed against;
* ``nearest``, ``stochastic``, ``kahan``: bfloat16 parameters with
  ``jaxmp.experimental.low_precision_optimizer(inner, state_dtype=jnp.bfloat16,
  param_rounding=...)``.

Models: the character-level transformer language model of
``examples/haiku/transformer.py`` (Python's help topics, nothing downloaded)
and the ViT of ``benchmarks/models.py`` on a synthetic task that can be learnt
(a faint fixed random image per class under Gaussian noise).

For every (model, variant) it records, from the real pytrees and XLA:

* ``bytes_per_param_excluding_fixed``: bytes of the persistent training
  state (parameters + optimizer state + jaxmp's state: scaler, key, Kahan
  buffer) per parameter, leaving out ``fixed_bytes``: integer and scalar
  leaves (step counts, the PRNG key, the scaler's numbers), which do not grow
  with the model; ``state_bytes_per_param`` counts everything;
* ``xla_total_bytes`` / ``xla_temp_bytes``: XLA's memory estimate of the
  compiled training step (``compiled.memory_analysis()``, state donated);
* ``final_loss``: held-out loss (float32 evaluation of the trained parameters,
  fixed batches) and its ratio to the reference;
* ``update_ms``: the optimizer update alone (``tx.update`` +
  ``optax.apply_updates`` on the model's parameters and gradients, jitted,
  state donated), median over rounds that interleave the variants, and
  ``update_time_vs_bf16_optax``, the median over rounds of its ratio to
  ``bf16_optax`` in the same round; the same for one large parameter
  (``--large-leaf``), where the cost per element shows without the cost per
  kernel launch that dominates models of small arrays on a CPU.

Usage::

    python -m benchmarks.low_precision --out results/low_precision
    python -m benchmarks.low_precision --out results/lp-quick --quick    # smoke test, seconds
"""

from __future__ import annotations

import argparse
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
from benchmarks.vit import machine_info, xla_memory

VARIANTS = ("float32", "bf16_optax", "nearest", "stochastic", "kahan")
TARGET_BYTES = {"stochastic": 6.0, "kahan": 8.0}
TARGET_LOSS_RATIO = 1.01
TARGET_TIME_RATIO = 1.10


class Task(NamedTuple):
    """A model to train: initial float32 params, loss, batches and held-out batches."""

    name: str
    params: Any
    loss: Callable  # (params, x, y) -> scalar
    batches: list  # [(x, y)] one per step
    held_out: list  # [(x, y)]
    inner: Callable[[], optax.GradientTransformation]
    description: str


def _schedule(lr: float, steps: int):
    return optax.warmup_cosine_decay_schedule(0.0, lr, steps // 10 + 1, steps)


def transformer_task(steps: int, quick: bool, lr: float) -> Task:
    from examples.haiku import transformer as tr  # pylint: disable=g-import-not-at-top

    width, layers, heads, batch, seq = (32, 1, 2, 4, 16) if quick else (128, 2, 4, 16, 64)
    corpus = tr.load_corpus()
    model = tr.make_model(len(corpus.vocab), width, layers, heads)
    params = model.init(jax.random.key(0), np.zeros((1, seq), np.int32))
    data = list(tr.batches(corpus.train, batch, seq, steps, seed=0))
    held_out = list(tr.batches(corpus.test, batch, seq, 8, seed=1234))

    def inner():  # the example's optimizer
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adam(_schedule(lr, steps)))

    return Task("transformer", params, tr.make_loss_fn(model), data, held_out, inner,
                f"examples/haiku/transformer.py: width {width}, {layers} layers, {heads} heads, "
                f"batch {batch}x{seq} characters, {steps} steps, Adam peak lr {lr:g} "
                "(warmup-cosine), clip 1.0")


def vit_task(steps: int, quick: bool, lr: float) -> Task:
    config = models.TINY_VIT if quick else models.ViTConfig(
        image_size=16, patch_size=4, channels=3, width=64, depth=2, heads=4, mlp_dim=128,
        num_classes=10)
    batch = 8 if quick else 32
    params = models.init_vit(jax.random.key(0), config)
    shape = (config.image_size, config.image_size, config.channels)
    # One fixed random image per class, faint under unit noise: learnt in a few
    # hundred steps, far from solved in them.
    prototypes = 0.3 * jax.random.normal(jax.random.key(42), (config.num_classes,) + shape)

    def make(key):
        k1, k2 = jax.random.split(key)
        labels = jax.random.randint(k1, (batch,), 0, config.num_classes, jnp.int32)
        return prototypes[labels] + jax.random.normal(k2, (batch,) + shape), labels

    data = [make(jax.random.fold_in(jax.random.key(1), i)) for i in range(steps)]
    held_out = [make(jax.random.fold_in(jax.random.key(2), i)) for i in range(8)]

    def loss(p, x, y):
        return models.vit_loss(p, x.astype(jax.tree_util.tree_leaves(p)[0].dtype), y, config)

    def inner():
        return optax.adam(_schedule(lr, steps))

    return Task("vit", params, loss, data, held_out, inner,
                f"benchmarks/models.py ViT: {config.image_size}x{config.image_size} images, patch "
                f"{config.patch_size}, width {config.width}, depth {config.depth}, "
                f"{config.num_classes} classes (noisy class prototypes), batch {batch}, "
                f"{steps} steps, Adam peak lr {lr:g} (warmup-cosine)")


def optimizer_for(variant: str, task: Task) -> tuple[Any, optax.GradientTransformation]:
    """Initial parameters and optimizer of a variant."""
    if variant == "float32":  # a copy: the steps donate their state
        return jax.tree_util.tree_map(jnp.copy, task.params), task.inner()
    params = jaxmp.cast_tree(task.params, jnp.bfloat16)
    if variant == "bf16_optax":
        return params, task.inner()
    return params, jaxmp.experimental.low_precision_optimizer(task.inner(), state_dtype=jnp.bfloat16,
                                                              param_rounding=variant, seed=0)


def is_per_param(x) -> bool:
    """State leaves that grow with the model: floating arrays with at least one dimension."""
    return jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1


def fixed_bytes(state) -> int:
    """Bytes of ``(params, opt_state, scaler)`` that do not grow with the model: the whole
    loss scaler (its scalars and its record of alarm periods, some of which have a shape) and,
    in the parameters and the optimizer state, counts, keys and scalar hyperparameters."""
    params, opt_state, scaler = state
    return tree_bytes(scaler) + int(sum(x.nbytes for x in jax.tree_util.tree_leaves(
        (params, opt_state)) if not is_per_param(x)))


def tree_bytes(tree) -> int:
    return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
                   for x in jax.tree_util.tree_leaves(tree)))


def run_variant(task: Task, variant: str) -> dict[str, Any]:
    params, tx = optimizer_for(variant, task)
    grad_fn = jaxmp.mp_value_and_grad(task.loss, compute_dtype=jnp.bfloat16)

    def step(state, x, y):
        p, opt_state, scaler = state
        loss, grads, scaler, finite = grad_fn(p, x, y, scaler_state=scaler)
        p, opt_state = jaxmp.optimizer_update(p, tx, opt_state, grads, finite)
        return (p, opt_state, scaler), loss

    state = (params, tx.init(params), jaxmp.noop_scaler())
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    row: dict[str, Any] = {
        "model": task.name, "variant": variant, "params": int(n_params),
        "state_bytes": tree_bytes(state),
        "param_bytes": tree_bytes(state[0]),
        "optimizer_state_bytes": tree_bytes(state[1]),
        "scaler_state_bytes": tree_bytes(state[2]),
    }
    row["state_bytes_per_param"] = row["state_bytes"] / n_params
    row["fixed_bytes"] = fixed_bytes(state)
    row["bytes_per_param_excluding_fixed"] = (row["state_bytes"] - row["fixed_bytes"]) / n_params

    jitted = jax.jit(step, donate_argnums=0)
    compiled = jitted.lower(state, *task.batches[0]).compile()
    row.update(xla_memory(compiled))

    losses = []
    start = time.perf_counter()
    for x, y in task.batches:
        state, loss = compiled(state, x, y)
        losses.append(loss)
    jax.block_until_ready(state)
    row["train_seconds"] = time.perf_counter() - start
    losses = np.asarray(jax.device_get(losses), np.float64)
    row["train_loss_last20"] = float(losses[-20:].mean())
    evaluate = jax.jit(task.loss)
    final = jaxmp.cast_tree(state[0], jnp.float32)
    row["final_loss"] = float(np.mean([float(evaluate(final, x, y)) for x, y in task.held_out]))
    row["finite"] = bool(np.all(np.isfinite(losses)))
    return row


def time_updates(params32, grads32, inner, rounds: int, calls: int) -> dict[str, Any]:
    """Milliseconds of one optimizer update (tx.update + apply_updates) per variant.

    Rounds interleave the variants, so that load from other processes on a
    shared machine hits them alike. Returns the median time of each variant
    and the median over rounds of its time relative to ``bf16_optax`` in the
    same round.
    """
    setups = {}
    for variant in VARIANTS:
        task = Task("", params32, None, [], [], inner, "")
        params, tx = optimizer_for(variant, task)
        grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads32, params)

        def update(p, s, g, tx=tx):
            with jax.numpy_dtype_promotion("standard"):
                u, s = tx.update(g, s, p)
                return optax.apply_updates(p, u), s

        fn = jax.jit(update, donate_argnums=(0, 1))
        state = (params, tx.init(params))
        state = fn(*state, grads)  # compile and warm up
        jax.block_until_ready(state)
        setups[variant] = [fn, state, grads]
    times = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            fn, state, grads = setups[variant]
            start = time.perf_counter()
            for _ in range(calls):
                state = fn(*state, grads)
            jax.block_until_ready(state)
            times[variant].append((time.perf_counter() - start) / calls)
            setups[variant][1] = state
    return {
        "ms": {v: 1000 * statistics.median(t) for v, t in times.items()},
        "vs_bf16_optax": {v: statistics.median(a / b for a, b in zip(t, times["bf16_optax"]))
                          for v, t in times.items()},
    }


def large_leaf_timing(size: int, rounds: int, calls: int) -> dict[str, Any]:
    """The same update timing on one parameter of ``size`` elements (no per-leaf overhead)."""
    params = {"w": 0.05 * jax.random.normal(jax.random.key(0), (size,))}
    grads = {"w": jax.random.normal(jax.random.key(1), (size,))}
    return time_updates(params, grads, lambda: optax.adam(1e-3), rounds, calls)


def add_relative(rows: list[dict[str, Any]], timing: dict[str, Any]) -> None:
    ref = next(r for r in rows if r["variant"] == "float32")
    for row in rows:
        row["update_ms"] = timing["ms"][row["variant"]]
        row["update_time_vs_bf16_optax"] = timing["vs_bf16_optax"][row["variant"]]
        row["final_loss_vs_float32"] = row["final_loss"] / ref["final_loss"]
        row["state_bytes_vs_float32"] = row["state_bytes"] / ref["state_bytes"]
        if "xla_total_bytes" in row and "xla_total_bytes" in ref:
            row["xla_total_vs_float32"] = row["xla_total_bytes"] / ref["xla_total_bytes"]
        targets = {}
        if row["variant"] in TARGET_BYTES:
            targets["bytes_per_param"] = (row["bytes_per_param_excluding_fixed"]
                                          <= TARGET_BYTES[row["variant"]])
            targets["final_loss_within_1pct"] = row["final_loss_vs_float32"] <= TARGET_LOSS_RATIO
            targets["update_time_within_10pct"] = (
                row["update_time_vs_bf16_optax"] <= TARGET_TIME_RATIO)
        if row["variant"] == "nearest":
            targets["fails_loss_target (expected)"] = row["final_loss_vs_float32"] > TARGET_LOSS_RATIO
        row["targets"] = targets


def markdown(results: dict[str, Any]) -> str:
    lines = [f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores, "
             f"{results['machine']['backend']} backend, jax {results['machine']['jax_version']}.",
             f"Command: `{results['command']}`", ""]
    for task in results["tasks"]:
        lines.append(f"**{task['name']}**: {task['description']}; "
                     f"{task['rows'][0]['params']:,} parameters.")
        lines.append("")
        lines.append("| variant | state bytes/param | + fixed bytes | XLA step estimate (MiB) | "
                     "final loss | vs float32 | update (ms) | vs bf16 optax |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in task["rows"]:
            xla = f"{r['xla_total_bytes'] / 2**20:.2f}" if "xla_total_bytes" in r else "n/a"
            lines.append(
                f"| {r['variant']} | {r['bytes_per_param_excluding_fixed']:.2f} | "
                f"{r['fixed_bytes']} | {xla} | "
                f"{r['final_loss']:.4f} | {100 * (r['final_loss_vs_float32'] - 1):+.2f}% | "
                f"{r['update_ms']:.3f} | {r['update_time_vs_bf16_optax']:.2f}x |")
        lines.append("")
        checks = []
        for r in task["rows"]:
            for name, ok in r["targets"].items():
                checks.append(f"{r['variant']} {name}: {'met' if ok else 'NOT met'}")
        lines.append("Targets: " + "; ".join(checks) + ".")
        lines.append("")
    if results.get("large_leaf"):
        big = results["large_leaf"]
        lines.append(f"**Update of one parameter of {big['size']:,} elements** (Adam, lr 1e-3; "
                     "no per-leaf kernel overhead):")
        lines.append("")
        lines.append("| variant | update (ms) | vs bf16 optax |")
        lines.append("|---|---:|---:|")
        for v in VARIANTS:
            lines.append(f"| {v} | {big['ms'][v]:.3f} | {big['vs_bf16_optax'][v]:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (a smoke test)")
    parser.add_argument("--models", default="transformer,vit")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 300, quick 10)")
    parser.add_argument("--transformer-lr", type=float, default=3e-4)
    parser.add_argument("--vit-lr", type=float, default=3e-4)
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 15, quick 2)")
    parser.add_argument("--calls", type=int, default=None,
                        help="updates per timing round (default 50, quick 5)")
    parser.add_argument("--large-leaf", type=int, default=None,
                        help="also time the update of one parameter of this many elements "
                             "(default 2**21, quick 0: off)")
    args = parser.parse_args(argv)
    steps = args.steps or (10 if args.quick else 300)
    rounds = args.rounds or (2 if args.quick else 31)
    args.calls = args.calls or (5 if args.quick else 50)
    if args.large_leaf is None:
        args.large_leaf = 0 if args.quick else 2**21
    makers = {"transformer": lambda: transformer_task(steps, args.quick, args.transformer_lr),
              "vit": lambda: vit_task(steps, args.quick, args.vit_lr)}
    results: dict[str, Any] = {
        "machine": machine_info(),
        "command": "python -m benchmarks.low_precision " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "tasks": [],
    }
    for name in args.models.split(","):
        task = makers[name]()
        rows = []
        for variant in VARIANTS:
            row = run_variant(task, variant)
            print(f"{name:12s} {variant:11s} final loss {row['final_loss']:.4f}  "
                  f"{row['state_bytes_per_param']:.3f} bytes/param  "
                  f"trained in {row['train_seconds']:.1f} s", flush=True)
            rows.append(row)
        grads32 = jax.grad(task.loss)(task.params, *task.batches[0])
        add_relative(rows, time_updates(task.params, grads32, task.inner, rounds, args.calls))
        results["tasks"].append({"name": name, "description": task.description, "rows": rows})
    if args.large_leaf:
        results["large_leaf"] = {"size": args.large_leaf, **large_leaf_timing(
            args.large_leaf, rounds, max(1, args.calls // 10))}
    text = markdown(results)
    print()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    return results


if __name__ == "__main__":
    main()
