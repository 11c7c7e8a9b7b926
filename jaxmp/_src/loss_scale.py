"""Loss scaling whose state is an explicit pytree.

The state is a ``flax.struct`` dataclass: the numbers that change during
training (the scale and the counters) are array fields, and the settings are
static fields, so they are part of the tree structure and survive ``jit``,
``tree_map``, ``lax.scan`` carries and checkpoints. Free functions take a state
in and give a new state out, in the manner of optax.

Three modes share the one state type:

* ``"dynamic"`` (:func:`init_scaler`): the scale grows after a run of finite
  steps and backs off on overflow. For float16.
* ``"static"`` (:func:`static_scaler`): a fixed scale.
* ``"none"`` (:func:`noop_scaler`): no scaling at all, for bfloat16 or float32;
  finiteness is still tracked so that non-finite steps are skipped.

Every mode also watches for training that goes wrong: *stuck* training (the
scale sits at its minimum and every step overflows, so no step can ever be
applied again) and *frequent skips* (a third of the recent steps skipped).
:func:`adjust` records either in the state's ``alarm``, and jaxmp says so once
(a :class:`TrainingStuckWarning` or :class:`SkippedStepsWarning` by default, an
error or nothing, by the ``on_stuck`` setting) when the state comes back to the
host: the step itself contains no host callback, so healthy steps pay nothing.
What is said, and when, is :mod:`jaxmp._src.alarms`'s; this module computes
the alarm. A concrete state reaches the host by its constructor: JAX rebuilds
a ``flax.struct`` state returned by a compiled step (``jit``, a ``lax.scan``
inside it, ``vmap``, ``pmap``, ``shard_map``) with it, and no other jaxmp code
runs on the host between steps, so ``__post_init__`` hands such a state to
:func:`jaxmp._src.alarms.watch` (which leaves tracers and ``on_stuck="off"``
alone). A custom pytree registration could do that without a constructor hook,
but the state's type is fixed as a ``flax.struct`` dataclass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization
from flax import struct

from jaxmp._src import alarms
from jaxmp._src import casting
from jaxmp._src import sharding

# Defined with the texts of the alarms; the classes are imported from here by
# jaxmp/__init__.py, the bit STUCK by the tests.
from jaxmp._src.alarms import SkippedStepsWarning  # pylint: disable=unused-import
from jaxmp._src.alarms import STUCK  # pylint: disable=unused-import
from jaxmp._src.alarms import TrainingStuckError  # pylint: disable=unused-import
from jaxmp._src.alarms import TrainingStuckWarning  # pylint: disable=unused-import

PyTree = Any

_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)


def _setting(default: Any) -> Any:
    """A static field: part of the tree structure, not a leaf (``pytree_node=False``)."""
    return struct.field(pytree_node=False, default=default)


@struct.dataclass
class ScalerState:
    """The state of a loss scaler.

    Create it with :func:`init_scaler`, :func:`static_scaler` or
    :func:`noop_scaler`; do not build it by hand.

    Attributes:
        scale: float32 scalar, the current loss scale.
        steps_since_overflow: int32 scalar, consecutive finite steps since the
            last non-finite one. The scale grows whenever this reaches a
            multiple of ``growth_interval``.
        overflow_streak: int32 scalar, consecutive non-finite steps (for
            hysteresis).
        skipped_steps: int32 scalar, total number of non-finite (skipped) steps.
        steps: int32 scalar, total number of steps (finite or not).
        recent: uint32 ``[2]``, one bit per step of the last 64, set for a
            skipped step (from the first finite step on).
        alarm: int32 scalar, what went wrong at this step: 1 (stuck), 2
            (frequent skips), 3 (both) or 0; jaxmp reads it on the host and
            says what it means.
        alarm_step: int32 scalar, the value of ``steps`` when ``alarm`` last
            changed.
        longest_skip_run: int32 scalar, the longest run of consecutive skipped
            steps of the whole run (the largest ``overflow_streak`` so far).
        alarm_record: int32 scalar, every alarm bit raised in the whole run
            (``alarm`` is the current one).
        alarm_periods: int32 ``[2]``, the number of periods (a rise of the
            alarm's bit to its fall) of each alarm kind in the whole run:
            index 0 stuck, index 1 frequent skips.
        first_alarm: int32 ``[2, 2]``, per kind, the first and the last step
            (values of ``steps``) of its first period; 0 for a kind never raised.
        last_alarm: int32 ``[2, 2]``, per kind, the first and the last step of
            its latest period, which goes on while ``alarm`` has the kind's bit.
            With ``first_alarm``, the record from which a run inside one
            ``jit`` (steps in a ``lax.scan``), whose state comes back to the
            host once, says each period as a loop of steps would have.
        alarm_scale: float32 ``[2, 2]``, per kind, the loss scale that the
            last skipped step of its first and of its latest period ran at.
        mode: ``"dynamic"``, ``"static"`` or ``"none"`` (static field).
        growth_interval, growth_factor, backoff_factor, min_scale, max_scale,
        hysteresis: the settings (static fields).
        on_stuck: what :func:`adjust` does when training is stuck, that is when
            ``stuck_after`` consecutive steps have overflowed and the scale is
            at ``min_scale``: ``"warn"`` (a :class:`TrainingStuckWarning`, the
            default), ``"raise"`` (a :class:`TrainingStuckError`) or ``"off"``
            (static field).
        stuck_after: the number of consecutive overflowing steps, counted by
            ``overflow_streak``, after which training at ``min_scale`` is
            called stuck (static field).

    Examples:
        >>> import jax
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=1024.0, growth_interval=100)
        >>> float(state.scale), int(state.skipped_steps), state.growth_interval
        (1024.0, 0, 100)
        >>> # A pytree: the numbers are its leaves, the settings part of its type.
        >>> new = jax.jit(jaxmp.adjust)(state, True)
        >>> int(new.steps_since_overflow), new.growth_interval
        (1, 100)
    """

    scale: jax.Array
    steps_since_overflow: jax.Array
    overflow_streak: jax.Array
    skipped_steps: jax.Array
    steps: jax.Array
    recent: jax.Array
    alarm: jax.Array
    alarm_step: jax.Array
    longest_skip_run: jax.Array
    alarm_record: jax.Array
    alarm_periods: jax.Array
    first_alarm: jax.Array
    last_alarm: jax.Array
    alarm_scale: jax.Array
    mode: str = _setting("dynamic")
    growth_interval: int = _setting(2000)
    growth_factor: float = _setting(2.0)
    backoff_factor: float = _setting(0.5)
    min_scale: float = _setting(1.0)
    max_scale: float = _setting(2.0**24)
    hysteresis: int = _setting(1)
    on_stuck: str = _setting("warn")
    stuck_after: int = _setting(10)

    def __post_init__(self):
        # Every concrete state built on the host, including each one a compiled step
        # returns (JAX rebuilds it with this constructor), is read once its step has run.
        alarms.watch(self)

    @property
    def alarm_record_step(self) -> jax.Array:
        """Deprecated: the value of ``steps`` when the latest alarm was raised.

        The record keeps each alarm kind's periods instead (``last_alarm``,
        ``first_alarm``, ``alarm_periods``); this is ``last_alarm[..., 0]``'s
        largest entry over the kinds raised.
        """
        warnings.warn(
            "ScalerState.alarm_record_step is deprecated (issue 40): it kept only the latest "
            "alarm's step. Read state.last_alarm[..., k, 0] (the first step of the latest "
            "period of alarm kind k: 0 stuck, 1 frequent skips), with first_alarm and "
            "alarm_periods.", DeprecationWarning, stacklevel=2)
        raised = self.alarm_periods > 0
        return jnp.max(jnp.where(raised, self.last_alarm[..., 0], 0), axis=-1)


# The array fields of a ScalerState (what a checkpoint holds), and those added after
# its first release: the record of the whole run (issue 34), whose latest alarm's step
# (``alarm_record_step``) became the periods of each alarm kind (issue 40). A checkpoint
# written before has not these: it is loaded with the record started from what it holds
# (``_from_state_dict``).
_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(ScalerState)
                      if f.metadata.get("pytree_node", True))
_RECORD_FIELDS = ("longest_skip_run", "alarm_record", "alarm_record_step")
_PERIOD_FIELDS = ("alarm_periods", "first_alarm", "last_alarm", "alarm_scale")


def _to_state_dict(state: ScalerState) -> dict:
    """What ``flax.serialization`` (and so a checkpoint) stores: the array fields."""
    return {name: serialization.to_state_dict(getattr(state, name)) for name in _ARRAY_FIELDS}


def _periods_of_old_record(state: dict) -> dict:
    """The periods of each alarm kind, from a record of the issue 34 layout.

    That record kept the alarm kinds raised (``alarm_record``) and the step of
    the latest raise (``alarm_record_step``): each kind raised gets one period
    that starts there, and goes on to the current step if its bit is still set.
    """
    record = np.asarray(state["alarm_record"], np.int32)[..., None]
    alarm = np.asarray(state.get("alarm", 0), np.int32)[..., None]
    kinds = np.asarray(alarms.KINDS, np.int32)
    raised, on = (record & kinds) != 0, (alarm & kinds) != 0
    start = np.where(raised, np.asarray(state["alarm_record_step"], np.int32)[..., None], 0)
    end = np.where(on, np.asarray(state.get("steps", 0), np.int32)[..., None], start)
    period = np.stack([start, end], axis=-1).astype(np.int32)
    scale = np.where(raised, np.asarray(state.get("scale", 1.0), np.float32)[..., None], 0)
    return {"alarm_periods": raised.astype(np.int32), "first_alarm": period,
            "last_alarm": period, "alarm_scale": np.stack([scale, scale], -1).astype(np.float32)}


def _from_state_dict(target: ScalerState, state: dict) -> ScalerState:
    """``flax.serialization``'s restore of a :class:`ScalerState`, old checkpoints included.

    The settings come from ``target``, the arrays from ``state``. A state dict
    without the record fields (a checkpoint from before they existed) gets them
    from its own counters: the longest run of skips is the current one, the
    record is the current alarm, raised when the alarm last changed. One
    without the periods of each alarm kind (before issue 40) gets one period
    per kind on its record, from its latest alarm's step. Any other missing or
    unknown field is an error that lists the fields.
    """
    state = dict(state)
    if all(name not in state for name in _RECORD_FIELDS) and "overflow_streak" in state:
        alarm = np.asarray(state.get("alarm", 0), np.int32)
        state["longest_skip_run"] = np.asarray(state["overflow_streak"], np.int32)
        state["alarm_record"] = alarm
        state["alarm_record_step"] = np.where(
            alarm != 0, np.asarray(state.get("alarm_step", 0), np.int32), np.int32(0))
    if (all(name not in state for name in _PERIOD_FIELDS) and "alarm_record" in state
            and "alarm_record_step" in state):
        state.update(_periods_of_old_record(state))
        del state["alarm_record_step"]
    missing = [name for name in _ARRAY_FIELDS if name not in state]
    unknown = sorted(set(state) - set(_ARRAY_FIELDS))
    if missing or unknown:
        raise ValueError(
            f"Cannot restore a jaxmp.ScalerState at {serialization.current_path()}: "
            + (f"missing field(s) {', '.join(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown field(s) {', '.join(unknown)}" if unknown else "")
            + f". Its checkpoint holds the array fields {', '.join(_ARRAY_FIELDS)} (one "
            f"written before the record fields {', '.join(_RECORD_FIELDS)} or "
            f"{', '.join(_PERIOD_FIELDS)} existed loads without them): restore the scaler "
            "state saved with the run, onto a target made by jaxmp.init_scaler, static_scaler "
            "or noop_scaler.")
    return target.replace(**{
        name: serialization.from_state_dict(getattr(target, name), state[name], name=name)
        for name in _ARRAY_FIELDS})


serialization.register_serialization_state(
    ScalerState, _to_state_dict, _from_state_dict, override=True)


def _check_number(name: str, value: Any, *, integer: bool = False) -> float | int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not (
        hasattr(value, "shape") and value.shape == ()
    ):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    try:
        value = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(f"{name} must be a concrete Python number, not a traced value.") from e
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}.")
    if integer:
        if value != int(value):
            raise ValueError(f"{name} must be a whole number, got {value}.")
        return int(value)
    return value


def _check_stuck_settings(on_stuck: Any, stuck_after: Any) -> tuple[str, int]:
    if on_stuck not in alarms.ON_STUCK:
        raise ValueError(f"on_stuck must be one of {', '.join(map(repr, alarms.ON_STUCK))}, got {on_stuck!r}.")
    stuck_after = _check_number("stuck_after", stuck_after, integer=True)
    if stuck_after < 1:
        raise ValueError(f"stuck_after must be >= 1, got {stuck_after}.")
    return on_stuck, stuck_after


def _make_state(initial_scale, mode, *, on_stuck, stuck_after, **settings) -> ScalerState:
    on_stuck, stuck_after = _check_stuck_settings(on_stuck, stuck_after)
    state = ScalerState(
        scale=jnp.asarray(initial_scale, jnp.float32),
        steps_since_overflow=jnp.zeros((), jnp.int32),
        overflow_streak=jnp.zeros((), jnp.int32),
        skipped_steps=jnp.zeros((), jnp.int32),
        steps=jnp.zeros((), jnp.int32),
        recent=jnp.zeros((2,), jnp.uint32),
        alarm=jnp.zeros((), jnp.int32),
        alarm_step=jnp.zeros((), jnp.int32),
        longest_skip_run=jnp.zeros((), jnp.int32),
        alarm_record=jnp.zeros((), jnp.int32),
        alarm_periods=jnp.zeros((len(alarms.KINDS),), jnp.int32),
        first_alarm=jnp.zeros((len(alarms.KINDS), 2), jnp.int32),
        last_alarm=jnp.zeros((len(alarms.KINDS), 2), jnp.int32),
        alarm_scale=jnp.zeros((len(alarms.KINDS), 2), jnp.float32),
        mode=mode,
        on_stuck=on_stuck,
        stuck_after=stuck_after,
        **settings,
    )
    return state


def init_scaler(
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
    *,
    on_stuck: str = "warn",
    stuck_after: int = 10,
) -> ScalerState:
    """Creates the state of a dynamic loss scaler.

    After ``growth_interval`` consecutive finite steps the scale is multiplied
    by ``growth_factor`` (capped at ``max_scale``). After ``hysteresis``
    consecutive non-finite steps, and on every further one, it is multiplied by
    ``backoff_factor`` (floored at ``min_scale``). Non-finite steps are counted
    in ``skipped_steps`` whatever the hysteresis.

    Args:
        initial_scale: the starting scale.
        growth_interval: finite steps between two growths (a whole number >= 1).
        growth_factor: factor > 1 applied on growth.
        backoff_factor: factor in (0, 1) applied on overflow.
        min_scale: lower bound of the scale (> 0).
        max_scale: upper bound of the scale (at most float32's largest value).
        hysteresis: consecutive overflows tolerated before backing off
            (a whole number >= 1; 1 backs off on every overflow).
        on_stuck: ``"warn"`` (default), ``"raise"`` or ``"off"``: what to do
            when training is stuck, i.e. when ``stuck_after`` consecutive
            steps have overflowed and the scale is at ``min_scale`` (see
            :func:`adjust`).
        stuck_after: consecutive overflowing steps before training at
            ``min_scale`` counts as stuck (a whole number >= 1).

    Returns:
        A :class:`ScalerState`.

    Raises:
        ValueError: if a setting is out of range, e.g. ``backoff_factor=2``.

    Examples:
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=1024.0, growth_interval=2)
        >>> state = jaxmp.adjust(jaxmp.adjust(state, True), True)
        >>> float(state.scale)
        2048.0
        >>> float(jaxmp.adjust(state, False).scale)
        1024.0
    """
    initial_scale = _check_number("initial_scale", initial_scale)
    growth_interval = _check_number("growth_interval", growth_interval, integer=True)
    growth_factor = _check_number("growth_factor", growth_factor)
    backoff_factor = _check_number("backoff_factor", backoff_factor)
    min_scale = _check_number("min_scale", min_scale)
    max_scale = _check_number("max_scale", max_scale)
    hysteresis = _check_number("hysteresis", hysteresis, integer=True)
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be >= 1, got {growth_interval}.")
    if growth_factor <= 1.0:
        raise ValueError(f"growth_factor must be > 1, got {growth_factor}.")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}.")
    if min_scale <= 0.0:
        raise ValueError(f"min_scale must be > 0, got {min_scale}.")
    if max_scale > _FLOAT32_MAX:
        raise ValueError(f"max_scale must fit in float32 (<= {_FLOAT32_MAX:.4g}), got {max_scale}.")
    if min_scale > max_scale:
        raise ValueError(f"min_scale ({min_scale}) must not exceed max_scale ({max_scale}).")
    if not min_scale <= initial_scale <= max_scale:
        raise ValueError(
            f"initial_scale ({initial_scale}) must lie in [min_scale, max_scale] = "
            f"[{min_scale}, {max_scale}]."
        )
    if hysteresis < 1:
        raise ValueError(f"hysteresis must be >= 1, got {hysteresis}.")
    return _make_state(
        initial_scale,
        "dynamic",
        growth_interval=growth_interval,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
        on_stuck=on_stuck,
        stuck_after=stuck_after,
    )


def static_scaler(scale: float, *, on_stuck: str = "warn", stuck_after: int = 10) -> ScalerState:
    """Creates a scaler with a fixed scale.

    Non-finite steps are still counted and reported, so that they can be
    skipped, but the scale never changes. ``on_stuck`` and ``stuck_after``
    are as for :func:`init_scaler` (the fixed scale is the minimum).

    Examples:
        >>> import jaxmp
        >>> state = jaxmp.static_scaler(128.0)
        >>> float(jaxmp.adjust(state, False).scale)
        128.0
    """
    scale = _check_number("scale", scale)
    if not 0.0 < scale <= _FLOAT32_MAX:
        raise ValueError(f"scale must be positive and fit in float32, got {scale}.")
    return _make_state(scale, "static", min_scale=scale, max_scale=scale, on_stuck=on_stuck,
                       stuck_after=stuck_after)


def noop_scaler(*, on_stuck: str = "warn", stuck_after: int = 10) -> ScalerState:
    """Creates a scaler that does not scale: for bfloat16 or float32 training.

    :func:`scale` and :func:`unscale` only convert to float32; :func:`adjust`
    counts skipped steps, and says when ``stuck_after`` consecutive steps were
    not finite (``on_stuck``, as for :func:`init_scaler`). The interface is
    that of the other scalers, so a training loop does not change.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> state = jaxmp.noop_scaler()
        >>> float(jaxmp.scale(state, jnp.asarray(3.0)))
        3.0
        >>> int(jaxmp.adjust(state, False).skipped_steps)  # a non-finite step is still counted
        1
    """
    return _make_state(1.0, "none", min_scale=1.0, max_scale=1.0, on_stuck=on_stuck,
                       stuck_after=stuck_after)


def check_scaler_state(state: Any, name: str = "scaler_state") -> ScalerState:
    """Raises ``TypeError`` if ``state`` is not a :class:`ScalerState`."""
    if not isinstance(state, ScalerState):
        raise TypeError(
            f"{name} must be a jaxmp.ScalerState (from jaxmp.init_scaler(), "
            f"jaxmp.static_scaler() or jaxmp.noop_scaler()), got {type(state).__name__}."
        )
    return state


def _apply_scale(state: ScalerState, tree: PyTree, op: Callable) -> PyTree:
    """Widens the floating-point leaves of ``tree`` to float32, then applies ``op(leaf, scale)``."""
    check_scaler_state(state)

    def leaf(x):
        if not casting.is_float_array(x):
            return x
        x = jnp.asarray(x)
        x = x.astype(casting.wide_dtype(x.dtype))
        return x if state.mode == "none" else op(x, state.scale.astype(x.dtype))

    return jax.tree_util.tree_map(leaf, tree)


def scale(state: ScalerState, tree: PyTree) -> PyTree:
    """Multiplies the floating-point leaves of ``tree`` by the loss scale.

    The product is computed and returned in float32 (or wider): a half-precision
    loss times a large scale does not fit in float16 (12 x 8192 > 65504).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=8192.0)
        >>> scaled = jaxmp.scale(state, jnp.asarray(12.0, jnp.float16))
        >>> float(scaled), scaled.dtype
        (98304.0, dtype('float32'))
    """
    return _apply_scale(state, tree, jnp.multiply)


def unscale(state: ScalerState, tree: PyTree) -> PyTree:
    """Divides the floating-point leaves of ``tree`` by the scale, in float32.

    The leaves are converted to float32 (or kept wider) *before* the division,
    so scaled half-precision gradients lose nothing more.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=1024.0)
        >>> g = jaxmp.unscale(state, {"w": jnp.full((2,), 2048.0, jnp.float16)})
        >>> g["w"].dtype, float(g["w"][0])
        (dtype('float32'), 2.0)
    """
    return _apply_scale(state, tree, jnp.divide)


def check_finite_flag(finite: Any, name: str = "finite") -> jax.Array:
    """Returns ``finite`` as an array, raising ``ValueError`` unless it is a scalar bool.

    ``name`` is the argument as the error message calls it.
    """
    try:
        finite = jnp.asarray(finite)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a scalar boolean (as returned by jaxmp.all_finite or "
            f"jaxmp.mp_value_and_grad), got {type(finite).__name__}."
        ) from None
    if finite.shape != () or finite.dtype != jnp.bool_:
        raise ValueError(
            f"{name} must be a scalar boolean (as returned by jaxmp.all_finite or "
            f"jaxmp.mp_value_and_grad), got an array of shape {finite.shape} and dtype "
            f"{finite.dtype}."
        )
    return finite


def adjust(state: ScalerState, finite: Any) -> ScalerState:
    """Returns the state after a step whose gradients were ``finite`` or not.

    Pure and traceable: call it inside ``jit``, ``lax.scan`` or ``shard_map``.
    The result has exactly the type of ``state`` (same dtypes, same settings),
    so a scan carry or a jit cache never sees a new type.

    It also watches for training that goes wrong, and records it in the
    state's ``alarm``: *stuck* training (the last ``state.stuck_after`` steps
    all overflowed *and* the scale is at ``min_scale``) and *frequent skips*
    (at least 22 of the last 64 steps skipped, counted from the first finite
    step, so the scale's first descent does not count). When the state comes
    back to the host, jaxmp warns (``on_stuck="warn"``: a
    :class:`TrainingStuckWarning` or a :class:`SkippedStepsWarning`), raises
    (``"raise"``, a :class:`TrainingStuckError`) or does nothing (``"off"``),
    with what to do. Each is said once (a finite step ends a stuck run). The
    step contains no host callback: jaxmp reads the alarm from the returned
    state once the step has run, at the latest two steps later.

    The state also keeps a record of the whole run: the longest run of
    skipped steps (``longest_skip_run``), every alarm kind raised
    (``alarm_record``) and, per kind, how many periods it had and the steps
    that began and ended its first and its latest (``alarm_periods``,
    ``first_alarm``, ``last_alarm``). A run of many steps inside one ``jit``
    (``lax.scan`` over steps) returns its state once, at its end: each period
    that a loop of the same steps would have said as it happened is said from
    the record then, once, with its steps (a kind with more than two periods:
    its first and its latest, and how many). :func:`scaler_metrics` gives the
    alarm per step, as an output of the scan.

    Args:
        state: a :class:`ScalerState`.
        finite: scalar boolean, whether the step's gradients were all finite.

    Returns:
        The new :class:`ScalerState`.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=8.0, growth_interval=2)
        >>> state = jaxmp.adjust(state, jnp.asarray(False))  # overflow: back off, count it
        >>> float(state.scale), int(state.skipped_steps)
        (4.0, 1)
        >>> step = jax.jit(jaxmp.adjust)  # traceable; two finite steps grow the scale
        >>> float(step(step(state, jnp.asarray(True)), jnp.asarray(True)).scale)
        8.0

        >>> import warnings
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=4.0, stuck_after=3)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for _ in range(5):
        ...         state = jaxmp.adjust(state, False)
        >>> float(state.scale), int(state.overflow_streak), len(caught)
        (1.0, 5, 1)
        >>> str(caught[0].message).startswith("jaxmp: training is stuck since step 3. The last 3")
        True
    """
    check_scaler_state(state)
    finite = check_finite_flag(finite)
    one = jnp.ones((), jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    since = jnp.where(finite, state.steps_since_overflow + one, zero)
    streak = jnp.where(finite, zero, state.overflow_streak + one)
    skipped = state.skipped_steps + jnp.where(finite, zero, one)
    steps = state.steps + one
    new_scale = state.scale
    if state.mode == "dynamic":
        grow = finite & (since % state.growth_interval == 0)
        back_off = jnp.logical_not(finite) & (streak >= state.hysteresis)
        grown = jnp.minimum(state.scale * state.growth_factor, state.max_scale)
        shrunk = jnp.maximum(state.scale * state.backoff_factor, state.min_scale)
        new_scale = jnp.where(grow, grown, jnp.where(back_off, shrunk, state.scale))
    new_scale = new_scale.astype(jnp.float32)
    # The last 64 steps, one bit each (a skip after the first finite step).
    bit = (jnp.logical_not(finite) & (skipped < steps)).astype(jnp.uint32)
    low, high = state.recent[..., 0], state.recent[..., 1]
    low, high = (low << 1) | bit, (high << 1) | (low >> 31)
    alarm = zero
    if state.on_stuck != "off":
        floor = jnp.asarray(state.min_scale, jnp.float32)
        stuck = (streak >= state.stuck_after) & (new_scale <= floor)
        count = jax.lax.population_count
        n_skipped = (count(low) + count(high)).astype(jnp.int32)
        alarm = (jnp.where(stuck, alarms.STUCK, 0)
                 | jnp.where(n_skipped >= alarms.FREQUENT_SKIPS, alarms.FREQUENT, 0))
    alarm = jnp.asarray(alarm, jnp.int32)
    alarm_step = jnp.where(alarm != state.alarm, steps, state.alarm_step)
    return state.replace(
        scale=new_scale,
        steps_since_overflow=since.astype(jnp.int32),
        overflow_streak=streak.astype(jnp.int32),
        skipped_steps=skipped.astype(jnp.int32),
        steps=steps.astype(jnp.int32),
        recent=_pair(low, high),
        alarm=alarm,
        alarm_step=alarm_step.astype(jnp.int32),
        longest_skip_run=jnp.maximum(state.longest_skip_run, streak).astype(jnp.int32),
        alarm_record=state.alarm_record | alarm,
        **_record_periods(state, alarm, steps, finite),
    )


def _record_periods(state: ScalerState, alarm: jax.Array, steps: jax.Array,
                    finite: jax.Array) -> dict[str, jax.Array]:
    """The record of each alarm kind's periods after a step whose alarm word is ``alarm``.

    A period of a kind runs from the step its bit rises to the last step it is
    set: what a loop of steps says as it happens, and a run inside one ``jit``
    says from this record when its state comes back (the first and the latest
    period of each kind, and how many there were).
    """
    kinds = jnp.broadcast_to(jnp.asarray(alarms.KINDS, jnp.int32), alarm.shape + (2,))
    on = (_last(alarm) & kinds) != 0
    rose = on & ((_last(state.alarm) & kinds) == 0)
    periods = state.alarm_periods + rose.astype(jnp.int32)
    # A period's first step where its kind rose, its last step wherever the kind is on.
    last = jnp.where(_pair(rose, on), _last(_last(steps)), state.last_alarm)
    skipped_here = on & jnp.logical_not(finite)
    last_scale = jnp.where(skipped_here, _last(state.scale), state.alarm_scale[..., 1])
    # While a kind's first period is its latest, the two are the same.
    first = _last(periods == 1)
    return {
        "alarm_periods": periods.astype(jnp.int32),
        "first_alarm": jnp.where(first, last, state.first_alarm).astype(jnp.int32),
        "last_alarm": last.astype(jnp.int32),
        "alarm_scale": jnp.where(first, _last(last_scale), _pair(
            state.alarm_scale[..., 0], last_scale)).astype(jnp.float32),
    }


# adjust and _record_periods write the scaler's pairs (``recent``, a kind's first and
# last step) with the two helpers below rather than ``jnp.stack``, and count bits without
# a reduction: every op is elementwise, so XLA:GPU fuses the update of the whole state
# into a few kernels. A stack is a concatenation and a sum over the pair a reduction,
# each a kernel of its own that the next ops wait for (16 kernels for adjust on an H100,
# 11 without them; each small kernel costs a launch, ~3 us).
def _last(x: jax.Array) -> jax.Array:
    """``x`` repeated along a new last axis of two: ``jnp.stack([x, x], -1)``, elementwise."""
    return jnp.broadcast_to(x[..., None], x.shape + (2,))


def _pair(first: jax.Array, second: jax.Array) -> jax.Array:
    """``jnp.stack([first, second], -1)`` as a select over the new axis's index."""
    shape = first.shape + (2,)
    is_first = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1) == 0
    return jnp.where(is_first, _last(first), _last(second))


