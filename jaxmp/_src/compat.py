"""jaxmp's one point of contact with JAX's internals.

jaxmp reads and rewrites jaxprs: it walks their equations, reads the
parameters of the higher-order ones (``scan``, ``while``, ``cond``, ``jit``,
``checkpoint``, ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``) and of
the collectives, binds primitives again, tells tracers apart and parses name
stacks. JAX changes these between releases (jax 0.11 binds ``scan`` with
``ft_in``/``ft_out`` instead of ``num_consts``/``num_carry``, and its jaxprs
inside equations are open; ``shard_map`` names its manual axes three ways), so
every such contact lives here, behind a small typed accessor, and no other
module of jaxmp reads ``eqn.params``, ``eqn.source_info``, ``jax.core``,
``jax.extend`` or ``jax._src`` (``tests/test_compat.py`` checks it). jaxmp
supports jax 0.8.0 (the floor in pyproject.toml, tested by CI with
``constraints/oldest.txt``) to the newest release.

What is here:

- Versions that differ: :func:`bind_params` (``Primitive.get_bind_params``
  returns ``(subfuns, params)`` up to jax 0.8 and only ``params`` later),
  :func:`pcast_to_varying` (``jax.lax.pcast(x, axes, to="varying")``, called
  ``jax.lax.pvary(x, axes)`` before it), :func:`varying_axes`
  (``jax.typeof(x).manual_axis_type.varying``, formerly ``.vma``).
- Jaxprs and binding: :func:`is_literal`, :func:`is_var`, :func:`closed`,
  :func:`eval_jaxpr`, :func:`at_source_of`, :func:`inside_call`, :func:`bind`,
  :func:`bind_with`.
- Equation parameters, one typed accessor per primitive family:
  :func:`scan`, :func:`while_loop`, :func:`cond_branches`,
  :func:`checkpoint`, :func:`called_jaxpr`, :func:`shard_map`,
  :func:`psum_axes`, :func:`all_gather`, :func:`dimension_numbers`,
  :func:`precision`, :func:`new_dtype`, :func:`integer_exponent`,
  :func:`params_for_bind`, :func:`params_key`, :func:`sub_jaxprs`,
  :func:`is_higher_order`. An accessor that does not find what it knows
  raises :class:`UnknownEquation` (never a ``KeyError``); the interpreter
  then runs that equation as written and says so once
  (:class:`UnknownEquationWarning`).
- Name stacks: :func:`name_stack`, :func:`is_backward`,
  :func:`transpose_depth`, :func:`without_transforms`.
- Tracers: :func:`is_tracer`, :func:`in_forward_mode`.
- Private APIs, each with a fallback: :func:`user_frames` (JAX's
  ``source_info_util.user_frames``; the fallback keeps the frames outside
  JAX's own directories, which differs only for code that registered itself
  with JAX as a library to skip) and :func:`without_dead_code`
  (``dce_jaxpr``; the fallback keeps dead code).
- The primitive-name tables that jaxmp's rules are made of
  (:data:`LOW_PRECISION`, :data:`FOLLOW`, ...), and :data:`LEGACY_PRIMITIVES`:
  the names in them that the newest JAX no longer binds, each with a note.
  :func:`installed_primitives` lists the primitives of the installed JAX, so
  that a test can check every name of every table.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib
import os
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import jax
from jax import lax
from jax.extend import core as _jex_core
from jax.extend import source_info_util as _source_info

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


def abstract_like(aval: Any, shape: Any = None, dtype: Any = None) -> jax.ShapeDtypeStruct:
    """A ``jax.ShapeDtypeStruct`` with ``aval``'s shape, dtype and varying manual axes.

    Tracing a function of it inside a ``shard_map`` body gives a program typed as
    the body's values are (a scan body retraced from plain shapes would lose its
    carry's varying axes and no longer match the scan). The keyword is
    ``manual_axis_type`` from jax 0.9 on, ``vma`` before. ``shape`` and ``dtype``,
    when given, replace ``aval``'s (a scan's slice of a stacked input, a narrowed
    carry): the varying axes stay.
    """
    shape = aval.shape if shape is None else tuple(shape)
    dtype = aval.dtype if dtype is None else dtype
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None and manual.varying:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding_of(aval, shape),
                                    manual_axis_type=manual)
    varying = getattr(aval, "vma", None)  # jax <= 0.8
    if manual is None and varying:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=_sharding_of(aval, shape),
                                    vma=varying)
    return jax.ShapeDtypeStruct(shape, dtype)


def _sharding_of(aval: Any, shape: tuple) -> Any:
    """``aval``'s (abstract-mesh) sharding, for an abstract value of ``shape``: its spec
    without the leading entries of the dimensions ``shape`` drops (a scan's slice)."""
    sharding = aval.sharding
    if len(shape) == len(aval.shape):
        return sharding
    spec = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
    return sharding.update(spec=jax.sharding.PartitionSpec(*spec[len(aval.shape) - len(shape):]))


def without_dead_code(jaxpr: Any, keep_inputs: bool = False) -> Any:
    """``jaxpr`` (an open ``Jaxpr``) without the equations no output depends on.

    What lowering drops: a custom_vjp's primal computation under ``grad``,
    unused values. Unused inputs go too, unless ``keep_inputs``. Private
    (JAX's ``dce_jaxpr``); a JAX release without it gives ``jaxpr`` unchanged.
    """
    if _private_dce_jaxpr is None:  # pragma: no cover
        return jaxpr
    return _private_dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=keep_inputs)[0]


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


