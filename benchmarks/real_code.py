"""Half-precision share of real framework code, with jaxmp's default and with the inputs cast.

Each pattern is written the way public models write it, and each one made the
cast-the-inputs recipe (``autocast=False``) train in float32 without a word:

* ``linen_dtype_float32``: Flax linen layers that carry ``dtype=jnp.float32``;
* ``linen_batch_in_closure``: the batch captured by the loss's closure;
* ``linen_noise_in_loss``: float32 noise from ``jax.random.normal`` drawn inside the loss (a VAE);
* ``nnx_embed``: a Flax nnx ``Embed`` (its output keeps the parameters' dtype) before ``Linear``s;
* ``equinox_noise_then_conv``: float32 noise added inside the loss before an Equinox ``Conv2d``.

For each, in float16 and bfloat16, the share of matrix-product FLOPs of the
gradient step whose operands are half precision, in the program lowered for a
GPU (nothing runs, so the figure does not depend on the machine)::

    python -m benchmarks.real_code --out results/real_code
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxmp


class LinenMLP(nn.Module):
    """Layers that fix their dtype to float32, as many public models do."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32, dtype=jnp.float32)(x))
        return nn.Dense(4, dtype=jnp.float32)(x)


def _linen_fixed_dtype():
    model = LinenMLP()
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 4))
    params = model.init(jax.random.key(0), x)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, (params, x, y)


def _linen_batch_in_closure():
    model = nn.Dense(8)
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 8))
    params = model.init(jax.random.key(0), x)

    def loss(params):  # the batch is captured, not passed
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, (params,)


class Vae(nn.Module):
    @nn.compact
    def __call__(self, x, key):
        mean = nn.Dense(8)(nn.relu(nn.Dense(32)(x)))
        z = mean + jax.random.normal(key, mean.shape)  # float32 noise drawn in the loss
        return nn.Dense(16)(nn.relu(nn.Dense(64)(z)))  # the decoder: most of the FLOPs


def _linen_noise_in_loss():
    model = Vae()
    x = jnp.ones((8, 16))
    params = model.init(jax.random.key(0), x, jax.random.key(1))

    def loss(params, x, key):
        return jnp.mean((model.apply(params, x, key) - x) ** 2)

    return loss, (params, x, jax.random.key(2))


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(50, 16, rngs=rngs)  # fixes its dtype to the parameters'
        self.hidden = nnx.Linear(16, 32, rngs=rngs)
        self.out = nnx.Linear(32, 50, rngs=rngs)

    def __call__(self, tokens):
        return self.out(nnx.relu(self.hidden(self.embed(tokens))))


def _nnx_embed():
    graphdef, params = nnx.split(NnxLM(nnx.Rngs(0)))
    tokens = jnp.arange(16).reshape(2, 8) % 50

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), tokens).mean()

    return loss, (params, tokens)


def _equinox_noise_then_conv():
    conv = eqx.nn.Conv2d(3, 4, 3, padding=1, key=jax.random.key(0))
    params, static = eqx.partition(conv, eqx.is_inexact_array)
    images = jnp.ones((2, 3, 8, 8))

    def loss(params, images, key):
        model = eqx.combine(params, static)
        noisy = images + jax.random.normal(key, images.shape)  # float32 noise
        return jnp.mean(jax.vmap(model)(noisy) ** 2)

    return loss, (params, images, jax.random.key(3))


PATTERNS = {
    "linen_dtype_float32": _linen_fixed_dtype,
    "linen_batch_in_closure": _linen_batch_in_closure,
    "linen_noise_in_loss": _linen_noise_in_loss,
    "nnx_embed": _nnx_embed,
    "equinox_noise_then_conv": _equinox_noise_then_conv,
}


def half_share(loss, args, **options) -> float | str:
    """The half-precision matmul FLOP share of ``mp_value_and_grad(loss, **options)``'s step."""
    grad_fn = jaxmp.mp_value_and_grad(loss, **options)
    scaler = jaxmp.scaler_for(options["compute_dtype"])
    try:
        return jaxmp.debug.half_matmul_flop_share(lambda *a: grad_fn(*a, scaler_state=scaler)[1], *args)
    except TypeError as error:  # float32 noise meets float16 weights in an Equinox layer
        return f"TypeError: {str(error).splitlines()[0][:60]}"


def run() -> list[dict]:
    rows = []
    with jax.numpy_dtype_promotion("standard"), warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.debug.MostlyFloat32Warning)
        for name in sorted(PATTERNS):
            loss, args = PATTERNS[name]()
            for dtype in (jnp.float16, jnp.bfloat16):
                row = {"pattern": name, "compute_dtype": jnp.dtype(dtype).name}
                row["autocast_false"] = half_share(loss, args, compute_dtype=dtype, autocast=False)
                row["default"] = half_share(loss, args, compute_dtype=dtype)
                rows.append(row)
    return rows


def markdown(rows) -> str:
    fmt = lambda v: f"{v:.0%}" if isinstance(v, float) else v
    lines = ["| pattern | compute dtype | inputs cast (`autocast=False`) | default (autocast) |",
             "|---|---|---|---|"]
    lines += [f"| {r['pattern']} | {r['compute_dtype']} | {fmt(r['autocast_false'])} "
              f"| {fmt(r['default'])} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for real_code.json and real_code.md")
    args = parser.parse_args(argv)
    rows = run()
    table = markdown(rows)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "real_code.json"), "w", encoding="utf-8") as f:
        json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "real_code.md"), "w", encoding="utf-8") as f:
        f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
