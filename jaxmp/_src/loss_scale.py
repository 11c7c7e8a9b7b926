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

from jaxmp._src import casting
from jaxmp._src import host
from jaxmp._src import sharding

PyTree = Any

_FLOAT32_MAX = float(jnp.finfo(jnp.float32).max)
ON_STUCK = ("warn", "raise", "off")
# Frequent skips: at least this many of the last SKIP_WINDOW steps skipped
# (counted from the first finite step, so the scale's first descent is not).
SKIP_WINDOW = 64
FREQUENT_SKIPS = 22
# Bits of ScalerState.alarm.
STUCK = 1
FREQUENT = 2


class TrainingStuckWarning(RuntimeWarning):
    """Issued once when every step overflows at the minimum loss scale.

    Filter it like any warning, e.g.
    ``warnings.simplefilter("error", jaxmp.TrainingStuckWarning)``, or choose
    ``on_stuck="raise"`` / ``"off"`` when creating the scaler.

    Examples:
        >>> import jaxmp
        >>> issubclass(jaxmp.TrainingStuckWarning, RuntimeWarning)
        True
        >>> quiet = jaxmp.init_scaler(on_stuck="off")  # or "raise"; "warn" is the default
        >>> quiet.on_stuck, quiet.stuck_after
        ('off', 10)
    """


class SkippedStepsWarning(RuntimeWarning):
    """Issued once when a third of the recent steps were skipped (non-finite gradients).

    Intermittent overflows that lowering the scale does not cure: each skipped
    step throws away a batch. Controlled, like :class:`TrainingStuckWarning`,
    by the scaler's ``on_stuck`` setting (``"raise"`` raises a
    :class:`TrainingStuckError` with the same message).

    Examples:
        >>> import warnings
        >>> import jax
        >>> import jaxmp
        >>> state, step = jaxmp.noop_scaler(), jax.jit(jaxmp.adjust)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     for i in range(90):
        ...         state = step(state, i % 2 == 0)  # every other step is skipped
        >>> [type(w.message).__name__ for w in caught]
        ['SkippedStepsWarning']
    """


class TrainingStuckError(RuntimeError):
    """Raised (with ``on_stuck="raise"``) when every step overflows at the minimum loss scale.

    It is raised on the host when the stuck state comes back from the step:
    by the call that returns a later state, at most two steps after the stuck
    one (jaxmp reads a state once its step has finished, so that the host
    never waits for the step it has just started).

    Examples:
        >>> import jaxmp
        >>> state = jaxmp.init_scaler(initial_scale=1.0, stuck_after=2, on_stuck="raise")
        >>> try:
        ...     for _ in range(5):
        ...         state = jaxmp.adjust(state, False)
        ... except jaxmp.TrainingStuckError as error:
        ...     print(str(error).startswith("jaxmp: training is stuck."))
        True
    """


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
            changed, so that each alarm is said once.
        longest_skip_run: int32 scalar, the longest run of consecutive skipped
            steps of the whole run (the largest ``overflow_streak`` so far).
        alarm_record: int32 scalar, every alarm bit raised in the whole run
            (``alarm`` is the current one): a stuck period that has ended
            stays on record, so a run inside one ``jit`` (steps in a
            ``lax.scan``), whose state comes back to the host once, still says
            it.
        alarm_record_step: int32 scalar, the value of ``steps`` when the
            latest alarm was raised.
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
    alarm_record_step: jax.Array
    mode: str = struct.field(pytree_node=False, default="dynamic")
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    growth_factor: float = struct.field(pytree_node=False, default=2.0)
    backoff_factor: float = struct.field(pytree_node=False, default=0.5)
    min_scale: float = struct.field(pytree_node=False, default=1.0)
    max_scale: float = struct.field(pytree_node=False, default=2.0**24)
    hysteresis: int = struct.field(pytree_node=False, default=1)
    on_stuck: str = struct.field(pytree_node=False, default="warn")
    stuck_after: int = struct.field(pytree_node=False, default=10)

    def __post_init__(self):
        # Every concrete state built on the host, including each one a jitted
        # step returns, is read once its step has run (see jaxmp/_src/host.py).
        if self.on_stuck != "off" and host.is_concrete_array(self.alarm):
            host.watch(_alarm_words(self), functools.partial(_say_alarm, self),
                       background=self.on_stuck == "warn")


