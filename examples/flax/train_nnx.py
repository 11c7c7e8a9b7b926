"""Flax (nnx): a small CNN with BatchNorm, trained on the digits in float32, float16 or bfloat16.

    python -m examples.flax.train_nnx --precision float16
    python -m examples.flax.train_nnx --precision float32 float16 bfloat16  # side by side

(from the repository root). What it shows:

* ``nnx.split`` / ``nnx.merge`` around jaxmp's functional core: the module is
  split once into a graph definition, parameters and batch statistics; the
  loss function takes both, merges them back, calls the model and returns the
  updated statistics through ``has_aux``. ``no_cast_argnums`` passes the
  statistics as they are, float32; the new ones are kept only on finite steps;
* per-module precision without a policy mechanism:
  ``jaxmp.force_full_precision`` runs each BatchNorm in float32 and hands its
  output back in the compute dtype;
* a jitted training step in a Python loop, with the loss-scaler state carried
  like any other state. (Not ``lax.scan`` over steps: on XLA:CPU, convolutions
  inside a loop body run some 50x slower than the same step called from Python,
  jax-ml/jax#12868.)

No ``dtype=`` attribute is needed on the modules: autocast (jaxmp's default)
chooses the precision of each operation, nnx's fixed dtypes included.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jaxmp
from examples import digits
from examples import training

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


class CNN(nnx.Module):
    """Three 3x3 convolutions with BatchNorm, global average pooling, a linear head."""

    def __init__(self, width: int = 32, *, rngs: nnx.Rngs):
        shapes = ((1, width, 1), (width, 2 * width, 2), (2 * width, 2 * width, 1))
        self.convs = nnx.List([
            nnx.Conv(cin, cout, (3, 3), strides=stride, use_bias=False, rngs=rngs)
            for cin, cout, stride in shapes
        ])
        self.norms = nnx.List([
            nnx.BatchNorm(cout, momentum=0.9, rngs=rngs) for _, cout, _ in shapes
        ])
        self.head = nnx.Linear(2 * width, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images
        for conv, norm in zip(self.convs, self.norms):
            x = conv(x)
            # BatchNorm in float32, output in the compute dtype. Left alone, it would
            # promote to the float32 of its statistics, and so would every later layer.
            x = jaxmp.force_full_precision(norm, return_dtype=x.dtype)(x)
            x = nnx.relu(x)
        x = jnp.mean(x, axis=(1, 2))
        return self.head(x)


# ---------------------------------------------------------------------------
# The jaxmp adapter: this block is everything jaxmp adds to an nnx program.
# ---------------------------------------------------------------------------


class TrainState(NamedTuple):
    params: Any
    batch_stats: Any  # float32
    opt_state: Any
    scaler: jaxmp.ScalerState


def make_train_step(graphdef: nnx.GraphDef, optimizer, precision: str):
    def loss_fn(params, batch_stats, images, labels):
        # copy=True: fresh Variables that BatchNorm may update inside this trace.
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        logits = model(images).astype(jnp.float32)  # the softmax in float32
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, nnx.state(model, nnx.BatchStat)

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


def make_predict(graphdef: nnx.GraphDef, precision: str):
    """Inference in the compute dtype, returning float32 logits."""
    def predict(params, batch_stats, images):
        model = nnx.merge(graphdef, params, batch_stats)
        model.eval()  # BatchNorm uses the running statistics
        return model(images)

    predict = jaxmp.cast_function(predict, DTYPES[precision], return_dtype=jnp.float32)
    return jax.jit(lambda ts, images: predict(ts.params, ts.batch_stats, images))


# ---------------------------------------------------------------------------
# The rest is an ordinary JAX training script.
# ---------------------------------------------------------------------------


def train_and_evaluate(args, precision: str) -> dict[str, float]:
    train, test = digits.load()

    model = CNN(args.width, rngs=nnx.Rngs(args.seed))
    graphdef, params, batch_stats = nnx.split(model, nnx.Param, nnx.BatchStat)
    optimizer = optax.adam(optax.cosine_decay_schedule(args.learning_rate, args.steps))
    scaler = jaxmp.scaler_for(DTYPES[precision])  # dynamic for float16, none otherwise
    ts = TrainState(params, batch_stats, optimizer.init(params), scaler)

    batches = list(digits.batches(train, args.batch_size, args.steps, seed=args.seed))
    train_step = make_train_step(graphdef, optimizer, precision)
    ts, loss, seconds_per_step, compile_time = training.fit(
        "nnx", precision, train_step, ts, batches, args.log_every)

    logits = make_predict(graphdef, precision)(ts, test.images)
    return training.summarize(ts.scaler, training.accuracy(logits, test.labels), loss,
                          seconds_per_step, compile_time)


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
    return training.main(__doc__, train_and_evaluate, argv)


if __name__ == "__main__":
    main()
