"""Messages from inside a traced step: host callbacks that only a bad step makes.

jaxmp says when training is stuck (:func:`jaxmp.adjust`) and when an
optimizer's update overflows (:func:`jaxmp.optimizer_update`) from inside the
jitted step. Both go through :func:`call_back_if`: a ``jax.debug.callback``
under ``lax.cond``, so a healthy step never calls back to the host.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import numpy as np

# Whether jaxmp's steps may call back to the host (stuck and overflow messages).
# A JAX user context, so that it is part of the trace cache key: a step traced
# with callbacks is traced again, without, inside ``no_host_callbacks``.
_HOST_CALLBACKS = jax.make_user_context(default_value=True)


@contextlib.contextmanager
def no_host_callbacks():
    """Within this block, steps traced by jaxmp contain no host callback.

    For programs lowered for another platform than the machine's (the GPU
    FLOP count of :func:`jaxmp.matmul_flops` on a CPU-only machine): a host
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
