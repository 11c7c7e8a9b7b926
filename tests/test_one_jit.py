"""The whole-run-in-one-jit example (examples/one_jit.py, docs/one_jit.md).

A PPO-shaped program: a scan over updates, each a rollout then scans over epochs and
minibatches, with the scaler state in the carry and its metrics out of the scans. The default
test compiles one tiny run (plain JAX, float16) whose environment returns NaN rewards for a
while: the run gets stuck inside the jit, recovers, and says so once when its state comes back.
The runs against float32 (both frameworks, float16 and bfloat16) are slow.
"""

import functools
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from examples import one_jit

ROOT = Path(__file__).resolve().parents[1]
TINY = one_jit.Config(updates=6, num_envs=2, num_steps=8, epochs=2, minibatches=2, hidden=8)
FAST_COMPILE = {"xla_backend_optimization_level": 0}


class NaNRewardsFor:
    """CartPole whose rewards are NaN from env step ``start`` to ``stop`` (a bug in a user's
    environment): every gradient step trained on those rollouts is non-finite."""

    def __init__(self, start, stop):
        self.env, self.start, self.stop = one_jit.CartPole(), start, stop

    def reset(self, key):
        state, obs = self.env.reset(key)
        return (state, jnp.zeros((), jnp.int32)), obs

    def step(self, key, state, action):
        inner, clock = state
        inner, obs, reward, done = self.env.step(key, inner, action)
        bad = (clock >= self.start) & (clock < self.stop)
        return (inner, clock + 1), obs, jnp.where(bad, jnp.nan, reward), done

    def __getattr__(self, name):
        return getattr(self.env, name)


def _compile(framework, dtype, config, env=None, key=None, scaler=None):
    train = one_jit.make_train(one_jit.MODELS[framework](config.hidden), config, dtype, env)
    # unsafe_rbg: a smaller program to compile than threefry's, for the same test.
    key = jax.random.key(0, impl="unsafe_rbg") if key is None else key
    scaler = jaxmp.scaler_for(dtype) if scaler is None else scaler
    return jax.jit(train).lower(key, scaler).compile(FAST_COMPILE), key, scaler


def test_a_run_in_one_jit_reports_a_stuck_period_and_metrics_per_step():
    # Updates 1 to 3 train on NaN rewards (env steps 8 to 31 of each environment): 12 gradient
    # steps skipped in a row; the scale falls 16 -> 1 in 4 and the run is stuck at step 8.
    steps = TINY.num_steps
    scaler = jaxmp.init_scaler(initial_scale=16.0, stuck_after=3)
    compiled, key, scaler = _compile("jax", jnp.float16, TINY, NaNRewardsFor(steps, 4 * steps),
                                     scaler=scaler)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        final, metrics = jax.block_until_ready(compiled(key, scaler))
        # No later state comes back: jaxmp reads this one in the background once it is ready.
        deadline = time.monotonic() + 30
        while not record and time.monotonic() < deadline:
            time.sleep(0.01)
    # Said once, when the state came back, although it had recovered by then.
    assert len(record) == 1
    message = str(record[0].message)
    assert "got stuck at step 8" in message and "recovered by step 24" in message
    assert "stayed stuck to step 16 (9 steps)" in message
    assert int(final.scaler.alarm) == 0

    per_step = jax.device_get(metrics["step"])
    shape = (TINY.updates, TINY.epochs, TINY.minibatches)
    assert all(np.shape(v) == shape for v in per_step.values())
    finite = per_step["finite"].reshape(-1)
    assert finite.tolist() == [True] * 4 + [False] * 12 + [True] * 8
    assert int(final.scaler.skipped_steps) == 12 and int(final.scaler.longest_skip_run) == 12
    assert per_step["alarm"].reshape(-1).tolist() == [0] * 7 + [1] * 9 + [0] * 8
    assert per_step["loss_scale"].reshape(-1)[[3, 7, 23]].tolist() == [16.0, 1.0, 1.0]
    assert np.isfinite(per_step["loss"].reshape(-1)[finite]).all()
    # The parameters stayed float32 master weights and finite through the skipped steps.
    for leaf in jax.tree_util.tree_leaves(final.params):
        assert leaf.dtype == jnp.float32 and bool(jnp.isfinite(leaf).all())
    # The carry kept its type: the same compiled run takes the state it returned.
    assert jax.tree_util.tree_structure(final.scaler) == jax.tree_util.tree_structure(scaler)


