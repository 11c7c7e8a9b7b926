"""Flax (linen): a small CNN with BatchNorm, trained on the digits in float32, float16 or bfloat16.

    python -m examples.flax.train_linen --precision float16
    python -m examples.flax.train_linen --precision float32 float16 bfloat16  # side by side

(from the repository root). What it shows:

* the loss function of a linen training loop, ``loss_fn(params, batch_stats,
  images, labels)`` with ``model.apply(..., mutable=["batch_stats"])``, the
  updated statistics returned through ``has_aux``. Autocast (jaxmp's default)
  runs the convolutions and products in half precision and the statistics in
  float32, and ``batch_stats`` come back float32; the new statistics are kept
  only when the step is finite;
* a jitted training step in a Python loop, with the loss-scaler state carried
  like any other state. (Not ``lax.scan`` over steps: on XLA:CPU, convolutions
  inside a loop body run some 50x slower than the same step called from Python,
  jax-ml/jax#12868.)

No ``dtype=`` attribute is needed on the modules: autocast chooses the precision
of each operation (a module with ``dtype=jnp.float32`` trains in half precision
too). ``nn.BatchNorm`` computes its statistics and normalises in float32 by
itself (``force_float32_reductions``) and returns the dtype of its input.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jaxmp
from examples import digits
from examples import training

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


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


class TrainState(NamedTuple):
    params: Any
    batch_stats: Any  # float32
    opt_state: Any
    scaler: jaxmp.ScalerState


def make_train_step(model: nn.Module, optimizer, precision: str):
    def loss_fn(params, batch_stats, images, labels):
        variables = {"params": params, "batch_stats": batch_stats}
        logits, updates = model.apply(variables, images, train=True, mutable=["batch_stats"])
        logits = logits.astype(jnp.float32)  # the softmax in float32
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates["batch_stats"]

    # Autocast (the default) runs the products in the compute dtype whatever the
    # dtypes of the inputs. no_cast_argnums=1 keeps the state argument exactly
    # as given if the inputs are cast instead (autocast=False).
    grad_fn = jaxmp.mp_value_and_grad(
        loss_fn, has_aux=True, no_cast_argnums=1, compute_dtype=DTYPES[precision],
        use_mixed_precision=precision != "float32")

    def train_step(ts: TrainState, batch: digits.Split):
        (loss, batch_stats), grads, scaler, finite = grad_fn(
            ts.params, ts.batch_stats, batch.images, batch.labels, scaler_state=ts.scaler)
        params, opt_state = jaxmp.optimizer_update(
            ts.params, optimizer, ts.opt_state, grads, finite)
        # A skipped step keeps the old statistics too.
        batch_stats = jaxmp.select_tree(finite, batch_stats, ts.batch_stats)
        return TrainState(params, batch_stats, opt_state, scaler), loss

    return train_step


def make_predict(model: nn.Module, precision: str):
    """Inference in the compute dtype, returning float32 logits."""
    apply = jaxmp.cast_function(model.apply, DTYPES[precision], return_dtype=jnp.float32)
    return jax.jit(lambda ts, images: apply(
        {"params": ts.params, "batch_stats": ts.batch_stats}, images, train=False))


# ---------------------------------------------------------------------------
# The rest is an ordinary JAX training script.
# ---------------------------------------------------------------------------


def train_and_evaluate(args, precision: str) -> dict[str, float]:
    train, test = digits.load()

    model = CNN(args.width)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    init = jax.jit(model.init, static_argnames="train")
    variables = init(jax.random.key(args.seed), train.images[:1], train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]
    scaler = jaxmp.scaler_for(DTYPES[precision])  # dynamic for float16, none otherwise
    ts = TrainState(params, batch_stats, optimizer.init(params), scaler)

    batches = list(digits.batches(train, args.batch_size, args.steps, seed=args.seed))
    train_step = make_train_step(model, optimizer, precision)
    ts, loss, seconds_per_step, compile_time = training.fit(
        "linen", precision, train_step, ts, batches, args.log_every)

    logits = make_predict(model, precision)(ts, test.images)
    return training.summarize(ts.scaler, training.accuracy(logits, test.labels), loss,
                          seconds_per_step, compile_time)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    return training.main(__doc__, train_and_evaluate, argv)


if __name__ == "__main__":
    main()
