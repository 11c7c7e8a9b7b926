"""Float8 on convolution nets, in three frameworks: FLOP shares and loss against bfloat16.

Three small residual convolution nets, written as each framework's users
write them:

* ``flax_linen_resnet``: a Flax linen module with ``nn.BatchNorm``; the loss
  applies it with ``mutable=["batch_stats"]`` and returns the new statistics
  through ``has_aux``;
* ``haiku_resnet``: ``hk.transform_with_state`` with ``hk.BatchNorm``; the state
  comes back through ``has_aux``;
* ``equinox_convnet``: an ``eqx.Module`` of ``eqx.nn.Conv2d``, ``eqx.nn.GroupNorm``
  and ``eqx.nn.Linear`` holding ``jax.nn.gelu`` as a field, split with
  ``eqx.partition``.

For each, and each variant (``float32``: no mixed precision; ``bfloat16``:
``mp_value_and_grad(..., compute_dtype=jnp.bfloat16)``, autocast, jaxmp's
default; ``float8``: the same with ``matmul_dtype=jnp.float8_e4m3fn`` and
``Float8Rules(include={"convolution"})``, which asks for the float8 convolutions
autocast keeps in bfloat16 by default), it
records for the whole training step (gradient + ``jaxmp.optimizer_update``
with Adam):

* the share of matrix + convolution FLOPs with float8 operands (and with
  low-precision ones) in the program lowered for CUDA (``jaxmp.debug.matmul_flops``;
  nothing runs), for the forward pass (the loss alone), the backward pass
  (the step less the forward pass) and the whole step;

and, unless ``--no-train``, trains every variant from the same
initialisation on the same batches of scikit-learn's digits (8x8, tiled to 3
channels and upsampled to 16x16) and compares the final training loss (mean of
the last 20 steps) and the float32 test loss.

Usage::

    python -m benchmarks.float8_conv --out results/float8_conv
    python -m benchmarks.float8_conv --out results/float8_conv-quick --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from benchmarks import vit as vit_bench
from benchmarks.float8 import digits_batches
from benchmarks.float8 import share_totals

VARIANTS = ("float32", "bfloat16", "float8")
MODELS = ("flax_linen_resnet", "haiku_resnet", "equinox_convnet")
WIDTH = 16


class Net(NamedTuple):
    """A model as the benchmark drives it.

    ``loss(params, state, images, labels) -> (loss, new_state)``; ``state`` is
    the framework's non-trained state (batch statistics; ``None`` for Equinox)
    and ``evaluate(params, state, images, labels) -> loss`` the float32 loss in
    inference mode. ``combine`` rebuilds nothing for Linen and Haiku; for
    Equinox the static half of the partitioned module is closed over.
    """

    name: str
    loss: Callable
    evaluate: Callable
    params: Any
    state: Any


def flax_linen_resnet(seed: int, images: np.ndarray) -> Net:
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    class Block(nn.Module):
        channels: int
        stride: int

        @nn.compact
        def __call__(self, x, train: bool):
            y = nn.Conv(self.channels, (3, 3), self.stride, use_bias=False)(x)
            y = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(y))
            y = nn.Conv(self.channels, (3, 3), use_bias=False)(y)
            y = nn.BatchNorm(use_running_average=not train, momentum=0.9)(y)
            if x.shape != y.shape:
                x = nn.Conv(self.channels, (1, 1), self.stride, use_bias=False)(x)
            return nn.relu(x + y)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(
                nn.Conv(WIDTH, (3, 3), use_bias=False)(x)))
            x = Block(WIDTH, 1)(x, train)
            x = Block(2 * WIDTH, 2)(x, train)
            return nn.Dense(10)(jnp.mean(x, axis=(1, 2)))

    model = ResNet()
    variables = model.init(jax.random.key(seed), images[:2], train=False)

    def loss(params, batch_stats, images, labels):
        logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                      train=True, mutable=["batch_stats"])
        return (optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(),
                updates["batch_stats"])

    def evaluate(params, batch_stats, images, labels):
        logits = model.apply({"params": params, "batch_stats": batch_stats}, images, train=False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return Net("flax_linen_resnet", loss, evaluate, variables["params"],
               variables["batch_stats"])


def haiku_resnet(seed: int, images: np.ndarray) -> Net:
    import haiku as hk  # pylint: disable=g-import-not-at-top

    def block(x, channels, stride, is_training):
        bn = lambda: hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)
        y = hk.Conv2D(channels, 3, stride=stride, with_bias=False)(x)
        y = jax.nn.relu(bn()(y, is_training))
        y = bn()(hk.Conv2D(channels, 3, with_bias=False)(y), is_training)
        if x.shape != y.shape:
            x = hk.Conv2D(channels, 1, stride=stride, with_bias=False)(x)
        return jax.nn.relu(x + y)

    def forward(x, is_training):
        x = hk.Conv2D(WIDTH, 3, with_bias=False)(x)
        x = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(x, is_training))
        x = block(x, WIDTH, 1, is_training)
        x = block(x, 2 * WIDTH, 2, is_training)
        return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))

    net = hk.without_apply_rng(hk.transform_with_state(forward))
    params, state = net.init(jax.random.key(seed), images[:2], True)

    def loss(params, state, images, labels):
        logits, state = net.apply(params, state, images, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state

    def evaluate(params, state, images, labels):
        logits, _ = net.apply(params, state, images, False)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return Net("haiku_resnet", loss, evaluate, params, state)


def equinox_convnet(seed: int, images: np.ndarray) -> Net:
    import equinox as eqx  # pylint: disable=g-import-not-at-top

    class ConvNet(eqx.Module):
        convs: list
        norms: list
        head: eqx.nn.Linear
        activation: Callable  # a function leaf (jax.nn.gelu, a custom_jvp)

        def __init__(self, key):
            keys = jax.random.split(key, 4)
            shapes = [(3, WIDTH, 1), (WIDTH, WIDTH, 1), (WIDTH, 2 * WIDTH, 2)]
            self.convs = [eqx.nn.Conv2d(i, o, 3, stride=s, padding=1, key=k)
                          for (i, o, s), k in zip(shapes, keys)]
            self.norms = [eqx.nn.GroupNorm(4, o) for _, o, _ in shapes]
            self.head = eqx.nn.Linear(2 * WIDTH, 10, key=keys[3])
            self.activation = jax.nn.gelu

        def __call__(self, x):  # one image, channels first
            for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
                y = self.activation(norm(conv(x)))
                x = x + y if i == 1 else y
            return self.head(jnp.mean(x, axis=(1, 2)))

    model = ConvNet(jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def logits_of(params, images):
        model = eqx.combine(params, static)
        return jax.vmap(model)(jnp.transpose(images, (0, 3, 1, 2)))

    def loss(params, state, images, labels):
        logits = logits_of(params, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), state

    def evaluate(params, state, images, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, images),
                                                               labels).mean()

    return Net("equinox_convnet", loss, evaluate, params, None)


BUILDERS = {"flax_linen_resnet": flax_linen_resnet, "haiku_resnet": haiku_resnet,
            "equinox_convnet": equinox_convnet}


#: float8 convolutions, asked for: autocast keeps convolutions in the compute dtype by default
#: (float8 does not pay for them on an H100, ``docs/float8.md``); this benchmark measures them.
FLOAT8_CONVOLUTIONS = jaxmp.experimental.Float8Rules(include={"convolution"})


def _loss(net: Net, variant: str) -> Callable:
    """``net.loss``, under float8 autocast for the ``float8`` variant (the outer autocast of
    ``mp_value_and_grad`` keeps its float8 products)."""
    if variant != "float8":
        return net.loss
    return jaxmp.autocast(net.loss, jnp.bfloat16, matmul_dtype=jnp.float8_e4m3fn,
                          float8_rules=FLOAT8_CONVOLUTIONS)


def make_step(net: Net, variant: str, learning_rate: float = 3e-4) -> tuple[Callable, Callable]:
    """``(init, step)``: a training step of ``net`` in ``variant``, as the examples write it."""
    optimizer = optax.adam(learning_rate)
    if variant == "float32":
        options = dict(use_mixed_precision=False)
    else:
        options = dict(compute_dtype=jnp.bfloat16)
    grad_fn = jaxmp.mp_value_and_grad(_loss(net, variant), has_aux=True, no_cast_argnums=1,
                                      **options)

    def init(params, state):
        return {"params": params, "state": state, "opt_state": optimizer.init(params),
                "scaler": jaxmp.noop_scaler()}

    def step(train_state, images, labels):
        (loss, state), grads, scaler, finite = grad_fn(
            train_state["params"], train_state["state"], images, labels,
            scaler_state=train_state["scaler"])
        params, opt_state = jaxmp.optimizer_update(train_state["params"], optimizer,
                                                   train_state["opt_state"], grads, finite)
        state = jaxmp.select_tree(finite, state, train_state["state"])
        return {"params": params, "state": state, "opt_state": opt_state, "scaler": scaler}, loss

    return init, step


def flop_shares(net: Net, variant: str, images, labels) -> dict[str, Any]:
    """Float8 and low-precision shares of the forward pass, the backward pass and the step."""
    init, step = make_step(net, variant)
    loss = _loss(net, variant)
    if variant == "bfloat16":
        loss = jaxmp.autocast(loss, jnp.bfloat16)
    fwd = share_totals(jaxmp.debug.matmul_flops(loss, net.params, net.state, images, labels))
    flops = jaxmp.debug.matmul_flops(step, init(net.params, net.state), images, labels)
    both = share_totals(flops)
    bwd = {k: both[k] - fwd[k] for k in fwd}
    share = lambda part, key: part[key] / part["total"] if part["total"] else 0.0
    return {"matmul_flops_cuda": flops,
            "float8_share_forward": share(fwd, "float8"),
            "float8_share_backward": share(bwd, "float8"),
            "float8_share_step": share(both, "float8"),
            "low_precision_share_step": share(both, "low")}


def train(net: Net, variant: str, data, test, learning_rate: float = 3e-4) -> dict[str, Any]:
    init, step = make_step(net, variant, learning_rate)
    step = jax.jit(step)
    state = init(net.params, net.state)
    losses = []
    start = time.perf_counter()
    for images, labels in data:
        state, loss = step(state, images, labels)
        losses.append(loss)
    losses = np.asarray(jax.device_get(losses), np.float64)
    seconds = time.perf_counter() - start
    evaluate = jax.jit(net.evaluate)
    test_loss = float(np.mean([float(evaluate(state["params"], state["state"], x, y))
                               for x, y in test]))
    return {"final_train_loss": float(np.mean(losses[-20:])), "first_loss": float(losses[0]),
            "test_loss_float32": test_loss, "seconds": seconds, "steps": len(data),
            "nonfinite_losses": int(np.sum(~np.isfinite(losses)))}


def run(args) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": vit_bench.machine_info(),
        "command": "python -m benchmarks.float8_conv " + " ".join(args.argv),
        "shares": {}, "training": {}}
    data0, _ = digits_batches(1, args.batch_size, upsample=2)
    images, labels = (jnp.asarray(a) for a in data0[0])
    for name in args.models:
        net = BUILDERS[name](0, np.asarray(images))
        rows = {v: flop_shares(net, v, images, labels) for v in VARIANTS}
        results["shares"][name] = rows
        print(f"{name}: " + json.dumps({v: {k: round(x, 4) for k, x in r.items()
                                            if k != "matmul_flops_cuda"}
                                        for v, r in rows.items()}), flush=True)
    if not args.train:
        return results
    for name in args.models:
        per_seed = []
        for seed in range(args.seeds):
            data, (tx, ty) = digits_batches(args.steps, args.batch_size, seed=seed, upsample=2)
            test = [(tx[i:i + 120], ty[i:i + 120]) for i in range(0, len(ty) - 119, 120)]
            net = BUILDERS[name](seed, data[0][0])
            per_seed.append({v: train(net, v, data, test, args.learning_rate) for v in VARIANTS})
            print(f"{name} seed {seed}: " + json.dumps(per_seed[-1]), flush=True)
        mean = lambda key: {v: float(np.mean([r[v][key] for r in per_seed])) for v in VARIANTS}
        train_loss, test_loss = mean("final_train_loss"), mean("test_loss_float32")
        results["training"][name] = {
            "steps": args.steps, "learning_rate": args.learning_rate, "seeds": per_seed,
            "mean_final_train_loss": train_loss, "mean_test_loss_float32": test_loss,
            "train_ratio_to_bfloat16": {v: train_loss[v] / train_loss["bfloat16"]
                                        for v in VARIANTS},
            "test_ratio_to_bfloat16": {v: test_loss[v] / test_loss["bfloat16"] for v in VARIANTS},
            "nonfinite_losses": sum(r[v]["nonfinite_losses"] for r in per_seed for v in VARIANTS),
        }
    return results


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"Machine: {m.get('cpu', '?')}, backend {m.get('backend', '?')}, "
             f"jax {m.get('jax_version', '?')}, {m.get('cores', '?')} cores. Command: `{results['command']}`.", "",
             "| model | float8 share fwd | float8 share bwd | float8 share step "
             "| bf16 low-precision share step |",
             "|---|---|---|---|---|"]
    for name, rows in results["shares"].items():
        f8, bf = rows["float8"], rows["bfloat16"]
        lines.append(f"| {name} | {f8['float8_share_forward']:.1%} | "
                     f"{f8['float8_share_backward']:.1%} | {f8['float8_share_step']:.1%} | "
                     f"{bf['low_precision_share_step']:.1%} |")
    if results["training"]:
        lines += ["", "| model | steps x seeds | final train loss f32 / bf16 / f8 "
                  "| f8 / bf16 (train) | test loss f32 / bf16 / f8 | f8 / bf16 (test) |",
                  "|---|---|---|---|---|---|"]
        for name, r in results["training"].items():
            tr, te = r["mean_final_train_loss"], r["mean_test_loss_float32"]
            lines.append(
                f"| {name} | {r['steps']} x {len(r['seeds'])} | "
                f"{tr['float32']:.4f} / {tr['bfloat16']:.4f} / {tr['float8']:.4f} | "
                f"{r['train_ratio_to_bfloat16']['float8']:.3f} | "
                f"{te['float32']:.4f} / {te['bfloat16']:.4f} / {te['float8']:.4f} | "
                f"{r['test_ratio_to_bfloat16']['float8']:.3f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=3e-4,
                        help="Adam's; low enough that the loss is far from 0 after 300 steps, "
                             "where a ratio of losses says something")
    parser.add_argument("--no-train", dest="train", action="store_false")
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 30 steps (a smoke run: the losses are not for comparison)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = 30, 1
    args.argv = list(argv)
    return args


def main(argv=None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    results = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    table = markdown(results)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print(table)
    return results


if __name__ == "__main__":
    main()
