"""Finding the operation that overflows: ``find_nonfinite``.

A float16 step that is skipped again and again says only that *some*
gradient was inf or NaN. :func:`find_nonfinite` says which operation made it,
in which pass, at which line: it evaluates the scaled loss and its gradient,
exactly as :func:`jaxmp.mp_value_and_grad` builds them, one equation at a
time on the shared interpreter (``interpret.py``), and beside every value
keeps a float32 *shadow*: the same equation evaluated with every
half-precision operand held in float32. An equation whose inputs are finite
and whose result is not, while its shadow is finite, is where half precision
overflowed; it is reported only if its non-finite values reach the loss or a
gradient (they travel from value to value wherever the half-precision value
is inf or NaN and its shadow is not, or is finite again but far from its
shadow, and stop where the value agrees with its shadow again: a mask's
``-1e9`` that float16 rounds to ``-inf``, selected away or turned into 0 by a
softmax's ``exp``, is not an overflow; a variance that overflows, making the
normalised values 0, is).

The forward pass is the jaxpr of the scaled loss; the backward pass is the
jaxpr of its ``value_and_grad`` less the operations the forward pass already
has. The backward pass therefore includes the derivative rules' own
arithmetic, such as ``rsqrt(v) / v`` for the derivative of ``rsqrt``, which
runs before any cotangent exists and does not depend on the loss scale.

Every finding names the user's code: the line of the operation (or, inside a
library such as Flax, the library's line and the user's line that calls it).
An operation jaxmp itself added has no line of its own: the cast of an
argument is named by the argument leaf's pytree path (``params['dense']['kernel']``),
and a conversion autocast added at an operation's operand by that operation's
line. jaxmp's own files are never named.

A step whose model uses collectives (a ``BatchNorm`` with ``axis_name``)
needs its axis bound. The mapping the user gives (``mapped=``: the
``jax.vmap``, ``jax.pmap`` or ``jax.shard_map`` around the step) is traced,
not run, and the traced program is evaluated here on one device, one
operation at a time like any other: a ``vmap``'s axis is traced away (its
collectives become operations over the batch dimension), and a ``shard_map``
(``pmap`` is one) is evaluated on the global arrays with one ``vmap`` per
mesh axis in its place (``one_device.py``). ``cond``, ``checkpoint`` and
custom derivative rules run inline, and loops one iteration at a time
(``interpret.eager_handlers``); only a loop too long for that is traced and
compiled, its findings reaching the host through ``jax.debug.callback``.
"""

from __future__ import annotations

import functools
import inspect
import textwrap
import threading
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import kernel
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src import loss_scale
from jaxmp._src import one_device
from jaxmp._src import sharding
from jaxmp._src import source

PyTree = Any

_DTYPE_PARAMS = ("new_dtype", "preferred_element_type", "dtype")
# Derivatives of these blow up for small inputs (1/x, x**-1.5, ...).
_SINGULAR = compat.SINGULAR
_SUMS = compat.SUMS
_EXPS = compat.EXPS
# jaxmp's own package folder, wherever it is installed or checked out (a user's
# project folder that happens to be called "jaxmp" is not library code).
_MAX_PER_PASS = 12
_MAX_UNDERFLOWS = 4
# Float32 values this large are sentinels (a mask's -1e30), meant to become -inf.
_SENTINEL = 1e30
# An underflow is reported when at least this fraction of a result flushes to zero.
_UNDERFLOW_FRACTION = 0.01
_SCATTERS = compat.SCATTERS


class Finding(NamedTuple):
    """One operation whose half-precision result went wrong where float32 did not.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        kind: ``"overflow"`` (inf or NaN in half precision, finite in float32),
            ``"underflow"`` (zero in half precision, not in float32) or
            ``"float32 too"`` (non-finite in float32 as well: not a precision
            problem, listed for context).
        primitive: the JAX primitive, e.g. ``"exp"`` or ``"div"``.
        where: ``file:line (function)`` of the operation in the Python code
            (the innermost frame outside JAX and jaxmp). For a cast that
            jaxmp itself applies to an argument (the input cast, or autocast
            narrowing a parameter for a matrix product), the pytree path of
            that argument's leaf instead, e.g. ``"params['dense']['kernel']"``;
            for a conversion autocast adds at an operand, the line of the
            operation it feeds (the matrix product).
        called_from: when ``where`` is inside a library (Haiku, Flax, ...),
            the first frame of the calling code outside libraries, else ``""``.
        dtype: the dtype of the result, e.g. ``"float16"``.
        count: how many elements of the result went wrong (inf or NaN for
            ``"overflow"`` and ``"float32 too"``, flushed to zero for
            ``"underflow"``), of ``size``.
        size: the number of elements of the result.
        half_max: the largest magnitude in the result as the mixed-precision
            program computed it, in ``dtype`` (``inf`` once it overflowed).
        float32_max: the largest finite magnitude of the same result in the
            float32 shadow (the program evaluated with float32 in place of
            every half-precision value): what the result should have held.
        float32_min: the smallest non-zero magnitude of that float32 result
            (what would flush to zero below the half dtype's smallest
            subnormal). In the backward pass all three include the loss scale.
        scale_dependent: for the backward pass, whether the value is
            proportional to the loss scale (an operation on cotangents) or
            not (a derivative rule's own arithmetic).
        hint: what to do about it.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> loss_fn = lambda w: jnp.log(jnp.sum(jnp.exp(w)))
        >>> find = jaxmp.debug.find_nonfinite(loss_fn, jnp.float16, autocast=False)
        >>> finding = find(jnp.full((2,), 12.0)).findings[0]
        >>> finding.phase, finding.kind, finding.primitive, finding.float32_max > 65504
        ('forward', 'overflow', 'exp', True)
    """

    phase: str
    kind: str
    primitive: str
    where: str
    called_from: str
    dtype: str
    count: int
    size: int
    half_max: float
    float32_max: float
    float32_min: float
    scale_dependent: bool
    hint: str


