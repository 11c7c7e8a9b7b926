"""Checkpoint and resume: (params, optimizer state, scaler state) survive a restart bit for bit."""

import dataclasses
import json
import warnings

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxmp
from jaxmp._src import host

N, M = 8, 8  # steps before and after the restart


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean(((h @ params["w2"])[:, 0] - y) ** 2)


def init_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (8, 16)) * 0.5,
        "b1": jnp.zeros((16,)),
        "w2": jax.random.normal(k2, (16, 1)) * 0.5,
    }


def batch(step):
    # The data of a step depends on the step number only, as with a resumable loader.
    kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    return jax.random.normal(kx, (32, 8)), jax.random.normal(ky, (32,))


OPTIMIZER = optax.adam(1e-2)
GRAD_FN = jaxmp.mp_value_and_grad(loss_fn, compute_dtype=jnp.float16)


@jax.jit
def train_step(train_state, step):
    params, opt_state, scaler = train_state
    x, y = batch(step)
    _, grads, scaler, finite = GRAD_FN(params, x, y, scaler_state=scaler)
    params, opt_state = jaxmp.optimizer_update(params, OPTIMIZER, opt_state, grads, finite)
    return params, opt_state, scaler


def fresh_state():
    params = init_params()
    # A scale too large for this model (it overflows at first and backs off),
    # a short growth interval and hysteresis: the scaler's counters all move.
    scaler = jaxmp.init_scaler(initial_scale=2.0**17, growth_interval=3, hysteresis=2)
    return params, OPTIMIZER.init(params), scaler


def run(train_state, start, stop):
    for step in range(start, stop):
        train_state = train_step(train_state, jnp.asarray(step, jnp.int32))
    return train_state


def assert_bit_identical(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted():
    return run(fresh_state(), 0, N + M)


def test_orbax_restart_is_bit_identical_to_an_uninterrupted_run(tmp_path, uninterrupted):
    at_n = run(fresh_state(), 0, N)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "step_8", at_n)
    checkpointer.wait_until_finished()
    del at_n

    # A new process would rebuild the target from its configuration.
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, fresh_state())
    restored = checkpointer.restore(tmp_path / "step_8", target)
    checkpointer.close()
    params, opt_state, scaler = restored
    assert isinstance(scaler, jaxmp.ScalerState)
    assert (scaler.growth_interval, scaler.hysteresis) == (3, 2)
    assert isinstance(opt_state[0], optax.ScaleByAdamState)

    resumed = run(restored, N, N + M)
    assert_bit_identical(resumed, uninterrupted)
    # The run exercised the scaler: overflows were skipped, and the scale moved.
    final = uninterrupted[2]
    assert int(final.skipped_steps) > 0
    assert float(final.scale) != 2.0**17


def test_restart_without_the_scaler_state_diverges(tmp_path, uninterrupted):
    # The scaler state is part of what must be saved: resuming with a fresh
    # scaler (a common mistake) does not reproduce the run. This guards the
    # test above against a scaler that never mattered.
    params, opt_state, _ = run(fresh_state(), 0, N)
    resumed = run((params, opt_state, fresh_state()[2]), N, N + M)
    scalers_differ = not np.array_equal(resumed[2].scale, uninterrupted[2].scale) or not (
        np.array_equal(resumed[2].skipped_steps, uninterrupted[2].skipped_steps))
    assert scalers_differ


def test_flax_serialization_round_trip_keeps_the_scaler_settings():
    scaler = jaxmp.init_scaler(
        initial_scale=2.0**10, growth_interval=7, growth_factor=3.0, backoff_factor=0.25,
        min_scale=2.0, max_scale=2.0**20, hysteresis=4)
    scaler = jaxmp.adjust(jaxmp.adjust(scaler, jnp.asarray(True)), jnp.asarray(False))
    params = init_params()
    opt_state = OPTIMIZER.init(params)
    blob = flax.serialization.to_bytes((params, opt_state, scaler))
    target = (init_params(), OPTIMIZER.init(params), jaxmp.init_scaler(
        initial_scale=2.0**10, growth_interval=7, growth_factor=3.0, backoff_factor=0.25,
        min_scale=2.0, max_scale=2.0**20, hysteresis=4))
    restored = flax.serialization.from_bytes(target, blob)
    assert_bit_identical(restored, (params, opt_state, scaler))
    r = restored[2]
    assert (r.mode, r.growth_interval, r.growth_factor, r.backoff_factor, r.min_scale,
            r.max_scale, r.hysteresis) == ("dynamic", 7, 3.0, 0.25, 2.0, 2.0**20, 4)
    assert int(r.steps_since_overflow) == 0 and int(r.overflow_streak) == 1
    assert int(r.skipped_steps) == 1
    # The restored state works in a jitted step with the original: same tree type.
    assert jax.tree_util.tree_structure(r) == jax.tree_util.tree_structure(scaler)


