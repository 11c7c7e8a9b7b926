"""The ordinary training-script part of the Haiku and Flax examples.

The command-line flags, the compile-then-time loop with its progress bar and
the printed summary are the same for every framework; each example keeps its
own jaxmp adapter (scaler, train state, train step, prediction) in plain view
and hands the pieces to these functions.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from tqdm import tqdm

import jaxmp
import digits

PRECISIONS = ("float32", "float16", "bfloat16")


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses the flags shared by the examples.

    Args:
      description: the text shown by ``--help``; only its first line is used,
        so an example can pass its module docstring.
      argv: the arguments; ``None`` reads ``sys.argv``.

    Returns:
      The parsed flags. ``JAXMP_EXAMPLES_QUICK`` (see ``digits.quick``) makes
      the defaults a few steps of a tiny model.
    """
    quick = digits.quick()
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS,
                        default=["float16"], help="one or more, trained one after the other")
    parser.add_argument("--steps", type=int, default=20 if quick else 1000)
    parser.add_argument("--log-every", type=int, default=10 if quick else 50,
                        help="steps between two updates of the loss shown by the progress bar")
    parser.add_argument("--batch-size", type=int, default=32 if quick else 64)
    parser.add_argument("--width", type=int, default=4 if quick else 32)
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


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
    with tqdm(batches, desc=f"{name} {precision}", unit="step") as bar:
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


def summarize(precision: str, scaler: jaxmp.ScalerState, accuracy: float, loss: jax.Array,
              seconds_per_step: float, compile_time: float, steps: int) -> dict[str, float]:
    """Prints the summary of one run and returns its numbers.

    Args:
      precision: the name of the compute dtype.
      scaler: the final loss-scaler state.
      accuracy: the test accuracy, a fraction.
      loss: the loss of the last step.
      seconds_per_step: the mean time of a step, compilation excluded.
      compile_time: the time to compile the step, in seconds.
      steps: the number of steps run.

    Returns:
      ``test_accuracy``, ``final_loss``, ``ms_per_step``, ``skipped_steps``
      and ``loss_scale``.
    """
    result = {
        "test_accuracy": accuracy,
        "final_loss": float(loss),
        "ms_per_step": 1000 * seconds_per_step,
        "skipped_steps": int(scaler.skipped_steps),
        "loss_scale": float(scaler.scale),
    }
    print(f"\nprecision      {precision}")
    print(f"test accuracy  {100 * result['test_accuracy']:.2f}%")
    print(f"final loss     {result['final_loss']:.4f}")
    print(f"time per step  {result['ms_per_step']:.2f} ms  "
          f"(compile {compile_time:.1f} s, {steps} steps)")
    print(f"skipped steps  {result['skipped_steps']}")
    print(f"loss scale     {result['loss_scale']:g}")
    return result