def test_the_message_on_the_docs_page_is_what_jaxmp_says():
    # docs/one_jit.md: the default float16 scaler, stuck for 40 steps then fine for 100.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flags = jnp.array([False] * 40 + [True] * 100)
        final, _ = jax.lax.scan(lambda s, f: (jaxmp.adjust(s, f), None),
                                jaxmp.scaler_for(jnp.float16), flags)
        jax.block_until_ready(final)
        from jaxmp._src import host  # pylint: disable=g-import-not-at-top
        host.flush()
    said = f"{caught[0].category.__name__}: {caught[0].message}"
    page = (ROOT / "docs" / "one_jit.md").read_text()
    # Up to the fixes, the advice included (the page wraps its lines).
    shown = page.split("```text\n")[1].split("\n  Then fix it")[0]
    assert " ".join(shown.split()) == " ".join(said.split("\n  Then fix it")[0].split())


# --- A float16 run stuck, then skipping often, in one jit and as a Python loop (issue 40) ---

N_STEPS = 300


def _classifier_loss(params, x, y, factor):
    # A bug in the user's code: ``factor`` is 1e6 on some steps.
    logits = x @ params["w"] + params["b"]
    return factor * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


OPTIMIZER = optax.sgd(0.1)
GRAD_FN = jaxmp.mp_value_and_grad(_classifier_loss, compute_dtype=jnp.float16)


def _classifier_step(carry, batch):
    params, opt_state, scaler = carry
    loss, grads, scaler, finite = GRAD_FN(params, *batch, scaler_state=scaler)
    params, opt_state = jaxmp.optimizer_update(params, OPTIMIZER, opt_state, grads, finite)
    return (params, opt_state, scaler), {"finite": finite, **jaxmp.scaler_metrics(scaler)}