# --- Jaxprs and binding ------------------------------------------------------------------------


def is_literal(v: Any) -> bool:
    """Whether ``v`` (an operand of an equation) is a jaxpr literal, not a variable."""
    return isinstance(v, _jex_core.Literal)


def is_var(v: Any) -> bool:
    """Whether ``v`` is a jaxpr variable (not a literal)."""
    return isinstance(v, _jex_core.Var)


def _is_jaxpr(x: Any) -> bool:
    return isinstance(x, (_jex_core.Jaxpr, _jex_core.ClosedJaxpr))


def closed(jaxpr: Any) -> Any:
    """``jaxpr`` as a ``ClosedJaxpr`` (it has ``.jaxpr`` and ``.consts``), whichever it is.

    Up to jax 0.10 the jaxprs inside equations are mostly closed; from jax
    0.11 they are open ``Jaxpr`` objects, which are their own closed form.
    """
    if isinstance(jaxpr, _jex_core.ClosedJaxpr):
        return jaxpr
    return _jex_core.ClosedJaxpr(jaxpr, ())


def like_given(program: Any, given: Any) -> Any:
    """The closed jaxpr ``program`` (no constants) in the form of ``given``, a jaxpr parameter
    of an equation: closed where it is closed, open where it is open (jax 0.11 on)."""
    return program if isinstance(given, _jex_core.ClosedJaxpr) else program.jaxpr


def open_jaxpr(jaxpr: Any) -> Any:
    """The open ``Jaxpr`` of ``jaxpr`` (closed or not): its ``eqns``, ``invars``, ``outvars``."""
    return getattr(jaxpr, "jaxpr", jaxpr)


def eval_jaxpr(jaxpr: Any, consts: Any, *args: Any) -> list:
    """``jaxpr`` (open) evaluated on ``args`` by JAX itself, its primitives bound as they are."""
    return jax.core.eval_jaxpr(jaxpr, consts, *args)


@contextlib.contextmanager
def at_source_of(eqn, own_names: bool = True):
    """Equations bound inside this block carry the source of ``eqn``: the user's line and names.

    The names are the ones ``jax.core.eval_jaxpr`` gives: the name stack of the
    current trace followed by the equation's own (its ``jax.named_scope``s,
    Flax and Haiku module paths), so that the compiled program's ``op_name``
    metadata and a profile show the user's layers. ``own_names=False``: the
    current name stack alone, for a higher-order ``eqn`` bound as written from
    within its own evaluation (:func:`inside_call`), which holds its names already.

    An equation with no frame in the user's code of its own (one of the body
    of a ``jnp.where`` or another cached ``jit`` of JAX's) carries instead the
    source of the call it is inside (:func:`inside_call`), once that call is
    inlined: the user's line of the ``jnp.where``.
    """
    stack = _source_info.current_name_stack()
    if own_names:
        stack = stack + eqn.source_info.name_stack
    traceback = eqn.source_info.traceback
    outer = _ENCLOSING_SOURCE.get()
    if outer is not None and traceback is not outer and not user_frames(traceback):
        traceback = outer
    with _source_info.user_context(traceback, name_stack=stack):
        yield


