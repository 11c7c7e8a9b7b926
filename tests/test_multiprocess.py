"""Two processes x two CPU devices (jax.distributed on localhost) against one process x four.

The test starts two worker processes running this file; each initialises
``jax.distributed`` on a free loopback port, builds global 4-device meshes, feeds
its rows of every batch with ``make_array_from_process_local_data`` and trains a
small model with jaxmp for ``STEPS`` steps: data parallel, FSDP (weights sharded
over "data") and 2-D (batch over "data", weights over "model"), each inside
``shard_map`` and under ``jit``. At step ``INF_STEP`` process 1 puts an ``inf`` into its shard of
the batch. The pytest process (4 CPU devices, see conftest.py) runs the same
training on one process and compares.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

STEPS = 20
INF_STEP = 5
DEVICES = 4
BATCH = 16
TIMEOUT_S = 120


def _data():
    rng = np.random.default_rng(0)
    params = {"w1": (rng.standard_normal((6, 8)) / 3).astype(np.float32),
              "w2": (rng.standard_normal((8, 1)) / 3).astype(np.float32),
              "b": np.zeros((1,), np.float32)}
    xs = rng.standard_normal((STEPS, BATCH, 6)).astype(np.float32)
    ys = rng.standard_normal((STEPS, BATCH)).astype(np.float32)
    xs[INF_STEP, BATCH - 1, 2] = np.inf  # the last rows are process 1's half of the batch
    return params, xs, ys


STRATEGIES = ("dp", "fsdp", "2d")


def train(process_index: int, process_count: int) -> dict[str, np.ndarray]:
    """Trains every strategy under shard_map and under jit.

    Returns, by ``"{path}_{strategy}/..."``, every step's loss, finite and
    scale, and the final scaler state and parameters (gathered from all
    processes).
    """
    del process_index, process_count  # read from each array's sharding instead
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

    import jaxmp  # pylint: disable=g-import-not-at-top

    auto = jax.sharding.AxisType.Auto
    meshes = {"dp": jax.make_mesh((DEVICES,), ("data",), axis_types=(auto,)),
              "fsdp": jax.make_mesh((DEVICES,), ("data",), axis_types=(auto,)),
              "2d": jax.make_mesh((2, 2), ("data", "model"), axis_types=(auto, auto))}
    specs = {"dp": {"w1": P(), "w2": P(), "b": P()},
             "fsdp": {"w1": P(None, "data"), "w2": P("data", None), "b": P()},
             "2d": {"w1": P(None, "model"), "w2": P("model", None), "b": P()}}
    opt = optax.adam(1e-2)

    def forward(params, x, y, gather=None, psum=None):
        w1, w2 = params["w1"], params["w2"]
        if gather:  # FSDP inside shard_map
            w1 = jax.lax.all_gather(w1, gather, axis=1, tiled=True)
            w2 = jax.lax.all_gather(w2, gather, axis=0, tiled=True)
        partial = jnp.tanh(x @ w1) @ w2
        pred = (jax.lax.psum(partial, psum) if psum else partial) + params["b"]
        return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)

    def make_step(loss_fn, axis_name, **options):
        def step(params, opt_state, scaler, x, y):
            loss, grads, scaler, finite = jaxmp.mp_value_and_grad(
                loss_fn, axis_name=axis_name, compute_dtype=jnp.float16, **options)(
                params, x, y, scaler_state=scaler)
            params, opt_state = jaxmp.optimizer_update(params, opt, opt_state, grads, finite)
            return params, opt_state, scaler, loss, finite
        return step

    params, xs, ys = _data()
    out = {}
    for strategy in STRATEGIES:
        mesh, pspec = meshes[strategy], specs[strategy]
        ospec = jax.tree_util.tree_map(  # Adam's moments are sharded like the parameters
            lambda s: pspec if isinstance(s, dict) else P(), opt.init(params),
            is_leaf=lambda s: isinstance(s, dict))
        scaler = jaxmp.init_scaler(initial_scale=2.0**8, growth_interval=6)
        sspec = jax.tree_util.tree_map(lambda _: P(), scaler)  # replicated
        shard_loss = {"dp": forward,
                      "fsdp": lambda p, x, y: forward(p, x, y, gather="data"),
                      "2d": lambda p, x, y: forward(p, x, y, psum="model")}[strategy]
        state_specs = (pspec, ospec, sspec)
        paths = {
            "shard_map": jax.jit(jax.shard_map(
                # float32: the reduce-scatter that differentiates FSDP's all_gather would
                # otherwise add float16 values in the collective backend's order.
                make_step(shard_loss, "data", reduce_dtype=jnp.float32), mesh=mesh,
                in_specs=state_specs + (P("data"), P("data")), out_specs=state_specs + (P(), P()))),
            "jit": jax.jit(make_step(forward, None)),
        }
        batch = NamedSharding(mesh, P("data"))

        def process_rows(shape, batch=batch):  # the rows of the batch this process feeds
            idx = batch.addressable_devices_indices_map(shape).values()
            return slice(min(i[0].start or 0 for i in idx), max(i[0].stop or shape[0] for i in idx))

        for path, fn in paths.items():
            init = (params, opt.init(params), scaler)
            # The same host values on every process, placed with global shardings (docs/multi_device.md).
            shardings = jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), state_specs,
                                               is_leaf=lambda s: isinstance(s, P))
            state = jax.device_put(jax.device_get(init), shardings)
            losses, finites, scales = [], [], []
            for i in range(STEPS):
                rows = process_rows(xs[i].shape)
                x = jax.make_array_from_process_local_data(batch, xs[i][rows], xs[i].shape)
                y = jax.make_array_from_process_local_data(batch, ys[i][rows], ys[i].shape)
                *state, loss, finite = fn(*state, x, y)
                losses.append(loss)
                finites.append(finite)
                scales.append(state[2].scale)
            name = f"{path}_{strategy}"
            fetch = lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True))
            out[f"{name}/loss"] = np.stack([fetch(v) for v in losses])
            out[f"{name}/finite"] = np.stack([fetch(v) for v in finites])
            out[f"{name}/scale"] = np.stack([fetch(v) for v in scales])
            for field in ("skipped_steps", "steps_since_overflow", "overflow_streak"):
                out[f"{name}/scaler/{field}"] = fetch(getattr(state[2], field))
            for k, v in state[0].items():
                out[f"{name}/params/{k}"] = fetch(v)
    return out


def _worker(process_id: int, port: int, out_path: str) -> None:
    import jax  # pylint: disable=g-import-not-at-top

    jax.config.update("jax_num_cpu_devices", DEVICES // 2)
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    assert jax.device_count() == DEVICES and jax.local_device_count() == DEVICES // 2
    np.savez(out_path, **train(jax.process_index(), jax.process_count()))
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
               JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(port),
                               str(out / f"proc{i}.npz")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.communicate()
        pytest.fail(f"the two processes did not finish within {TIMEOUT_S} s")
    for i, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"process {i} failed:\n{log[-4000:]}"
    return [dict(np.load(out / f"proc{i}.npz")) for i in range(2)]


@pytest.fixture(scope="module")
def one_process():
    import jax  # pylint: disable=g-import-not-at-top

    if jax.device_count() < DEVICES:
        pytest.skip(f"needs {DEVICES} devices")
    return train(0, 1)


def test_both_processes_agree_bit_for_bit(two_processes):
    a, b = two_processes
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def test_overflow_on_one_process_skips_everywhere(two_processes):
    for results in two_processes:
        for name in (f"{path}_{s}" for path in ("shard_map", "jit") for s in STRATEGIES):
            finite = results[f"{name}/finite"]
            assert finite.tolist() == [i != INF_STEP for i in range(STEPS)], name
            assert int(results[f"{name}/scaler/skipped_steps"]) == 1, name
            scale = results[f"{name}/scale"]
            assert scale[INF_STEP] == scale[INF_STEP - 1] / 2, name  # backed off once


def test_shard_map_matches_one_process_bit_for_bit(two_processes, one_process):
    keys = [k for k in one_process if k.startswith("shard_map_")]
    assert len(keys) == 3 * 9  # 3 strategies x (loss, finite, scale, 3 scaler fields, 3 params)
    for k in keys:
        assert two_processes[0][k].tobytes() == one_process[k].tobytes(), k


def test_jit_matches_one_process(two_processes, one_process):
    """XLA may sum float16 partial products in another order: same flags, close values."""
    keys = [k for k in one_process if k.startswith("jit_")]
    assert len(keys) == 3 * 9  # 3 strategies x (loss, finite, scale, 3 scaler fields, 3 params)
    for k in keys:
        got, want = two_processes[0][k], one_process[k]
        if "/params/" in k or k.endswith("/loss"):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4, err_msg=k)
        else:
            assert got.tolist() == want.tolist(), k


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