# The array fields of a ScalerState (what a checkpoint holds), and those added after
# its first release (the record of the whole run). A checkpoint written before has none
# of these: it is loaded with the record started from what it holds (``_from_state_dict``).
_ARRAY_FIELDS = tuple(f.name for f in dataclasses.fields(ScalerState)
                      if f.metadata.get("pytree_node", True))
_RECORD_FIELDS = ("longest_skip_run", "alarm_record", "alarm_record_step")


def _to_state_dict(state: ScalerState) -> dict:
    """What ``flax.serialization`` (and so a checkpoint) stores: the array fields."""
    return {name: serialization.to_state_dict(getattr(state, name)) for name in _ARRAY_FIELDS}


def _from_state_dict(target: ScalerState, state: dict) -> ScalerState:
    """``flax.serialization``'s restore of a :class:`ScalerState`, old checkpoints included.

    The settings come from ``target``, the arrays from ``state``. A state dict
    without the record fields (a checkpoint from before they existed) gets them
    from its own counters: the longest run of skips is the current one, the
    record is the current alarm. Any other missing or unknown field is an error
    that lists the fields.
    """
    state = dict(state)
    if all(name not in state for name in _RECORD_FIELDS) and "overflow_streak" in state:
        alarm = np.asarray(state.get("alarm", 0), np.int32)
        state["longest_skip_run"] = np.asarray(state["overflow_streak"], np.int32)
        state["alarm_record"] = alarm
        state["alarm_record_step"] = np.where(
            alarm != 0, np.asarray(state.get("alarm_step", 0), np.int32), np.int32(0))
    missing = [name for name in _ARRAY_FIELDS if name not in state]
    unknown = sorted(set(state) - set(_ARRAY_FIELDS))
    if missing or unknown:
        raise ValueError(
            f"Cannot restore a jaxmp.ScalerState at {serialization.current_path()}: "
            + (f"missing field(s) {', '.join(missing)}" if missing else "")
            + ("; " if missing and unknown else "")
            + (f"unknown field(s) {', '.join(unknown)}" if unknown else "")
            + f". Its checkpoint holds the array fields {', '.join(_ARRAY_FIELDS)} (one "
            f"written before the record fields {', '.join(_RECORD_FIELDS)} existed loads "
            "without them): restore the scaler state saved with the run, onto a target made "
            "by jaxmp.init_scaler, static_scaler or noop_scaler.")
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
    if on_stuck not in ON_STUCK:
        raise ValueError(f"on_stuck must be one of {', '.join(map(repr, ON_STUCK))}, got {on_stuck!r}.")
    stuck_after = _check_number("stuck_after", stuck_after, integer=True)
    if stuck_after < 1:
        raise ValueError(f"stuck_after must be >= 1, got {stuck_after}.")
    return on_stuck, stuck_after


def _make_state(initial_scale, mode, *, on_stuck, stuck_after, **settings) -> ScalerState:
    on_stuck, stuck_after = _check_stuck_settings(on_stuck, stuck_after)
    return ScalerState(
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
        alarm_record_step=jnp.zeros((), jnp.int32),
        mode=mode,
        on_stuck=on_stuck,
        stuck_after=stuck_after,
        **settings,
    )


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


def stuck_message(state: ScalerState, streak: int) -> str:
    """The text a user reads when training is stuck (see :func:`adjust`).

    Only the settings of ``state`` (static fields) are read.
    """
    return (
        f"jaxmp: training is stuck. The last {streak} steps all had non-finite gradients "
        f"{_stuck_where(state)} and were skipped: the parameters no longer change. "
        f"{_stuck_cause(state)}\n"
        "  Find the operation:  print(jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=...)"
        "(params, *batch))  (the same options as mp_value_and_grad)\n"
        "  Then fix it with one of: autocast=True, the default of mp_value_and_grad, if you "
        "passed autocast=False (sums, variances, exp/log in float32); "
        "jaxmp.force_full_precision around the overflowing code; "
        "compute_dtype=jnp.bfloat16 (float32's range); float32 master weights.\n"
        f"  (Said once per stuck run; the scaler's on_stuck='{state.on_stuck}' setting: "
        "'warn', 'raise' or 'off'.)"
    )