# The traceback of the innermost call (jit, checkpoint...) being evaluated that has a frame in
# the user's code: the source of the equations inside it that have none of their own.
_ENCLOSING_SOURCE: contextvars.ContextVar = contextvars.ContextVar(
    "jaxmp_enclosing_source", default=None)


@contextlib.contextmanager
def inside_call(eqn):
    """The context in which an interpreter evaluates the higher-order ``eqn`` (its body, and
    the loop, branch or call that replaces it).

    Names: the current name stack is followed by ``eqn``'s own, as
    ``jax.core.eval_jaxpr`` binds it. The equations of a body hold names
    relative to the body (``layers/mlp`` in the ``scan`` of a Flax ``decoder``):
    a body inlined (a ``jit``) carries ``Transformer/decoder/layers/mlp``, and a
    body traced again (``lax.scan``...) is lowered under the new loop's
    ``Transformer/decoder``, as the original program's is.

    Source: equations inside ``eqn`` whose own traceback has no frame in the
    user's code are bound at ``eqn``'s source (:func:`at_source_of`). JAX traces
    the body of a cached ``jit`` (``jnp.where``, ``jnp.var``...) once, and its
    equations keep no frame of the code that called it; an interpreter that
    inlines the call would otherwise lose the user's line.
    """
    stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with contextlib.ExitStack() as scope:
        scope.enter_context(_source_info.set_name_stack(stack))
        traceback = eqn.source_info.traceback
        if traceback is not None and user_frames(traceback):
            source = _ENCLOSING_SOURCE.set(traceback)
            scope.callback(_ENCLOSING_SOURCE.reset, source)
        # else: the enclosing call's source, if any, still applies
        yield


def bind(eqn, invals: Any, params: Mapping[str, Any] | None = None, *,
         own_names: bool = True) -> list:
    """Binds the primitive of ``eqn`` on ``invals`` (arrays); always returns a list.

    ``params`` replaces the equation's parameters (see :func:`params_for_bind`).
    The new equation keeps the source location of ``eqn`` (the user's line) and,
    unless ``own_names=False`` (see :func:`at_source_of`), its names.
    """
    params = eqn.params if params is None else params
    with at_source_of(eqn, own_names):
        subfuns, bound = bind_params(eqn.primitive, params)
        out = eqn.primitive.bind(*subfuns, *invals, **bound)
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_with(eqn, invals: Any, **changes: Any) -> Any:
    """The (first-order) primitive of ``eqn`` bound on ``invals``, some parameters changed;
    its result as the primitive gives it (a list only for a primitive with several results)."""
    return eqn.primitive.bind(*invals, **params_for_bind(eqn, **changes))


def bind_conv(x: Any, y: Any, params: Mapping[str, Any]) -> Any:
    """``conv_general_dilated`` of ``x`` and ``y`` with the parameters of a convolution
    equation (:func:`params_for_bind`), which ``jax.lax.conv_general_dilated`` does not take."""
    return lax.conv_general_dilated_p.bind(x, y, **params)


def params_for_bind(eqn, **changes: Any) -> dict:
    """A copy of ``eqn``'s parameters with ``changes``, to bind it again (:func:`bind`)."""
    return {**eqn.params, **changes}


def params_key(eqn) -> tuple:
    """A key of ``eqn``'s primitive and parameters for a cache (``TypeError`` if unhashable)."""
    key = (eqn.primitive, tuple(sorted(eqn.params.items())))
    hash(key)
    return key


def is_higher_order(eqn, *, combiners: bool = False, functions: bool = False) -> bool:
    """Whether ``eqn`` carries a jaxpr in its parameters (a body: ``scan``, ``jit``, ...).

    Args:
        eqn: an equation.
        combiners: count the primitives of :data:`AS_WRITTEN` (a scatter's or
            a reduction's combiner, a custom rule) as well.
        functions: count function parameters as well (a callback's, a custom
            rule's).
    """
    if eqn.primitive.name in AS_WRITTEN and not combiners:
        return False
    return any(_is_jaxpr(v) or (functions and callable(v))
               or (isinstance(v, (tuple, list)) and any(_is_jaxpr(x) for x in v))
               for v in eqn.params.values())


