"""Tests of jaxmp._src.loss_scale."""

import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp

ALL_STATES = {
    "dynamic": lambda: jaxmp.init_scaler(initial_scale=64.0, growth_interval=3, growth_factor=4.0,
                                         backoff_factor=0.25, min_scale=2.0, max_scale=1024.0,
                                         hysteresis=2),
    "static": lambda: jaxmp.static_scaler(128.0),
    "none": jaxmp.noop_scaler,
}


def _settings(state):
    return (state.mode, state.growth_interval, state.growth_factor, state.backoff_factor,
            state.min_scale, state.max_scale, state.hysteresis)


def _assert_same_type(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape


def test_defaults_work_and_have_expected_types():
    state = jaxmp.init_scaler()
    assert state.scale.dtype == jnp.float32 and state.scale.shape == ()
    for counter in (state.steps_since_overflow, state.overflow_streak, state.skipped_steps):
        assert counter.dtype == jnp.int32 and counter.shape == ()
    assert state.mode == "dynamic" and float(state.scale) == 2.0**15


def test_grows_on_the_interval_th_consecutive_finite_step():
    state = jaxmp.init_scaler(initial_scale=8.0, growth_interval=3, growth_factor=2.0)
    scales = []
    for _ in range(7):
        state = jaxmp.adjust(state, True)
        scales.append(float(state.scale))
    assert scales == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_overflow_resets_growth_and_backs_off():
    state = jaxmp.init_scaler(initial_scale=8.0, growth_interval=2, backoff_factor=0.5)
    state = jaxmp.adjust(state, True)
    state = jaxmp.adjust(state, False)
    assert float(state.scale) == 4.0 and int(state.skipped_steps) == 1
    assert int(state.steps_since_overflow) == 0
    state = jaxmp.adjust(state, True)
    assert float(state.scale) == 4.0  # the run of finite steps started again
    state = jaxmp.adjust(state, True)
    assert float(state.scale) == 8.0


def test_scale_is_capped_and_floored():
    state = jaxmp.init_scaler(initial_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=8.0)
    for _ in range(5):
        state = jaxmp.adjust(state, True)
    assert float(state.scale) == 8.0
    for _ in range(5):
        state = jaxmp.adjust(state, False)
    assert float(state.scale) == 2.0
    assert int(state.skipped_steps) == 5


def test_hysteresis_tolerates_overflows_before_backing_off():
    state = jaxmp.init_scaler(initial_scale=64.0, hysteresis=3)
    scales = []
    for finite in (False, False, True, False, False, False, False):
        state = jaxmp.adjust(state, finite)
        scales.append(float(state.scale))
    # The finite step resets the streak; the 3rd consecutive overflow backs off, and every further one.
    assert scales == [64.0, 64.0, 64.0, 64.0, 64.0, 32.0, 16.0]
    assert int(state.skipped_steps) == 6 and int(state.overflow_streak) == 4


def test_static_scaler_never_changes_but_counts_skips():
    state = jaxmp.static_scaler(128.0)
    for finite in (True, False, True, False):
        state = jaxmp.adjust(state, finite)
    assert float(state.scale) == 128.0 and int(state.skipped_steps) == 2


def test_noop_scaler_does_not_scale():
    state = jaxmp.noop_scaler()
    x = jnp.asarray([3.0, -1.5], jnp.bfloat16)
    np.testing.assert_array_equal(jaxmp.scale(state, x), np.asarray([3.0, -1.5], np.float32))
    assert jaxmp.unscale(state, x).dtype == jnp.float32
    state = jaxmp.adjust(state, False)
    assert float(state.scale) == 1.0 and int(state.skipped_steps) == 1


def test_regression_scaling_in_float32_does_not_overflow():
    # MPX multiplied a float16 loss by the scale in float16: 12 * 8192 -> inf.
    state = jaxmp.init_scaler(initial_scale=8192.0)
    scaled = jaxmp.scale(state, jnp.asarray(12.0, jnp.float16))
    assert scaled.dtype == jnp.float32 and float(scaled) == 12.0 * 8192.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscale_returns_float32_and_leaves_non_floats(dtype):
    state = jaxmp.init_scaler(initial_scale=1024.0)
    tree = {"g": jnp.full((3,), 512.0, dtype), "i": jnp.arange(3), "none": None}
    out = jaxmp.unscale(state, tree)
    assert out["g"].dtype == jnp.float32
    np.testing.assert_array_equal(out["g"], np.full((3,), 0.5, np.float32))
    assert out["i"] is tree["i"] and out["none"] is None
    back = jaxmp.scale(state, out)
    np.testing.assert_array_equal(back["g"], np.full((3,), 512.0, np.float32))


def test_all_finite():
    assert bool(jaxmp.all_finite({"a": jnp.ones(2), "b": jnp.arange(3)}))
    assert not bool(jaxmp.all_finite({"a": jnp.ones(2), "b": jnp.array([jnp.nan], jnp.bfloat16)}))
    assert not bool(jaxmp.all_finite([jnp.array([-jnp.inf], jnp.float16)]))
    assert bool(jaxmp.all_finite({"only_ints": jnp.arange(2), "none": None}))
    assert jaxmp.all_finite(jnp.ones(2)).dtype == jnp.bool_


def _and_reductions(fn, *args, platform="cpu"):
    """How many reductions by ``and`` the program of ``fn`` lowered for ``platform`` has."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text().count(
        "applies stablehlo.and")


def _typed(tree, mesh):
    """``tree``'s types, replicated over ``mesh``."""
    from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=NamedSharding(mesh, PartitionSpec())), tree)