# The most leaves all_finite reduces in one kernel: XLA:GPU fuses at most 96 operands into
# a kernel, and otherwise writes the concatenation out (645 MiB on an 8-layer GPT).
_FINITE_GROUP = 32


def _verdict(*leaves: jax.Array, size: int, chain: bool = False) -> jax.Array:
    """Whether every element of ``leaves`` is finite: one reduction per ``size`` leaves.

    A group of leaves is reduced over their concatenation; leaves of different
    dtypes meet in one that holds each exactly, inf and NaN included (float16
    and bfloat16 in float32). The verdict is the groups' minimum, taken over
    their sort. XLA rewrites a reduction over stacked scalars into a chain of
    one ``and`` per flag, then copies that chain into every consumer of the
    verdict (each select of optimizer_update): twice the optimised program of
    a ViT step. It cannot see through a sort, so the chain never forms; and
    the minimum, not the sort's first element, is the verdict, because an
    element (a slice) would be copied into every select too (two instructions
    each, ~3% of a small step). On a GPU (``chain=True``) the chain is what is
    wanted: a fused kernel reads the few flags for free, where the stack, the
    sort and the minimum were three kernels of their own (issue 41 part 2).
    """
    flags = []
    for i in range(0, len(leaves), size):
        group = leaves[i:i + size]
        if len(group) == 1:
            flags.append(jnp.all(jnp.isfinite(group[0])))
            continue
        dtypes = {jnp.dtype(x.dtype) for x in group}
        wide = dtypes.pop() if len(dtypes) == 1 else max(
            {jnp.dtype(casting.wide_dtype(x.dtype)) for x in group}, key=lambda d: d.itemsize)
        flat = jnp.concatenate([jnp.ravel(x).astype(wide) for x in group])
        flags.append(jnp.all(jnp.isfinite(flat)))
    if len(flags) == 1:
        return flags[0]
    if chain:
        return functools.reduce(jnp.logical_and, flags)
    return jnp.min(jax.lax.sort(jnp.stack(flags)))


