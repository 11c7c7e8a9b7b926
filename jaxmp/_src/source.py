"""Where an operation of a traced function comes from, in the user's code.

jaxmp's messages name the user's file and line, never jaxmp's own or an
installed package's: a matrix product inside ``flax.linen.Dense`` is reported
at the Dense layer's call in the user's model. jaxmp's own frames are never
named: an operation that jaxmp itself added to the user's program (the cast of
an input, autocast's conversion of an operand) has no line in the user's code,
and :func:`made_by_jaxmp` tells it apart so that a caller can name it by what
it acts on instead (``find_nonfinite`` names the argument's pytree path, or
the user's operation the converted value feeds).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from jaxmp._src import compat

_INSTALLED_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_JAXMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def frames(eqn) -> list:
    """The user frames of ``eqn``'s traceback, innermost first ([] when unknown)."""
    return compat.user_frames(compat.traceback(eqn))


def summary(frame) -> str:
    return f"{os.path.basename(frame.file_name)}:{frame.start_line} ({frame.function_name})"


def in_jaxmp(file_name: str) -> bool:
    """Whether a frame is in jaxmp itself (wherever it is installed or checked out)."""
    return os.path.abspath(file_name).startswith(_JAXMP_DIR)


def in_library(file_name: str) -> bool:
    """Whether a frame is in installed packages or in jaxmp itself, not in the user's code."""
    path = os.path.abspath(file_name)
    return path.startswith(_JAXMP_DIR) or any(d in path for d in _INSTALLED_DIRS)


def _found(eqn, enclosing: Sequence[Any]) -> list:
    """The frames of ``eqn``, or, inside a cached nested ``jit`` (``jnp.var``...) where JAX
    may keep no user frame, those of the innermost enclosing equation that has some."""
    found = frames(eqn)
    for outer in reversed(enclosing):
        if found:
            break
        found = frames(outer)
    return found


def made_by_jaxmp(eqn, enclosing: Sequence[Any] = ()) -> bool:
    """Whether jaxmp itself added ``eqn`` to the user's program (its innermost frame is jaxmp's).

    Such an operation (an input cast, autocast's conversion of an operand, the
    loss scaling) has no line of its own in the user's code.
    """
    return jaxmp_module(eqn, enclosing) is not None


def jaxmp_module(eqn, enclosing: Sequence[Any] = ()) -> str | None:
    """The jaxmp module that added ``eqn`` to the user's program, or ``None`` (not jaxmp's).

    Args:
        eqn: an equation of a traced program.
        enclosing: the equations ``eqn`` is nested in, outermost first: inside a
            cached nested ``jit`` JAX may keep no frame of ``eqn``'s own, and
            the innermost enclosing equation's frames are read instead.

    Returns:
        The dotted name of the module of ``eqn``'s innermost frame
        (``"jaxmp._src.autocast.interpreter"``; a package's ``__init__.py`` gives the
        package's name) when that frame is jaxmp's; ``None`` otherwise.
    """
    found = _found(eqn, enclosing)
    if not found or not in_jaxmp(found[0].file_name):
        return None
    path = os.path.relpath(os.path.abspath(found[0].file_name), _JAXMP_DIR)
    parts = ["jaxmp", *os.path.splitext(path)[0].split(os.sep)]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _user_frames(eqn, enclosing: Sequence[Any]) -> tuple[Any, Any]:
    """``(where, called_from)`` frames of ``eqn`` (see :func:`locate`); ``None`` when unknown."""
    found = [f for f in _found(eqn, enclosing) if not in_jaxmp(f.file_name)]
    if not found:
        return None, None
    where = found[0]
    if not in_library(where.file_name):
        return where, None
    for frame in found[1:]:
        if not in_library(frame.file_name):
            return where, frame
    return where, None


def locate(eqn, enclosing: Sequence[Any] = ()) -> tuple[str, str]:
    """``(where, called_from)`` for ``eqn``; inside a cached nested ``jit`` (``jnp.var``...)
    JAX may keep no user frame, and the innermost enclosing equation's location is used.
    ``where`` is the innermost frame outside jaxmp; ``called_from`` the first frame in the
    user's code when ``where`` is in a library ("" otherwise). jaxmp's own frames are
    never returned (for an operation jaxmp added, see :func:`made_by_jaxmp`)."""
    where, called_from = _user_frames(eqn, enclosing)
    if where is None:
        return "unknown", ""
    return summary(where), summary(called_from) if called_from is not None else ""


def user_location(eqn, enclosing: Sequence[Any] = ()) -> str:
    """The first place in the user's code that ``eqn`` comes from, for a message."""
    where, called_from = locate(eqn, enclosing)
    return called_from or where


def location_key(eqn, enclosing: Sequence[Any] = ()) -> tuple:
    """A hashable name of where ``eqn`` comes from, the same in every trace of the user's code.

    The full paths, lines and functions of the frames :func:`locate` names; an
    operation with no user frame is named by its primitive and operand dtypes
    instead (not shapes, which change between traces). A loss re-created (a new
    closure of the same code) and traced again, at new shapes or by another
    tool, gives the same key.
    """
    named = [f for f in _user_frames(eqn, enclosing) if f is not None]
    if named:
        return tuple((os.path.abspath(f.file_name), f.start_line, f.function_name) for f in named)
    return (eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars))