class NonfiniteReport(NamedTuple):
    """What :func:`find_nonfinite` found. ``print`` it for a table.

    ``bool(report)`` is true when some operation produced inf or NaN in half
    precision while float32 did not (an ``"overflow"`` finding); underflows
    are listed but do not make the report true.

    Attributes:
        findings: the :class:`Finding` entries, forward pass first, each pass
            in program order (at most a dozen per pass and kind).
        compute_dtype: the half-precision dtype that was checked.
        loss_scale: the loss scale used.
        loss: the loss in the mixed-precision run (float32, unscaled); with
            ``axis_name``, its mean over the axis, as the step returns it.
        loss_float32: the loss of the float32 shadow (likewise).

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> report = jaxmp.debug.find_nonfinite(lambda w: jnp.mean(w * w))(jnp.ones(3))
        >>> bool(report), len(report.findings), report.compute_dtype, report.loss
        (False, 0, 'bfloat16', 1.0)
    """

    findings: tuple[Finding, ...]
    compute_dtype: str
    loss_scale: float
    loss: float
    loss_float32: float

    def __bool__(self) -> bool:
        return any(f.kind == "overflow" for f in self.findings)

    def __len__(self) -> int:
        return len(self.findings)

    @property
    def forward(self) -> tuple[Finding, ...]:
        """The findings of the forward pass."""
        return tuple(f for f in self.findings if f.phase == "forward")

    @property
    def backward(self) -> tuple[Finding, ...]:
        """The findings of the backward pass."""
        return tuple(f for f in self.findings if f.phase == "backward")

    def __str__(self) -> str:
        head = (f"find_nonfinite: {self.compute_dtype}, loss scale {self.loss_scale:g}; "
                f"loss {self.loss:.6g} ({self.compute_dtype}) vs {self.loss_float32:.6g} "
                "(float32 shadow)")
        if not self.findings:
            return head + "\nNo operation overflows or underflows where float32 does not."
        n = sum(f.kind == "overflow" for f in self.findings)
        summary = (f"{n} operation(s) overflow in {self.compute_dtype} where float32 does not"
                   if n else f"No operation overflows in {self.compute_dtype} where float32 "
                   "does not, but some need attention")
        lines = [head, summary + " (first ones per pass, in program order):", ""]
        half = self.compute_dtype
        rows = [("pass", "op", "kind", "wrong/size", f"{half} max|x|", "float32 max|x|",
                 "float32 min|x|", "where")]
        for f in self.findings:
            where = f.where + (f"  <- {f.called_from}" if f.called_from else "")
            rows.append((f.phase, f.primitive, f.kind, f"{f.count}/{f.size}",
                         f"{f.half_max:.3g}", f"{f.float32_max:.3g}", f"{f.float32_min:.3g}",
                         where))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        info = jnp.finfo(half)
        legend = (
            "Each row is one operation's result. wrong/size: its elements that are inf or NaN "
            f"(overflow) or flushed to zero (underflow) in {half}, of all its elements. "
            f"{half} max|x|: the largest magnitude of the result as computed in {half} (inf once "
            "it overflowed). float32 max|x| and float32 min|x|: the largest and the smallest "
            "non-zero magnitude of the same result in the float32 shadow (the step evaluated "
            f"with float32 in place of every {half} value): what {half} had to hold; "
            f"{half} holds {float(info.smallest_subnormal):.3g} to {float(info.max):.6g}. "
            "Backward values include the loss scale. where: the line of your code (after "
            "'<-', the line of your code that calls the library the operation is in), or the "
            "pytree path of an argument leaf that is cast to " + half + ".")
        lines += ["", *textwrap.wrap(legend, 100), ""]
        seen = set()
        for f in self.findings:
            if f.hint not in seen:
                seen.add(f.hint)
                lines.append(f"hint ({f.phase} {f.primitive}, {f.where}): {f.hint}")
        return "\n".join(lines)


def _widen(x: Any) -> Any:
    if x is None or not casting.is_float_dtype(getattr(x, "dtype", None)):
        return x
    wide = casting.wide_dtype(x.dtype)
    return x if x.dtype == wide else jax.lax.convert_element_type(x, wide)


def _shadow_of(eqn, halves: list, shadows: list, outs: list) -> list:
    """The float32 shadow of ``eqn``'s results ``outs``: ``eqn`` on ``shadows``, its half-precision
    dtype parameters widened (or, where that cannot run, its results widened)."""
    name = eqn.primitive.name
    params = compat.params_for_bind(eqn)
    widened = False
    for key, dtype in compat.dtype_params(eqn, _DTYPE_PARAMS).items():
        if casting.is_narrow_dtype(dtype):
            params[key] = casting.wide_dtype(dtype)
            widened = True
    if not widened and all(h is s for h, s in zip(halves, shadows)):
        return outs  # nothing half-precision goes in: the shadow is the value itself
    if name == "reduce_precision":
        return list(shadows)
    if name == "bitcast_convert_type":  # bits: the same dtypes, or nothing to compare
        return _as_written(eqn, halves, shadows, outs)
    if name in _SCATTERS:
        # Their reduction is a jaxpr typed for the half dtype: let lax build a float32 one.
        keep = ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode")
        return [_SCATTERS[name](*shadows, **{k: params[k] for k in keep if k in params})]
    if compat.is_higher_order(eqn, combiners=True, functions=True):
        return [_widen(o) for o in outs]  # a typed sub-computation: the shadow follows
    try:
        shadow_outs = interpret.bind(eqn, shadows, params)
    except Exception:  # pylint: disable=broad-except  (a primitive that insists on its dtypes)
        return _as_written(eqn, halves, shadows, outs)
    expected = [casting.wide_dtype(o.dtype) if casting.is_float_dtype(o.dtype) else o.dtype
                for o in outs]
    if [s.dtype for s in shadow_outs] != expected:
        return _as_written(eqn, halves, shadows, outs)
    return shadow_outs


# Per equation signature (primitive, parameters, operand types): one compiled program that
# computes the value and its shadow together, where eager evaluation would compile two.
_BOTH: dict[Any, Callable] = {}
_BOTH_LIMIT = 4096


def _suspicious(h, s) -> Any:
    """Traced: whether the result ``h`` (shadow ``s``) needs the host's look (``_stats``): a
    non-finite element, or one flushed to zero in half precision where the shadow is not."""
    bad = jnp.any(~jnp.isfinite(h))
    if casting.is_narrow_dtype(h.dtype):
        s = s.astype(jnp.float32)
        tiny = float(jnp.finfo(h.dtype).smallest_subnormal)
        bad = bad | jnp.any((h == 0) & (s != 0) & (jnp.abs(s) < tiny))
    return bad


# One small program per result type (rather than in each equation's program: XLA:CPU takes
# twice as long to compile those with it, and there are far fewer result types).
_SUSPICIOUS = jax.jit(_suspicious)


def _both_compiled(eqn, halves: list, shadows: list):
    """``(outs, shadow_outs, suspicious)`` of a first-order ``eqn`` on concrete operands, from
    one compiled program per signature; ``None`` where that does not apply (traced operands,
    parameters that cannot be a cache key). ``suspicious`` says, per result, whether it may
    need the host's look (``_suspicious``; False for a result that is not a float array):
    most results do not, and are then not copied to the host at all."""
    operands = (*halves, *shadows)
    if eqn.effects or any(not isinstance(x, jax.Array) or compat.is_tracer(x)
                          for x in operands):
        return None
    same = tuple(h is s for h, s in zip(halves, shadows))
    try:
        key = (compat.params_key(eqn), same,
               tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in operands))
        run = _BOTH.get(key)
    except TypeError:  # a parameter that is not hashable
        return None
    if run is None:
        if len(_BOTH) >= _BOTH_LIMIT:
            _BOTH.clear()
        identical: list = []  # per result, whether its shadow is the value itself (traced once)

        def both(halves, shadows):
            shadows = [h if is_same else s for h, s, is_same in zip(halves, shadows, same)]
            outs = interpret.bind(eqn, halves)
            shadow_outs = _shadow_of(eqn, halves, shadows, outs)
            identical[:] = [s is o for s, o in zip(shadow_outs, outs)]
            return outs, [s for s, i in zip(shadow_outs, identical) if not i]

        run = _BOTH[key] = (jax.jit(both), identical)
    compiled, identical = run
    try:
        outs, rest = compiled(halves, shadows)
    except Exception:  # pylint: disable=broad-except  (evaluated eagerly instead)
        _BOTH.pop(key, None)
        return None
    rest = iter(rest)
    # Where nothing half-precision went in, the shadow is the value itself (the same object,
    # as eager evaluation gives it: later operations see that and skip their shadow).
    outs = list(outs)
    shadow_outs = [o if i else next(rest) for o, i in zip(outs, identical)]
    if any(compat.is_tracer(x) for x in (*outs, *shadow_outs)):
        # Concrete operands (a loop constant), evaluated inside a loop that is compiled
        # whole: the results are the loop's tracers, checked by callback (suspicious None).
        return outs, shadow_outs, None
    suspicious = [bool(_SUSPICIOUS(o, s)) if casting.is_float_array(o) and o.size else False
                  for o, s in zip(outs, shadow_outs)]
    return outs, shadow_outs, suspicious