def _one_device_mesh():
    return jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:1])


def test_all_finite_is_a_reduction_per_32_leaves_on_a_gpu():
    # On a GPU one reduction per group of at most 32 leaves, which XLA fuses with their
    # concatenation: two kernels in the H100 program per group (one or two per leaf before:
    # 117 kernels on an 8-layer GPT). XLA:GPU fuses at most 96 operands into one kernel and
    # otherwise writes the concatenation out (645 MiB on an 8-layer GPT). On a CPU, one
    # reduction per leaf: XLA:CPU would write the concatenation's flags out.
    many = [jnp.full(3, float(i)) for i in range(70)] + [jnp.ones((2, 2), jnp.bfloat16)]
    typed = _typed(many, _one_device_mesh())
    assert _and_reductions(jaxmp.all_finite, typed, platform="cuda") == 3
    assert _and_reductions(jaxmp.all_finite, typed, platform="cpu") == 71

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) * p["h"][:3].astype(jnp.float32))

    def step(p, x):
        return jaxmp.mp_value_and_grad(loss, compute_dtype=jnp.bfloat16)(
            p, x, scaler_state=jaxmp.noop_scaler())

    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3), "h": jnp.ones(5, jnp.bfloat16)}
    args = _typed((params, jnp.ones((2, 4))), _one_device_mesh())
    assert _and_reductions(step, *args, platform="cuda") == 1  # the step's one verdict
    assert bool(jaxmp.all_finite(many))
    assert not bool(jaxmp.all_finite(many[:69] + [jnp.array([1.0, jnp.inf])]))


def test_all_finite_concatenates_only_where_nothing_is_gathered():
    # Over several devices leaves may be sharded each its own way, and concatenating them
    # would gather them: one reduction per leaf there, on every platform. Typed for one
    # device, or inside a shard_map whose axes are all manual (each device has its own
    # shards): one reduction per group of leaves on a GPU.
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top

    tree = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3), "h": jnp.ones(5, jnp.bfloat16)}
    assert _and_reductions(jaxmp.all_finite, _typed(tree, _one_device_mesh()), platform="cuda") == 1
    if jax.device_count() > 1:  # this test session has several CPU devices
        every = jax.make_mesh((jax.device_count(),), ("data",),
                              axis_types=(jax.sharding.AxisType.Auto,))
        assert _and_reductions(jaxmp.all_finite, _typed(tree, every), platform="cuda") == 3
        assert _and_reductions(jaxmp.all_finite, tree, platform="cuda") == 3  # untyped
        local = jax.shard_map(lambda t: jaxmp.all_finite(t)[None], mesh=every, in_specs=P(),
                              out_specs=P("data"))
        assert _and_reductions(local, tree, platform="cuda") == 1
        assert np.asarray(local(tree)).all()
    assert not bool(jaxmp.all_finite(dict(tree, h=tree["h"].at[2].set(jnp.inf))))


