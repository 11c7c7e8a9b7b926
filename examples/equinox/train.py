"""Equinox: a Vision Transformer trained on the digits in float32, float16 or bfloat16.

    python -m examples.equinox.train --precision float16
    python -m examples.equinox.train --precision float32 float16 bfloat16  # side by side

(from the repository root). The model is an ordinary Equinox module. The jaxmp
part is the training step (``make_train_chunk``): the usual
``eqx.partition``/``eqx.combine`` pattern around ``jaxmp.mp_value_and_grad``
and ``jaxmp.optimizer_update``, with the loss-scaler state carried through
``jax.lax.scan`` like the optimizer state.
"""

from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jaxmp
from examples import cli
from examples import digits

DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


# --------------------------------------------------------------------------- model
class Block(eqx.Module):
    """Pre-norm transformer block: attention then MLP, each with a residual."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, dim: int, heads: int, mlp_dim: int, *, key):
        k1, k2 = jax.random.split(key)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attention = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.mlp = eqx.nn.MLP(dim, dim, mlp_dim, depth=1, activation=jax.nn.gelu, key=k2)

    def __call__(self, x):  # x: [tokens, dim]
        # In float16, layer-norm statistics and the attention softmax are where
        # a transformer overflows (a variance or a sum of exponentials beyond
        # 65504). Equinox already computes both in float32 internally
        # (LayerNorm and dot_product_attention upcast and cast back), so
        # nothing needs wrapping here: see cross_entropy below for what does.
        y = jax.vmap(self.norm1)(x)
        x = x + self.attention(y, y, y)
        y = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.mlp)(y)


class ViT(eqx.Module):
    """Patch embedding, a class token, transformer blocks and a linear head."""

    patch: int = eqx.field(static=True)
    embed: eqx.nn.Linear
    cls_token: jax.Array
    positions: jax.Array
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, image_size=8, channels=1, patch=4, dim=32, depth=2, heads=4,
                 mlp_dim=64, classes=10, key):
        keys = jax.random.split(key, depth + 4)
        tokens = (image_size // patch) ** 2
        self.patch = patch
        self.embed = eqx.nn.Linear(patch * patch * channels, dim, key=keys[0])
        self.cls_token = 0.02 * jax.random.normal(keys[1], (1, dim))
        self.positions = 0.02 * jax.random.normal(keys[2], (tokens, dim))
        self.blocks = [Block(dim, heads, mlp_dim, key=k) for k in keys[4:]]
        self.norm = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, classes, key=keys[3])

    def __call__(self, image):  # image: [height, width, channels] -> logits [classes]
        h, w, c = image.shape
        p = self.patch
        patches = image.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
        x = jax.vmap(self.embed)(patches.reshape(-1, p * p * c)) + self.positions
        x = jnp.concatenate([self.cls_token, x])
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[0]))


# The loss is the one place this model needs help in float16. A well-classified
# example's cross-entropy is log(1 + something small), and float16 numbers near 1
# are 2**-10 apart: late in training a float16 loss is off by about 5% and its
# gradient (softmax - one_hot) by about 3%. So the loss runs in float32: the
# logits are cast up, the integer labels pass unchanged.
@jaxmp.force_full_precision
def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def loss_fn(model, images, labels):
    return cross_entropy(jax.vmap(model)(images), labels)


# ------------------------------------------------------------- the jaxmp adapter
class TrainState(NamedTuple):
    params: ViT  # the floating-point leaves of the model (None elsewhere)
    opt_state: optax.OptState
    scaler: jaxmp.ScalerState


def make_train_chunk(static, optimizer, precision):
    """Returns a jitted function running ``jax.lax.scan`` of training steps over a chunk."""
    grad_fn = jaxmp.mp_value_and_grad(
        loss_fn, compute_dtype=DTYPES[precision], use_mixed_precision=precision != "float32")

    def step(state: TrainState, batch: digits.Split):
        model = eqx.combine(state.params, static)
        # Takes the module itself; autocast (the default) runs its products in
        # the compute dtype, the gradients come back in float32 (None for
        # other leaves).
        loss, grads, scaler, finite = grad_fn(
            model, batch.images, batch.labels, scaler_state=state.scaler)
        # Skipped (parameters and Adam moments unchanged) when not finite.
        params, opt_state = jaxmp.optimizer_update(
            state.params, optimizer, state.opt_state, grads, finite)
        return TrainState(params, opt_state, scaler), (loss, state.scaler.scale, finite)

    return jax.jit(lambda state, batches: jax.lax.scan(step, state, batches))


# ------------------------------------------------------------------------ training
class Config(NamedTuple):
    steps: int = 1000
    chunk: int = 50  # steps per jitted lax.scan call (the progress bar moves per chunk)
    batch_size: int = 64
    learning_rate: float = 3e-3
    patch: int = 4  # 4x4 patches: 4 tokens plus the class token
    dim: int = 32
    depth: int = 2
    heads: int = 4
    mlp_dim: int = 64
    # float16 only: shorter than the default 2000, so that a run of a thousand
    # steps tries larger scales (and shows what an overflow does).
    growth_interval: int = 200
    seed: int = 0


class Result(NamedTuple):
    precision: str
    accuracy: float  # on the test split
    losses: np.ndarray  # training loss of every step
    scales: np.ndarray  # the loss scale every step used
    finite: np.ndarray  # whether each step's gradients were finite (False: skipped)
    skipped_steps: int
    final_scale: float
    seconds_per_step: float  # compiled training steps only (compilation timed apart)
    compile_seconds: float
    model: ViT


def build(config: Config):
    model = ViT(patch=config.patch, dim=config.dim, depth=config.depth, heads=config.heads,
                mlp_dim=config.mlp_dim, key=jax.random.key(config.seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimizer = optax.adamw(optax.cosine_decay_schedule(config.learning_rate, config.steps))
    return params, static, optimizer


def accuracy(model, split: digits.Split, precision: str) -> float:
    model, images = jaxmp.cast_tree((model, split.images), DTYPES[precision])
    predict = eqx.filter_jit(lambda m, x: jnp.argmax(jax.vmap(m)(x), axis=-1))
    return float(np.mean(np.asarray(predict(model, images)) == split.labels))


def train(precision: str, config: Config, progress: bool = True) -> Result:
    train_split, test_split = digits.load()
    params, static, optimizer = build(config)
    # Dynamic loss scaling for float16; none for bfloat16 (float32's exponent
    # range: nothing for a scale to rescue) and float32. Non-finite steps are
    # skipped in every case.
    scaler = jaxmp.scaler_for(DTYPES[precision], growth_interval=config.growth_interval)
    state = TrainState(params, optimizer.init(params), scaler)
    chunk_size = min(config.chunk, config.steps)
    steps = config.steps // chunk_size * chunk_size  # whole chunks: one compiled program
    batches = digits.epoch_batches(train_split, config.batch_size, steps, seed=config.seed)
    chunks = [jax.tree_util.tree_map(lambda x, i=i: x[i:i + chunk_size], batches)
              for i in range(0, steps, chunk_size)]

    start = time.perf_counter()
    train_chunk = make_train_chunk(static, optimizer, precision).lower(state, chunks[0]).compile()
    compile_seconds = time.perf_counter() - start

    losses, scales, finite = [], [], []
    bar = tqdm(total=steps, desc=precision, disable=not progress, leave=False)
    start = time.perf_counter()
    for chunk in chunks:
        state, (loss, scale, ok) = train_chunk(state, chunk)
        loss, scale = np.asarray(loss), np.asarray(scale)  # waits for the chunk
        losses.append(loss)
        scales.append(scale)
        finite.append(np.asarray(ok))
        bar.update(len(loss))
        bar.set_postfix(loss=f"{loss.mean():.3f}", scale=f"{float(state.scaler.scale):.0f}",
                        skipped=int(state.scaler.skipped_steps))
    seconds = time.perf_counter() - start
    bar.close()

    model = eqx.combine(state.params, static)
    return Result(precision, accuracy(model, test_split, precision), np.concatenate(losses),
                  np.concatenate(scales), np.concatenate(finite), int(state.scaler.skipped_steps),
                  float(state.scaler.scale), seconds / steps, compile_seconds, model)


def rows(results: Sequence[Result], config: Config) -> list[tuple[str, list[str]]]:
    """The rows of the side-by-side table, one value per result."""
    tail = min(config.chunk, config.steps)
    return [
        ("test accuracy", [f"{100 * r.accuracy:.2f}%" for r in results]),
        (f"final train loss (mean of last {tail} steps)",
         [f"{r.losses[-tail:].mean():.4f}" for r in results]),
        (f"time per step, {jax.default_backend()} (compilation)",
         [f"{1000 * r.seconds_per_step:.2f} ms ({r.compile_seconds:.1f} s)" for r in results]),
        ("skipped steps", [str(r.skipped_steps) for r in results]),
        ("final loss scale", [f"{r.final_scale:.0f}" for r in results]),
    ]


def parse_args(description: str, argv: Sequence[str] | None = None, **more):
    """The flags of this example (one per :class:`Config` field) and ``more``.

    Returns:
        ``(args, config)``: the parsed flags and the :class:`Config` they give.
    """
    args = cli.parse_args(description, argv, **more, **Config()._asdict())
    return args, Config(**{name: getattr(args, name) for name in Config._fields})


def main(argv: Sequence[str] | None = None) -> list[Result]:
    args, config = parse_args(__doc__, argv)
    results = [train(precision, config) for precision in args.precision]
    print(cli.table(args.precision, rows(results, config)))
    return results


if __name__ == "__main__":
    main()