def _as_written(eqn, halves, shadows, outs) -> list:
    """The shadow of an equation that runs only in its own dtypes (``bitcast_convert_type``
    to a narrow float): on the shadow's inputs where they have the dtypes of the values (the
    bits of a float8 block scale that the shadow computed itself), else the value, widened."""
    if all(getattr(h, "dtype", None) == getattr(s, "dtype", None)
           for h, s in zip(halves, shadows)):
        try:
            return [_widen(o) for o in interpret.bind(eqn, shadows)]
        except Exception:  # pylint: disable=broad-except
            pass
    return [_widen(o) for o in outs]


class _Site(NamedTuple):
    """The static description of one equation that went wrong."""

    order: int
    primitive: str
    where: str
    called_from: str
    dtype: str
    size: int
    transpose: bool
    # For an operation jaxmp added: "argument" (the cast of an argument leaf,
    # ``where`` is its path) or "conversion" (a conversion at an operand of
    # the user's operation at ``where``); "" for the user's own operations.
    added: str = ""
    feeds: str = ""  # "conversion": the primitive of the operation it feeds
    producer: str = ""  # "conversion": where the converted value was computed


class _Locator:
    """Names an equation in the user's terms: the line of the user's code that made it, or,
    for an operation jaxmp added, the argument leaf it casts or the user's operation it feeds.

    The evaluator (:class:`_Shadow`) tells it what it evaluates: each jaxpr
    (:meth:`add_jaxpr`), the equations it is inside (``enclosing``, innermost
    last: the equation being evaluated) and which variables hold the user's
    arguments (``input_paths``, passed into called jaxprs by :meth:`pass_paths`).
    """

    def __init__(self):
        self.enclosing: list[Any] = []  # the equations being evaluated, innermost last
        # The pytree path (in the user's arguments) of each input variable; the
        # producer and the consumers of every variable of the jaxprs evaluated, and the
        # variables that leave a jaxpr (see _Flow.carry).
        self.input_paths: dict[Any, str] = {}
        self.uses = jaxprs.Uses()
        self.seen_jaxprs: dict[int, Any] = {}

    def add_jaxpr(self, jaxpr) -> None:
        """Indexes the variables of ``jaxpr``, the first time it is evaluated."""
        if id(jaxpr) not in self.seen_jaxprs:
            self.seen_jaxprs[id(jaxpr)] = jaxpr  # kept alive: ids stay unique
            self.uses.add(jaxpr)

    def pass_paths(self, outer_vars, inner_vars) -> None:
        """A called jaxpr's inputs ``inner_vars`` hold the arguments its ``outer_vars`` hold."""
        for outer_v, inner_v in zip(outer_vars, inner_vars):
            if compat.is_var(outer_v) and outer_v in self.input_paths:
                self.input_paths[inner_v] = self.input_paths[outer_v]

    def where(self, eqn) -> tuple:
        """``(where, called_from)`` of ``eqn`` in the user's terms, and, for an operation
        jaxmp added, ``added``, ``feeds`` and ``producer`` (the trailing fields of _Site)."""
        enclosing = self.enclosing[:-1]
        if not source.made_by_jaxmp(eqn, enclosing):
            return source.locate(eqn, enclosing)
        operand = eqn.invars[0] if eqn.invars else None
        if compat.is_var(operand) and operand in self.input_paths:
            return self.input_paths[operand], "", "argument"
        # A conversion jaxmp added (autocast narrowing a value for a product, or
        # its transpose in the backward pass): the user's operation it feeds,
        # else the one that computed the value.
        consumer = self._nearest_user_eqn(eqn, downstream=True)
        producer = self._nearest_user_eqn(eqn, downstream=False)
        producer_where = ""
        if producer is not None:
            where, called_from = source.locate(producer, enclosing)
            producer_where = f"{producer.primitive.name} at {called_from or where}"
        if consumer is not None:
            where, called_from = source.locate(consumer, enclosing)
            return where, called_from, "conversion", consumer.primitive.name, producer_where
        if producer is not None:
            where, called_from = source.locate(producer, enclosing)
            return where, called_from, "conversion", "", producer_where
        return source.locate(eqn, enclosing)  # no better: the user's call (never a jaxmp frame)

    def _leaving_calls(self, outvars) -> list:
        """``outvars`` and, for each that a call being evaluated returns (a float32 region of
        autocast, which may end in the narrowing of its result), the call's own result, outward:
        the code that uses a value can be outside the call that made it."""
        found = list(outvars)
        calls = self.enclosing[:-1]
        for v in outvars:
            for call in reversed(calls):
                inner = jaxprs.called_jaxpr(call)
                if inner is None or not any(o is v for o in inner.outvars):
                    break
                v = call.outvars[[o is v for o in inner.outvars].index(True)]
                found.append(v)
        return found

    def _nearest_user_eqn(self, eqn, downstream: bool, depth: int = 4):
        """The nearest equation after (or before) ``eqn`` that is the user's, not jaxmp's.

        Looks inside the calls on the way (autocast runs each float32 region in
        its own ``checkpoint``).
        """
        frontier, seen = [eqn], {id(eqn)}
        for _ in range(depth):
            nearby = []
            for e in frontier:
                if downstream:
                    for v in self._leaving_calls(e.outvars):
                        for c in self.uses.users.get(v, ()):
                            inner = jaxprs.called_jaxpr(c)
                            if inner is not None:
                                nearby += [d for i, u in enumerate(c.invars) if u is v
                                           for d in self.uses.users.get(inner.invars[i], ())]
                            nearby.append(c)
                else:
                    for v in e.invars:
                        p = self.uses.producer.get(v) if compat.is_var(v) else None
                        if p is None:
                            continue
                        inner = jaxprs.called_jaxpr(p)
                        if inner is not None:
                            inner_v = inner.outvars[p.outvars.index(v)]
                            if compat.is_var(inner_v) and inner_v in self.uses.producer:
                                nearby.append(self.uses.producer[inner_v])
                        nearby.append(p)
            frontier = [e for e in nearby if id(e) not in seen]
            seen.update(id(e) for e in frontier)
            for e in frontier:
                if not source.made_by_jaxmp(e, self.enclosing[:-1]):
                    return e
        return None