def _stuck_where(state: ScalerState) -> str:
    if state.mode == "none":
        return "without loss scaling"
    return f"at the minimum loss scale ({state.min_scale:g})"


def _stuck_cause(state: ScalerState) -> str:
    if state.mode == "none":
        return ("The loss or the gradients are inf/NaN whatever the step: an operation "
                "overflows (or divides by zero) in this precision.")
    return ("Lowering the scale cannot help: an operation overflows float16 by itself, "
            "typically the backward pass of a normalisation (rsqrt of a small variance), "
            "a softmax or a large sum computed in float16.")


def skips_message(state: ScalerState, skipped: int) -> str:
    """The text a user reads when many recent steps were skipped (see :func:`adjust`)."""
    return (
        f"jaxmp: {skipped} of the last {SKIP_WINDOW} steps were skipped (non-finite "
        f"gradients; the loss scale is now {_scale_words(state)}). Each skipped step throws "
        "its batch away, and overflows that keep coming back are not cured by the scale: "
        "an operation overflows now and then in this precision (a loss computed in half "
        "precision, a softmax, a normalisation of large activations, random draws far in "
        "the tail).\n"
        "  Find the operation:  print(jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=...)"
        "(params, *batch))  on a batch whose step was skipped\n"
        "  Then fix it with one of: autocast=True (the default of mp_value_and_grad) "
        "rather than autocast=False; jaxmp.force_full_precision around the overflowing "
        "code; compute_dtype=jnp.bfloat16 (float32's range).\n"
        f"  (Said once; the scaler's on_stuck='{state.on_stuck}' setting: "
        "'warn', 'raise' or 'off'.)"
    )


def _scale_words(state: ScalerState) -> str:
    return "not used" if state.mode == "none" else f"in [{state.min_scale:g}, {state.max_scale:g}]"


@jax.jit
def _alarm_words(state: ScalerState) -> jax.Array:
    """What the host needs to say an alarm: one row per scaler (``vmap`` makes several)."""
    skipped = (jax.lax.population_count(state.recent).astype(jnp.int32)).sum(axis=-1)
    words = [state.alarm, state.alarm_step, state.steps, state.overflow_streak, skipped,
             state.alarm_record, state.alarm_record_step, state.longest_skip_run]
    return jnp.stack([jnp.ravel(w) for w in words], axis=-1)


# Alarms already said, as (alarm, alarm_step), and the alarms of the record
# said, as ("raised", alarm_record_step). A state from an earlier step than one
# of them belongs to another run (or a run resumed from a checkpoint), whose
# alarms are its own: seeing one forgets those.
_SAID: set = set()


def _say_alarm(settings: ScalerState, words: np.ndarray) -> None:
    """Host side: says what a state's ``alarm`` means, once per alarm.

    A state whose alarm has ended since it was raised (a run inside one
    ``jit`` comes back once, at its end) says the alarm of its record instead,
    unless an earlier state said it already. Only the settings (static
    fields) of ``settings`` are read: its arrays may have been donated to a
    later step.
    """
    for row in np.asarray(words).reshape(-1, 8).tolist():
        alarm, alarm_step, steps, streak, skipped, record, record_step, longest = row
        _SAID.difference_update([key for key in _SAID if key[1] > steps])
        if alarm:
            if (alarm, alarm_step) in _SAID:
                continue
            _SAID.update([(alarm, alarm_step), ("raised", record_step)])
            if alarm & STUCK:
                message, category = stuck_message(settings, streak), TrainingStuckWarning
            else:
                message, category = skips_message(settings, skipped), SkippedStepsWarning
        elif record and ("raised", record_step) not in _SAID:
            _SAID.add(("raised", record_step))
            message = past_alarm_message(settings, record, record_step, steps, longest)
            category = TrainingStuckWarning if record & STUCK else SkippedStepsWarning
        else:
            continue
        if settings.on_stuck == "raise":
            raise TrainingStuckError(message)
        warnings.warn(message, category, stacklevel=1)


