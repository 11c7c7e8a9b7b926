"""What jaxmp says when training goes wrong, said once, from the host.

:func:`jaxmp.adjust` records in a scaler state's ``alarm`` whether training is
*stuck* (every step overflows at the minimum scale) or skips steps
*frequently*; this module turns that word into what a user reads: a
:class:`TrainingStuckWarning`, a :class:`SkippedStepsWarning` or a
:class:`TrainingStuckError`, by the scaler's ``on_stuck`` setting, each once.

* The alarm word: its bits (:data:`STUCK`, :data:`FREQUENT`) and the
  thresholds of frequent skips (:data:`FREQUENT_SKIPS` of the last
  :data:`SKIP_WINDOW` steps), which :func:`jaxmp.adjust` computes with.
* The texts: :func:`stuck_message`, :func:`skips_message` and
  :func:`past_alarm_message` (an alarm that ended before the host saw it).
* The record of what was said, so that each alarm is said once.
* :func:`watch`: the registration of a concrete state with
  :func:`jaxmp._src.host.watch`, which reads the alarm once its step has run.
  The state's constructor calls it: JAX rebuilds a state that a compiled step
  returns with its constructor, the one moment jaxmp's code runs on the host
  between steps (see :mod:`jaxmp._src.loss_scale`).

A state is read duck-typed: its settings (static fields ``mode``,
``min_scale``, ``max_scale``, ``stuck_after``, ``on_stuck``) and its array
fields, so this module does not import the scaler's.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import host

# A scaler state; any object with its fields (see jaxmp._src.loss_scale.ScalerState).
State = Any

# What to do when an alarm is raised: the choices of a scaler's ``on_stuck``.
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


def stuck_message(state: State, streak: int) -> str:
    """The text a user reads when training is stuck (see :func:`jaxmp.adjust`).

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


def _stuck_where(state: State) -> str:
    if state.mode == "none":
        return "without loss scaling"
    return f"at the minimum loss scale ({state.min_scale:g})"


def _stuck_cause(state: State) -> str:
    if state.mode == "none":
        return ("The loss or the gradients are inf/NaN whatever the step: an operation "
                "overflows (or divides by zero) in this precision.")
    return ("Lowering the scale cannot help: an operation overflows float16 by itself, "
            "typically the backward pass of a normalisation (rsqrt of a small variance), "
            "a softmax or a large sum computed in float16.")


def skips_message(state: State, skipped: int) -> str:
    """The text a user reads when many recent steps were skipped (see :func:`jaxmp.adjust`)."""
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


def _scale_words(state: State) -> str:
    return "not used" if state.mode == "none" else f"in [{state.min_scale:g}, {state.max_scale:g}]"


def past_alarm_message(state: State, record: int, record_step: int, steps: int,
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


@jax.jit
def _alarm_words(state: State) -> jax.Array:
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


def _say_alarm(settings: State, words: np.ndarray) -> None:
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


def watch(state: State) -> None:
    """Has the host say ``state``'s alarm once the step that computed it has run.

    The registration of a state with :func:`jaxmp._src.host.watch`.
    A state with ``on_stuck="off"``, or whose arrays have no value yet
    (tracers, inside ``jit``, ``vmap`` or ``lax.scan``; ``None`` or
    ``PartitionSpec`` leaves of a tree of the state's shape) is left alone:
    the compiled step that returns it to the host registers it then. The
    host reads a few words computed from ``state`` (a new array, so that
    donating the state to the next step does not delete them), at the latest
    two states later, and warns or raises from the caller's thread; with
    ``on_stuck="warn"`` a state that is the last for a while is read by a
    background thread.

    Args:
        state: a :class:`jaxmp.ScalerState`.
    """
    if state.on_stuck != "off" and host.is_concrete_array(state.alarm):
        host.watch(_alarm_words(state), functools.partial(_say_alarm, state),
                   background=state.on_stuck == "warn")
