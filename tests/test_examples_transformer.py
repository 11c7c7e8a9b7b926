"""Tests of the Haiku transformer example (examples/haiku/transformer.py), on a tiny model.

The naive float16 port must be caught (the scaler says training is stuck) and
explained (find_nonfinite names the backward pass at Haiku's layer norm);
float16 with autocast must train like float32.
"""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

PATH = Path(__file__).resolve().parents[1] / "examples" / "haiku" / "transformer.py"
TINY = dict(width=32, layers=1, heads=2)
SEQ_LEN, BATCH = 16, 4


@pytest.fixture(scope="module")
def ex():
    spec = importlib.util.spec_from_file_location("_example_transformer", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus(ex):
    return ex.load_corpus()


def _setup(ex, corpus):
    model = ex.make_model(len(corpus.vocab), **TINY)
    loss_fn = ex.make_loss_fn(model)
    params = model.init(jax.random.key(0), np.zeros((1, SEQ_LEN), np.int32))
    data = list(ex.batches(corpus.train, BATCH, SEQ_LEN, 20, seed=0))
    return loss_fn, params, data


def _train(ex, loss_fn, params, data, precision, autocast):
    optimizer = optax.adam(1e-3)
    ts = ex.TrainState(params, optimizer.init(params), ex.new_scaler(precision))
    step = jax.jit(ex.make_train_step(loss_fn, optimizer, precision, autocast))
    losses = []
    for x, y in data:
        ts, loss = step(ts, x, y)
        losses.append(float(loss))
    return ts, np.asarray(losses)


def test_corpus_ships_with_python(corpus):
    assert len(corpus.train) > 300_000 and len(corpus.test) > 30_000
    assert 50 < len(corpus.vocab) < 200 and "e" in corpus.vocab


@pytest.mark.slow  # trains the example until its scaler says it is stuck, then diagnoses it
def test_naive_float16_port_is_detected_and_explained(ex, corpus):
    loss_fn, params, data = _setup(ex, corpus)
    # Detected: from 2**15 the scale reaches 1 after 15 skipped steps; the scaler says so once.
    with pytest.warns(jaxmp.TrainingStuckWarning, match="training is stuck") as record:
        ts, _ = _train(ex, loss_fn, params, data, "float16", autocast=False)
    assert len(record) == 1 and "find_nonfinite" in str(record[0].message)
    assert int(ts.scaler.skipped_steps) == len(data) and float(ts.scaler.scale) == 1.0
    # Explained: the backward pass, at Haiku's layer norm, called from the example's model.
    report = jaxmp.debug.find_nonfinite(loss_fn, autocast=False, compute_dtype=jnp.float16)(
        params, *data[0], scaler_state=jaxmp.static_scaler(float(ts.scaler.scale)))
    assert bool(report) and not [f for f in report.forward if f.kind == "overflow"]
    first = [f for f in report.backward if f.kind == "overflow"][0]
    assert first.where.startswith("layer_norm.py:") and first.primitive == "div"
    assert first.called_from.startswith("transformer.py:")
    assert "no scale fixes it" in first.hint and "autocast=True" in first.hint


@pytest.mark.slow  # trains the example in three precisions
def test_autocast_float16_and_bfloat16_train_like_float32(ex, corpus):
    loss_fn, params, data = _setup(ex, corpus)
    _, reference = _train(ex, loss_fn, params, data, "float32", autocast=True)
    ts16, float16 = _train(ex, loss_fn, params, data, "float16", autocast=True)
    _, bfloat16 = _train(ex, loss_fn, params, data, "bfloat16", autocast=True)
    assert int(ts16.scaler.skipped_steps) == 0
    assert reference[-1] < reference[0] - 0.3  # it learns
    np.testing.assert_allclose(float16, reference, rtol=2e-3)
    np.testing.assert_allclose(bfloat16, reference, rtol=3e-2)


@pytest.mark.slow  # runs the example's main() end to end
def test_command_line(ex, capsys):
    with pytest.raises(SystemExit):
        ex.parse_args(["--help"])
    help_text = capsys.readouterr().out
    assert "(default: 300)" in help_text and "--no-autocast" in help_text
    args = ex.parse_args(["--precision", "float32", "bfloat16", "--steps", "2"])
    assert args.precision == ["float32", "bfloat16"] and args.steps == 2 and args.autocast
    assert not ex.parse_args(["--no-autocast"]).autocast
    results = ex.main(["--precision", "bfloat16", "--steps", "2", "--width", "16", "--layers", "1",
                       "--heads", "2", "--seq-len", "8", "--batch-size", "2", "--log-every", "1"])
    assert [r["label"] for r in results] == ["bfloat16"]
    out = capsys.readouterr().out
    assert "test loss (bits per character)" in out and "skipped steps" in out
    assert all(np.isfinite(r["test_bits_per_char"]) for r in results)