def loop_trips(eqn) -> int:
    """How often a ``while`` equation runs its body, when it counts its iterations, else 1.

    A counted loop has a carry that starts at the literal 0, a condition that is
    that carry ``lt`` a literal, and a body that adds 1 to it (a ``fori_loop``
    with traced bounds does not; one with fixed bounds is a ``scan``). The FLOP
    count of the lowered program (``lowered_flops._loop_trips``) reads the same
    loops the same way.
    """
    loop = while_loop(eqn)
    cond, body = loop.cond.jaxpr, loop.body.jaxpr
    test = next((e for e in cond.eqns if cond.outvars[0] in e.outvars), None)
    if test is None or test.primitive.name != "lt":
        return 1
    counter, bound = test.invars
    carries = cond.invars[loop.cond_nconsts:]
    if not is_literal(bound) or counter not in carries:
        return 1
    k = carries.index(counter)
    start = eqn.invars[loop.cond_nconsts + loop.body_nconsts + k]
    step = next((e for e in body.eqns if body.outvars[k] in e.outvars), None)
    if not is_literal(start) or int(start.val) != 0 or step is None or step.primitive.name != "add":
        return 1
    a, b = step.invars
    mine = body.invars[loop.body_nconsts + k]
    one = b if a is mine else a if b is mine else None
    if not is_literal(one) or int(one.val) != 1:
        return 1
    return max(int(bound.val), 0)


def sub_jaxprs(eqn) -> Iterator[tuple[Any, int]]:
    """The (open) jaxprs inside ``eqn`` (scan, while, cond, jit, checkpoint, custom rules,
    shard_map), each with how many times it runs per run of ``eqn``: a ``scan``'s length, a
    counted ``while`` loop's trip count (:func:`loop_trips`), 1 otherwise."""
    repeat = 1
    if eqn.primitive.name == "scan":
        repeat = int(eqn.params.get("length", 1))
    elif eqn.primitive.name == "while":
        repeat = loop_trips(eqn)
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = open_jaxpr(item)
            if hasattr(inner, "eqns"):
                yield inner, repeat


# --- Equation parameters ------------------------------------------------------------------------


class UnknownEquation(Exception):
    """An equation whose parameters are not those jaxmp knows for its primitive.

    Raised by the accessors below instead of a ``KeyError``: a JAX release
    changed the primitive. :class:`jaxmp._src.interpret.Interpreter` catches
    it, runs the equation as written and warns once
    (:class:`UnknownEquationWarning`).
    """

    def __init__(self, eqn, missing: str):
        self.primitive = eqn.primitive.name
        super().__init__(
            f"the {self.primitive} equation has no parameter {missing} (its parameters: "
            f"{', '.join(sorted(eqn.params))})")


class UnknownEquationWarning(UserWarning):
    """Says that jaxmp met an equation it does not understand and ran it as written.

    Issued at trace time, once per primitive, by :func:`jaxmp.autocast` (and so
    :func:`jaxmp.mp_value_and_grad`'s default), :func:`jaxmp.debug.find_nonfinite`
    and the one-device evaluation of a ``shard_map``, when an equation's
    primitive has a body jaxmp has no rule for (a higher-order primitive new
    to it) or parameters it does not know (a JAX release changed them). The
    equation then runs exactly as the function wrote it, in its own dtypes:
    nothing inside it is autocast or diagnosed. The message names the
    primitive; upgrading jaxmp, or reporting the primitive, is the fix.

    Examples:
        >>> import jaxmp
        >>> issubclass(jaxmp.debug.UnknownEquationWarning, UserWarning)
        True
    """


_MISSING = object()


def _param(eqn, *names: str, default: Any = _MISSING) -> Any:
    """The first of the parameters ``names`` that ``eqn`` has (``default``, or raises
    :class:`UnknownEquation`)."""
    for name in names:
        if name in eqn.params:
            return eqn.params[name]
    if default is _MISSING:
        raise UnknownEquation(eqn, " or ".join(repr(n) for n in names))
    return default


class Scan(NamedTuple):
    """A ``scan`` equation: ``body`` (closed) on ``num_consts`` constants, ``num_carry`` carries
    and the sliced rest; the other fields are ``lax.scan``'s arguments."""

    body: Any
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: Any
    split_transpose: bool