@pytest.mark.parametrize("chain", [False, True], ids=["sorted", "chained"])
def test_all_finite_mixed_dtypes_meet_exactly(chain):
    # float32's largest values overflow bfloat16 and float16; a group's concatenation of
    # them is float32. The GPU's grouped verdict, evaluated here on the CPU.
    from jaxmp._src import loss_scale  # pylint: disable=g-import-not-at-top

    grouped = jax.jit(lambda *xs: loss_scale._verdict(*xs, size=32, chain=chain))
    # Groups of one leaf, their flags combined (the sort and minimum, or the GPU's chain).
    single = jax.jit(lambda *xs: loss_scale._verdict(*xs, size=1, chain=chain))
    assert bool(single(jnp.ones(2), jnp.ones(3, jnp.bfloat16), jnp.float16(2)))
    for bad in range(3):
        leaves = [jnp.ones(2), jnp.ones(3, jnp.bfloat16), jnp.float16(2)]
        leaves[bad] = leaves[bad] * jnp.asarray(jnp.nan, leaves[bad].dtype)
        assert not bool(single(*leaves))
    big = jnp.float32(3.4e38)  # rounds to inf in bfloat16
    assert jnp.isinf(big.astype(jnp.bfloat16))
    assert bool(grouped(big, jnp.ones(2, jnp.bfloat16)))
    assert bool(grouped(jnp.float16(6e4), jnp.bfloat16(1e38)))
    assert not bool(grouped(jnp.float16(1), jnp.bfloat16(jnp.inf)))
    assert not bool(grouped(jnp.zeros((0, 3)), jnp.array([jnp.nan])))
    assert bool(grouped(jnp.zeros((0, 3)), jnp.ones(2, jnp.float16)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"initial_scale": 0.5, "min_scale": 1.0}, "initial_scale"),
        ({"initial_scale": float("inf")}, "initial_scale must be finite"),
        ({"growth_interval": 0}, "growth_interval must be >= 1"),
        ({"growth_interval": 2.5}, "growth_interval must be a whole number"),
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"min_scale": 0.0}, "min_scale must be > 0"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, "must not exceed max_scale"),
        ({"max_scale": 1e39}, "max_scale must fit in float32"),
        ({"hysteresis": 0}, "hysteresis must be >= 1"),
        ({"growth_factor": "2"}, "growth_factor must be a number"),
        ({"hysteresis": True}, "hysteresis must be a number"),
    ],
)
def test_invalid_settings_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxmp.init_scaler(**kwargs)


def test_invalid_static_scale_raises():
    with pytest.raises(ValueError, match="scale must be positive"):
        jaxmp.static_scaler(-1.0)


# Round trips: the state never changes type, the settings always survive. ----

@pytest.mark.parametrize("kind", sorted(ALL_STATES))
def test_round_trips_keep_settings_and_types(kind):
    state = ALL_STATES[kind]()
    flat, treedef = jax.tree_util.tree_flatten(state)
    assert _settings(jax.tree_util.tree_unflatten(treedef, flat)) == _settings(state)
    assert _settings(jax.tree_util.tree_map(lambda x: x, state)) == _settings(state)
    jitted = jax.jit(lambda s: jaxmp.adjust(s, jnp.asarray(True)))(state)
    assert _settings(jitted) == _settings(state)
    _assert_same_type(jitted, state)
    restored = serialization.from_bytes(state, serialization.to_bytes(jaxmp.adjust(state, False)))
    assert _settings(restored) == _settings(state)
    assert int(restored.skipped_steps) == 1
    # Branches of lax.cond must agree on the type: catches dtype drift.
    both = jax.lax.cond(jnp.asarray(True), lambda s: jaxmp.adjust(s, True),
                        lambda s: jaxmp.adjust(s, False), state)
    _assert_same_type(both, state)


@pytest.mark.parametrize("kind", sorted(ALL_STATES))
def test_scan_carry_and_single_compilation(kind):
    state = ALL_STATES[kind]()
    flags = jnp.array([True, True, False, True, True, True, False, False, True])

    def body(s, f):
        s = jaxmp.adjust(s, f)
        return s, s.scale

    final, scales = jax.lax.scan(body, state, flags)
    _assert_same_type(final, state)
    # The same trajectory step by step in Python with a jitted adjust, compiled once.
    traces = []

    @jax.jit
    def step(s, f):
        traces.append(1)
        return jaxmp.adjust(s, f)

    s = state
    for i, f in enumerate(flags):
        s = step(s, f)
        assert float(s.scale) == float(scales[i])
    assert len(traces) == 1
    assert int(final.skipped_steps) == 3