class _Flow:
    """Where non-finite values go: the overflows whose values reach the loss or a gradient.

    An overflow is reported only where its non-finite values reach an end of the program
    (the loss, a gradient): each value whose half-precision array is inf or NaN where its
    float32 shadow is finite, or (made from such values) finite but far from the shadow,
    carries the sites its non-finite elements came from, from the operands of the operation
    that made it; a value that agrees with its shadow again (exp(-inf) = 0, a select that
    drops them, tanh(inf) = 1) carries nothing on.
    """

    def __init__(self, uses: jaxprs.Uses):
        self.uses = uses  # the jaxprs evaluated (_Locator's index): what uses each variable
        # Where non-finite values go (see carry): the sites each value's non-finite elements
        # come from, by the value's half-precision array (kept alive: ids stay unique); the
        # sites whose non-finite values reach an end of the program; the variables of the
        # program evaluated (its ends).
        self.carried: dict[int, tuple[Any, frozenset]] = {}
        self.reached: set[int] = set()
        self.ends: set[Any] = set()
        self.gathering: list[set] = []  # per higher-order equation being evaluated

    def enter(self) -> None:
        """A higher-order equation starts: gathers the sites carried inside it."""
        self.gathering.append(set())

    def leave(self) -> set:
        """The innermost higher-order equation ends: the sites carried inside it."""
        return self.gathering.pop()

    def carry_out(self, eqn, halves, inside: set, outs) -> None:
        """The results ``outs`` (pairs) of the higher-order ``eqn``, on the arrays ``halves``,
        carry what they carried in and what was carried ``inside`` it."""
        # Its results are new arrays (a loop's stacked outputs, a shard_map's merged
        # blocks): they carry whatever non-finite values went in or were made inside.
        sites = self.carried_by(halves) | inside
        for v, out in zip(eqn.outvars, outs):
            if sites and out is not None and self.diverges(*out, carrying=True):
                self.carry(out[0], sites, v)

    @staticmethod
    def diverges(h, s, carrying: bool = False) -> bool:
        """Whether the half-precision ``h`` is inf or NaN somewhere its shadow ``s`` is finite,
        or, for a value made from values that carry non-finite elements (``carrying``), differs
        from its shadow by more than a tenth of the shadow's largest magnitude: a variance that
        overflowed makes ``x / sqrt(var)`` finite but 0 (carried on), where ``exp(-inf)`` is
        the 0 float32 has too and ``tanh(inf)`` its 1 (carried no further)."""
        if not casting.is_float_array(h) or h.size == 0 or compat.is_tracer(h) or (
                compat.is_tracer(s)):
            return False
        h, s = _f32(h), _f32(s)
        finite = np.isfinite(s)
        if bool((~np.isfinite(h) & finite).any()):
            return True
        if not carrying or not finite.any():
            return False
        both = finite & np.isfinite(h)
        error = float(np.abs(h[both] - s[both]).max()) if both.any() else 0.0
        return error > 0.1 * float(np.abs(s[finite]).max())

    def carried_by(self, halves) -> set:
        """The sites whose non-finite values any of ``halves`` (arrays) carries."""
        sites: set = set()
        for h in halves:
            entry = self.carried.get(id(h))
            if entry is not None and entry[0] is h:
                sites |= entry[1]
        return sites

    def carry(self, h, sites, var) -> None:
        """``h`` (the value of ``var``) carries the non-finite values of ``sites``; where
        ``var`` is an end of the program (its result, or a value nothing uses: a gradient),
        they reach it."""
        if not sites:
            return
        sites = frozenset(sites)
        self.carried[id(h)] = (h, sites)
        for inside in self.gathering:
            inside |= sites
        if var in self.ends or (var not in self.uses.users and var not in self.uses.outputs):
            self.reached |= sites