def scan(eqn) -> Scan:
    """The parameters of a ``scan`` equation.

    Up to jax 0.10: ``num_consts``, ``num_carry``. From jax 0.11: ``ft_in``,
    a flat tree of (constants, carries, sliced inputs).
    """
    if "num_consts" in eqn.params:
        num_consts, num_carry = _param(eqn, "num_consts"), _param(eqn, "num_carry")
    elif "ft_in" in eqn.params:
        try:
            num_consts, num_carry, _ = (len(part) for part in eqn.params["ft_in"].unpack())
        except (AttributeError, TypeError, ValueError) as e:
            raise UnknownEquation(eqn, "'ft_in' of (consts, carry, xs)") from e
    else:
        raise UnknownEquation(eqn, "'num_consts' or 'ft_in'")
    return Scan(closed(_param(eqn, "jaxpr")), num_consts, num_carry, _param(eqn, "length"),
                _param(eqn, "reverse"), _param(eqn, "unroll", default=1),
                _param(eqn, "_split_transpose", default=False))


def scan_with_body(eqn, body: Any) -> dict:
    """The parameters of a ``scan`` equation with its body replaced by the closed jaxpr
    ``body`` (no constants; the same operands), in the form the equation holds its body."""
    given = _param(eqn, "jaxpr")
    return {**eqn.params, "jaxpr": like_given(body, given)}


class While(NamedTuple):
    """A ``while`` equation: ``cond`` and ``body`` (closed) on their constants and the carry."""

    cond: Any
    body: Any
    cond_nconsts: int
    body_nconsts: int


def while_loop(eqn) -> While:
    """The parameters of a ``while`` equation."""
    return While(closed(_param(eqn, "cond_jaxpr")), closed(_param(eqn, "body_jaxpr")),
                 _param(eqn, "cond_nconsts"), _param(eqn, "body_nconsts"))


def cond_branches(eqn) -> tuple:
    """The branches (closed) of a ``cond`` equation, by index."""
    return tuple(closed(b) for b in _param(eqn, "branches"))


class Checkpoint(NamedTuple):
    """A ``checkpoint`` (``remat2``) equation: ``body`` (open) and ``jax.checkpoint``'s options."""

    body: Any
    prevent_cse: bool
    policy: Any


def checkpoint(eqn) -> Checkpoint:
    """The parameters of a ``checkpoint`` equation."""
    return Checkpoint(open_jaxpr(_param(eqn, "jaxpr")), _param(eqn, "prevent_cse", default=True),
                      _param(eqn, "policy", default=None))


def called_jaxpr(eqn, default: Any = _MISSING) -> Any:
    """The jaxpr that a call-like equation (``jit``, ``closed_call``, ``checkpoint``,
    ``custom_jvp_call``, ``custom_vjp_call``, ``shard_map``) calls, closed or open as the
    equation has it; ``default`` (if given) for an equation without one."""
    return _param(eqn, "jaxpr", "call_jaxpr", default=default)


class ShardMap(NamedTuple):
    """A ``shard_map`` equation: ``body`` on ``mesh``, manual over ``manual_axes``."""

    body: Any
    mesh: Any
    manual_axes: frozenset
    in_specs: tuple
    out_specs: tuple


def shard_map(eqn) -> ShardMap:
    """The parameters of a ``shard_map`` equation.

    Its manual axes are ``manual_axes`` in jax 0.8, ``newly_manual_axes`` from
    jax 0.9 and ``axis_names`` in some releases; with none of them, every axis
    of the mesh.
    """
    mesh = _param(eqn, "mesh")
    manual = next((eqn.params[k] for k in ("manual_axes", "newly_manual_axes", "axis_names")
                   if eqn.params.get(k) is not None), None)
    return ShardMap(_param(eqn, "jaxpr"), mesh,
                    frozenset(mesh.axis_names if manual is None else manual),
                    tuple(_param(eqn, "in_specs")), tuple(_param(eqn, "out_specs")))


def psum_axes(eqn) -> tuple:
    """The named axes a ``psum`` (``psum_invariant``, ``pmax``, ``pmin``) reduces over."""
    return tuple(_param(eqn, "axes"))


class AllGather(NamedTuple):
    """An ``all_gather`` (``all_gather_invariant``) equation's parameters."""

    axis_name: Any
    dimension: int
    axis_index_groups: Any
    tiled: bool


