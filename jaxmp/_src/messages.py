"""How jaxmp words and says what it finds while tracing a step.

* :func:`warn_once`: a trace-time warning is said once per place in the
  user's code (:func:`source.location_key`), not once per trace: a loss
  re-created inside a jitted step, traced again at new shapes, or traced by
  the FLOP tools says it once. The warning points at the user's frame, past
  jaxmp's, JAX's and a framework's own.
* :func:`percent`: a share as a percentage that reads 100% or 0% only when
  it is exactly that, for the warnings and the precision report.

Warnings said from the host while training runs (the scaler's alarms) are
:mod:`jaxmp._src.alarms`'s.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from jaxmp._src import source

# The warnings said, by key, to the listener they were said to (see ``warn_once``).
_said: dict = {"listener": None, "keys": set()}


def _listener() -> tuple:
    """What shows a warning now: a ``catch_warnings(record=True)`` block installs a new one."""
    return getattr(warnings, "_showwarnmsg_impl", None), warnings.showwarning


def warn_once(key: Any, message: str, category: type) -> bool:
    """Warns ``message`` unless a warning with ``key`` was said already; returns whether it warned.

    ``key`` names the place in the user's code (:func:`source.location_key`),
    so that tracing the same code again says nothing, whatever the filters
    (``"always"`` included). The record lasts as long as warnings are shown
    the same way: a ``warnings.catch_warnings(record=True)`` block (as
    ``pytest.warns`` and pytest's capture of each test's warnings use)
    starts a new one, so a test can count what a function says; a block that
    only changes filters (as ``equinox.filter_jit`` wraps its calls in) does
    not. A warning turned into an error by a filter is not recorded (it is
    raised again next time).
    """
    listener = _listener()
    if (_said["listener"] is None
            or any(a is not b for a, b in zip(_said["listener"], listener))):
        _said["listener"], _said["keys"] = listener, set()
    key = (category.__name__, key)
    if key in _said["keys"]:
        return False
    warnings.warn(message, category, stacklevel=_user_stacklevel())
    _said["keys"].add(key)
    return True


def _user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in :func:`warn_once`) of the innermost frame
    in the user's code: the call of the traced function, past jaxmp's, JAX's and a framework's
    own frames (``equinox.filter_jit``)."""
    frame, level = sys._getframe(2), 2  # pylint: disable=protected-access  (warn_once's caller)
    while frame is not None and source.in_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def percent(share: float, digits: int = 0) -> str:
    """``share`` as a percentage that reads 100% or 0% only when it is exactly that.

    Args:
        share: a fraction, from 0 to 1.
        digits: the digits after the decimal point.

    Returns:
        The percentage (``"50%"``); a share that rounds to 100% (0%) without
        being all (none) reads ``">99%"`` (``"<1%"``), with ``digits`` digits.

    Examples:
        >>> [percent(s) for s in (0.0, 0.001, 0.5, 0.999, 1.0)]
        ['0%', '<1%', '50%', '>99%', '100%']
        >>> percent(0.0004, 1)
        '<0.1%'
    """
    text = f"{share:.{digits}%}"
    if float(text[:-1]) == 100 and share < 1:
        return f">{100 - 10 ** -digits:g}%"
    if float(text[:-1]) == 0 and share > 0:
        return f"<{10 ** -digits:g}%"
    return text