class _Shadow(interpret.Interpreter):
    """Evaluates a jaxpr on pairs ``(value, float32 shadow)`` and records what goes wrong.

    Evaluation is eager (``interpret.eager_handlers``; a ``shard_map`` on one
    device), and records are made directly; only inside a loop too long to run
    one iteration at a time do they go through ``jax.debug.callback``. Its
    ``locator`` names each site in the user's terms, and its ``flow`` follows
    where non-finite values go (which overflows reach the loss or a gradient).
    """

    def __init__(self):
        super().__init__({**interpret.eager_handlers(), "shard_map": _shard_map})
        self.sites: list[_Site] = []
        self.site_of: dict[tuple[int, int], int] = {}
        self.records: dict[tuple[int, str], dict] = {}
        self.lock = threading.Lock()  # a traced loop's callbacks record while evaluation goes on
        self.transposing = 0
        self.locator = _Locator()
        self.flow = _Flow(self.locator.uses)

    def run(self, closed, flat_args: Sequence[Any], paths: Sequence[str]) -> list:
        """Evaluates ``closed`` on ``flat_args`` (arrays) paired with their float32 shadows."""
        self.locator.input_paths.update(zip(closed.jaxpr.invars, paths))
        self.flow.ends.update(v for v in closed.jaxpr.outvars if compat.is_var(v))
        return self.eval_closed(closed, [(x, _widen(x)) for x in flat_args])

    def eval_jaxpr(self, jaxpr, consts, args):
        self.locator.add_jaxpr(jaxpr)
        return super().eval_jaxpr(jaxpr, consts, args)

    # Values are pairs.
    def literal(self, lit):
        x = jnp.asarray(lit.val, lit.aval.dtype)
        return (x, _widen(x))

    def const(self, array):
        return (array, _widen(array))

    def to_original(self, value, aval):
        return value[0]

    def from_original(self, array, like):
        return None if array is None else (array, _widen(array))

    def eval_eqn(self, eqn, invals):
        inner = jaxprs.called_jaxpr(eqn)
        if inner is not None:
            self.locator.pass_paths(eqn.invars, inner.invars)
        transpose = compat.is_backward(compat.name_stack(eqn))
        higher_order = eqn.primitive.name in self.handlers
        self.transposing += transpose
        self.locator.enclosing.append(eqn)
        if higher_order:
            self.flow.enter()
        try:
            outs = super().eval_eqn(eqn, invals)
        finally:
            self.transposing -= transpose
            self.locator.enclosing.pop()
            inside = self.flow.leave() if higher_order else set()
        if higher_order:
            self.flow.carry_out(eqn, [h for h, _ in invals], inside, outs)
        return outs

    def first_order(self, eqn, invals):
        halves = [h for h, _ in invals]
        shadows = [s for _, s in invals]
        both = _both_compiled(eqn, halves, shadows)
        suspicious = None
        if both is None:
            outs = interpret.bind(eqn, halves)
            shadow_outs = _shadow_of(eqn, halves, shadows, outs)
        else:
            outs, shadow_outs, suspicious = both
        self._check(eqn, invals, outs, shadow_outs, suspicious)
        return list(zip(outs, shadow_outs))

    def _site(self, eqn, index: int, out) -> int:
        key = (id(eqn), index)
        if key not in self.site_of:
            where, called_from, *more = self.locator.where(eqn)
            self.site_of[key] = len(self.sites)
            self.sites.append(_Site(
                len(self.sites), eqn.primitive.name, where, called_from,
                np.dtype(out.dtype).name, int(np.prod(out.shape)), self.transposing > 0,
                **dict(zip(("added", "feeds", "producer"), more))))
        return self.site_of[key]

    def _check(self, eqn, invals, outs, shadow_outs, suspicious=None):
        """Checks each float result of ``eqn``; ``suspicious`` (per result, from the device)
        skips the host's look at results with nothing wrong that carry nothing."""
        float_in = [(h, s) for h, s in invals if casting.is_float_array(h) and h.size]
        in_h = [h for h, _ in float_in]
        in_s = [s for _, s in float_in]
        came_in = None
        for i, (h, s) in enumerate(zip(outs, shadow_outs)):
            if not casting.is_float_array(h) or h.size == 0:
                continue
            site = self._site(eqn, i, h)
            if suspicious is not None and not suspicious[i]:
                if came_in is None:
                    came_in = self.flow.carried_by(in_h)
                if not came_in:
                    continue
            if any(compat.is_tracer(x) for x in (*in_h, *in_s, h, s)):
                # Inside a loop too long to run one iteration at a time: check on the
                # host at run time, where values are not followed (what overflows there is
                # reported whether or not it reaches the loss).
                jax.debug.callback(functools.partial(self._host_check, site, True),
                                   in_h, in_s, h, s)
                continue
            h_host, s_host = jax.device_get((h, s))
            overflow = self._host_check(site, False, in_h, in_s, h_host, s_host)
            if came_in is None:
                came_in = self.flow.carried_by(in_h)
            if overflow or self.flow.diverges(h_host, s_host, carrying=bool(came_in)):
                self.flow.carry(h, came_in | {site} if overflow else came_in, eqn.outvars[i])

    def _host_check(self, site, unfollowed, in_h, in_s, h, s) -> bool:
        """Records what went wrong in one result; whether it overflowed where float32 did not."""
        stats = _stats(in_h, in_s, *jax.device_get((h, s)))  # inputs: only if needed
        if not stats[0]:
            return False
        overflow = self._record(site, *stats[1:]) == "overflow"
        if overflow and unfollowed:
            with self.lock:
                self.flow.reached.add(site)
        return overflow

    def _record(self, site, created, shadow_finite, nonfinite, underflow, half_max, f32_max,
                f32_min, in_max) -> str:
        """Records one result that went wrong (the first time per site and kind); its kind,
        or ``""`` when it is not a finding."""
        created, shadow_finite = bool(created), bool(shadow_finite)
        if created:
            if shadow_finite and f32_max >= _SENTINEL and not np.isnan(half_max):
                return ""  # e.g. jnp.where(mask, logits, -1e30): -inf in half precision, by design
            kind, count = ("overflow" if shadow_finite else "float32 too"), int(nonfinite)
        else:
            kind, count = "underflow", int(underflow)
            if count < _UNDERFLOW_FRACTION * self.sites[site].size:
                return ""  # a few tiny values flushed to zero: rounding, not a problem
        key = (site, kind)
        with self.lock:
            if key not in self.records:  # the first time (the first scan iteration...) is kept
                self.records[key] = dict(count=count, half_max=float(half_max),
                                         float32_max=float(f32_max), float32_min=float(f32_min),
                                         input_max=float(in_max))
        return kind


def _shard_map(shadow: _Shadow, eqn, invals: list) -> list:
    """A ``shard_map`` (or ``pmap``): its body on the global arrays, one operation at a time."""
    batched = one_device.as_batched(eqn)
    shadow.locator.pass_paths(eqn.invars, batched.jaxpr.jaxpr.invars)
    blocks = [tuple(batched.split(i, x) for x in pair) for i, pair in enumerate(invals)]
    outs = shadow.eval_closed(batched.jaxpr, blocks)
    return [tuple(batched.merge(i, y) for y in pair) for i, pair in enumerate(outs)]


def _f32(x) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _stats(in_h: list, in_s: list, h: np.ndarray, s: np.ndarray) -> tuple:
    """What went wrong in one result ``h`` (shadow ``s``) of an operation on ``in_h`` (``in_s``).

    Computed on the host with NumPy. Returns ``(interesting, created,
    shadow_finite, nonfinite, underflow, half_max, float32_max, float32_min,
    input_max)``.
    """
    half_dtype = np.asarray(h).dtype
    h, s = _f32(h), _f32(s)
    nonfinite = int((~np.isfinite(h)).sum())
    underflow = 0
    if casting.is_narrow_dtype(half_dtype):
        tiny = float(jnp.finfo(half_dtype).smallest_subnormal)
        underflow = int(((h == 0) & (s != 0) & (np.abs(s) < tiny)).sum())
    if not nonfinite and not underflow:  # most results: the inputs need no look
        return (False,) * 9
    shadow_finite = bool(np.isfinite(s).all())
    in_finite, in_underflow, in_max = True, False, 0.0
    for hi, si in zip(in_h, in_s):
        hi, si = _f32(hi), _f32(si)
        in_finite = in_finite and bool(np.isfinite(hi).all())
        in_underflow = in_underflow or bool(((hi == 0) & (si != 0)).any())
        finite = np.abs(si[np.isfinite(si)])
        in_max = max(in_max, float(finite.max()) if finite.size else 0.0)
    created = in_finite and nonfinite > 0
    interesting = created or (in_finite and not in_underflow and underflow > 0)
    if not interesting:
        return (False,) * 9
    abs_h, abs_s = np.abs(h), np.abs(s)
    finite_s = abs_s[np.isfinite(abs_s)]
    nonzero_s = abs_s[abs_s > 0]
    return (interesting, created, shadow_finite, nonfinite, underflow,
            float(np.where(np.isnan(abs_h), np.inf, abs_h).max()),
            float(finite_s.max()) if finite_s.size else 0.0,
            float(nonzero_s.min()) if nonzero_s.size else 0.0, in_max)


class _Case(NamedTuple):
    """What a hint is written from: one finding and the diagnosis's settings."""

    site: _Site
    phase: str
    kind: str
    stats: dict
    scale: float
    half: np.dtype
    autocast: bool

    @property
    def half_max(self) -> float:
        return float(jnp.finfo(self.half).max)

    @property
    def float32(self) -> str:
        """The general fix: this code in float32."""
        if self.autocast:
            return ("run this code in float32 (jaxmp.force_full_precision around it, or "
                    "autocast's full_precision rules), or compute_dtype=jnp.bfloat16")
        return ("run this code in float32: mp_value_and_grad(..., autocast=True), "
                "jaxmp.force_full_precision around it, or compute_dtype=jnp.bfloat16")

    @property
    def unscaled(self) -> float:
        """The largest magnitude at a loss scale of 1 (operations on cotangents are linear)."""
        return max(self.stats["float32_max"], self.stats["input_max"]) / self.scale


