"""The ordinary training-script part of the Haiku and Flax examples.

The compile-then-time loop with its progress bar and the summary table are the
same for every framework; each example keeps its own jaxmp adapter (scaler,
train state, train step, prediction) in plain view and hands the pieces to
these functions.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

import jaxmp
from examples import cli
from examples import digits


def fit(name: str, precision: str, train_step: Callable, ts: Any,
        batches: Sequence[digits.Split], log_every: int) -> tuple[Any, jax.Array, float, float]:
    """Compiles ``train_step`` once, then runs it over ``batches`` and times the steps.

    Compilation is timed apart, and the clock stops only once the final state
    is computed (``block_until_ready``), not when the last step is dispatched.

    Args:
      name: the framework, shown with ``precision`` by the progress bar.
      precision: the name of the compute dtype.
      train_step: ``(ts, batch) -> (ts, loss)``, not yet jitted; ``ts`` has a
        ``scaler`` field holding a ``jaxmp.ScalerState``.
      ts: the initial train state.
      batches: one batch per step.
      log_every: steps between two updates of the loss, loss scale and
        skipped steps shown by the progress bar.

    Returns:
      ``(ts, loss, seconds_per_step, compile_time)``: the final state, the
      loss of the last step, and the times in seconds.
    """
    start = time.perf_counter()
    compiled = jax.jit(train_step).lower(ts, batches[0]).compile()
    compile_time = time.perf_counter() - start

    start = time.perf_counter()
    with tqdm(batches, desc=f"{name} {precision}", unit="step", leave=False) as bar:
        for i, batch in enumerate(bar):
            ts, loss = compiled(ts, batch)
            if (i + 1) % log_every == 0 or i + 1 == len(batches):
                m = jax.device_get(jaxmp.scaler_metrics(ts.scaler))
                bar.set_postfix(loss=f"{float(loss):.4f}", loss_scale=f"{m['loss_scale']:g}",
                                skipped=int(m["skipped_steps"]))
    jax.block_until_ready(ts)
    seconds_per_step = (time.perf_counter() - start) / len(batches)
    return ts, loss, seconds_per_step, compile_time


def accuracy(logits: jax.Array, labels: np.ndarray) -> float:
    """The fraction of ``labels`` that ``logits`` [N, classes] rank first."""
    return float(np.mean(np.argmax(np.asarray(logits), axis=-1) == labels))


def summarize(scaler: jaxmp.ScalerState, accuracy: float, loss: jax.Array,
              seconds_per_step: float, compile_time: float) -> dict[str, float]:
    """The numbers of one run, as :func:`table` shows them."""
    return {
        "test_accuracy": accuracy,
        "final_loss": float(loss),
        "ms_per_step": 1000 * seconds_per_step,
        "compile_s": compile_time,
        "skipped_steps": int(scaler.skipped_steps),
        "loss_scale": float(scaler.scale),
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """The side-by-side table of :func:`summarize` results, one column per precision."""
    runs = list(results.values())
    return cli.table(list(results), [
        ("test accuracy", [f"{100 * r['test_accuracy']:.2f}%" for r in runs]),
        ("final loss", [f"{r['final_loss']:.4f}" for r in runs]),
        (f"time per step, {jax.default_backend()} (compilation)",
         [f"{r['ms_per_step']:.2f} ms ({r['compile_s']:.1f} s)" for r in runs]),
        ("skipped steps", [str(r["skipped_steps"]) for r in runs]),
        ("final loss scale", [f"{r['loss_scale']:g}" for r in runs]),
    ])


def main(description: str, train_and_evaluate: Callable[[Any, str], dict[str, float]],
         argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    """The command line of the digits CNN examples: every precision asked for, then one table."""
    args = cli.parse_args(description, argv, steps=1000, batch_size=64, width=32,
                          learning_rate=3e-3, seed=0, log_every=50)
    results = {precision: train_and_evaluate(args, precision) for precision in args.precision}
    print(table(results))
    return results