@functools.lru_cache(maxsize=None)
def _classifier_data():
    """The parameters and 300 batches, the loss times 1e6 on the steps 51-66 (counted from 1)
    and on every other step up to the 120th: stuck at the minimum scale, then skipping often."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k1, (8, 4)) / 3, "b": jnp.zeros(4)}
    i = np.arange(N_STEPS)
    bad = ((i >= 50) & (i < 66)) | ((i >= 66) & (i < 120) & (i % 2 == 1))
    batches = (jax.random.normal(k2, (N_STEPS, 16, 8)),
               jax.random.randint(k3, (N_STEPS, 16), 0, 4),
               jnp.asarray(np.where(bad, 1e6, 1.0), jnp.float32))
    return params, batches


@functools.lru_cache(maxsize=None)
def _run_classifier(one_jit):
    """The warnings of 300 steps, in one jit or as a Python loop, and the per-step metrics."""
    params, batches = _classifier_data()
    carry = (params, OPTIMIZER.init(params), jaxmp.scaler_for(jnp.float16))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if one_jit:
            carry, metrics = jax.jit(lambda c, b: jax.lax.scan(_classifier_step, c, b))(
                carry, batches)
        else:
            step, metrics = jax.jit(_classifier_step), []
            for i in range(N_STEPS):
                carry, m = step(carry, jax.tree.map(lambda b: b[i], batches))
                metrics.append(m)
            metrics = jax.tree.map(lambda *m: jnp.stack(m), *metrics)
        jax.block_until_ready(carry)
        from jaxmp._src import host  # pylint: disable=g-import-not-at-top
        host.flush()
    said = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    return said, carry, jax.device_get(metrics)


def _kind_and_step(warning):
    return warning.category.__name__, int(re.search(r"step (\d+)", str(warning.message))[1])


def test_a_run_in_one_jit_says_every_period_as_the_same_loop_does():
    loop, _, loop_metrics = _run_classifier(one_jit=False)
    scan, (params, _, scaler), metrics = _run_classifier(one_jit=True)
    # Stuck at the minimum scale from the 65th step (15 back-offs from 2**15, then at 1); a
    # third of the recent steps skipped from the 78th: each said once, with its step.
    expected = [("TrainingStuckWarning", 65), ("SkippedStepsWarning", 78)]
    assert [_kind_and_step(w) for w in loop] == expected
    assert [_kind_and_step(w) for w in scan] == expected
    stuck, skips = (str(w.message) for w in scan)
    assert "stayed stuck to step 66 (2 steps)" in stuck and "recovered by step 300" in stuck
    assert "from step 78 to step 141 (64 steps)" in skips
    # The per-step metrics agree with the record and with the loop.
    alarm = metrics["alarm"]
    assert np.flatnonzero(alarm & 1).tolist() == [64, 65]  # steps 65 and 66, from 0 here
    assert np.flatnonzero(alarm & 2)[[0, -1]].tolist() == [77, 140]
    assert np.asarray(scaler.last_alarm).tolist() == [[65, 66], [78, 141]]
    for key in ("finite", "alarm", "loss_scale"):
        np.testing.assert_array_equal(loop_metrics[key], metrics[key])
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree_util.tree_leaves(params))


def _advised_call(message):
    """The find_nonfinite call a warning advises, as written in it."""
    return re.search(r"Find the operation:  print\((.*)\)  \(", message)[1]


def test_the_advice_of_each_warning_diagnoses_at_the_scale_the_steps_were_skipped_at():
    said, _, metrics = _run_classifier(one_jit=True)
    params, batches = _classifier_data()
    skipped = np.flatnonzero(~metrics["finite"])
    for warning, step in zip(said, (60, skipped[-1])):  # a step skipped in each period
        call = _advised_call(str(warning.message))
        assert "scaler_state=jaxmp.static_scaler(1.0)" in call  # stuck, and skipping, at 1
        # As the user runs it: their loss, their options, a batch whose step was skipped.
        batch = jax.tree.map(lambda b: b[step], batches)  # pylint: disable=cell-var-from-loop
        report = eval(call.replace("compute_dtype=...", "compute_dtype=jnp.float16"),  # noqa: S307
                      {"jaxmp": jaxmp, "jnp": jnp, "loss_fn": _classifier_loss,
                       "params": params, "batch": batch})
        assert report and report.loss_scale == 1.0
        hints = [f.hint for f in report.findings if f.kind == "overflow"]
        assert hints and all("no loss scale fixes it" in h for h in hints), hints
    # Without scaler_state (the advice before issue 40), the default scale 32768 blamed it.
    report = jaxmp.debug.find_nonfinite(_classifier_loss, compute_dtype=jnp.float16)(
        params, *jax.tree.map(lambda b: b[60], batches))
    assert any("a smaller loss scale avoids it" in f.hint for f in report.findings)


def _learning_runs(framework):
    """Mean return per update, for three seeds in one program (``vmap`` over the run, as
    PureJaxRL trains several seeds at once), in each precision."""
    config = one_jit.Config(updates=40)
    keys = jax.random.split(jax.random.key(0), 3)
    out = {}
    for name, dtype in one_jit.PRECISIONS.items():
        train = one_jit.make_train(one_jit.MODELS[framework](config.hidden), config, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("error", jaxmp.TrainingStuckWarning)
            final, metrics = jax.jit(jax.vmap(train, in_axes=(0, None)))(
                keys, jaxmp.scaler_for(dtype))
            out[name] = np.asarray(metrics["update"]["mean_return"])  # (seeds, updates)
        assert not np.asarray(final.scaler.alarm_record).any()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("framework", sorted(one_jit.MODELS))
def test_half_precision_learns_like_float32(framework):
    runs = _learning_runs(framework)
    f32 = runs["float32"][:, -5:].mean(axis=1)
    for name, returns in runs.items():
        start, end = returns[:, :5].mean(), returns[:, -5:].mean()
        assert end > 2 * start, (name, start, end)  # it learns
        if name != "float32":
            # Within the float32 seeds' spread, widened by a third of their mean.
            lo, hi = f32.min() - f32.mean() / 3, f32.max() + f32.mean() / 3
            assert lo <= returns[:, -5:].mean() <= hi, (name, returns[:, -5:].mean(axis=1), f32)


@pytest.mark.slow
def test_the_command_line_runs():
    out = subprocess.run([sys.executable, "-m", "examples.one_jit", "--framework", "jax",
                          "--updates", "2", "--precision", "float16"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "float16: mean return" in out and "all in one jit" in out