def _argument_hint(c: _Case) -> str:
    half, site = c.half, c.site
    tiny = float(jnp.finfo(half).smallest_subnormal)
    how = (f"when autocast narrows it to {half.name} for a matrix product" if c.autocast
           else f"when the inputs are cast to {half.name}")
    if c.kind == "underflow":
        what = (f"values of {site.where} below {half.name}'s smallest ({tiny:.3g}) become "
                f"zero {how}")
    else:
        what = f"values of {site.where} beyond {half.name}'s {c.half_max:g} become inf {how}"
    if c.autocast:
        fix = ("rescale it (its initialisation, or a factor applied after the product), "
               "keep its product in float32 with jaxmp.force_full_precision, or "
               "compute_dtype=jnp.bfloat16 (float32's range)")
    else:
        fix = ("autocast=True (the default), which narrows an argument only where it "
               "enters a matrix product; no_cast_argnums= for an argument that is not "
               "differentiated; rescale it; or compute_dtype=jnp.bfloat16")
    return f"{what}: {fix}"


def _conversion_hint(c: _Case) -> str:
    site, half = c.site, c.half
    value = f"a float32 value (from {site.producer})" if site.producer else "a float32 value"
    into = f" for this {site.feeds}" if site.feeds else ""
    if c.kind == "underflow":
        what = f"{value} below {half.name}'s range becomes zero when autocast narrows it{into}"
    else:
        what = (f"{value} does not fit in {half.name} ({c.half_max:g}) when autocast narrows "
                f"it{into}")
    return (f"{what}: keep this operation in float32 (jaxmp.force_full_precision around "
            "it, or autocast's rules), scale the value down before it, or "
            "compute_dtype=jnp.bfloat16")


def _forward(c: _Case) -> bool:
    return c.phase == "forward"


# The hints of find_nonfinite's findings: the first row whose test holds writes the hint.
_HINTS: tuple[tuple[Callable[[_Case], bool], Callable[[_Case], str]], ...] = (
    (lambda c: c.kind == "float32 too",
     lambda c: ("float32 overflows here as well (e.g. log(0), x/0, a diverging model): "
                "not a precision problem; fix the computation or the inputs")),
    (lambda c: c.site.added == "argument", _argument_hint),
    (lambda c: c.site.added == "conversion" and _forward(c), _conversion_hint),
    (lambda c: c.kind == "underflow" and c.phase == "backward",
     lambda c: (f"gradients below {c.half.name}'s smallest value flush to zero: a larger "
                "loss scale (the dynamic scaler grows it after growth_interval finite "
                "steps), or float32 for this code")),
    (lambda c: c.kind == "underflow",
     lambda c: f"values below {c.half.name}'s range flush to zero: {c.float32}"),
    (lambda c: _forward(c) and c.site.primitive == "convert_element_type",
     lambda c: (f"a value computed in float32 (a sum, a variance, a mean...) does not fit "
                f"in {c.half.name} ({c.half_max:g}) when cast back: {c.float32}")),
    (lambda c: _forward(c) and c.site.primitive in _SUMS,
     lambda c: f"a sum or product that outgrows {c.half.name} ({c.half_max:g}): {c.float32}"),
    (lambda c: _forward(c) and c.site.primitive in _EXPS,
     lambda c: f"an exponential or power that outgrows {c.half.name}: {c.float32}"),
    (_forward,
     lambda c: f"the result outgrows {c.half.name} ({c.half_max:g}): {c.float32}"),
    (lambda c: not c.site.transpose,
     lambda c: ("computed by " + (
         "the derivative rule of a 1/x-like function (rsqrt, sqrt, division, log, pow "
         "of a small value; e.g. rsqrt(var)/var in a normalisation)"
         if c.site.primitive in _SINGULAR else "a derivative rule's own arithmetic")
         + ", before any cotangent: it does not depend on the loss scale, so no scale "
         f"fixes it. Fix: {c.float32}")),
    (lambda c: c.unscaled < c.half_max,
     lambda c: (f"a cotangent scaled by {c.scale:g} outgrows {c.half.name}; at scale 1 it "
                f"would be {c.unscaled:.3g}: a smaller loss scale avoids it (the dynamic "
                "scaler backs off by itself), or keep this code in float32")),
    (lambda c: True,
     lambda c: (f"even unscaled the cotangent reaches {c.unscaled:.3g} > {c.half_max:g}: no "
                f"loss scale fixes it. Fix: {c.float32}")),
)


def _hint(site: _Site, phase: str, kind: str, stats: dict, scale: float, half: np.dtype,
          autocast: bool) -> str:
    """The hint of one finding: the first row of ``_HINTS`` that applies."""
    case = _Case(site, phase, kind, stats, scale, half, autocast)
    return next(text(case) for applies, text in _HINTS if applies(case))


