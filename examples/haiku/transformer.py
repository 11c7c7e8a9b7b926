"""Haiku: a character-level transformer language model in float32, float16 and bfloat16.

    python examples/haiku/transformer.py                      # the three precisions, side by side
    python examples/haiku/transformer.py --precision float16 --no-autocast   # the naive port

The text is Python's own documentation: the help topics that ship with every
Python installation (``pydoc_data.topics``, some 460,000 characters), so
nothing is downloaded. The model is a small pre-LayerNorm transformer built
from ``hk.Embed``, ``hk.MultiHeadAttention``, ``hk.LayerNorm`` and ``hk.Linear``,
with the small embedding initialisation of Haiku's own transformer example.

What it shows:

* the naive float16 port (cast everything to float16, ``--no-autocast``) does
  not train: Haiku's ``LayerNorm`` runs in its input's dtype, and the
  derivative of ``rsqrt`` at a small variance (``rsqrt(v) / v``) exceeds
  float16's 65504 whatever the loss scale. The scaler's stuck detection says
  so after a few steps (a ``jaxmp.TrainingStuckWarning``), and the script
  then prints what ``jaxmp.debug.find_nonfinite`` finds: the backward pass, at
  Haiku's layer-norm line;
* ``mp_value_and_grad(..., autocast=True)`` (the default here) fixes it in
  one argument: normalisation statistics, softmax and sums run in float32,
  the matrix products in float16;
* bfloat16 has float32's range: plain casting trains without loss scaling.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NamedTuple, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

PRECISIONS = ("float32", "float16", "bfloat16")
COMPUTE_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


# ---------------------------------------------------------------------------
# Data: Python's help topics, character by character.
# ---------------------------------------------------------------------------


class Corpus(NamedTuple):
    train: np.ndarray  # int32 character ids
    test: np.ndarray
    vocab: tuple[str, ...]


def load_corpus(test_fraction: float = 0.1) -> Corpus:
    """The help topics that ship with Python, as arrays of character ids."""
    from pydoc_data.topics import topics  # pylint: disable=g-import-not-at-top

    text = "\n\n".join(topics[name] for name in sorted(topics))
    vocab = tuple(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
    split = int(len(ids) * (1.0 - test_fraction))
    return Corpus(ids[:split], ids[split:], vocab)


def batches(ids: np.ndarray, batch_size: int, seq_len: int, steps: int, seed: int):
    """``steps`` batches of random windows: inputs and next-character targets."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq_len - 1, size=batch_size)
        windows = np.stack([ids[s:s + seq_len + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


# ---------------------------------------------------------------------------
# The model: an ordinary Haiku transformer, written in float32.
# ---------------------------------------------------------------------------


class Transformer(hk.Module):
    """A causal pre-LayerNorm transformer over character embeddings."""

    def __init__(self, vocab_size: int, width: int, layers: int, heads: int,
                 name: str | None = None):
        super().__init__(name=name)
        self.vocab_size, self.width, self.layers, self.heads = vocab_size, width, layers, heads

    def __call__(self, tokens: jax.Array) -> jax.Array:
        seq_len = tokens.shape[-1]
        embed_init = hk.initializers.TruncatedNormal(stddev=0.02)  # as Haiku's own example
        x = hk.Embed(self.vocab_size, self.width, w_init=embed_init)(tokens)
        positions = hk.get_parameter("positional_embeddings", [seq_len, self.width],
                                     init=embed_init)
        x = x + positions
        mask = jnp.tril(jnp.ones((1, 1, seq_len, seq_len), jnp.bool_))
        init = hk.initializers.VarianceScaling(2.0 / self.layers)
        for _ in range(self.layers):
            h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
            x = x + hk.MultiHeadAttention(self.heads, self.width // self.heads, w_init=init,
                                          model_size=self.width)(h, h, h, mask=mask)
            h = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
            h = jax.nn.gelu(hk.Linear(4 * self.width, w_init=init)(h))
            x = x + hk.Linear(self.width, w_init=init)(h)
        x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x)
        return hk.Linear(self.vocab_size)(x)


def make_model(vocab_size: int, width: int, layers: int, heads: int) -> hk.Transformed:
    return hk.without_apply_rng(hk.transform(
        lambda tokens: Transformer(vocab_size, width, layers, heads)(tokens)))


def make_loss_fn(model: hk.Transformed):
    def loss_fn(params, inputs, targets):
        logits = model.apply(params, inputs)
        # The loss in float32 whatever the compute dtype (jaxmp scales it in float32 too).
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return loss_fn


# ---------------------------------------------------------------------------
# The jaxmp part: a scaler per precision and the training step.
# ---------------------------------------------------------------------------


def new_scaler(precision: str) -> jaxmp.ScalerState:
    if precision == "float16":
        return jaxmp.init_scaler()
    return jaxmp.noop_scaler()  # bfloat16 and float32: nothing to rescue by scaling


def grad_options(precision: str, autocast: bool) -> dict[str, Any]:
    return dict(
        compute_dtype=COMPUTE_DTYPES[precision],
        use_mixed_precision=precision != "float32",
        # Per-operation precision (the default): normalisation, softmax and sums in float32.
        autocast=autocast,
    )


class TrainState(NamedTuple):
    params: Any  # float32 master weights
    opt_state: Any
    scaler: jaxmp.ScalerState


def make_train_step(loss_fn, optimizer, precision: str, autocast: bool):
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, **grad_options(precision, autocast))

    def train_step(ts: TrainState, inputs, targets):
        loss, grads, scaler, finite = grad_fn(ts.params, inputs, targets, scaler_state=ts.scaler)
        params, opt_state = jaxmp.optimizer_update(ts.params, optimizer, ts.opt_state, grads,
                                                   finite)
        return TrainState(params, opt_state, scaler), loss

    return train_step


# ---------------------------------------------------------------------------
# The rest is an ordinary training script.
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                        help="one or more, trained one after the other")
    parser.add_argument("--autocast", action=argparse.BooleanOptionalAction, default=True,
                        help="float16 with jaxmp's per-operation precision; --no-autocast casts "
                             "everything to float16 (the naive port, which does not train)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per precision")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    parser.add_argument("--width", type=int, default=128, help="model width")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--learning-rate", type=float, default=2e-3,
                        help="peak learning rate of the warmup-cosine schedule")
    parser.add_argument("--log-every", type=int, default=100, help="steps between two progress lines")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    return parser.parse_args(argv)