def all_finite(tree: PyTree, axis_name: Any = None) -> jax.Array:
    """Whether every floating-point leaf of ``tree`` is free of inf and NaN.

    Inside ``shard_map`` (or ``pmap``) the answer is reduced over every manual
    axis of the mesh, so every device gets the same flag even when only one
    shard on one device overflowed: a scaler adjusted with it stays the same
    everywhere.

    Args:
        tree: any pytree; leaves that are not floating-point arrays are ignored.
        axis_name: further axis name(s) to reduce over, e.g. a ``vmap`` axis;
            mesh axes are always included. An axis that is not bound where
            this is traced raises ``ValueError``.

    Returns:
        A scalar boolean array (``True`` for a tree with no floating leaves).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> bool(jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
        False
    """
    leaves = [x for x in jax.tree_util.tree_leaves(tree) if casting.is_float_array(x)]
    finite = jnp.asarray(True)
    if leaves and sharding.values_are_local(leaves):
        # On a GPU, one reduction per group of leaves, over their
        # concatenation: XLA:GPU fuses the concatenation into it (nothing is
        # written but a flag per block), so a group costs two kernels where
        # one reduction per leaf cost one or two kernels each (the H100
        # program of a 2-layer GPT step: 217 -> 179 kernels). XLA:CPU writes
        # the concatenation's flags out instead (a byte per element, all
        # leaves at once: 1.05x the memory of a tiny ViT step), so the choice
        # is made when the program is lowered.
        grouped = functools.partial(_verdict, size=_FINITE_GROUP, chain=True)
        finite = jax.lax.platform_dependent(*leaves, cuda=grouped, rocm=grouped,
                                            default=functools.partial(_verdict, size=1))
    elif leaves:
        # Over several devices under ``jit`` the leaves may be sharded, each its
        # own way, and concatenating them would gather them: one leaf a group.
        finite = _verdict(*leaves, size=1)
    axes = None if axis_name is None else sharding.check_bound(axis_name)
    # pmin over devices: one device with a non-finite value makes all agree.
    return sharding.verdict(finite, axes)


