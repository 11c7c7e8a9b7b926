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
from typing import Any, NamedTuple

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
# The alarm kinds, in the order of the record's per-kind arrays (ScalerState.last_alarm...).
KINDS = (STUCK, FREQUENT)


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
        ...     print(str(error).startswith("jaxmp: training is stuck since step 2."))
        True
    """


def stuck_message(state: State, streak: int, start: int | None = None) -> str:
    """The text a user reads when training is stuck (see :func:`jaxmp.adjust`).

    ``start`` is the step (the scaler's ``steps``) at which it got stuck. Only
    the settings of ``state`` (static fields) are read.
    """
    since = "" if start is None else f" since step {start}"
    return (
        f"jaxmp: training is stuck{since}. The last {streak} steps all had non-finite gradients "
        f"{_stuck_where(state)} and were skipped: the parameters no longer change. "
        f"{_stuck_cause(state)}\n"
        f"{_find_advice(state, state.min_scale)}\n"
        "  Then fix it with one of: autocast=True, the default of mp_value_and_grad, if you "
        "passed autocast=False (sums, variances, exp/log in float32); "
        "jaxmp.force_full_precision around the overflowing code; "
        "compute_dtype=jnp.bfloat16 (float32's range); float32 master weights.\n"
        f"  (Said once per stuck period; the scaler's on_stuck='{state.on_stuck}' setting: "
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


def _find_advice(state: State, scale: float) -> str:
    """The call that finds the operation, at the scale the skipped steps ran at."""
    scaler = ("jaxmp.noop_scaler()" if state.mode == "none"
              else f"jaxmp.static_scaler({float(scale)!r})")
    return ("  Find the operation:  print(jaxmp.debug.find_nonfinite(loss_fn, compute_dtype=...)"
            f"(params, *batch, scaler_state={scaler}))  (the options of mp_value_and_grad, a "
            "batch whose step was skipped, "
            + ("no loss scale, as the run)" if state.mode == "none"
               else "the loss scale it was skipped at)"))


def _scale_sentence(state: State, scale: float) -> str:
    """The current loss scale, and the range the scaler keeps it in (a sentence, no period)."""
    if state.mode == "none":
        return "No loss scale is used"
    if state.mode == "static":
        return f"The loss scale is {scale:g} (static)"
    return (f"The loss scale is now {scale:g} (the scaler keeps it within "
            f"[{state.min_scale:g}, {state.max_scale:g}])")


def skips_message(state: State, skipped: int, start: int | None = None,
                  scale: float | None = None, skip_scale: float | None = None) -> str:
    """The text a user reads when many recent steps were skipped (see :func:`jaxmp.adjust`).

    ``start`` is the step at which a third of the recent steps had been
    skipped, ``scale`` the loss scale now (the minimum when not given) and
    ``skip_scale`` the one the last skipped step ran at (``scale`` when not
    given).
    """
    scale = state.min_scale if scale is None else scale
    skip_scale = scale if skip_scale is None else skip_scale
    since = "" if start is None else f"steps are skipped often since step {start}: "
    ran_at = "" if state.mode == "none" else (
        f"; the last skipped step ran at loss scale {skip_scale:g}")
    return (
        f"jaxmp: {since}{skipped} of the last {SKIP_WINDOW} steps were skipped (non-finite "
        f"gradients). {_scale_sentence(state, scale)}{ran_at}. Each skipped step throws "
        "its batch away, and overflows that keep coming back are not cured by the scale: "
        "an operation overflows now and then in this precision (a loss computed in half "
        "precision, a softmax, a normalisation of large activations, random draws far in "
        "the tail).\n"
        f"{_find_advice(state, skip_scale)}\n"
        "  Then fix it with one of: autocast=True (the default of mp_value_and_grad) "
        "rather than autocast=False; jaxmp.force_full_precision around the overflowing "
        "code; compute_dtype=jnp.bfloat16 (float32's range).\n"
        f"  (Said once per period of frequent skips; the scaler's on_stuck='{state.on_stuck}' "
        "setting: 'warn', 'raise' or 'off'.)"
    )


class Period(NamedTuple):
    """One period of an alarm kind, as the record keeps it (steps are the scaler's ``steps``).

    Attributes:
        kind: :data:`STUCK` or :data:`FREQUENT`.
        start, end: the first and the last step with the kind's bit set.
        number: which period of the kind this is (1 for the first).
        periods: how many periods of the kind the run had.
        skip_scale: the loss scale the last skipped step of the period ran at.
    """

    kind: int
    start: int
    end: int
    number: int
    periods: int
    skip_scale: float


def _which(period: Period) -> str:
    """Which of the run's periods of its kind ``period`` is, when there were several."""
    if period.periods == 1:
        return ""
    if period.number == 1:
        return f"; the first of {period.periods} such periods in this run"
    between = period.periods - 2
    return (f"; the latest of {period.periods} such periods in this run"
            + (f", {between} of them between the first and this one, not said here"
               if between else ""))


def _steps(n: int) -> str:
    return "1 step" if n == 1 else f"{n} steps"


def past_alarm_message(state: State, period: Period, steps: int, longest: int,
                       scale: float) -> str:
    """The text a user reads for an alarm period that ended before the host saw it.

    ``steps`` is the step of the state that came back, ``longest`` its longest
    run of skipped steps, ``scale`` its loss scale. Only the settings of
    ``state`` (static fields) are read.
    """
    length = period.end - period.start + 1
    if period.kind == STUCK:
        what = (f"training got stuck at step {period.start} ({state.stuck_after} or more steps "
                "in a row had had non-finite gradients and been skipped, "
                f"{_stuck_where(state)}) and stayed stuck to step {period.end} "
                f"({_steps(length)}{_which(period)}), and had recovered by step {steps}")
        cause = _stuck_cause(state)
        advice_scale = state.min_scale
    else:
        what = (f"from step {period.start} to step {period.end} ({_steps(length)}"
                f"{_which(period)}), {FREQUENT_SKIPS} or more of the last {SKIP_WINDOW} "
                "steps had been skipped (non-finite gradients), and that had ended by step "
                f"{steps}")
        cause = ("Overflows that keep coming back are not cured by the scale: an operation "
                 "overflows now and then in this precision.")
        advice_scale = period.skip_scale
    return (
        f"jaxmp: {what}, when this scaler state came back to the host. "
        f"{_scale_sentence(state, scale)}. The longest run of skipped steps in this run: "
        f"{longest} (the parameters did not change during it). A run inside one jit (steps "
        "in a lax.scan) returns its state once, so jaxmp says it now; "
        f"jaxmp.scaler_metrics(state) as an output of the scan says at which steps. {cause}\n"
        f"{_find_advice(state, advice_scale)}\n"
        "  Then fix it with one of: jaxmp.force_full_precision around the overflowing code; "
        "compute_dtype=jnp.bfloat16 (float32's range); autocast=True (the default of "
        "mp_value_and_grad) rather than autocast=False.\n"
        f"  (Said once; the scaler's on_stuck='{state.on_stuck}' setting: "
        "'warn', 'raise' or 'off'.)"
    )


# The words _alarm_words computes per scaler: six about the state, then seven per alarm kind.
_HEAD, _PER_KIND = 6, 7


def _as_int32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


@jax.jit
def _alarm_words(state: State) -> jax.Array:
    """What the host needs to say an alarm: one row per scaler (``vmap`` makes several).

    The alarm, the step, the streak and the skips of the window, the longest
    run of skipped steps and the scale (its bits); then per alarm kind: its
    number of periods, its first period's first and last step and the scale
    (bits) its last skipped step ran at, and the same of its latest period.
    """
    rows = state.steps.size
    skipped = jax.lax.population_count(state.recent).astype(jnp.int32).sum(axis=-1)
    head = [state.alarm, state.steps, state.overflow_streak, skipped, state.longest_skip_run,
            _as_int32(state.scale)]
    kinds = [state.alarm_periods, state.first_alarm[..., 0], state.first_alarm[..., 1],
             _as_int32(state.alarm_scale[..., 0]), state.last_alarm[..., 0],
             state.last_alarm[..., 1], _as_int32(state.alarm_scale[..., 1])]
    return jnp.concatenate([jnp.stack([jnp.ravel(w) for w in head], axis=-1),
                            jnp.stack([w.reshape(rows, -1) for w in kinds], axis=-1).reshape(
                                rows, -1)], axis=-1)


def _as_float(word: int) -> float:
    return float(np.asarray(word, np.int32).view(np.float32))


# Alarm periods already said, as (kind, first step). A state from an earlier step than
# one of them belongs to another run (or a run resumed from a checkpoint), whose alarms
# are its own: seeing one forgets those.
_SAID: set = set()


def _periods(row: list) -> list[tuple[Period, bool]]:
    """The periods a row of words shows, each with whether it goes on, by first step."""
    alarm = row[0]
    found = []
    for i, kind in enumerate(KINDS):
        n, first_start, first_end, first_scale, start, end, scale = row[
            _HEAD + i * _PER_KIND:][:_PER_KIND]
        if n == 0:
            continue
        found.append((Period(kind, start, end, n, n, _as_float(scale)), bool(alarm & kind)))
        if n > 1:
            found.append((Period(kind, first_start, first_end, 1, n, _as_float(first_scale)),
                          False))
    return sorted(found, key=lambda p: p[0].start)


def _say_alarm(settings: State, words: np.ndarray) -> None:
    """Host side: says each alarm period a state shows, once per period.

    A period that goes on is said as it is (stuck, or skipping often); one that
    has ended since it began (a run inside one ``jit`` comes back once, at its
    end) from the record, with its steps, unless an earlier state said it
    already. Only the settings (static fields) of ``settings`` are read: its
    arrays may have been donated to a later step.
    """
    width = _HEAD + _PER_KIND * len(KINDS)
    for row in np.asarray(words).reshape(-1, width).tolist():
        _, steps, streak, skipped, longest, scale_bits = row[:_HEAD]
        _SAID.difference_update([key for key in _SAID if key[1] > steps])
        scale = _as_float(scale_bits)
        for period, going_on in _periods(row):
            if (period.kind, period.start) in _SAID:
                continue
            _SAID.add((period.kind, period.start))
            stuck = period.kind == STUCK
            if going_on and stuck:
                message = stuck_message(settings, streak, period.start)
            elif going_on:
                message = skips_message(settings, skipped, period.start, scale,
                                        period.skip_scale)
            else:
                message = past_alarm_message(settings, period, steps, longest, scale)
            if settings.on_stuck == "raise":
                raise TrainingStuckError(message)
            warnings.warn(message, TrainingStuckWarning if stuck else SkippedStepsWarning,
                          stacklevel=1)


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