def past_alarm_message(state: ScalerState, record: int, record_step: int, steps: int,
                       longest: int) -> str:
    """The text a user reads when the state shows an alarm that ended before the host saw it.

    Only the settings of ``state`` (static fields) are read.
    """
    if record & STUCK:
        what = (f"training got stuck at step {record_step} ({state.stuck_after} steps in a row "
                f"had non-finite gradients {_stuck_where(state)} and were skipped)")
        cause = _stuck_cause(state)
    else:
        what = (f"at step {record_step}, {FREQUENT_SKIPS} or more of the last {SKIP_WINDOW} "
                "steps had been skipped (non-finite gradients)")
        cause = ("Overflows that keep coming back are not cured by the scale: an operation "
                 "overflows now and then in this precision.")
    return (
        f"jaxmp: {what}, and had recovered by step {steps}, when this scaler state came back "
        f"to the host. The longest run of skipped steps in this run: {longest} (the "
        "parameters did not change during it). A run inside one jit (steps in a lax.scan) "
        "returns its state once, so jaxmp says it now; jaxmp.scaler_metrics(state) as an "
        f"output of the scan says at which steps. {cause}\n"
        "  Find the operation:  print(jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=...)"
        "(params, *batch))  on a batch whose step was skipped\n"
        "  Then fix it with one of: jaxmp.force_full_precision around the overflowing code; "
        "compute_dtype=jnp.bfloat16 (float32's range); autocast=True (the default of "
        "mp_value_and_grad) rather than autocast=False.\n"
        f"  (Said once; the scaler's on_stuck='{state.on_stuck}' setting: "
        "'warn', 'raise' or 'off'.)"
    )


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
    skipped steps (``longest_skip_run``) and every alarm raised
    (``alarm_record``, ``alarm_record_step``). A run of many steps inside one
    ``jit`` (``lax.scan`` over steps) returns its state once, at its end: a
    stuck period that ended before then is said from the record, once.
    :func:`scaler_metrics` gives all of it per step, as an output of the scan.

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
        >>> str(caught[0].message).startswith("jaxmp: training is stuck. The last 3 steps")
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
    recent = jnp.stack([(low << 1) | bit, (high << 1) | (low >> 31)], axis=-1)
    alarm = zero
    if state.on_stuck != "off":
        floor = jnp.asarray(state.min_scale, jnp.float32)
        stuck = (streak >= state.stuck_after) & (new_scale <= floor)
        n_skipped = jax.lax.population_count(recent).astype(jnp.int32).sum(axis=-1)
        alarm = (jnp.where(stuck, STUCK, 0) | jnp.where(n_skipped >= FREQUENT_SKIPS, FREQUENT, 0))
    alarm = jnp.asarray(alarm, jnp.int32)
    alarm_step = jnp.where(alarm != state.alarm, steps, state.alarm_step)
    # The record of the whole run: what a run read once, at its end, must still say.
    raised = (alarm & ~state.alarm) != 0
    return state.replace(
        scale=new_scale,
        steps_since_overflow=since.astype(jnp.int32),
        overflow_streak=streak.astype(jnp.int32),
        skipped_steps=skipped.astype(jnp.int32),
        steps=steps.astype(jnp.int32),
        recent=recent,
        alarm=alarm,
        alarm_step=alarm_step.astype(jnp.int32),
        longest_skip_run=jnp.maximum(state.longest_skip_run, streak).astype(jnp.int32),
        alarm_record=state.alarm_record | alarm,
        alarm_record_step=jnp.where(raised, steps, state.alarm_record_step).astype(jnp.int32),
    )


# The most leaves all_finite reduces in one kernel: XLA:GPU fuses at most 96 operands into
# a kernel, and otherwise writes the concatenation out (645 MiB on an 8-layer GPT).
_FINITE_GROUP = 32


def _verdict(*leaves: jax.Array, size: int) -> jax.Array:
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
    each, ~3% of a small step).
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
    return flags[0] if len(flags) == 1 else jnp.min(jax.lax.sort(jnp.stack(flags)))


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
        grouped = functools.partial(_verdict, size=_FINITE_GROUP)
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
