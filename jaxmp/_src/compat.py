"""The JAX APIs that changed between the versions jaxmp supports, or that are private.

jaxmp supports jax 0.8.0 (the floor in pyproject.toml, tested by CI with
``constraints/oldest.txt``) to the newest release. Where the two ends differ,
or where jaxmp needs something JAX keeps private, the difference lives in one
small function here, with a fallback, and nowhere else:

- :func:`bind_params`: ``Primitive.get_bind_params`` returns ``(subfuns,
  params)`` up to jax 0.8 and only ``params`` later.
- :func:`pcast_to_varying`: ``jax.lax.pcast(x, axes, to="varying")``, called
  ``jax.lax.pvary(x, axes)`` before it (both public).
- :func:`varying_axes`: the varying manual axes of a value's type,
  ``jax.typeof(x).manual_axis_type.varying``, formerly ``jax.typeof(x).vma``.
- :func:`user_frames`: the frames of an equation's traceback that are the
  user's code. JAX has this only privately (``jax._src.source_info_util``);
  the fallback keeps the frames outside JAX's own directories, which differs
  only for code that registered itself with JAX as a library to skip, and
  otherwise (no traceback at all) returns no frames: ``jaxmp.find_nonfinite``
  then reports an operation without its source line.

Everything else jaxmp uses is public API (``jax.extend`` included).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple

import jax

try:  # Private: only for user_frames, which has a fallback.
    from jax._src import source_info_util as _private_source_info
except ImportError:  # pragma: no cover (a JAX release that moved it)
    _private_source_info = None

try:  # Private: only for without_dead_code, which has a fallback.
    from jax._src.interpreters.partial_eval import dce_jaxpr as _private_dce_jaxpr
except ImportError:  # pragma: no cover (a JAX release that moved it)
    _private_dce_jaxpr = None


def bind_params(primitive: Any, params: Mapping[str, Any]) -> tuple[list, dict]:
    """``(subfuns, params)`` with which to call ``primitive.bind(*subfuns, *args, **params)``."""
    got = primitive.get_bind_params(params)
    if isinstance(got, tuple):  # jax <= 0.8: (subfuns, params)
        subfuns, params = got
        return list(subfuns), dict(params)
    return [], dict(got)


def pcast_to_varying(x: jax.Array, axes: tuple[Any, ...]) -> jax.Array:
    """Types ``x`` as varying over the manual ``axes`` (no data moves)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, tuple(axes), to="varying")
    return jax.lax.pvary(x, tuple(axes))  # jax <= 0.8


def varying_axes(x: Any) -> frozenset:
    """The manual axes over which ``x`` is typed as varying (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax <= 0.8


def without_dead_code(jaxpr: Any) -> Any:
    """``jaxpr`` (an open ``Jaxpr``) without the equations no output depends on.

    What lowering drops: a custom_vjp's primal computation under ``grad``,
    unused values. Private (JAX's ``dce_jaxpr``); a JAX release without it
    gives ``jaxpr`` unchanged.
    """
    if _private_dce_jaxpr is None:  # pragma: no cover
        return jaxpr
    return _private_dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def in_forward_mode(values: Any) -> bool:
    """Whether some value of ``values`` is being differentiated in forward mode.

    ``jax.jvp``, ``jax.jacfwd`` and ``jax.hessian`` trace with JAX's forward-mode
    tracer (``JVPTracer``); ``jax.grad``, ``jax.vjp`` and ``jax.linearize`` trace
    with its linearize tracer. The tracer of each value is followed through
    the tracers that wrap it (``vmap``'s, and the linearize tracer of
    forward-over-reverse). Private: the tracer classes are recognised by
    name, and a JAX release that renamed them gives ``False`` (autocast then
    raises its forward-mode message instead of adapting).
    """
    for x in jax.tree_util.tree_leaves(values):
        seen = 0
        while isinstance(x, jax.core.Tracer) and seen < 64:
            if type(x).__name__ == "JVPTracer":
                return True
            inner = None
            for attr in ("primal", "val"):  # JVP/linearize tracers; vmap's BatchTracer
                inner = getattr(x, attr, None)
                if inner is not None:
                    break
            x, seen = inner, seen + 1
    return False


class Frame(NamedTuple):
    """A source location, with the fields of JAX's private ``Frame`` that jaxmp reads."""

    file_name: str
    function_name: str
    start_line: int


_JAX_DIRS = tuple(os.path.dirname(m.__file__) + os.sep
                  for m in (jax, __import__("jaxlib")) if getattr(m, "__file__", None))


def user_frames(traceback: Any, *, private: bool = True) -> list:
    """The frames of ``traceback`` (an equation's) in the user's code, innermost first.

    Each has ``file_name``, ``function_name`` and ``start_line``.

    Args:
        traceback: ``eqn.source_info.traceback``, or ``None``.
        private: use JAX's private ``user_frames`` when it is there (it also
            skips the files that libraries registered with JAX); ``False``
            gives the public fallback, which skips JAX's own files only.
    """
    if traceback is None:
        return []
    if private and _private_source_info is not None:
        try:
            return list(_private_source_info.user_frames(traceback))
        except Exception:  # pylint: disable=broad-except  (a changed private API: use the fallback)
            pass
    return [Frame(f.file_name, f.function_name, f.line_num)
            for f in getattr(traceback, "frames", ())
            if not os.path.abspath(f.file_name).startswith(_JAX_DIRS)]
