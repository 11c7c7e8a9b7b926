"""Tests of the Haiku and Flax examples (examples/haiku, examples/flax).

Smoke tests run each example as a user would, in a subprocess; in-process
tests check what the examples promise: the model state (Haiku state, linen and
nnx batch statistics) stays float32 and close to a float32 run across a jitted
mixed-precision step, a non-finite step leaves everything unchanged, and the
step compiles once.
"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
from examples import digits

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "haiku": "examples.haiku.train",
    "linen": "examples.flax.train_linen",
    "nnx": "examples.flax.train_nnx",
}
# A few steps of a tiny model: the smoke tests check that the examples run.
QUICK_FLAGS = ["--steps=20", "--log-every=10", "--batch-size=32", "--width=4"]
# Unoptimised XLA code compiles in half the time; these tests check what the
# examples compute, not how fast.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _load(name):
    return importlib.import_module(EXAMPLES[name])


def _read_table(stdout, columns):
    """``{row label: [cell per column]}`` of the table that the examples print."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split() == columns)
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        # Labels and cells hold single spaces; columns are at least two apart.
        label, *cells = re.split(r"\s{2,}", line.strip())
        assert len(cells) == len(columns), line
        rows[label] = cells
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs(name):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # The smoke test checks that the example runs end to end, not its speed.
    flags = [env.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"]
    env["XLA_FLAGS"] = " ".join(filter(None, flags))
    proc = subprocess.run(
        [sys.executable, "-m", EXAMPLES[name], "--precision", "float16", "bfloat16", *QUICK_FLAGS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One table, a column per precision; read back as one summary per precision.
    rows = _read_table(proc.stdout, ["float16", "bfloat16"])
    time_row = next(label for label in rows if label.startswith("time per step"))
    summaries = [
        {"precision": precision, "test accuracy": rows["test accuracy"][i],
         "skipped steps": rows["skipped steps"][i], "time per step": rows[time_row][i],
         "loss scale": rows["final loss scale"][i]}
        for i, precision in enumerate(["float16", "bfloat16"])
    ]
    assert [s["precision"] for s in summaries] == ["float16", "bfloat16"]
    for summary in summaries:
        assert 0.0 <= float(summary["test accuracy"].rstrip("%")) <= 100.0
        assert int(summary["skipped steps"]) >= 0
        assert " ms " in summary["time per step"]
    assert float(summaries[0]["loss scale"]) >= 1.0  # float16: dynamic loss scaling
    assert float(summaries[1]["loss scale"]) == 1.0  # bfloat16: no scaling


# --- In-process: one example step, checked against a float32 step ----------------------


def _haiku_setup(precision):
    ex = _load("haiku")
    ex.set_haiku_policies(precision)
    model = ex.make_model(width=4)
    optimizer = optax.adam(1e-3)
    images = jnp.asarray(_batch().images)
    init = jax.jit(model.init, static_argnames="is_training", compiler_options=FAST_COMPILE)
    params, state = init(jax.random.key(0), images[:1], is_training=True)
    ts = ex.TrainState(params, state, optimizer.init(params), jaxmp.scaler_for(precision))
    return ex, ex.make_train_step(model, optimizer, precision), ts, "state"


def _linen_setup(precision):
    ex = _load("linen")
    model = ex.CNN(width=4)
    optimizer = optax.adam(1e-3)
    init = jax.jit(model.init, static_argnames="train", compiler_options=FAST_COMPILE)
    variables = init(jax.random.key(0), jnp.asarray(_batch().images[:1]), train=False)
    params, stats = variables["params"], variables["batch_stats"]
    ts = ex.TrainState(params, stats, optimizer.init(params), jaxmp.scaler_for(precision))
    return ex, ex.make_train_step(model, optimizer, precision), ts, "batch_stats"


def _nnx_setup(precision):
    ex = _load("nnx")
    graphdef, params, stats = nnx.split(ex.CNN(4, rngs=nnx.Rngs(0)), nnx.Param, nnx.BatchStat)
    optimizer = optax.adam(1e-3)
    ts = ex.TrainState(params, stats, optimizer.init(params), jaxmp.scaler_for(precision))
    return ex, ex.make_train_step(graphdef, optimizer, precision), ts, "batch_stats"


def _jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


SETUPS = {"haiku": _haiku_setup, "linen": _linen_setup, "nnx": _nnx_setup}


def _batch():
    train, _ = digits.load()
    return next(digits.batches(train, batch_size=16, num_steps=1, seed=0))


@pytest.fixture(autouse=True)
def _no_haiku_policies():
    yield
    hk.mixed_precision.clear_policy(hk.BatchNorm)
    if EXAMPLES["haiku"] in sys.modules:
        hk.mixed_precision.clear_policy(sys.modules[EXAMPLES["haiku"]].CNN)


def _float_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree) if jaxmp.debug.is_float_array(x)]


@pytest.mark.parametrize("name", sorted(SETUPS))
def test_state_stays_float32_and_step_compiles_once(name):
    """float16, the case with loss scaling; the smoke tests run bfloat16 too."""
    batch = _batch()
    # Haiku's moving averages (jnp.power(float, int)) and Flax's BatchNorm
    # (float16 input minus float32 mean) promote implicitly inside the
    # frameworks themselves; the examples' own code does not.
    with jax.numpy_dtype_promotion("standard"):
        _, ref_step, ts32, field = SETUPS[name]("float32")
        ref, ref_loss = _jit(ref_step)(ts32, batch)
        _, train_step, ts, _ = SETUPS[name]("float16")
        # Every convolution and matrix product of the step runs in float16
        # (nothing silently promoted back to float32 after a BatchNorm).
        assert jaxmp.debug.matmul_flops(train_step, ts, batch).keys() == {"float16"}
        step = _jit(train_step)
        before = getattr(ts, field)
        ts1, loss = step(ts, batch)
        # A batch that overflows: the step is skipped and leaves no trace.
        bad = batch._replace(images=np.full_like(batch.images, np.inf))
        ts2, _ = step(ts1, bad)
        ts3, _ = step(ts2, batch)

    state1 = getattr(ts1, field)
    assert jax.tree_util.tree_structure(state1) == jax.tree_util.tree_structure(before)
    for leaf in _float_leaves(state1) + _float_leaves(getattr(ts3, field)):
        assert leaf.dtype == jnp.float32
    tol = 1e-2
    np.testing.assert_allclose(loss, ref_loss, rtol=tol)
    for got, want in zip(_float_leaves(state1), _float_leaves(getattr(ref, field))):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    # The statistics did move (so the comparison above is not between two initial states).
    assert any(not np.allclose(a, b) for a, b in zip(_float_leaves(state1), _float_leaves(before)))

    assert int(ts2.scaler.skipped_steps) == 1 and int(ts1.scaler.skipped_steps) == 0
    for a, b in zip(_float_leaves((ts1.params, state1, ts1.opt_state)),
                    _float_leaves((ts2.params, getattr(ts2, field), ts2.opt_state))):
        np.testing.assert_array_equal(a, b)
    for leaf in _float_leaves((ts3.params, getattr(ts3, field))):
        assert bool(jnp.all(jnp.isfinite(leaf)))
    # Three calls (the carried state, a skipped step, the state after it): one compilation.
    assert step._cache_size() == 1


def test_haiku_policies_put_the_network_in_half_and_batchnorm_in_float32():
    ex = _load("haiku")
    ex.set_haiku_policies("float16")
    assert hk.mixed_precision.get_policy(ex.CNN) == jaxmp.get_policy("p=f32,c=f16,o=f32")
    assert hk.mixed_precision.get_policy(hk.BatchNorm) == jaxmp.get_policy("p=f32,c=f32,o=f16")
    model = ex.make_model(width=4)
    images = jnp.asarray(_batch().images)
    with jax.numpy_dtype_promotion("standard"):  # Haiku's moving averages promote implicitly
        init = jax.jit(model.init, static_argnames="is_training", compiler_options=FAST_COMPILE)
        params, state = init(jax.random.key(0), images[:1], is_training=True)
        apply = jax.jit(model.apply, static_argnames="is_training", compiler_options=FAST_COMPILE)
        logits, state = apply(params, state, images, is_training=True)
    assert logits.dtype == jnp.float32  # the network's output dtype
    for leaf in _float_leaves((params, state)):
        assert leaf.dtype == jnp.float32  # parameters created, statistics updated in float32