def _reference_scaler(flags, initial, interval, growth, backoff, lo, hi, hysteresis):
    """A plain-Python model of the dynamic scaler, to check the traced one against."""
    scale, since, streak, skipped, out = initial, 0, 0, 0, []
    for finite in flags:
        if finite:
            since, streak = since + 1, 0
            if since % interval == 0:
                scale = min(scale * growth, hi)
        else:
            since, streak, skipped = 0, streak + 1, skipped + 1
            if streak >= hysteresis:
                scale = max(scale * backoff, lo)
        out.append(scale)
    return out, skipped


@settings(max_examples=40, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=30),
    interval=st.integers(1, 4),
    growth=st.sampled_from([2.0, 4.0, 1.5]),
    backoff=st.sampled_from([0.5, 0.25, 0.9]),
    hysteresis=st.integers(1, 3),
    initial_exp=st.integers(0, 10),
)
def test_property_dynamic_scaler_matches_reference(flags, interval, growth, backoff, hysteresis,
                                                    initial_exp):
    lo, hi = 1.0, 2.0**12
    state = jaxmp.init_scaler(initial_scale=2.0**initial_exp, growth_interval=interval,
                              growth_factor=growth, backoff_factor=backoff, min_scale=lo,
                              max_scale=hi, hysteresis=hysteresis)
    final, scales = jax.lax.scan(lambda s, f: (jaxmp.adjust(s, f), jaxmp.adjust(s, f).scale),
                                 state, jnp.asarray(flags))
    expected, skipped = _reference_scaler(flags, 2.0**initial_exp, interval, growth, backoff, lo,
                                          hi, hysteresis)
    np.testing.assert_allclose(np.asarray(scales), np.asarray(expected, np.float32), rtol=1e-6)
    assert int(final.skipped_steps) == skipped
    assert lo <= float(scales.min()) and float(scales.max()) <= hi


def test_scaler_metrics_are_scalars_in_and_out_of_jit():
    state = jaxmp.adjust(jaxmp.init_scaler(initial_scale=4.0), False)
    metrics = jaxmp.scaler_metrics(state)
    assert {k: v.item() for k, v in metrics.items()} == {
        "loss_scale": 2.0, "skipped_steps": 1, "steps_since_overflow": 0, "overflow_streak": 1,
        "longest_skip_run": 1, "alarm": 0}
    jitted = jax.jit(jaxmp.scaler_metrics)(state)
    assert all(v.shape == () for v in jitted.values())


# Stuck training: said once, from the state the step returns; no step calls back. ----

def _run_flags(state, flags, jit=True):
    step = jax.jit(jaxmp.adjust) if jit else jaxmp.adjust
    for f in flags:
        state = step(state, jnp.asarray(f))
    return jax.block_until_ready(state)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_stuck_training_warns_once_with_what_to_do(jit):
    # From 2**4, the scale reaches min_scale=1 after 4 overflows; with
    # stuck_after=6 the 6th consecutive overflow is the stuck one.
    state = jaxmp.init_scaler(initial_scale=16.0, stuck_after=6)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        state = _run_flags(state, [False] * 30, jit)
    assert len(record) == 1
    message = str(record[0].message)
    assert "The last 6 steps" in message and "minimum loss scale (1)" in message
    for advice in ("find_nonfinite", "autocast=True", "bfloat16"):
        assert advice in message
    assert float(state.scale) == 1.0 and int(state.overflow_streak) == 30


def test_stuck_waits_for_the_minimum_scale():
    # 5 overflows from 2**10 leave the scale at 32: not stuck yet, even past stuck_after.
    state = jaxmp.init_scaler(initial_scale=2.0**10, stuck_after=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxmp.TrainingStuckWarning)
        state = _run_flags(state, [False] * 5)
    assert float(state.scale) == 32.0
    with pytest.warns(jaxmp.TrainingStuckWarning, match="The last 10 steps") as record:
        _run_flags(state, [False] * 8)
    assert len(record) == 1


def test_stuck_again_after_a_recovery_is_said_again():
    state = jaxmp.static_scaler(4.0, stuck_after=3)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        state = _run_flags(state, [False] * 4 + [True] + [False] * 5)
    assert len(record) == 2


def test_healthy_and_briefly_overflowing_runs_are_silent():
    flags = ([True] * 5 + [False] * 2) * 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for make in ALL_STATES.values():
            _run_flags(make(), flags)
        # A long streak above min_scale is not stuck either.
        _run_flags(jaxmp.init_scaler(initial_scale=2.0**20, min_scale=1.0), [False] * 12)