def _parameter_names(fn: Callable) -> list[str]:
    """The names of ``fn``'s positional parameters, as far as its signature tells."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    names = []
    for p in parameters:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names


def _leaf_paths(arrays: PyTree, names: Sequence[str]) -> list[str]:
    """The user-facing path of every leaf of ``arrays`` (``(args, kwargs)``), in flattening order.

    A path reads as the argument's name in ``loss_fn``'s signature (``names``)
    followed by ``jax.tree_util.keystr`` of the path inside it:
    ``params['dense']['kernel']``.
    """
    paths = []
    for path, _ in jax.tree_util.tree_flatten_with_path(arrays)[0]:
        group, key, rest = path[0], path[1], tuple(path[2:])
        if group.idx == 0:
            name = names[key.idx] if key.idx < len(names) else f"args[{key.idx}]"
        else:
            name = str(key.key)
        paths.append(name + jax.tree_util.keystr(rest))
    return paths


def _collect(shadow: _Shadow, phase_of: Callable, scale: float, half: np.dtype,
             skip: set, autocast: bool) -> list[Finding]:
    findings = []
    for (site_id, kind), stats in sorted(shadow.records.items()):
        site = shadow.sites[site_id]
        key = (site.primitive, site.where, site.dtype, site.size, kind)
        if key in skip or (kind == "overflow" and site_id not in shadow.flow.reached):
            continue  # its non-finite values never reach the loss or a gradient
        phase = phase_of(site)
        findings.append(Finding(
            phase, kind, site.primitive, site.where, site.called_from, site.dtype,
            stats["count"], site.size, stats["half_max"], stats["float32_max"],
            stats["float32_min"], site.transpose,
            _hint(site, phase, kind, stats, scale, half, autocast)))
    kept, per = [], {}
    for f in findings:
        per[(f.phase, f.kind)] = per.get((f.phase, f.kind), 0) + 1
        if per[(f.phase, f.kind)] <= (_MAX_UNDERFLOWS if f.kind == "underflow" else _MAX_PER_PASS):
            kept.append(f)
    return kept


def find_nonfinite(
    loss_fn: Callable,
    compute_dtype: Any = jnp.bfloat16,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    autocast: bool = True,
    no_cast_argnums: int | Sequence[int] = (),
    *,
    axis_name: Any = None,
    reduce_dtype: Any = None,
    mapped: Callable[[Callable], Callable] | None = None,
    matmul_dtype: Any = None,
    float8_scaling: str = "tensor",
    float8_rules: Any = None,
) -> Callable[..., NonfiniteReport]:
    """Finds the operations that overflow in half precision, forward and backward.

    The returned function takes the arguments of ``loss_fn`` and an optional
    keyword ``scaler_state``, and builds the scaled loss and its gradient
    exactly as :func:`jaxmp.mp_value_and_grad` with the same options would
    (same casts, same scale). It then evaluates them one operation at a time
    beside a float32 shadow of the same computation and reports, for the
    forward and the backward pass, the operations whose inputs were finite
    and whose half-precision result is inf or NaN while the float32 shadow is
    finite, and those where at least 1% of the result flushed to zero while
    float32 has non-zero values; each with the line of your code it comes
    from (or the pytree path of the argument leaf whose cast went wrong), the
    magnitudes of the result in half precision and in float32 (see
    :class:`jaxmp.debug.Finding`), and a hint. ``print`` the report for a table
    whose columns are explained under it.

    It is a debugging tool: it runs eagerly, operation by operation, each
    operation compiled on its first use (a ResNet18-sized model takes tens of
    seconds, several hundred of its training steps: see
    ``benchmarks/README.md``), so give it one batch. It does not change anything:
    the training step is untouched. Control flow (``cond``, ``while``) follows
    the half-precision values. Float32 values beyond 1e30 are taken for
    sentinels (a mask's ``-1e30``) whose overflow to ``-inf`` is intended.

    An overflow is reported only where it matters: an operation whose
    half-precision inf or NaN, carried from value to value for as long as the
    value disagrees with its float32 shadow (inf or NaN where the shadow is
    finite, or off by more than a tenth of its magnitude), reaches the loss or
    a gradient. A
    causal mask written ``jnp.where(causal, scores, -1e9)`` becomes ``-inf``
    in float16 where float32 keeps ``-1e9``, and the softmax makes it 0 in
    both: no finding. Inside a loop too long to run one iteration at a time
    (compiled whole), values are not followed and every overflow is reported.

    A model with collectives (a ``BatchNorm`` that averages over
    ``axis_name``, as in data-parallel training) runs only where its axis is
    bound. Pass ``axis_name`` as to the step and, as ``mapped``, what maps your
    step over it: ``jax.vmap``, ``jax.pmap`` or ``jax.shard_map``, as in your
    training step. The mapping is traced, not run, and the traced step is
    evaluated on one device like any other: a ``vmap``'s collectives become
    operations over the batch dimension, and a ``pmap`` or ``shard_map`` body
    runs on the global arrays (its devices' blocks stacked along one ``vmap``
    per mesh axis), so the diagnosis needs the memory of the whole batch on
    one device. Without ``mapped``, the whole batch is one member of the
    axis: right for a batch captured in a closure, or a loss written for the
    batch of one device (whose collectives then see the whole batch). The
    returned function itself must be called outside ``jit``, ``vmap``,
    ``pmap`` and ``shard_map``.

    Args:
        loss_fn: the loss function, as given to :func:`jaxmp.mp_value_and_grad`.
        compute_dtype: ``jnp.bfloat16`` (default, as everywhere in jaxmp) or
            ``jnp.float16``: the dtype the step trains in (a float16 step that
            gets stuck is checked with ``jnp.float16``).
        argnums: the differentiated positional arguments.
        has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
        autocast: check ``jaxmp.autocast(loss_fn)`` (the default, as in
            :func:`jaxmp.mp_value_and_grad`); ``False`` casts the inputs instead.
        no_cast_argnums: arguments passed uncast, as in
            :func:`jaxmp.mp_value_and_grad`.
        axis_name: the data-parallel axis name(s), as given to
            :func:`jaxmp.mp_value_and_grad`: the loss reported is the mean over
            them. Without ``mapped``, the whole batch is one member of it.
        reduce_dtype: as given to :func:`jaxmp.mp_value_and_grad` (the dtype
            of the gradient sums over devices): the step checked is the same.
        mapped: a function that maps a step over ``axis_name`` as your
            training step is mapped, e.g.
            ``lambda f: jax.vmap(f, in_axes=(None, 0), axis_name="batch")``,
            ``lambda f: jax.pmap(f, axis_name="batch", in_axes=(None, 0))`` or
            ``lambda f: jax.shard_map(f, mesh=mesh, in_specs=(P(), P("batch")), out_specs=P())``.
            The ``f`` it is given takes the arguments of ``loss_fn`` and
            returns the scaled loss averaged over ``axis_name`` (a float32
            scalar, the same on every member): ``out_specs=P()`` under
            ``shard_map``.
        matmul_dtype: with ``autocast=True``, a float8 dtype for the matrix
            products, as in :func:`jaxmp.mp_value_and_grad`. The float32
            shadow of a float8 product is the exact float32 product, so a
            product whose float8 result goes wrong is reported at its line.
        float8_scaling: the float8 recipe, as in :func:`jaxmp.mp_value_and_grad`
            (``"tensor"``, ``"mxfp8"`` or ``"nvfp4"``).
        float8_rules: as in :func:`jaxmp.mp_value_and_grad`.

    Returns:
        A function ``(*args, scaler_state=None, **kwargs) -> NonfiniteReport``.
        Without ``scaler_state``, the scale is that of a fresh
        ``jaxmp.init_scaler()`` for float16 and 1 for bfloat16. Pass the
        scaler state of a stuck run to check the scale it is stuck at.

    Raises:
        ValueError: when the loss uses a collective over an axis that is
            not bound (give ``axis_name``).
        TypeError: when the returned function is called inside ``jit``,
            ``vmap``, ``pmap`` or ``shard_map`` (pass ``mapped`` instead).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     return jnp.mean(jnp.exp(x @ w))
        >>> w, x = jnp.full((4,), 3.0), jnp.ones((2, 4))
        >>> # float16, inputs cast (autocast=False): exp(12) > 65504
        >>> report = jaxmp.debug.find_nonfinite(loss_fn, jnp.float16, autocast=False)(w, x)
        >>> bool(report), report.findings[0].phase, report.findings[0].primitive
        (True, 'forward', 'exp')

        A step mapped over a batch axis, with a collective in the loss:

        >>> def centred_loss(w, x):  # x: one example; the mean is over the batch axis
        ...     h = x @ w
        ...     return jnp.mean((h - jax.lax.pmean(h, "batch")) ** 2)
        >>> find = jaxmp.debug.find_nonfinite(
        ...     centred_loss, jnp.float16, axis_name="batch",
        ...     mapped=lambda f: jax.vmap(f, in_axes=(None, 0), axis_name="batch"))
        >>> report = find(jnp.full((4, 2), 100.0), jnp.arange(12.0).reshape(3, 4) * 50)
        >>> report.findings[0].kind, report.findings[0].primitive, report.loss_float32 > 65504
        ('overflow', 'dot_general', True)

        A loss for one device's examples under ``jax.pmap`` (over the devices
        there are), and the same loss on a batch captured in a closure, with
        no ``mapped``: the whole batch is then one member of the axis.

        >>> def device_loss(w, x):  # x: this device's examples
        ...     h = x @ w
        ...     return jnp.mean((h - jax.lax.pmean(jnp.mean(h, 0), "batch")) ** 2)
        >>> n = jax.local_device_count()
        >>> x = jnp.arange(12.0 * n).reshape(n, 3, 4) * 50
        >>> find = jaxmp.debug.find_nonfinite(
        ...     device_loss, jnp.float16, axis_name="batch",
        ...     mapped=lambda f: jax.pmap(f, axis_name="batch", in_axes=(None, 0)))
        >>> find(jnp.full((4, 2), 100.0), x).findings[0].primitive
        'dot_general'
        >>> batch = x.reshape(-1, 4)
        >>> find = jaxmp.debug.find_nonfinite(lambda w: device_loss(w, batch), jnp.float16,
        ...                             axis_name="batch")
        >>> find(jnp.full((4, 2), 100.0)).findings[0].primitive
        'dot_general'
    """
    # The very step mp_value_and_grad runs: same validation, casts and scaled loss.
    step = kernel.Step.create(
        loss_fn, api="jaxmp.debug.find_nonfinite", argnums=argnums, no_cast_argnums=no_cast_argnums,
        has_aux=has_aux, compute_dtype=compute_dtype, use_mixed_precision=True,
        axis_name=axis_name, autocast=autocast, reduce_dtype=reduce_dtype,
        matmul_dtype=matmul_dtype, float8_scaling=float8_scaling, float8_rules=float8_rules,
        # Not the training step's trace-time check of the half-precision share
        # (MostlyFloat32Warning): a diagnosis is not a training step.
        check_share=False)
    half = casting.canonical_float_dtype(compute_dtype, allowed=casting.COMPUTE_DTYPES,
                                         what="compute_dtype")
    if not casting.is_narrow_dtype(half):
        raise ValueError("find_nonfinite compares half precision with float32: compute_dtype "
                         f"must be float16 or bfloat16, got {half.name}.")
    if mapped is not None and not callable(mapped):
        raise TypeError("mapped must be a function that maps a step over the data axes (e.g. "
                        f"lambda f: jax.vmap(f, ..., axis_name=...)), got {type(mapped).__name__}.")
    if axis_name is not None and mapped is None:
        mapped = _one_member(axis_name)
    names = _parameter_names(loss_fn)

    def report_fn(*args, scaler_state=None, **kwargs) -> NonfiniteReport:
        if any(compat.is_tracer(x) for x in jax.tree_util.tree_leaves((args, kwargs))):
            raise TypeError(
                "The function returned by jaxmp.debug.find_nonfinite returns a report (Python "
                "data) and must be called outside jit, vmap, pmap and shard_map. To diagnose a "
                "step that runs under one of them, pass find_nonfinite(..., axis_name=..., "
                "mapped=lambda f: jax.vmap(f, ..., axis_name=...)) (or the jax.pmap or "
                "jax.shard_map of your step) and call it on the whole batch.")
        if scaler_state is None:
            state = loss_scale.init_scaler() if half == jnp.float16 else loss_scale.noop_scaler()
        else:
            state = step.check_state(scaler_state)
        scale = 1.0 if state.mode == "none" else float(state.scale)

        def traced(backward: bool):
            """The step's closed jaxpr and the arrays it takes (``(args, kwargs)``'s array
            leaves): every array is an input of the traced step (not a constant), so that
            the casts of the batch are evaluated and named too."""

            def on_member(*args, **kwargs):  # inside the mapping, if any
                diff, rebuild, devices = step.differentiable(args, state)

                def scaled_loss(d):
                    return step.scaled_loss(state, rebuild(d), kwargs)[0]

                loss = jax.value_and_grad(scaled_loss)(diff)[0] if backward else scaled_loss(diff)
                axes = devices.axes or sharding.manual_axes()
                return jax.lax.pmean(loss, axes) if axes else loss

            run = on_member if mapped is None else mapped(on_member)
            whole, arrays = jaxprs.over_arrays(run, args, kwargs)
            return _trace(whole, arrays), arrays

        # The mapping (if any) is traced, not run: each pass is evaluated here,
        # one operation at a time (a shard_map or pmap on the global arrays).
        fwd, bwd = _Shadow(), _Shadow()
        forward_step, arrays = traced(backward=False)
        flat = jax.tree_util.tree_leaves(arrays)
        paths = _leaf_paths(arrays, names)
        (loss,) = fwd.run(forward_step, flat, paths)
        bwd.run(traced(backward=True)[0], flat, paths)
        jax.effects_barrier()  # every record from a callback is in before the report is read
        # One loss per member under a mapping (equal when averaged over axis_name).
        loss, loss_float32 = (float(np.asarray(x, np.float32).mean()) / scale for x in loss)
        forward = _collect(fwd, lambda site: "forward", scale, half, set(), autocast)
        skip = {(f.primitive, f.where, f.dtype, f.size, f.kind) for f in forward}
        backward = _collect(bwd, lambda site: "backward", scale, half, skip, autocast)
        return NonfiniteReport(tuple(forward + backward), half.name, scale, loss, loss_float32)

    return report_fn


def _one_member(axis_name) -> Callable[[Callable], Callable]:
    """The mapping of a step given the whole batch: one member of each of ``axis_name``'s axes.

    A collective over the axes (a ``BatchNorm``'s mean) then sees the whole
    batch, as the collective of a data-parallel step sees every device's.
    """
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)

    def mapped(f):
        def on_whole_batch(*args, **kwargs):
            g = functools.partial(f, **kwargs)  # keyword arguments would be mapped over axis 0
            for name in reversed(names):
                g = jax.vmap(g, in_axes=None, axis_size=1, axis_name=name)
            return g(*args)

        return on_whole_batch

    return mapped


def _trace(fn: Callable, *args):
    """``jax.make_jaxpr(fn)(*args)``, with advice when the loss uses an axis that is not bound."""
    try:
        return jax.make_jaxpr(fn)(*args)
    except NameError as e:
        if "axis name" not in str(e):
            raise
        raise ValueError(
            f"The loss uses a collective over an axis that is not bound here ({e}). Give "
            "find_nonfinite the axis_name you give mp_value_and_grad: "
            "find_nonfinite(loss_fn, axis_name=...) treats the whole batch as one member of "
            "it; add mapped=lambda f: jax.vmap(f, in_axes=..., axis_name=...) (or the jax.pmap "
            "or jax.shard_map of your step) where the loss is written for one member.") from e