def all_gather(eqn) -> AllGather:
    """The parameters of an ``all_gather`` equation."""
    return AllGather(_param(eqn, "axis_name"), _param(eqn, "all_gather_dimension"),
                     _param(eqn, "axis_index_groups", default=None), _param(eqn, "tiled"))


def dimension_numbers(eqn) -> Any:
    """The ``dimension_numbers`` of a ``dot_general`` (``((lc, rc), (lb, rb))``) or of a
    ``conv_general_dilated`` (a ``ConvDimensionNumbers``)."""
    return _param(eqn, "dimension_numbers")


def precision(eqn) -> Any:
    """The ``precision`` of a ``dot_general`` or ``conv_general_dilated`` (``None``: default)."""
    return _param(eqn, "precision", default=None)


def preferred_element_type(eqn) -> Any:
    """The ``preferred_element_type`` of a product (``None`` when it has none)."""
    return _param(eqn, "preferred_element_type", default=None)


def new_dtype(eqn) -> Any:
    """The dtype a ``convert_element_type`` converts to."""
    return _param(eqn, "new_dtype")


def integer_exponent(eqn) -> int:
    """The exponent of an ``integer_pow``."""
    return _param(eqn, "y")


def conv_params(eqn) -> dict:
    """The parameters of a ``conv_general_dilated`` equation (strides, padding, dilations,
    dimension numbers, group counts, precision, result type), as ``lax.conv_general_dilated_p``
    binds them."""
    for name in ("window_strides", "lhs_dilation", "batch_group_count"):
        _param(eqn, name)
    return dict(eqn.params)


def dtype_params(eqn, keys: tuple) -> dict:
    """The parameters of ``eqn`` among ``keys`` that are set (not ``None``): dtypes."""
    return {k: eqn.params[k] for k in keys if eqn.params.get(k) is not None}


def some_params(eqn, keys: tuple) -> dict:
    """The parameters of ``eqn`` among ``keys`` that it has."""
    return {k: eqn.params[k] for k in keys if k in eqn.params}


# --- Name stacks ------------------------------------------------------------------------------

# Name-stack entries JAX adds itself (transformations, control flow, checkpoints).
_JAX_SCOPES = re.compile(r"^(jit|pjit|jvp|transpose|vmap|checkpoint|remat|rematted_computation"
                         r"|while|cond|scan|body|branch|closed_call|custom_jvp_call"
                         r"|custom_vjp_call|shard_map|xmap|pmap)$")
_WRAPPED = re.compile(r"^(\w+)\((.*)\)$")


def name_stack(eqn) -> str:
    """``eqn``'s name stack as text: ``jvp(Net)/Dense_0``, ``transpose(jvp(Net))/Dense_0``."""
    return str(eqn.source_info.name_stack)


def traceback(eqn) -> Any:
    """``eqn``'s traceback (for :func:`user_frames`), or ``None``."""
    return eqn.source_info.traceback


def transpose_depth(stack: str) -> int:
    """How many transpositions (``transpose(`` entries) a name stack is under.

    One for the backward pass of ``jax.grad``; a custom_vjp's backward rule is
    traced inside its own transpose as well, so it is under two.
    """
    return stack.count("transpose(")


def is_backward(stack: str) -> bool:
    """Whether a name stack (:func:`name_stack`) is the backward pass: under a transpose."""
    return transpose_depth(stack) > 0


def without_transforms(entry: str) -> str:
    """A name-stack entry without JAX's wrappers: ``transpose(jvp(Net))`` gives ``Net``, and
    an entry JAX adds itself (``jit``, ``scan``, ``checkpoint``...) gives ``""``."""
    while True:
        found = _WRAPPED.match(entry)
        if found is None or not _JAX_SCOPES.match(found.group(1)):
            break
        entry = found.group(2)
    return "" if _JAX_SCOPES.match(entry) else entry


