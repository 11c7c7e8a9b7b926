"""Messages about training, said on the host without slowing healthy steps.

A compiled step cannot print without a host callback, and a callback costs
every step: on a CPU about half a millisecond even under a ``lax.cond`` that
never fires, on a GPU a wait for the predicate. jaxmp therefore says most of
what it has to say from the *state the step returns*:

* :func:`watch` is called whenever a concrete :class:`jaxmp.ScalerState` is
  built on the host, which includes every time a jitted step returns one. It
  keeps a few words computed from the state (a new array, because a training
  loop usually donates the state to the next step) and reads them once they are
  ready: at the latest two states later, so the host never waits for the step
  it has just dispatched. When the alarm is set, the state's ``check`` says
  why (a warning or an error). A state that is the last for a while (a whole
  run in one ``jit`` returns one) is read by a background thread as soon as
  it is ready, when its check only warns. At interpreter exit the last states
  are read.
* :func:`call_back_if` is the callback under ``lax.cond``, for the one message
  that no returned state can carry (an optimizer update that overflows
  float16 parameters); it is traced only where that can happen.

:func:`no_host_callbacks` removes the callbacks from steps traced inside it,
for programs lowered for another platform.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import threading
from typing import Any, Callable

import jax
import numpy as np

from jaxmp._src import compat

# Checked states, oldest first: (copy of the alarm word, the check to run, whether
# the background reader may run the check).
_PENDING: collections.deque = collections.deque()
# How many unread states may wait: the host dispatches the next step before it
# reads the one just returned, and reads it at the latest this many steps later.
MAX_PENDING = 2
# _PENDING is read by the caller's thread and by the background reader.
_LOCK = threading.RLock()
_READER: list = []  # the background reader thread, while it runs
# What a check raised in the background reader (a warning turned into an error by a
# filter): raised by the caller's next watch or flush.
_DEFERRED: list = []

# Whether jaxmp's steps may call back to the host (the float16 update-overflow
# message). A JAX user context, so that it is part of the trace cache key: a
# step traced with callbacks is traced again, without, inside
# ``no_host_callbacks``.
_HOST_CALLBACKS = jax.make_user_context(default_value=True)


def is_concrete_array(x: Any) -> bool:
    """Whether ``x`` is a jax.Array with a value (not a tracer, not a shape)."""
    return isinstance(x, jax.Array) and not compat.is_tracer(x)


def watch(alarm: jax.Array, check: Callable[[np.ndarray], None], *,
          background: bool = False) -> None:
    """Reads ``alarm`` once it is computed, then calls ``check(value)`` with its value.

    ``alarm`` must be an array of the caller's own (computed from the state,
    not one of its leaves), so that donating the state does not delete it.

    Earlier watched alarms that are ready are read first (and raise or warn
    from here); if more than :data:`MAX_PENDING` wait, the oldest is waited for.
    With ``background=True`` (a check that only warns), an alarm still not
    ready is read by a background thread as soon as it is: the state of a
    whole run inside one ``jit`` comes back once, and no later state would
    read it before the interpreter exits.
    """
    with _LOCK:
        _raise_deferred()
        _PENDING.append((alarm, check, background))
        while _PENDING and (len(_PENDING) > MAX_PENDING or _is_ready(_PENDING[0][0])):
            _read(*_PENDING.popleft()[:2])
        if _PENDING and _PENDING[0][2] and not _READER:
            reader = threading.Thread(target=_read_in_background, name="jaxmp-alarms",
                                      daemon=True)
            _READER.append(reader)
            reader.start()


def flush() -> None:
    """Reads every watched alarm now, waiting for the steps that compute them."""
    with _LOCK:
        _raise_deferred()
        while _PENDING:
            _read(*_PENDING.popleft()[:2])


def _raise_deferred() -> None:
    if _DEFERRED:
        raise _DEFERRED.pop(0)


def _read_in_background() -> None:
    """The background reader: reads the oldest alarms while their checks may run here."""
    while True:
        with _LOCK:
            if not _PENDING or not _PENDING[0][2]:
                _READER.clear()  # a check that raises is left to the caller's thread
                return
            alarm = _PENDING[0][0]
        try:
            alarm.block_until_ready()
        except RuntimeError:
            pass  # deleted: _read drops it
        with _LOCK:
            if _PENDING and _PENDING[0][0] is alarm:
                try:
                    _read(*_PENDING.popleft()[:2])
                except Exception as e:  # pylint: disable=broad-except
                    _DEFERRED.append(e)


def _is_ready(x: jax.Array) -> bool:
    try:
        return x.is_ready()
    except RuntimeError:
        return True  # deleted: _read drops it


def _read(alarm: jax.Array, check: Callable[[np.ndarray], None]) -> None:
    try:
        value = np.asarray(alarm.addressable_data(0))
    except RuntimeError:  # deleted, or the backend is gone (interpreter exit)
        return
    check(value)


@atexit.register
def _flush_at_exit() -> None:
    try:
        flush()
    except Exception:  # pylint: disable=broad-except
        pass  # a message at exit must never turn a finished run into a failure


@contextlib.contextmanager
def no_host_callbacks():
    """Within this block, steps traced by jaxmp contain no host callback.

    For programs lowered for another platform than the machine's (the GPU
    FLOP count of :func:`jaxmp.debug.matmul_flops` on a CPU-only machine): a host
    callback cannot be lowered there. Training steps never need it.
    """
    with _HOST_CALLBACKS(False):
        yield


def call_back_if(pred: jax.Array, callback: Callable[..., None], *args: Any) -> None:
    """Calls ``callback(*args)`` on the host on a step where ``pred`` holds, and on no other.

    Traced under ``lax.cond``, so a step where ``pred`` is false makes no host
    round trip; inside :func:`no_host_callbacks` nothing is traced at all.
    Under ``vmap`` the ``cond`` becomes a select and the callback runs for
    every step, so ``pred`` is checked again on the host.
    """
    if not _HOST_CALLBACKS.value:
        return

    def on_host(fired, *values):
        if np.asarray(fired).any():
            callback(*values)

    jax.lax.cond(pred, lambda p, *a: jax.debug.callback(on_host, p, *a),
                 lambda p, *a: None, pred, *args)