def scaler_metrics(state: ScalerState) -> dict[str, jax.Array]:
    """A flat dict of the scaler's scalars, for a metrics logger.

    Works inside ``jit`` and as an output of a ``lax.scan`` over steps (one
    value per step); outside, ``jax.device_get`` of the dict gives NumPy
    scalars and ``{k: v.item() ...}`` plain Python numbers.

    Keys: ``loss_scale``; ``skipped_steps`` (in the whole run);
    ``steps_since_overflow``; ``overflow_streak`` (consecutive skipped steps
    up to this one); ``longest_skip_run`` (the longest such run so far);
    ``alarm``, what is going wrong at this step: 0 nothing, 1 stuck (every
    step overflows at the minimum scale), 2 frequent skips (a third of the
    last 64 steps), 3 both.

    Examples:
        >>> import jaxmp
        >>> m = jaxmp.scaler_metrics(jaxmp.init_scaler(initial_scale=4.0))
        >>> {k: v.item() for k, v in m.items()}  # doctest: +NORMALIZE_WHITESPACE
        {'loss_scale': 4.0, 'skipped_steps': 0, 'steps_since_overflow': 0, 'overflow_streak': 0,
         'longest_skip_run': 0, 'alarm': 0}

        Per step, from a run inside one ``jit`` that gets stuck and recovers
        (said once, when the final state comes back):

        >>> import warnings
        >>> import jax, jax.numpy as jnp
        >>> def step(state, finite):
        ...     state = jaxmp.adjust(state, finite)
        ...     return state, jaxmp.scaler_metrics(state)
        >>> state = jaxmp.init_scaler(initial_scale=4.0, stuck_after=3)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     final, per_step = jax.jit(lambda s, f: jax.lax.scan(step, s, f))(
        ...         state, jnp.array([False] * 5 + [True] * 2))
        ...     _ = jax.block_until_ready(final)
        >>> per_step["alarm"].tolist(), per_step["longest_skip_run"].tolist()
        ([0, 0, 1, 1, 1, 0, 0], [1, 2, 3, 4, 5, 5, 5])
        >>> [type(w.message).__name__ for w in caught]
        ['TrainingStuckWarning']
    """
    check_scaler_state(state)
    return {
        "loss_scale": state.scale,
        "skipped_steps": state.skipped_steps,
        "steps_since_overflow": state.steps_since_overflow,
        "overflow_streak": state.overflow_streak,
        "longest_skip_run": state.longest_skip_run,
        "alarm": state.alarm,
    }