def evaluate(loss_fn, params, ids: np.ndarray, args: argparse.Namespace) -> float:
    """The float32 test loss in bits per character, over 8 fixed batches."""
    loss = jax.jit(loss_fn)
    losses = [float(loss(params, x, y))
              for x, y in batches(ids, args.batch_size, args.seq_len, 8, seed=1234)]
    return float(np.mean(losses)) / np.log(2.0)


def train(args: argparse.Namespace, precision: str, corpus: Corpus) -> dict[str, float]:
    model = make_model(len(corpus.vocab), args.width, args.layers, args.heads)
    loss_fn = make_loss_fn(model)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(
        optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, args.steps // 10 + 1,
                                           args.steps)))
    params = model.init(jax.random.key(args.seed), np.zeros((1, args.seq_len), np.int32))
    ts = TrainState(params, optimizer.init(params), new_scaler(precision))
    step = jax.jit(make_train_step(loss_fn, optimizer, precision, args.autocast))

    data = list(batches(corpus.train, args.batch_size, args.seq_len, args.steps, args.seed))
    label = precision + ("" if precision != "float16" else
                         " (autocast)" if args.autocast else " (no autocast)")
    start = time.perf_counter()
    step.lower(ts, *data[0]).compile()
    compile_time = time.perf_counter() - start
    losses = []
    start = time.perf_counter()
    for i, (x, y) in enumerate(data):
        ts, loss = step(ts, x, y)
        losses.append(loss)
        if (i + 1) % args.log_every == 0 or i + 1 == len(data):
            m = jax.device_get(jaxmp.scaler_metrics(ts.scaler))
            print(f"{label:22s} step {i + 1:5d}  loss {float(loss):.4f}  "
                  f"scale {m['loss_scale']:g}  skipped {int(m['skipped_steps'])}", flush=True)
    jax.block_until_ready(ts)
    seconds = time.perf_counter() - start

    if int(ts.scaler.overflow_streak) >= ts.scaler.stuck_after:
        # Stuck: ask find_nonfinite which operation overflows, on the last batch,
        # with the options of the training step, at the scale the run is stuck at
        # (as the TrainingStuckWarning advises).
        options = grad_options(precision, args.autocast)
        del options["use_mixed_precision"]
        stuck_at = jaxmp.static_scaler(float(ts.scaler.scale))
        report = jaxmp.debug.find_nonfinite(loss_fn, **options)(ts.params, *data[-1],
                                                                scaler_state=stuck_at)
        print(f"\n{label} is stuck. jaxmp.debug.find_nonfinite says:\n{report}\n")
    return {
        "label": label,
        "train_loss": float(np.mean(np.asarray(losses[-20:]))),
        "test_bits_per_char": evaluate(loss_fn, ts.params, corpus.test, args),
        "skipped_steps": int(ts.scaler.skipped_steps),
        "loss_scale": float(ts.scaler.scale),
        "ms_per_step": 1000 * seconds / len(data),
        "compile_s": compile_time,
    }


def table(results: Sequence[dict[str, Any]]) -> str:
    rows = [
        ("", [r["label"] for r in results]),
        ("train loss (nats, mean of last 20 steps)", [f"{r['train_loss']:.4f}" for r in results]),
        ("test loss (bits per character)", [f"{r['test_bits_per_char']:.4f}" for r in results]),
        ("skipped steps", [str(r["skipped_steps"]) for r in results]),
        ("final loss scale", [f"{r['loss_scale']:g}" for r in results]),
        (f"time per step (ms, {jax.default_backend()})",
         [f"{r['ms_per_step']:.1f}" for r in results]),
    ]
    width = max(18, *(len(r["label"]) + 2 for r in results))
    return "\n".join(f"{name:42s}" + "".join(f"{v:>{width}s}" for v in values)
                     for name, values in rows)


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    corpus = load_corpus()
    print(f"text: {len(corpus.train) + len(corpus.test):,} characters of Python's help topics, "
          f"{len(corpus.vocab)} distinct")
    results = [train(args, precision, corpus) for precision in args.precision]
    print()
    print(table(results))
    return results


if __name__ == "__main__":
    main()
