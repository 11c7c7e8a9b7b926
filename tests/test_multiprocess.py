"""Two processes x two CPU devices (jax.distributed on localhost) against one process x four.

The test starts two worker processes running this file; each initialises
``jax.distributed`` on a free loopback port, builds a global 4-device mesh, feeds
its half of every batch with ``make_array_from_process_local_data`` and trains a
small model with jaxmp for ``STEPS`` steps, once inside ``shard_map`` and once
under ``jit``. At step ``INF_STEP`` process 1 puts an ``inf`` into its shard of
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


def train(process_index: int, process_count: int) -> dict[str, np.ndarray]:
    """Trains under shard_map and under jit; returns every step's loss, finite and scale, and params."""
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

    import jaxmp  # pylint: disable=g-import-not-at-top

    mesh = jax.make_mesh((DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    opt = optax.adam(1e-2)

    def loss_fn(params, x, y):
        pred = jnp.tanh(x @ params["w1"]) @ params["w2"] + params["b"]
        return jnp.mean((pred[:, 0] - y).astype(jnp.float32) ** 2)

    def step(params, opt_state, scaler, x, y, axis_name=None):
        loss, grads, scaler, finite = jaxmp.mp_value_and_grad(loss_fn, axis_name=axis_name)(
            params, x, y, scaler_state=scaler)
        params, opt_state = jaxmp.optimizer_update(params, opt, opt_state, grads, finite)
        return params, opt_state, scaler, loss, finite

    in_specs = (P(), P(), P(), P("data"), P("data"))
    steps = {
        "shard_map": jax.jit(jax.shard_map(
            lambda *a: step(*a, axis_name="data"), mesh=mesh, in_specs=in_specs,
            out_specs=P())),
        "jit": jax.jit(step),
    }
    params, xs, ys = _data()
    rows = slice(process_index * BATCH // process_count, (process_index + 1) * BATCH // process_count)

    def local(a):  # a replicated global array as NumPy, from this process's first device
        return np.asarray(a.addressable_shards[0].data)

    out = {}
    for name, fn in steps.items():
        state = (params, opt.init(params), jaxmp.init_scaler(initial_scale=2.0**8, growth_interval=6))
        state = jax.tree_util.tree_map(
            lambda v: jax.make_array_from_process_local_data(replicated, np.asarray(v)), state)
        losses, finites, scales = [], [], []
        for i in range(STEPS):
            x = jax.make_array_from_process_local_data(batch, xs[i][rows], xs[i].shape)
            y = jax.make_array_from_process_local_data(batch, ys[i][rows], ys[i].shape)
            *state, loss, finite = fn(*state, x, y)
            losses.append(local(loss))
            finites.append(local(finite))
            scales.append(local(state[2].scale))
        out[f"{name}/loss"] = np.stack(losses)
        out[f"{name}/finite"] = np.stack(finites)
        out[f"{name}/scale"] = np.stack(scales)
        out[f"{name}/skipped"] = local(state[2].skipped_steps)
        for k, v in state[0].items():
            out[f"{name}/params/{k}"] = local(v)
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
        for name in ("shard_map", "jit"):
            finite = results[f"{name}/finite"]
            assert finite.tolist() == [i != INF_STEP for i in range(STEPS)]
            assert int(results[f"{name}/skipped"]) == 1
            scale = results[f"{name}/scale"]
            assert scale[INF_STEP] == scale[INF_STEP - 1] / 2  # backed off once, on every device


def test_shard_map_matches_one_process_bit_for_bit(two_processes, one_process):
    for k, v in one_process.items():
        if k.startswith("shard_map/"):
            assert two_processes[0][k].tobytes() == v.tobytes(), k


def test_jit_matches_one_process(two_processes, one_process):
    """XLA may sum float16 partial products in another order: same flags, close values."""
    for k, v in one_process.items():
        if not k.startswith("jit/"):
            continue
        got = two_processes[0][k]
        if k.endswith(("finite", "scale", "skipped")):
            assert got.tolist() == v.tolist(), k
        else:
            np.testing.assert_allclose(got, v, rtol=1e-3, atol=1e-4, err_msg=k)


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
