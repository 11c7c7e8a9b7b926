"""Collectives of a mixed-precision training step: how many, in which dtype, how many bytes.

Compiles one jaxmp training step (float16 compute, float32 parameters, an MLP)
on several devices and reads the HLO: every all-reduce, reduce-scatter and
all-gather, by element type, and the bytes each moves per step. Nothing is
timed, so the figures do not depend on the machine; they do depend on the XLA
backend for the *compiled* HLO (the CPU backend, for one, runs bfloat16
all-reduces in float32), so both the HLO JAX emits and the compiled one are
reported.

Modes (``--devices`` devices, batch split over them):

* ``jit_dp`` / ``jit_fsdp``: ``jax.jit`` with ``NamedSharding``, parameters
  replicated / sharded along the data axis; XLA inserts the collectives.
  ``reduce_dtype=None`` leaves them in the dtype of the matrix products (float16,
  on scaled gradients); ``reduce_dtype=float32`` makes the products give their
  gradients in float32, which moves XLA's reductions to float32.
* ``shard_map_dp`` / ``shard_map_fsdp``: ``jax.shard_map`` with
  ``axis_name="data"``; jaxmp reduces the unscaled gradients itself, in
  ``reduce_dtype`` (``None``: float32).
* ``float32``: the same step without mixed precision, for scale.

Bytes: ``payload`` is the size of the buffer each collective reduces or
gathers on one device (the full buffer for all-reduce and all-gather, the
unscattered input for reduce-scatter); ``ring`` is what a ring algorithm sends
per device: 2(n-1)/n of the payload for all-reduce, (n-1)/n for the others.

Usage::

    python -m benchmarks.collectives --out results/collectives
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import sys

import numpy as np

OPS = ("all-reduce", "reduce-scatter", "all-gather")
BYTES = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8, "s32": 4, "pred": 1, "u32": 4}


def _group_size(line: str, default: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    return default


def count_collectives(hlo: str, devices: int) -> dict:
    """``{"op dtype": {"buffers", "elements", "payload_bytes", "ring_bytes"}}`` from HLO text.

    A collective over a tuple counts one buffer per element.
    """
    out: dict = collections.defaultdict(lambda: collections.Counter())
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) (" + "|".join(OPS) + r")(-start)?\(", line)
        if not m:
            continue
        op = m.group(2)
        n = _group_size(line, devices)
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            elements = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
            payload = elements * BYTES.get(dtype, 4) * (n if op == "reduce-scatter" else 1)
            ring = payload * (2 if op == "all-reduce" else 1) * (n - 1) / max(n, 1)
            entry = out[f"{op} {dtype}"]
            entry["buffers"] += 1
            entry["elements"] += elements
            entry["payload_bytes"] += payload
            entry["ring_bytes"] += int(ring)
    return {k: dict(v) for k, v in sorted(out.items())}


def build(devices: int, width: int, depth: int, batch: int):
    """The steps to compile, by (mode, reduce dtype name)."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

    import jaxmp  # pylint: disable=g-import-not-at-top

    mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    keys = jax.random.split(jax.random.key(0), depth + 2)
    sizes = [width] * depth + [16]
    params = {f"w{i}": jax.random.normal(keys[i], (a, b)) / np.sqrt(a)
              for i, (a, b) in enumerate(zip([width] + sizes[:-1], sizes))}
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, 16))
    scaler = jaxmp.init_scaler(initial_scale=2.0**12)

    def mlp(params, x, y, gather=False):
        h = x
        for i in range(len(params)):
            w = params[f"w{i}"]
            if gather:
                w = jax.lax.all_gather(w, "data", tiled=True)
            h = h @ w
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        return jnp.mean((h - y).astype(jnp.float32) ** 2)

    def put(tree, spec):
        return jax.device_put(tree, NamedSharding(mesh, spec))

    xs, ys = put(x, P("data")), put(y, P("data"))
    replicated = put(params, P())
    fsdp = put(params, P("data"))
    steps = {}

    def jit_step(params, reduce_dtype, mixed=True, autocast=False):
        # autocast=False: the cast-inputs path, whose parameters are cast before the model
        # sees them; autocast=True: jaxmp's default.
        fn = jaxmp.mp_value_and_grad(mlp, reduce_dtype=reduce_dtype, use_mixed_precision=mixed,
                                     autocast=autocast, compute_dtype=jnp.float16)
        return jax.jit(lambda p, x, y, s: fn(p, x, y, scaler_state=s)), (params, xs, ys, scaler)

    def shard_map_step(gather, reduce_dtype, autocast=False):
        fn = jaxmp.mp_value_and_grad(lambda p, x, y: mlp(p, x, y, gather), axis_name="data",
                                     reduce_dtype=reduce_dtype, autocast=autocast,
                                         compute_dtype=jnp.float16)
        spec = P("data") if gather else P()
        body = jax.shard_map(lambda p, x, y, s: fn(p, x, y, scaler_state=s), mesh=mesh,
                             in_specs=(spec, P("data"), P("data"), P()),
                             out_specs=(P(), spec, P(), P()))
        return jax.jit(body), (fsdp if gather else replicated, xs, ys, scaler)

    steps[("float32", "-", "-")] = jit_step(replicated, None, mixed=False)
    for path, autocast in (("cast", False), ("default", True)):
        for name, rd in (("none", None), ("float32", jnp.float32)):
            steps[("jit_dp", name, path)] = jit_step(replicated, rd, autocast=autocast)
            steps[("jit_fsdp", name, path)] = jit_step(fsdp, rd, autocast=autocast)
        for name, rd in (("none", None), ("float32", jnp.float32), ("bfloat16", jnp.bfloat16),
                         ("float16", jnp.float16)):
            steps[("shard_map_dp", name, path)] = shard_map_step(False, rd, autocast)
            steps[("shard_map_fsdp", name, path)] = shard_map_step(True, rd, autocast)
    return steps


