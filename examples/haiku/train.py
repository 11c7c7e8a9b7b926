"""Haiku: a small CNN with BatchNorm, trained on the digits in float32, float16 or bfloat16.

    python -m examples.haiku.train --precision float16
    python -m examples.haiku.train --precision float32 float16 bfloat16  # side by side

(from the repository root). What it shows:

* a ``hk.transform_with_state`` model trained the way Haiku's own loops are
  written: the state (the BatchNorm statistics) is an argument of the loss and
  comes back through ``has_aux``, float32; autocast (jaxmp's default) runs
  the convolutions and products in half precision; the new state is kept only
  when the step's gradients are finite;
* Haiku's own per-module precision driven by ``jaxmp.Policy`` values: the
  network computes in half precision and returns float32 logits, BatchNorm
  computes in float32;
* a jitted training step in a Python loop, with the loss-scaler state carried
  like any other state. (Not ``lax.scan`` over steps: on XLA:CPU, convolutions
  inside a loop body run some 50x slower than the same step called from Python,
  jax-ml/jax#12868.)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import optax

import jaxmp
from examples import digits
from examples import training

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


class CNN(hk.Module):
    """Three 3x3 convolutions with BatchNorm, global average pooling, a linear head."""

    def __init__(self, width: int = 32, name: str | None = None):
        super().__init__(name=name)
        self.width = width

    def __call__(self, images: jax.Array, is_training: bool) -> jax.Array:
        x = images
        for channels, stride in ((self.width, 1), (2 * self.width, 2), (2 * self.width, 1)):
            x = hk.Conv2D(channels, kernel_shape=3, stride=stride, with_bias=False)(x)
            x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(x, is_training)
            x = jax.nn.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return hk.Linear(10)(x)


def make_model(width: int) -> hk.TransformedWithState:
    return hk.without_apply_rng(
        hk.transform_with_state(lambda images, is_training: CNN(width)(images, is_training))
    )


# ---------------------------------------------------------------------------
# The jaxmp adapter: this block is everything jaxmp adds to a Haiku program.
# ---------------------------------------------------------------------------


def set_haiku_policies(precision: str) -> None:
    """Haiku's per-module precision, with jaxmp policies (Haiku calls their cast_* methods)."""
    if precision == "float32":
        hk.mixed_precision.clear_policy(CNN)
        hk.mixed_precision.clear_policy(hk.BatchNorm)
        return
    # The network computes in half precision and returns float32 logits for the loss ...
    hk.mixed_precision.set_policy(CNN, jaxmp.get_policy(f"p=float32,c={precision},o=float32"))
    # ... while BatchNorm normalises, and updates its statistics, in float32.
    bn_policy = jaxmp.get_policy(f"p=float32,c=float32,o={precision}")
    hk.mixed_precision.set_policy(hk.BatchNorm, bn_policy)


class TrainState(NamedTuple):
    params: Any
    state: Any  # Haiku state: the BatchNorm statistics, float32
    opt_state: Any
    scaler: jaxmp.ScalerState


def make_train_step(model: hk.TransformedWithState, optimizer, precision: str):
    def loss_fn(params, state, images, labels):
        logits, state = model.apply(params, state, images, is_training=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, state

    # Autocast (the default) runs the products in the compute dtype whatever the
    # dtypes of the inputs. no_cast_argnums=1 keeps the state argument exactly
    # as given if the inputs are cast instead (autocast=False).
    grad_fn = jaxmp.mp_value_and_grad(
        loss_fn, has_aux=True, no_cast_argnums=1, compute_dtype=DTYPES[precision],
        use_mixed_precision=precision != "float32")

    def train_step(ts: TrainState, batch: digits.Split):
        (loss, state), grads, scaler, finite = grad_fn(
            ts.params, ts.state, batch.images, batch.labels, scaler_state=ts.scaler)
        params, opt_state = jaxmp.optimizer_update(
            ts.params, optimizer, ts.opt_state, grads, finite)
        state = jaxmp.select_tree(finite, state, ts.state)  # a skipped step keeps old statistics
        return TrainState(params, state, opt_state, scaler), loss

    return train_step


# ---------------------------------------------------------------------------
# The rest is an ordinary JAX training script.
# ---------------------------------------------------------------------------


def accuracy(model, ts: TrainState, split: digits.Split) -> float:
    logits, _ = jax.jit(model.apply, static_argnames="is_training")(
        ts.params, ts.state, split.images, is_training=False
    )
    return training.accuracy(logits, split.labels)


def train_and_evaluate(args, precision: str) -> dict[str, float]:
    train, test = digits.load()

    set_haiku_policies(precision)
    model = make_model(args.width)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    init = jax.jit(model.init, static_argnames="is_training")
    params, state = init(jax.random.key(args.seed), train.images[:1], is_training=True)
    scaler = jaxmp.scaler_for(DTYPES[precision])  # dynamic for float16, none otherwise
    ts = TrainState(params, state, optimizer.init(params), scaler)

    batches = list(digits.batches(train, args.batch_size, args.steps, seed=args.seed))
    train_step = make_train_step(model, optimizer, precision)
    ts, loss, seconds_per_step, compile_time = training.fit(
        "haiku", precision, train_step, ts, batches, args.log_every)
    return training.summarize(ts.scaler, accuracy(model, ts, test), loss, seconds_per_step,
                          compile_time)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    return training.main(__doc__, train_and_evaluate, argv)


if __name__ == "__main__":
    main()
