"""The Equinox example and the main command (examples/compare.py), as a user runs them."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from examples import digits
from examples.equinox import train as example

ROOT = Path(__file__).resolve().parents[1]
# A few steps of a tiny model (it learns: well above chance after 60 steps).
QUICK = dict(steps=60, chunk=20, batch_size=32, learning_rate=1e-2, dim=16, depth=1, heads=2,
             mlp_dim=32)
QUICK_FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in QUICK.items()]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_compilation_cache")


def _run(argv, cache, **env):
    env = {
        **os.environ,
        # The repo root goes on the path so that `import jaxmp` works without an install.
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        # Speed only: the runs below compile the same small programs (the
        # float16 and bfloat16 steps of the example are those of compare.py),
        # and a shared persistent compilation cache saves compiling them twice.
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        **env,
    }
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_equinox_example_runs(precision, jax_cache):
    proc = _run([sys.executable, "-m", "examples.equinox.train", "--precision", precision,
                 *QUICK_FLAGS], jax_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0].split() == [precision], proc.stdout  # the table's header
    found = re.search(r"test accuracy\s+([\d.]+)%.*time per step.* ms .*"
                      r"skipped steps\s+(\d+)", proc.stdout, flags=re.S)
    assert found, proc.stdout
    # A few steps of a tiny model: well above chance (10%), far from trained.
    assert 25.0 < float(found.group(1)) <= 100.0


@pytest.mark.slow
def test_readme_main_command(tmp_path, jax_cache):
    readme = (ROOT / "README.md").read_text()
    line = next(l for l in readme.splitlines() if "python -m examples.compare" in l)
    command = shlex.split(line.split("&&", 1)[1])
    assert command[0] == "python"
    out = tmp_path / "out"
    # The command as written, made small and pointed at a temporary directory.
    proc = _run([sys.executable, *command[1:], *QUICK_FLAGS, f"--out={out}"], jax_cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in ("test accuracy", "final train loss", "time per step", "saved activations",
                "float32 / this", "skipped steps", "final loss scale"):
        assert row in proc.stdout, (row, proc.stdout)
    columns = ["float32", "float16", "bfloat16"]
    assert any(line.split() == columns for line in proc.stdout.splitlines()), proc.stdout
    # Half-precision activations: float32 keeps more bytes for the backward pass.
    ratios = re.search(r"float32 / this\s+([\d.]+)x\s+([\d.]+)x\s+([\d.]+)x", proc.stdout)
    assert float(ratios.group(1)) == 1.0
    assert float(ratios.group(2)) > 1.2 and float(ratios.group(3)) > 1.2
    png = out / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "compare.txt").read_text().strip() in proc.stdout


@pytest.mark.parametrize("precision, rtol", [("float16", 1e-2), ("bfloat16", 5e-2)])
def test_mixed_precision_step_matches_float32_gradients(precision, rtol):
    config = example.Config(**QUICK)
    params, static, _ = example.build(config)
    train_split, _ = digits.load()
    batch = digits.epoch_batches(train_split, 32, num_steps=1)

    # Reference: plain Equinox in float32.
    model = eqx.combine(params, static)
    ref_loss, reference = eqx.filter_jit(eqx.filter_value_and_grad(example.loss_fn))(
        model, batch.images[0], batch.labels[0])
    reference = eqx.filter(reference, eqx.is_inexact_array)

    # One jitted step of the example's own training chunk, with SGD at learning
    # rate 1, so that params - new_params are the gradients it applied.
    optimizer = optax.sgd(1.0)
    scaler = jaxmp.scaler_for(example.DTYPES[precision], growth_interval=config.growth_interval)
    state = example.TrainState(params, optimizer.init(params), scaler)
    train_chunk = example.make_train_chunk(static, optimizer, precision)
    new_state, (loss, scale, finite) = train_chunk(state, batch)
    assert bool(finite[0])
    applied = jax.tree_util.tree_map(lambda p, q: p - q, params, new_state.params)

    leaves = jax.tree_util.tree_leaves(applied)
    ref_leaves = jax.tree_util.tree_leaves(reference)
    assert len(leaves) == len(ref_leaves) > 10
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(new_state.params))
    flat = jnp.concatenate([x.ravel() for x in leaves])
    ref_flat = jnp.concatenate([x.ravel() for x in ref_leaves])
    error = float(jnp.linalg.norm(flat - ref_flat) / jnp.linalg.norm(ref_flat))
    assert error < rtol, error
    np.testing.assert_allclose(float(loss[0]), float(ref_loss), rtol=rtol)


@pytest.mark.slow
def test_the_getting_started_table_shows_what_compare_computes():
    """docs/getting_started.md's example table: its saved-activation rows are what the default
    command computes (``jax.eval_shape``: the same on any machine), and its columns are the
    command's. (Issue 34: the page said 1388.4 KiB / 1.57x where the run printed 1261.8 / 1.73x.)"""
    from examples import compare  # pylint: disable=g-import-not-at-top

    page = (ROOT / "docs" / "getting_started.md").read_text()
    shown = page.split("It prints a table like this one")[1].split("```")[1]
    _, config = example.parse_args(compare.__doc__, [], precision=("float32",), out="out")
    memory = {p: compare.saved_activation_bytes(p, config) for p in ("float32", "float16",
                                                                      "bfloat16")}
    kib = re.search(r"saved activations per step \(KiB\)\s+(.*)", shown).group(1).split()
    ratio = re.search(r"saved activations, float32 / this\s+(.*)", shown).group(1).split()
    precisions = ("float32", "float16", "bfloat16")
    measured_on = re.search(r"jax (\d+\.\d+\.\d+)", page.split("It prints a table")[1]).group(1)
    if measured_on == jax.__version__:  # the page's own JAX: to the digit
        assert kib == [f"{memory[p] / 1024:.1f}" for p in precisions]
        assert ratio == [f"{memory['float32'] / memory[p]:.2f}x" for p in precisions]
    else:  # what JAX saves moves by a few percent between releases (0.12: 2018.0 KiB in float32)
        np.testing.assert_allclose([float(k) for k in kib],
                                   [memory[p] / 1024 for p in precisions], rtol=0.1)
        np.testing.assert_allclose([float(r[:-1]) for r in ratio],
                                   [memory["float32"] / memory[p] for p in precisions], rtol=0.05)