def bytes_by_kind(counted: dict) -> dict:
    """Payload bytes per collective kind (all dtypes together) from :func:`count_collectives`."""
    totals: dict = {}
    for key, v in counted.items():
        kind = key.split()[0]
        totals[kind] = totals.get(kind, 0) + v["payload_bytes"]
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for collectives.json")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)

    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_num_cpu_devices", args.devices)  # CPU only; before any JAX op
    if jax.device_count() < args.devices:
        print(f"needs {args.devices} devices, found {jax.device_count()}", file=sys.stderr)
        return 1

    results = []
    for (mode, reduce_dtype, path), (fn, fn_args) in build(
            args.devices, args.width, args.depth, args.batch).items():
        lowered = fn.lower(*fn_args)
        row = {
            "mode": mode,
            "reduce_dtype": reduce_dtype,
            "path": path,
            "emitted": count_collectives(lowered.as_text(dialect="hlo"), args.devices),
            "compiled": count_collectives(lowered.compile().as_text(), args.devices),
        }
        results.append(row)

    machine = (f"{platform.node() or 'unknown'}: {jax.default_backend()} backend, "
               f"{jax.device_count()} devices, {os.cpu_count()} CPU cores, jax {jax.__version__}")
    print(f"# Collectives per training step ({machine})")
    print(f"# MLP {args.depth} x {args.width}, batch {args.batch}, float16 compute, "
          "float32 parameters")
    print(f"{'mode':16} {'reduce_dtype':12} {'path':8} {'HLO':9} {'collective':20} {'bufs':>4} "
          f"{'payload B':>11} {'ring B/dev':>11}")
    for row in results:
        for which in ("emitted", "compiled"):
            for key, v in row[which].items():
                print(f"{row['mode']:16} {row['reduce_dtype']:12} {row['path']:8} {which:9} "
                      f"{key:20} {v['buffers']:>4} {v['payload_bytes']:>11} "
                      f"{v['ring_bytes']:>11}")
    # The default (autocast) against the cast path, per collective kind (compiled HLO).
    by = {(r["mode"], r["reduce_dtype"], r["path"]): bytes_by_kind(r["compiled"])
          for r in results}
    print(f"\n{'mode':16} {'reduce_dtype':12} {'collective':16} {'cast B':>11} "
          f"{'default B':>11} {'default/cast':>12}")
    for (mode, rd, path), cast in by.items():
        if path != "cast":
            continue
        default = by[(mode, rd, "default")]
        for kind in sorted(set(cast) | set(default)):
            c, d = cast.get(kind, 0), default.get(kind, 0)
            ratio = f"{d / c:.3f}" if c else "-"
            print(f"{mode:16} {rd:12} {kind:16} {c:>11} {d:>11} {ratio:>12}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "collectives.json")
        with open(path, "w") as f:
            json.dump({"machine": machine, "config": vars(args), "results": results}, f, indent=1)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
