"""Flax (linen): a small CNN with BatchNorm, trained on the digits in float32, float16 or bfloat16.

    python examples/flax/train_linen.py --precision float16
    python examples/flax/train_linen.py --precision float32 float16 bfloat16  # side by side

What it shows:

* ``model.apply(..., mutable=["batch_stats"])`` inside a loss function, with
  the updated ``batch_stats`` returned through
  ``jaxmp.mp_value_and_grad(..., has_aux=True)``; they stay float32;
* a jitted training step in a Python loop, with the loss-scaler state carried
  like any other state. (Not ``lax.scan`` over steps: on XLA:CPU, convolutions
  inside a loop body run some 50x slower than the same step called from Python,
  jax-ml/jax#12868.)

No ``dtype=`` attribute is set on the modules: jaxmp casts the parameters and
the inputs to the compute dtype, and linen computes in the dtype of what it
gets. ``nn.BatchNorm`` computes its statistics and normalises in float32 by
itself (``force_float32_reductions``) and returns the dtype of its input.

``JAXMP_EXAMPLES_QUICK=1`` runs a few steps of a tiny model (the smoke test).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import digits  # noqa: E402  (the shared data helper in examples/)
import training  # noqa: E402  (the shared training loop and summary)

COMPUTE_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


class CNN(nn.Module):
    """Three 3x3 convolutions with BatchNorm, global average pooling, a linear head."""

    width: int = 32

    @nn.compact
    def __call__(self, images: jax.Array, train: bool) -> jax.Array:
        x = images
        for channels, stride in ((self.width, 1), (2 * self.width, 2), (2 * self.width, 1)):
            x = nn.Conv(channels, (3, 3), strides=stride, use_bias=False)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(10)(x)


# ---------------------------------------------------------------------------
# The jaxmp adapter: this block is everything jaxmp adds to a linen program.
# ---------------------------------------------------------------------------


def new_scaler(precision: str) -> jaxmp.ScalerState:
    if precision == "float16":
        return jaxmp.init_scaler()  # dynamic: small float16 gradients would flush to zero
    # float32, and bfloat16 (float32's exponent range: nothing to rescue by scaling);
    # a non-finite step is still detected and skipped.
    return jaxmp.noop_scaler()


class TrainState(NamedTuple):
    params: Any
    batch_stats: Any  # float32
    opt_state: Any
    scaler: jaxmp.ScalerState


def make_train_step(model: nn.Module, optimizer, precision: str):
    grad_fn_options = dict(
        has_aux=True,
        compute_dtype=COMPUTE_DTYPES[precision],
        use_mixed_precision=precision != "float32",
    )

    def train_step(ts: TrainState, batch: digits.Split):
        # batch_stats are closed over, not passed as an argument: mp_value_and_grad
        # casts its arguments to the compute dtype, and the running statistics
        # must not be rounded to half precision every step.
        def loss_fn(params, images, labels):
            variables = {"params": params, "batch_stats": ts.batch_stats}
            logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
            logits = logits.astype(jnp.float32)  # the softmax in float32
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, updates["batch_stats"]

        grad_fn = jaxmp.mp_value_and_grad(loss_fn, **grad_fn_options)
        (loss, batch_stats), grads, scaler, finite = grad_fn(
            ts.params, batch.images, batch.labels, scaler_state=ts.scaler)
        params, opt_state = jaxmp.optimizer_update(
            ts.params, optimizer, ts.opt_state, grads, finite)
        # A skipped step keeps the old statistics too.
        batch_stats = jaxmp.select_tree(finite, batch_stats, ts.batch_stats)
        return TrainState(params, batch_stats, opt_state, scaler), loss

    return train_step


def make_predict(model: nn.Module, precision: str):
    """Inference in the compute dtype, returning float32 logits."""
    apply = jaxmp.cast_function(model.apply, COMPUTE_DTYPES[precision], return_dtype=jnp.float32)
    return jax.jit(lambda ts, images: apply(
        {"params": ts.params, "batch_stats": ts.batch_stats}, images, train=False))


# ---------------------------------------------------------------------------
# The rest is an ordinary JAX training script.
# ---------------------------------------------------------------------------


def train_and_evaluate(args: argparse.Namespace, precision: str) -> dict[str, float]:
    train, test = digits.load()

    model = CNN(args.width)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    init = jax.jit(model.init, static_argnames="train")
    variables = init(jax.random.key(args.seed), train.images[:1], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    ts = TrainState(params, batch_stats, optimizer.init(params), new_scaler(precision))

    batches = list(digits.batches(train, args.batch_size, args.steps, seed=args.seed))
    train_step = make_train_step(model, optimizer, precision)
    ts, loss, seconds_per_step, compile_time = training.fit(
        "linen", precision, train_step, ts, batches, args.log_every)

    logits = make_predict(model, precision)(ts, test.images)
    return training.summarize(precision, ts.scaler, training.accuracy(logits, test.labels),
                              loss, seconds_per_step, compile_time, args.steps)


def main(argv=None) -> dict[str, dict[str, float]]:
    args = training.parse_args(__doc__, argv)
    return {precision: train_and_evaluate(args, precision) for precision in args.precision}


if __name__ == "__main__":
    main()