# --- Tracers ----------------------------------------------------------------------------------


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer (``jit``, ``grad``, ``vmap``...), not a concrete value."""
    return isinstance(x, jax.core.Tracer)


# --- Primitive names --------------------------------------------------------------------------
#
# Every set of primitive names jaxmp's rules use. Each name is a primitive of the
# installed JAX, or a legacy name of LEGACY_PRIMITIVES that a supported release binds
# but the newest does not (tests/test_compat.py checks it). Names that no supported
# JAX (0.8.0 to 0.12) binds were removed: "copy_p" and "expand_dims" (never primitives:
# jnp.copy binds "copy", jnp.expand_dims "broadcast_in_dim" or "reshape"), "psum_scatter"
# (jax.lax.psum_scatter binds "reduce_scatter"), "random_gamma_grad", "pcast",
# "mesh_cast", "custom_vjp_call_jaxpr", and the older names of jit ("pjit", jax < 0.7),
# of checkpoint ("checkpoint", "remat": "remat2" since jax 0.3) and "core_call".

#: Names that a supported JAX binds but the newest does not, with when.
LEGACY_PRIMITIVES = {
    "closed_call": "bound by jax 0.8.0 and 0.10.2 (jax.extend.core.closed_call_p); gone from "
                   "jax 0.12.0.1, checked 2026",
}

#: Matrix products and convolutions: autocast runs them in the compute dtype.
LOW_PRECISION = frozenset({"dot_general", "conv_general_dilated"})

#: Numerically sensitive operations: autocast runs them in (at least) float32.
FULL_PRECISION = frozenset({
    # Sums and products whose result outgrows its inputs (the scatter-adds of
    # jax.ops.segment_sum and x.at[i].add among them).
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    "reduce_window_sum", "scatter-add", "scatter-sub",
    # Exponentials, logarithms, powers and roots.
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "sqrt", "rsqrt", "cbrt",
    # Functions that overflow or lose their tails in half precision.
    "sinh", "cosh", "tan", "asin", "acos", "atanh", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
})

#: Operations that autocast runs in the narrowest floating dtype of their operands.
FOLLOW = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "floor", "ceil",
    "round", "is_finite", "nextafter", "rem", "atan2", "sin",
    "cos", "atan", "asinh", "acosh", "select_n", "clamp", "eq", "ne", "lt", "le",
    "gt", "ge", "broadcast_in_dim", "reshape", "transpose", "squeeze",
    "slice", "dynamic_slice", "dynamic_update_slice", "gather",
    "concatenate", "pad", "rev", "reduce_max", "reduce_min", "argmax", "argmin",
    "cummax", "cummin", "reduce_window_max", "reduce_window_min", "stop_gradient",
    "copy", "reduce_precision", "top_k", "split",
})

#: Saturating functions: their result is bounded whatever their operand, so autocast
#: narrows a value kept in float32 to the compute dtype on its way in (tanh(inf) is 1).
BOUNDED = frozenset({"tanh", "logistic"})

#: Operations whose operands are independent: autocast lets each keep its own dtype.
PASSTHROUGH = frozenset({
    "optimization_barrier", "name", "sharding_constraint", "reshard",
    "device_put", "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
    "reduce_scatter", "pbroadcast", "pvary", "sort",
    # What shard_map binds for psum and all_gather under its varying-axes types (check_vma).
    "psum_invariant", "all_gather_invariant", "ragged_all_to_all",
})

#: Collectives that communicate: their results are always saved for the backward pass,
#: never recomputed (a recomputed collective would move its bytes twice).
COMMUNICATING = frozenset({
    "psum", "psum_invariant", "pmax", "pmin", "ppermute", "all_gather", "all_gather_invariant",
    "all_to_all", "ragged_all_to_all", "reduce_scatter",
})

#: Collectives that move a value between devices unchanged (no arithmetic).
MOVING_COLLECTIVES = frozenset({"all_gather", "all_gather_invariant", "ppermute", "all_to_all"})

#: Operations that move a value's elements around on one device, no arithmetic.
MOVEMENT = frozenset({"broadcast_in_dim", "reshape", "squeeze", "transpose",
                      "slice", "dynamic_slice", "rev", "copy", "pvary",
                      "sharding_constraint", "reshard"})

#: Operations that pass a value on unchanged but for its shape (or its rounding).
RESHAPING = frozenset({"broadcast_in_dim", "reshape", "squeeze", "stop_gradient",
                       "copy", "convert_element_type"})

#: Reductions: their results are statistics of a tensor.
REDUCTIONS = frozenset({"reduce_sum", "reduce_prod"})

#: The linear reductions: a recomputed float32 region keeps their values from the forward pass.
LINEAR_REDUCTIONS = frozenset({"reduce_sum"})

#: Elementwise operations that may continue a float32 region's narrowing tail.
TAIL_OPS = frozenset({"mul", "add", "sub", "div", "neg", "max", "min"})

#: The matrix products and convolutions whose FLOPs jaxmp counts.
PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})

#: The primitives autocast can run in float8.
FLOAT8_PRIMITIVES = frozenset({"dot_general", "conv_general_dilated"})

#: Functions with their own derivative rule (which autocast runs as written), by the
#: JAX function that makes them.
CUSTOM_RULES = {"custom_jvp_call": "jax.custom_jvp", "custom_vjp_call": "jax.custom_vjp"}

#: Equations that call one jaxpr on exactly their operands and return its results.
CALLS = frozenset({"jit", "closed_call", "remat2", "custom_jvp_call", "custom_vjp_call"})

#: Loops and branches: equations whose bodies run any number of times, or one of several.
LOOPS_AND_BRANCHES = frozenset({"scan", "while", "cond"})

#: Loops: equations whose bodies run any number of times, their carries fed back.
LOOPS = frozenset({"scan", "while"})

#: The checkpoint primitive (``jax.checkpoint``, ``jax.remat``).
CHECKPOINTS = frozenset({"remat2"})

#: Operations whose derivatives blow up for small inputs (1/x, x**-1.5, ...).
SINGULAR = frozenset({"rsqrt", "sqrt", "div", "log", "pow", "integer_pow", "cbrt", "atanh",
                      "acos", "asin"})

#: Sums: where a half-precision result overflows although each term fits.
SUMS = frozenset({"reduce_sum", "cumsum", "reduce_window_sum", "dot_general",
                  "conv_general_dilated", "add_any"})

#: Operations whose transpose is a sum (a gather's is a scatter-add of the cotangents): autocast
#: runs them on float32 operands, their result narrowed back, so that the backward pass
#: accumulates in float32.
SUMMED_BACKWARD = frozenset({"gather"})

#: Exponentials and powers: where a half-precision result overflows from a moderate input.
EXPS = frozenset({"exp", "exp2", "expm1", "pow", "integer_pow", "square", "sinh", "cosh"})

#: The scatters, each by the ``jax.lax`` function that builds it for any dtype.
SCATTERS: Mapping[str, Callable] = {
    "scatter-add": lax.scatter_add,
    "scatter-sub": lax.scatter_sub,
    "scatter-mul": lax.scatter_mul,
    "scatter-min": lax.scatter_min,
    "scatter-max": lax.scatter_max,
}

#: Higher-order primitives that jaxmp knowingly runs as written, without a word: their
#: jaxprs are a small computation of their own (a scatter's or a reduction's combiner, a
#: selection) or a rule of the function's author (a custom batching or linear-solve rule;
#: jaxmp's own MXFP8 product is a ``custom_vmap_call``), not a body to rewrite. Any other
#: higher-order primitive without a handler is new to jaxmp, and the interpreter says so
#: (see :func:`is_higher_order`).
AS_WRITTEN = frozenset({"scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min",
                        "scatter-max", "reduce", "reduce_window", "select_and_scatter",
                        "custom_vmap_call", "custom_linear_solve", "linear_call", "custom_lin"})

#: The primitives ``shard_map`` binds under its varying-axes types (check_vma), and what
#: they are without them: a one-device evaluation drops the types.
UNVARYING = {"pvary": None, "pbroadcast": None, "psum_invariant": "psum",
             "all_gather_invariant": "all_gather"}

#: Every table above, by name (for the test that checks their names).
TABLES: Mapping[str, Any] = {
    name: table for name, table in dict(globals()).items()
    if name.isupper() and isinstance(table, (frozenset, dict)) and name != "LEGACY_PRIMITIVES"
}

_PRIMITIVE_MODULES = ("jax.lax", "jax.numpy", "jax.nn", "jax.random", "jax.scipy.special",
                      "jax.ad_checkpoint", "jax.experimental.shard_map")


def installed_primitives() -> frozenset:
    """The names of the primitives the installed JAX defines (those of its public modules)."""
    for module in _PRIMITIVE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:  # pragma: no cover (a module a release moved)
            pass
    return frozenset(o.name for o in gc.get_objects() if isinstance(o, _jex_core.Primitive))