def test_stuck_raise_mode_raises():
    state = jaxmp.noop_scaler(on_stuck="raise", stuck_after=3)
    state = _run_flags(state, [False] * 2)  # not yet
    # Raised when a later state comes back: at most two steps after the stuck one.
    with pytest.raises(jaxmp.TrainingStuckError, match="training is stuck"):
        _run_flags(state, [False] * 3)


def test_stuck_off_is_silent_and_adds_no_callback():
    state = jaxmp.init_scaler(initial_scale=2.0, on_stuck="off", stuck_after=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_flags(state, [False] * 5)
    for s in (state, jaxmp.init_scaler()):  # no step ever contains a host callback
        assert "callback" not in str(jax.make_jaxpr(jaxmp.adjust)(s, jnp.asarray(False)))


def test_stuck_inside_scan_warns_once():
    state = jaxmp.init_scaler(initial_scale=8.0, stuck_after=4)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        final, _ = jax.lax.scan(lambda s, f: (jaxmp.adjust(s, f), None), state,
                                jnp.zeros(20, jnp.bool_))
        jax.block_until_ready(final)
    assert len(record) == 1


# A run inside one jit: its state comes back once, at the end. ----

def _one_jit_run(state, flags):
    """``flags`` as the steps of one jitted scan; the final state and the per-step metrics."""
    def step(s, f):
        s = jaxmp.adjust(s, f)
        return s, jaxmp.scaler_metrics(s)

    final, metrics = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(state, jnp.asarray(flags))
    return jax.block_until_ready(final), metrics


def test_a_stuck_period_inside_one_jit_is_said_when_the_state_comes_back():
    # Stuck for 20 steps, then fine for 30: the returned state's alarm is 0, and before the
    # record it said nothing (issue 34).
    flags = [False] * 20 + [True] * 30
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        final, metrics = _one_jit_run(jaxmp.init_scaler(initial_scale=8.0, stuck_after=4), flags)
    assert int(final.alarm) == 0 and int(final.skipped_steps) == 20
    assert int(final.longest_skip_run) == 20 and int(final.alarm_record) == jaxmp_stuck()
    # Stuck from step 4 (8 -> 4 -> 2 -> 1, then 4 overflows at 1) to step 20; never skipping
    # often (the skips before the first finite step do not count).
    assert np.asarray(final.last_alarm).tolist() == [[4, 20], [0, 0]]
    assert np.asarray(final.first_alarm).tolist() == [[4, 20], [0, 0]]
    assert np.asarray(final.alarm_periods).tolist() == [1, 0]
    assert len(record) == 1
    message = str(record[0].message)
    assert "got stuck at step 4" in message and "stayed stuck to step 20 (17 steps)" in message
    assert "recovered by step 50" in message
    assert "longest run of skipped steps in this run: 20" in message
    # Per step, as outputs of the scan: where it was stuck, and the longest run so far.
    alarm = np.asarray(metrics["alarm"])
    assert alarm[3:20].tolist() == [1] * 17 and alarm[:3].sum() == 0 and alarm[20:].sum() == 0
    assert np.asarray(metrics["longest_skip_run"]).tolist() == list(range(1, 21)) + [20] * 30
    # The same state seen again (a copy, a later read) says nothing more.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.block_until_ready(jax.jit(lambda s: s)(final))
        jax.block_until_ready(jaxmp.adjust(final, True))


def jaxmp_stuck():
    from jaxmp._src import loss_scale  # pylint: disable=g-import-not-at-top
    return loss_scale.STUCK


def test_frequent_skips_inside_one_jit_are_said_at_the_end():
    flags = [i % 2 == 0 for i in range(100)] + [True] * 100
    with pytest.warns(jaxmp.SkippedStepsWarning) as record:
        final, _ = _one_jit_run(jaxmp.noop_scaler(), flags)
    assert int(final.alarm) == 0 and len(record) == 1
    assert "of the last 64 steps had been skipped" in str(record[0].message)


def test_a_stuck_period_said_step_by_step_is_not_said_again_from_the_record():
    step = jax.jit(jaxmp.adjust)
    state = jaxmp.init_scaler(initial_scale=2.0, stuck_after=3)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        for f in [False] * 6 + [True] * 6:
            state = step(state, jnp.asarray(f))
        jax.block_until_ready(state)
        from jaxmp._src import host  # pylint: disable=g-import-not-at-top
        host.flush()
    assert len(record) == 1 and "training is stuck" in str(record[0].message)
    assert int(state.alarm) == 0 and int(state.alarm_record) != 0


def test_the_record_raises_with_on_stuck_raise_and_is_silent_with_off():
    flags = [False] * 12 + [True] * 5
    with pytest.raises(jaxmp.TrainingStuckError, match="got stuck at step"):
        _one_jit_run(jaxmp.init_scaler(initial_scale=2.0, stuck_after=3, on_stuck="raise"), flags)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        final, _ = _one_jit_run(jaxmp.init_scaler(initial_scale=2.0, stuck_after=3,
                                                  on_stuck="off"), flags)
    assert int(final.alarm_record) == 0 and int(final.longest_skip_run) == 12


def _said(flags, make, one_jit):
    """``(warning class, first step)`` of each alarm said for the steps ``flags``: step by step
    (a jitted ``adjust`` per step, as a Python loop) or in one jitted scan."""
    from jaxmp._src import host  # pylint: disable=g-import-not-at-top
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        final = _one_jit_run(make(), flags)[0] if one_jit else _run_flags(make(), flags)
        host.flush()
    said = [(w.category.__name__, int(re.search(r"step (\d+)", str(w.message)).group(1)))
            for w in caught if issubclass(w.category, RuntimeWarning)]
    return said, final


_PERIODS = {
    # Stuck from the 8th step (16 -> 1 in 4 back-offs, then 4 at 1) to the 16th, then every
    # other step skipped: frequent skips from step 36, after the stuck period ended (issue 40).
    "stuck_then_skips": [True] * 4 + [False] * 12 + [i % 2 == 0 for i in range(80)] + [True] * 90,
    # Stuck long enough (30 steps) that a third of the recent steps are skipped too (alarm 3):
    # a loop used to say the stuck period twice.
    "stuck_and_skips": [True] * 4 + [False] * 30 + [True] * 90,
    "stuck_twice": [True] * 4 + [False] * 9 + [True] * 100 + [False] * 6 + [True] * 3,
}


@pytest.mark.parametrize("pattern", sorted(_PERIODS))
def test_a_run_in_one_jit_says_every_period_a_loop_says(pattern):
    flags = _PERIODS[pattern]

    def make():
        return jaxmp.init_scaler(initial_scale=16.0, stuck_after=4)

    loop, _ = _said(flags, make, one_jit=False)
    scan, final = _said(flags, make, one_jit=True)
    assert scan == loop
    # Each period is said once, by its kind and the step it began.
    expected = {
        "stuck_then_skips": [("TrainingStuckWarning", 8), ("SkippedStepsWarning", 36)],
        "stuck_and_skips": [("TrainingStuckWarning", 8), ("SkippedStepsWarning", 26)],
        "stuck_twice": [("TrainingStuckWarning", 8), ("TrainingStuckWarning", 117)],
    }[pattern]
    assert loop == expected
    if pattern == "stuck_then_skips":  # the record: when each began and ended
        assert np.asarray(final.last_alarm).tolist() == [[8, 16], [36, 117]]
        assert int(final.alarm) == 0


def test_a_kind_with_three_periods_in_one_jit_says_its_first_and_latest():
    flags = ([True] * 4 + [False] * 9 + [True] * 100) + ([False] * 6 + [True] * 100) * 2
    make = lambda: jaxmp.init_scaler(initial_scale=16.0, stuck_after=4)  # noqa: E731
    loop, _ = _said(flags, make, one_jit=False)
    assert loop == [("TrainingStuckWarning", 8), ("TrainingStuckWarning", 117),
                    ("TrainingStuckWarning", 223)]
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        final, _ = _one_jit_run(make(), flags)
        from jaxmp._src import host  # pylint: disable=g-import-not-at-top
        host.flush()
    assert int(final.alarm_periods[0]) == 3
    first, latest = (str(w.message) for w in record)
    assert "got stuck at step 8 " in first and "the first of 3 such periods" in first
    assert "got stuck at step 223 " in latest and "stayed stuck to step 225 (3 steps" in latest
    assert "the latest of 3 such periods in this run, 1 of them between" in latest


def test_frequent_skips_say_the_current_scale_not_its_range():
    # Every other step skipped at a growing scale: the scale is not its minimum when said.
    state, seen = jaxmp.init_scaler(initial_scale=2.0**10, growth_interval=1), []
    step = jax.jit(jaxmp.adjust)
    with pytest.warns(jaxmp.SkippedStepsWarning) as record:
        for f in _skip_pattern(2, 100):
            state = step(state, jnp.asarray(f))
            seen.append((int(state.alarm), float(state.scale), int(state.steps)))
        jax.block_until_ready(state)
    alarm_step = next(steps for alarm, _, steps in seen if alarm)
    scale = seen[alarm_step - 1][1]
    message = str(record[0].message)
    assert f"since step {alarm_step}:" in message
    assert f"The loss scale is now {scale:g} (the scaler keeps it within [1, " in message
    assert "is now in [" not in message
    # The advice diagnoses at the scale the last skipped step ran at (the scale before it).
    flags = _skip_pattern(2, 100)
    last_skip = max(i for i in range(alarm_step) if not flags[i])
    ran_at = seen[last_skip - 1][1]
    assert ran_at != scale and f"scaler_state=jaxmp.static_scaler({ran_at!r})" in message


def test_alarm_record_step_is_deprecated_and_reads_the_latest_alarm():
    state = jaxmp.init_scaler(initial_scale=16.0, stuck_after=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        final, _ = _one_jit_run(state, _PERIODS["stuck_then_skips"])
    with pytest.warns(DeprecationWarning, match="last_alarm"):
        assert int(final.alarm_record_step) == 36  # the frequent skips, the latest alarm raised


@pytest.mark.parametrize("kind", sorted(ALL_STATES))
def test_the_record_round_trips(kind):
    state = ALL_STATES[kind]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for f in [False] * 12 + [True] * 3:
            state = jaxmp.adjust(state, f)
    names = ("longest_skip_run", "alarm_record", "alarm_periods", "first_alarm", "last_alarm",
             "alarm_scale")
    record = [np.asarray(getattr(state, name)).tolist() for name in names]
    assert record[0] == 12 and record[2] == [1, 0]
    flat, treedef = jax.tree_util.tree_flatten(state)
    for s in (jax.tree_util.tree_unflatten(treedef, flat), jax.jit(lambda s: s)(state),
              jax.lax.scan(lambda c, _: (c, None), state, None, length=2)[0],
              serialization.from_bytes(ALL_STATES[kind](), serialization.to_bytes(state))):
        assert [np.asarray(getattr(s, name)).tolist() for name in names] == record
        _assert_same_type(s, state)


@pytest.mark.parametrize("kwargs, message", [
    ({"on_stuck": "loud"}, "on_stuck must be one of"),
    ({"stuck_after": 0}, "stuck_after must be >= 1"),
    ({"stuck_after": 1.5}, "stuck_after must be a whole number"),
])
def test_invalid_stuck_settings_raise(kwargs, message):
    for make in (jaxmp.init_scaler, jaxmp.noop_scaler, lambda **k: jaxmp.static_scaler(2.0, **k)):
        with pytest.raises(ValueError, match=message):
            make(**kwargs)


def test_stuck_settings_survive_round_trips():
    state = jaxmp.init_scaler(on_stuck="raise", stuck_after=7)
    flat, treedef = jax.tree_util.tree_flatten(state)
    for s in (jax.tree_util.tree_unflatten(treedef, flat), jax.jit(lambda s: s)(state),
              serialization.from_bytes(state, serialization.to_bytes(state))):
        assert (s.on_stuck, s.stuck_after) == ("raise", 7)


def test_alarms_are_read_from_returned_states_even_when_donated():
    # A training loop donates its state to the next step: jaxmp reads its own copy.
    step = jax.jit(jaxmp.adjust, donate_argnums=0)
    state = jaxmp.init_scaler(initial_scale=2.0, stuck_after=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for f in [True, False, False, True] * 5:  # overflows, never stuck
            state = step(state, jnp.asarray(f))
        jax.block_until_ready(state)
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        for _ in range(8):
            state = step(state, jnp.asarray(False))
    assert len(record) == 1


def test_the_stuck_message_on_the_docs_page_is_what_jaxmp_says():
    # docs/float16_stuck.md quotes the warning of a naive float16 port: every step overflows, the
    # default scaler reaches its minimum after 15 back-offs, stuck from the 15th step.
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        _run_flags(jaxmp.init_scaler(), [False] * 17)
    said = f"{record[0].category.__name__}: {record[0].message}"
    page = (Path(__file__).resolve().parents[1] / "docs" / "float16_stuck.md").read_text()
    assert said in page


def _skip_pattern(period, n, skip_first=0):
    # ``skip_first`` overflows (the scale's first descent), then one skip every ``period`` steps.
    return [False] * skip_first + [i % period != period - 1 for i in range(n)]


@pytest.mark.parametrize("make", [
    lambda: jaxmp.init_scaler(initial_scale=2.0**15, growth_interval=4),
    jaxmp.noop_scaler,
], ids=["dynamic", "none"])
def test_frequent_skips_are_said_within_a_hundred_steps(make):
    # Every other step overflows, the scale never at its minimum for long: not stuck,
    # but half the batches are thrown away.
    with pytest.warns(jaxmp.SkippedStepsWarning) as record:
        final = _run_flags(make(), _skip_pattern(2, 100))
    frequent = [w for w in record if issubclass(w.category, jaxmp.SkippedStepsWarning)]
    assert len(frequent) == 1
    message = str(frequent[0].message)
    assert "of the last 64 steps were skipped" in message and "find_nonfinite" in message
    assert int(final.overflow_streak) <= 1  # never a streak: stuck detection alone says nothing


def test_rare_skips_and_the_first_descent_say_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The scale's descent from 2**15 to a workable 2**3 (12 skips in a row), then one
        # overflow in 150 steps.
        _run_flags(jaxmp.init_scaler(), _skip_pattern(150, 300, skip_first=12))
        # One step in four skipped: a quarter, under the third that is reported.
        _run_flags(jaxmp.noop_scaler(), _skip_pattern(4, 200))


def test_alarms_of_replicated_and_batched_scalers():
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    mesh = jax.make_mesh((4,), ("data",))
    state = jax.device_put(jaxmp.init_scaler(initial_scale=4.0, stuck_after=3),
                           NamedSharding(mesh, P()))
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        _run_flags(state, [False] * 8)  # replicated over 4 devices: said once
    assert len(record) == 1
    # A batch of independent scalers (vmap): a lane that gets stuck is said once.
    states = jax.vmap(lambda _: jaxmp.init_scaler(initial_scale=4.0, stuck_after=3))(jnp.arange(3))
    step = jax.jit(jax.vmap(jaxmp.adjust))
    with pytest.warns(jaxmp.TrainingStuckWarning) as record:
        for _ in range(8):
            states = step(states, jnp.array([True, False, True]))
        jax.block_until_ready(states)
        for _ in range(3):
            states = step(states, jnp.array([True, False, True]))
    assert len(record) == 1
    assert [int(s) for s in states.overflow_streak] == [0, 11, 0]


@pytest.mark.parametrize("make", [jaxmp.noop_scaler, lambda: jaxmp.init_scaler(stuck_after=3)],
                         ids=["noop", "dynamic"])
def test_adjust_is_elementwise_so_a_gpu_fuses_it(make):
    # Issue 41 part 2: a stack (concatenate) or a sum over the pairs of the state
    # (recent, the alarm record) is a GPU kernel of its own that the next ops wait for:
    # the scaler's update was 16 kernels of the H100 program, elementwise it is 10
    # (tests/test_gpu_optimizer_step.py counts them).
    jaxpr = jax.make_jaxpr(jaxmp.adjust)(make(), jnp.asarray(True))
    names = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
    assert not names & {"concatenate", "reduce_sum", "reduce_max", "reduce_and", "reduce_or"}


def test_adjust_of_a_batch_of_scalers_is_each_alone():
    # The pairs of the state live on its last axis, after any batch axes (vmap).
    state = jaxmp.init_scaler(initial_scale=2.0, stuck_after=3)
    lanes = ([False] * 5 + [True] + [False] * 4 + [True, True],
             [True, False, True, False, False, True, False, True, True, False, False, False])
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), state)
    alone = [state, state]
    batched, single = jax.jit(jax.vmap(jaxmp.adjust)), jax.jit(jaxmp.adjust)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxmp.TrainingStuckWarning)  # said; tested elsewhere
        for flags in zip(*lanes):
            batch = batched(batch, jnp.asarray(flags))
            alone = [single(s, f) for s, f in zip(alone, flags)]
    for lane, one in enumerate(alone):
        for x, y in zip(jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(one)):
            np.testing.assert_array_equal(x[lane], y)
    # Lane 0 is stuck at steps 3-5 and 9-10: two periods of its first alarm kind.
    assert np.asarray(alone[0].alarm_periods).tolist() == [2, 0]
    assert np.asarray(alone[0].first_alarm).tolist() == [[3, 5], [0, 0]]
    assert np.asarray(alone[0].last_alarm).tolist() == [[9, 10], [0, 0]]
    # Lane 1 only at its last step (its last three overflowed).
    assert np.asarray(alone[1].last_alarm).tolist() == [[12, 12], [0, 0]]