def scaler_for(compute_dtype: Any, **init_scaler_kwargs: Any) -> ScalerState:
    """The usual scaler for training in ``compute_dtype``.

    float16 gets a dynamic scaler (:func:`init_scaler`): its smallest normal
    number is about 6e-5, so small gradients flush to zero without a scale.
    bfloat16 and float32 get :func:`noop_scaler`: bfloat16 has float32's
    exponent range, so a scale has nothing to rescue; non-finite steps are still
    detected and skipped. A training script that offers several precisions
    calls this one function instead of choosing by hand.

    Args:
        compute_dtype: ``jnp.float16``, ``jnp.bfloat16`` or ``jnp.float32``
            (or their names).
        **init_scaler_kwargs: settings of the dynamic scaler, passed to
            :func:`init_scaler` for float16. They are checked for every dtype,
            so a misspelt or out-of-range setting fails whatever the dtype.

    Returns:
        A :class:`ScalerState`.

    Raises:
        ValueError: if ``compute_dtype`` is not float16, bfloat16 or float32,
            or a setting is out of range.
        TypeError: if a keyword is not an argument of :func:`init_scaler`.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> jaxmp.scaler_for(jnp.float16, growth_interval=200).mode
        'dynamic'
        >>> jaxmp.scaler_for("bfloat16").mode, jaxmp.scaler_for(jnp.float32).mode
        ('none', 'none')
    """
    dtype = casting.canonical_float_dtype(
        compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype")
    dynamic = init_scaler(**init_scaler_kwargs)
    return dynamic if dtype == jnp.float16 else noop_scaler()