@pytest.mark.parametrize("make", [lambda: jaxmp.static_scaler(64.0), jaxmp.noop_scaler],
                         ids=["static", "noop"])
def test_static_and_noop_scalers_round_trip(tmp_path, make):
    state = jaxmp.adjust(make(), jnp.asarray(False))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "scaler", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "scaler", make())
    checkpointer.close()
    assert restored.mode == state.mode and restored.max_scale == state.max_scale
    assert_bit_identical(restored, state)
    blob = flax.serialization.to_bytes(state)
    assert_bit_identical(flax.serialization.from_bytes(make(), blob), state)


def _settings(state):
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)
            if not f.metadata.get("pytree_node", True)}


def test_settings_come_from_the_restore_target_not_the_checkpoint(tmp_path):
    # What docs/checkpoint.md warns about: the settings are not stored, so a
    # target built with other arguments silently gives the state other settings.
    state = jaxmp.adjust(jaxmp.init_scaler(growth_interval=7, hysteresis=3), jnp.asarray(False))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "scaler", state)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "scaler", jaxmp.init_scaler())
    assert (restored.growth_interval, restored.hysteresis) == (2000, 1)
    assert int(restored.overflow_streak) == 1  # the arrays are the checkpoint's

    # The recipe of docs/checkpoint.md: settings stored as JSON beside it.
    (tmp_path / "scaler.json").write_text(json.dumps(_settings(state)))
    target = dataclasses.replace(jaxmp.init_scaler(),
                                 **json.loads((tmp_path / "scaler.json").read_text()))
    restored = checkpointer.restore(tmp_path / "scaler", target)
    checkpointer.close()
    assert _settings(restored) == _settings(state)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    assert_bit_identical(restored, state)


@pytest.mark.parametrize("make", [
    lambda: jaxmp.init_scaler(initial_scale=8.0, growth_factor=3.0, backoff_factor=0.25,
                              min_scale=2.0, max_scale=2.0**20, on_stuck="raise", stuck_after=4),
    lambda: jaxmp.static_scaler(64.0, on_stuck="off"),
    jaxmp.noop_scaler,
], ids=["dynamic", "static", "noop"])
def test_every_setting_survives_a_json_round_trip(make):
    state = make()
    settings = json.loads(json.dumps(_settings(state)))
    assert set(settings) >= {"mode", "growth_interval", "growth_factor", "backoff_factor",
                             "min_scale", "max_scale", "hysteresis", "on_stuck", "stuck_after"}
    rebuilt = dataclasses.replace(jaxmp.init_scaler(), **settings)
    assert _settings(rebuilt) == _settings(state)
    assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(state)


# The record of the run (issue 34) and, since issue 40, the periods of each alarm kind in place
# of the step of the latest alarm (alarm_record_step).
RECORD = ("longest_skip_run", "alarm_record")
PERIODS = ("alarm_periods", "first_alarm", "last_alarm", "alarm_scale")


def _old_checkpoint(state):
    """The state dict of ``state`` as jaxmp wrote it before the scaler kept a record of the run."""
    old = flax.serialization.to_state_dict(state)
    for name in RECORD + PERIODS:
        del old[name]
    return old


def _issue34_checkpoint(state, record_step):
    """The state dict of ``state`` as jaxmp wrote it from issue 34 to issue 40: the record kept
    the step of the latest alarm raised, ``record_step``, and no periods."""
    old = flax.serialization.to_state_dict(state)
    for name in PERIODS:
        del old[name]
    old["alarm_record_step"] = np.asarray(record_step, np.int32)
    return old


