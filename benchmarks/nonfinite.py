"""What a diagnosis costs: ``jaxmp.debug.find_nonfinite`` on a ResNet18-sized Flax model.

Times, on random 32x32x3 images (nothing is downloaded):

* ``step``: one plain ``jax.jit`` training step (``mp_value_and_grad`` + SGD),
  compiled, median of a few calls: the yardstick;
* ``default``: ``find_nonfinite(loss_fn)`` with ``BatchNorm`` over the batch
  (no axis), the whole batch in one call;
* ``vmap``: ``BatchNorm(axis_name="batch")`` and
  ``find_nonfinite(..., axis_name="batch", mapped=jax.vmap(...))``;
* ``pmap``: the same loss under ``jax.pmap`` over ``--devices`` host devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count`` is set before jax is
  imported), as the upstream Flax ImageNet example maps its step.

Each diagnosis is timed from the call to the report, compilation included (a
diagnosis runs once). Run: ``python -m benchmarks.nonfinite`` (``--quick``
for a small model, as `tests/test_benchmark_nonfinite.py` does).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

_DEVICES = 2
if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_DEVICES}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxmp  # noqa: E402


def resnet18(filters: int, axis_name: str | None):
    """A Flax linen ResNet18 (BasicBlock, stages 2-2-2-2) for 32x32 images, as Flax's example."""
    import flax.linen as nn

    class Block(nn.Module):
        features: int
        strides: int

        @nn.compact
        def __call__(self, x):
            norm = lambda: nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=axis_name)
            y = nn.Conv(self.features, (3, 3), (self.strides,) * 2, use_bias=False)(x)
            y = nn.relu(norm()(y))
            y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
            y = norm()(y)
            if x.shape[-1] != self.features or self.strides != 1:
                x = nn.Conv(self.features, (1, 1), (self.strides,) * 2, use_bias=False)(x)
                x = norm()(x)
            return nn.relu(x + y)

    class ResNet18(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(filters, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False, axis_name=axis_name)(x))
            for i, n in enumerate((2, 2, 2, 2)):
                for j in range(n):
                    x = Block(filters * 2 ** i, 2 if i > 0 and j == 0 else 1)(x)
            return nn.Dense(10)(jnp.mean(x, axis=(-3, -2)))

    return ResNet18()


def _setup(filters: int, batch: int, axis_name: str | None):
    model = resnet18(filters, axis_name)
    k1, k2 = jax.random.split(jax.random.key(0))
    images = jax.random.normal(k1, (batch, 32, 32, 3))
    labels = jax.random.randint(k2, (batch,), 0, 10)
    init = model.init
    if axis_name is not None:
        init = jax.vmap(model.init, in_axes=(None, 0), out_axes=None, axis_name=axis_name)
        variables = init(jax.random.key(1), images[:, None])
    else:
        variables = init(jax.random.key(1), images)

    def loss_fn(params, images, labels):
        logits, _ = model.apply({"params": params, "batch_stats": variables["batch_stats"]},
                                images, mutable=["batch_stats"])
        onehot = jax.nn.one_hot(labels, 10)
        return -jnp.mean(jnp.sum(onehot * jax.nn.log_softmax(logits), axis=-1))

    return loss_fn, variables["params"], images, labels


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    jax.block_until_ready(jax.tree_util.tree_leaves(out))
    return time.perf_counter() - start, out


def plain_step_seconds(loss_fn, params, images, labels, repeats: int) -> float:
    """Median seconds of one compiled ``mp_value_and_grad`` + SGD step."""
    grad_fn = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16)

    @jax.jit
    def step(params, scaler, images, labels):
        loss, grads, scaler, finite = grad_fn(params, images, labels, scaler_state=scaler)
        params = jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)
        return params, scaler, loss

    scaler = jaxmp.init_scaler()
    _timed(step, params, scaler, images, labels)  # compile
    return statistics.median(_timed(step, params, scaler, images, labels)[0]
                             for _ in range(repeats))


def run(filters: int, batch: int, devices: int, repeats: int, modes) -> dict:
    results = {"filters": filters, "batch": batch, "devices": devices,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "backend": jax.default_backend(), "jax": jax.__version__}
    loss_fn, params, images, labels = _setup(filters, batch, None)
    results["step_s"] = plain_step_seconds(loss_fn, params, images, labels, repeats)
    if "default" in modes:
        seconds, report = _timed(lambda: jaxmp.debug.find_nonfinite(loss_fn,
                                                                    compute_dtype=jnp.float16)(
                                                                        params, images, labels))
        results["default_s"], results["default_findings"] = seconds, len(report)
    loss_fn, params, images, labels = _setup(filters, batch, "batch")
    if "vmap" in modes:
        find = jaxmp.debug.find_nonfinite(loss_fn, axis_name="batch", mapped=lambda f: jax.vmap(
            f, in_axes=(None, 0, 0), axis_name="batch"), compute_dtype=jnp.float16)
        # One example per member: the members' batch dimension is the vmapped one.
        seconds, report = _timed(lambda: find(params, images[:, None], labels[:, None]))
        results["vmap_s"], results["vmap_findings"] = seconds, len(report)
    if "pmap" in modes and jax.device_count() >= devices:
        find = jaxmp.debug.find_nonfinite(loss_fn, axis_name="batch", mapped=lambda f: jax.pmap(
            f, in_axes=(None, 0, 0), axis_name="batch", devices=jax.devices()[:devices]),
                compute_dtype=jnp.float16)
        shape = (devices, batch // devices)
        seconds, report = _timed(lambda: find(params, images.reshape(*shape, 32, 32, 3),
                                              labels.reshape(shape)))
        results["pmap_s"], results["pmap_findings"] = seconds, len(report)
    for mode in ("default", "vmap", "pmap"):
        if f"{mode}_s" in results:
            results[f"{mode}_steps"] = results[f"{mode}_s"] / results["step_s"]
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--filters", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--devices", type=int, default=_DEVICES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", default="default,vmap,pmap")
    parser.add_argument("--quick", action="store_true", help="4 filters, batch 4, 2 repeats")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.filters, args.batch, args.repeats = 4, 4, 2
    results = run(args.filters, args.batch, args.devices, args.repeats, args.modes.split(","))
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