def test_a_checkpoint_from_before_the_record_loads():
    # Decided (issue 34): an old checkpoint loads; the record starts from its counters.
    state = jaxmp.adjust(jaxmp.adjust(jaxmp.init_scaler(hysteresis=3), False), False)
    blob = flax.serialization.msgpack_serialize(_old_checkpoint(state))
    restored = flax.serialization.from_bytes(jaxmp.init_scaler(hysteresis=3), blob)
    assert int(restored.overflow_streak) == 2 and int(restored.longest_skip_run) == 2
    assert int(restored.alarm_record) == 0 and restored.alarm_periods.tolist() == [0, 0]
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for name in RECORD + PERIODS:
        assert getattr(restored, name).dtype == getattr(state, name).dtype
        assert getattr(restored, name).shape == getattr(state, name).shape
    # A stuck alarm in the old checkpoint is on the record of the restored state: a period that
    # began when the alarm was raised and goes on.
    stuck = jaxmp.init_scaler(initial_scale=1.0, stuck_after=2, on_stuck="off")
    stuck = jaxmp.adjust(jaxmp.adjust(jaxmp.adjust(stuck, False), False), False)
    old = _old_checkpoint(stuck)
    old["alarm"], old["alarm_step"] = np.asarray(1, np.int32), np.asarray(2, np.int32)
    restored = flax.serialization.from_state_dict(stuck, old)
    assert int(restored.alarm_record) == 1 and restored.alarm_periods.tolist() == [1, 0]
    assert restored.last_alarm.tolist() == [[2, 3], [0, 0]] == restored.first_alarm.tolist()


def test_a_checkpoint_with_the_latest_alarm_step_loads_with_periods():
    # Written between issues 34 and 40: stuck, recovered, and the step of the latest alarm.
    state = jaxmp.init_scaler(initial_scale=1.0, stuck_after=2, on_stuck="off")
    for f in [False] * 4 + [True] * 3:
        state = jaxmp.adjust(state, f)
    old = _issue34_checkpoint(state.replace(alarm_record=jnp.asarray(1, jnp.int32)), 2)
    target = jaxmp.init_scaler(stuck_after=2)
    restored = flax.serialization.from_bytes(target, flax.serialization.msgpack_serialize(old))
    assert restored.alarm_periods.tolist() == [1, 0]
    assert restored.last_alarm.tolist() == [[2, 2], [0, 0]]  # its end is not known: its start
    assert int(restored.skipped_steps) == 4 and int(restored.steps) == 7
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)
    for name in PERIODS:
        assert getattr(restored, name).dtype == getattr(state, name).dtype
    # The restored state carries on: a new stuck period is the second, said once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f in [False] * 3:
            restored = jaxmp.adjust(restored, f)
        host.flush()
    said = [str(w.message) for w in caught if w.category is jaxmp.TrainingStuckWarning]
    # (A resumed run also says the record it restored: the period that ended at step 2.)
    assert [m for m in said if "stuck since step 9" in m] == said[-1:]
    assert restored.alarm_periods.tolist() == [2, 0]
    assert restored.first_alarm.tolist()[0] == [2, 2] and restored.last_alarm.tolist()[0] == [9, 10]


@pytest.mark.parametrize("layout", ["before_issue_34", "issue_34"])
def test_an_old_orbax_checkpoint_says_what_is_missing_and_loads_through_flax(tmp_path, layout):
    state = jaxmp.adjust(jaxmp.init_scaler(), False)
    old = (_old_checkpoint(state) if layout == "before_issue_34"
           else _issue34_checkpoint(state, 0))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "old", {"scaler": old})
    checkpointer.wait_until_finished()
    with pytest.raises(ValueError, match="alarm_periods"):  # orbax names the missing fields
        checkpointer.restore(tmp_path / "old", {"scaler": jaxmp.init_scaler()})
    # What docs/checkpoint.md says to do: restore without a target, then build the state.
    raw = checkpointer.restore(tmp_path / "old")
    checkpointer.close()
    restored = flax.serialization.from_state_dict(jaxmp.init_scaler(), raw["scaler"])
    assert int(restored.skipped_steps) == 1 and float(restored.scale) == 2.0**14
    assert int(restored.longest_skip_run) == 1 and restored.alarm_periods.tolist() == [0, 0]


def test_a_state_dict_missing_other_fields_is_a_clear_error():
    old = _old_checkpoint(jaxmp.init_scaler())
    del old["scale"]
    with pytest.raises(ValueError, match="missing field\\(s\\) scale. .*holds the array fields"):
        flax.serialization.from_state_dict(jaxmp.init_scaler(), old)
