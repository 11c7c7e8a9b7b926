"""Automatic mixed precision per operation: ``autocast``.

``autocast(fn)`` traces ``fn`` to a jaxpr and evaluates it again, one equation
at a time, choosing the precision of every operation from plain sets of
primitive names:

* ``low_precision`` (matrix products, convolutions): operands are cast to the
  compute dtype, and so is the result;
* ``full_precision`` (sums, products, cumulative sums, exp/log and friends,
  powers, square roots, ...): floating operands are cast up to float32 and the
  result is float32;
* ``bounded`` (tanh, logistic): like ``follow``, but a float32 operand is
  narrowed to the compute dtype first (the result is bounded anyway);
* ``follow`` (elementwise arithmetic, comparisons, reshapes, slices, max/min
  reductions, ...): operands are brought to one common dtype, the narrowest of
  them, so a float32 bias, scale or positional embedding added to a
  half-precision activation is cast down instead of pulling the activation
  back to float32;
* ``passthrough`` (collectives, sharding annotations, sorts, barriers): every
  operand keeps its own dtype;
* anything else runs exactly as written, on operands cast back to the dtypes
  the original program gave them.

A value computed by a ``full_precision`` operation (or anything computed from
one, and every loop carry) is *kept* in float32: an operation that mixes it
with a half-precision value runs in float32 rather than narrowing it, because
such values (a large sum before a division, a variance, the normaliser of a
softmax) are exactly the ones that overflow or lose their digits in half
precision. They are narrowed at the operands of a matrix product, at a
``bounded`` function, by an explicit cast in ``fn``, at the outputs of
``fn`` (which keep the dtypes ``fn`` gives them), and once normalised
(divided by a statistic, or multiplied by the reciprocal of one: a softmax,
a layer norm) unless something downstream needs their float32 digits
(``_narrow_safe``). With ``recompute_float32`` each connected float32 region
is recomputed in the backward pass instead of saved, with the half-precision
operations that narrow its result (``_eval_with_regions``).

Integer, boolean and PRNG-key values are never touched. Nested ``jit``,
``scan``, ``while_loop``, ``cond``, ``checkpoint``, ``custom_jvp`` and
``custom_vjp`` are handled by the shared interpreter (``interpret.py``); this
module supplies the per-equation rules. Whether a value is kept wide is part
of its pytree structure (a ``_Wide`` node), so it leaves loop bodies and
branches as static structure, not through side effects.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import interpret
from jaxmp._src import shortfall

# The primitive-name tables live in compat.py, with every other contact with JAX.
LOW_PRECISION = compat.LOW_PRECISION  # run in the compute dtype
FULL_PRECISION = compat.FULL_PRECISION  # run in (at least) float32
FOLLOW = compat.FOLLOW  # run in the narrowest floating dtype of their operands
BOUNDED = compat.BOUNDED  # saturating: a kept operand is narrowed first
PASSTHROUGH = compat.PASSTHROUGH  # each operand keeps its own dtype
_COMMUNICATING = compat.COMMUNICATING  # saved for the backward pass, never recomputed

_RULE_FIELDS = ("low_precision", "full_precision", "follow", "passthrough", "bounded")
_DEFAULT_SETS = {"low_precision": LOW_PRECISION, "full_precision": FULL_PRECISION,
                 "follow": FOLLOW, "passthrough": PASSTHROUGH, "bounded": BOUNDED}
_SET_NAMES = {"low_precision": "LOW_PRECISION", "full_precision": "FULL_PRECISION",
              "follow": "FOLLOW", "passthrough": "PASSTHROUGH", "bounded": "BOUNDED"}
# Reductions: their results are statistics of a tensor (see ``_Autocast``).
_REDUCTIONS = compat.REDUCTIONS


def _describe(field: str, names: frozenset) -> str:
    """A short expression for a rule set, relative to its default."""
    default = _DEFAULT_SETS[field]
    added, removed = sorted(names - default), sorted(default - names)
    if len(added) + len(removed) > 6:
        return f"<{len(names)} name{'' if len(names) == 1 else 's'}>"
    text = _SET_NAMES[field]
    if added:
        text += " | {" + ", ".join(repr(n) for n in added) + "}"
    if removed:
        text += " - {" + ", ".join(repr(n) for n in removed) + "}"
    return text


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """Which primitives :func:`jaxmp.autocast` runs in which precision.

    Each field is a set of primitive names (``jax.make_jaxpr`` shows them), one
    kind of rule: ``low_precision`` (run in the compute dtype),
    ``full_precision`` (run in float32), ``bounded`` (saturating functions
    such as ``tanh``: like ``follow``, but an operand kept in float32 is
    narrowed to the compute dtype first), ``follow`` (run in the narrowest
    dtype of their operands), ``passthrough`` (each operand keeps its dtype).
    A primitive in none of them runs as written. The defaults are
    ``jaxmp.autocast.LOW_PRECISION``, ``FULL_PRECISION``, ``BOUNDED``,
    ``FOLLOW`` and ``PASSTHROUGH``, which share no name. A primitive belongs
    to one kind (:meth:`kind`): a name added to a field takes it from the
    default set it was in, when that field is left as it is, and a name in two
    fields that were both given raises a ``ValueError``. Its ``repr`` names
    only what differs from the defaults.

    Examples:
        >>> import jaxmp
        >>> jaxmp.AutocastRules()
        AutocastRules()
        >>> rules = jaxmp.AutocastRules(full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"})
        >>> rules
        AutocastRules(full_precision=FULL_PRECISION | {'tanh'})
        >>> "tanh" in rules.full_precision
        True
    """

    low_precision: frozenset = LOW_PRECISION
    full_precision: frozenset = FULL_PRECISION
    follow: frozenset = FOLLOW
    passthrough: frozenset = PASSTHROUGH
    bounded: frozenset = BOUNDED

    def __post_init__(self):
        for field in _RULE_FIELDS:
            names = getattr(self, field)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"AutocastRules.{field} must be a collection of primitive names (strings), "
                    f"e.g. {{'exp', 'log'}}; got {names!r}.")
            object.__setattr__(self, field, frozenset(names))
        object.__setattr__(self, "_kinds", self._kind_table())

    def _kind_table(self) -> dict[str, str]:
        """Primitive name -> the field that holds it. A name in a field the user set and in a
        default set left as it is belongs to the user's; in two fields the user set, it is
        an error (which should win is not for jaxmp to guess)."""
        table: dict[str, str] = {}
        for field in _RULE_FIELDS:
            for name in getattr(self, field):
                other = table.get(name)
                if other is None:
                    table[name] = field
                    continue
                mine, theirs = (getattr(self, f) != _DEFAULT_SETS[f] for f in (field, other))
                if mine and theirs:
                    raise ValueError(
                        f"AutocastRules: {name!r} is in both {other} and {field}; a primitive "
                        f"runs one way. Remove it from one of them, e.g. "
                        f"{field}=jaxmp.autocast.{_SET_NAMES[field]} | {{...}} without "
                        f"{name!r}, or {other}=... - {{{name!r}}}.")
                if mine:
                    table[name] = field
        return table

    def kind(self, primitive: str) -> str | None:
        """The field that holds ``primitive`` (``"low_precision"``, ...), or ``None``.

        Examples:
            >>> import jaxmp
            >>> jaxmp.AutocastRules().kind("dot_general")
            'low_precision'
            >>> jaxmp.AutocastRules(follow=jaxmp.autocast.FOLLOW | {"tanh"}).kind("tanh")
            'follow'
        """
        return self._kinds.get(primitive)

    def __repr__(self) -> str:
        changed = [f"{f}={_describe(f, getattr(self, f))}" for f in _RULE_FIELDS
                   if getattr(self, f) != _DEFAULT_SETS[f]]
        return f"AutocastRules({', '.join(changed)})"


# What autocast knows of a floating value, beyond its dtype:
_PLAIN = ""  # nothing: narrowed by ``follow`` operations like any value
_KEPT = "kept"  # comes from a float32 operation: kept there by ``follow`` operations
_STAT = "stat"  # kept, and a statistic: computed from reductions and scalars only
_INV = "inv"  # kept, and the reciprocal of a statistic (``rsqrt(var + eps)``, ``1 / sum``)


@jax.tree_util.register_pytree_node_class
class _Wide:
    """A floating value *kept* wide: not narrowed by ``follow`` operations.

    The interpreter's values are arrays (plain) or ``_Wide`` nodes, whose
    static ``kind`` says why they are kept; being a pytree node, the mark
    travels through loops, branches and custom derivative rules as static
    structure.
    """

    __slots__ = ("x", "kind")

    def __init__(self, x, kind=_KEPT):
        self.x = x
        self.kind = kind

    def tree_flatten(self):
        return (self.x,), self.kind

    @classmethod
    def tree_unflatten(cls, kind, children):
        return cls(*children, kind)


def _unwrap(value) -> tuple[Any, str]:
    return (value.x, value.kind) if isinstance(value, _Wide) else (value, _PLAIN)


def _wrap(x, kind: str):
    return _Wide(x, kind) if kind else x



def _cast(x: Any, dtype: Any) -> Any:
    if x.dtype == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def _as_original(x: Any, aval: Any) -> Any:
    return _cast(x, aval.dtype) if casting.is_float_dtype(aval.dtype) else x


def _narrow_safe(closed, rules: "AutocastRules") -> frozenset:
    """The variables of ``closed`` (sub-jaxprs included) whose value must stay wide.

    A normalised value (see ``_Autocast``) is narrowed to the compute dtype
    only where nothing downstream needs its float32 digits: a value is in
    the returned set when it reaches, through ``follow`` and ``passthrough``
    operations and casts, a ``full_precision`` operation (``log`` of a
    probability, a sum), a loop or a branch, or an output of the function.
    """
    needed: set = set()

    def walk(jaxpr, out_needed):
        local = {v for v, n in zip(jaxpr.outvars, out_needed)
                 if n and not compat.is_literal(v)}
        for eqn in reversed(jaxpr.eqns):
            name = eqn.primitive.name
            outs_needed = [v in local for v in eqn.outvars]
            inner = compat.called_jaxpr(eqn, None)
            if name in compat.LOOPS_AND_BRANCHES:
                for sub, _ in compat.sub_jaxprs(eqn):
                    walk(sub, [True] * len(sub.outvars))
                ins = [True] * len(eqn.invars)
            elif inner is not None and hasattr(getattr(inner, "jaxpr", inner), "eqns"):
                inner = getattr(inner, "jaxpr", inner)
                ins = walk(inner, outs_needed)
            elif rules.kind(name) == "full_precision":
                ins = [True] * len(eqn.invars)
            elif rules.kind(name) in ("low_precision", "bounded"):
                ins = [False] * len(eqn.invars)  # they narrow their operands anyway
            elif (rules.kind(name) in ("follow", "passthrough")
                  or name == "convert_element_type"):
                ins = [any(outs_needed)] * len(eqn.invars)
            else:
                ins = [True] * len(eqn.invars)  # run as written, in float32
            for v, n in zip(eqn.invars, ins):
                if n and not compat.is_literal(v):
                    local.add(v)
        needed.update(local)
        return [v in local for v in jaxpr.invars]

    walk(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    return frozenset(needed)


def _uses(jaxpr) -> tuple[dict, set]:
    """``(users, outputs)`` of ``jaxpr``: the equations that read each variable, in order, and
    the variables it returns."""
    users: dict = {}
    for e in jaxpr.eqns:
        for v in e.invars:
            if not compat.is_literal(v):
                users.setdefault(v, []).append(e)
    return users, {v for v in jaxpr.outvars if not compat.is_literal(v)}


# Collectives that move a value between devices unchanged (no arithmetic).
_MOVING = compat.MOVING_COLLECTIVES
# Operations that move a value's elements around on one device, no arithmetic.
_MOVEMENT = compat.MOVEMENT


def _narrow_early(closed, rules: "AutocastRules") -> frozenset:
    """The results of moving collectives that can move in the compute dtype.

    An ``all_gather``, ``ppermute`` or ``all_to_all`` whose result reaches,
    through data movement only (``_MOVEMENT``), nothing but ``low_precision``
    operations (the matrix products, which narrow their operands to the
    compute dtype anyway) can move its operand already narrowed: the same
    values, half the bytes. This is what FSDP needs: a float32 parameter
    shard that the loss all-gathers for a product is gathered in the compute
    dtype, as the cast path gathers it, and the gradient's reduce-scatter
    (the gather's transpose) then runs in the compute dtype too. A result
    that reaches anything else (a float32 region, an output, a loop) is
    moved as it is. Returned as the collectives' output variables (sub-jaxprs
    included).
    """
    found: set = set()

    def walk(jaxpr):
        users, outputs = _uses(jaxpr)
        memo: dict = {}

        def only_narrowed(v) -> bool:
            if v not in memo:
                uses = users.get(v, [])
                memo[v] = bool(uses) and v not in outputs and all(
                    rules.kind(e.primitive.name) == "low_precision"
                    or (e.primitive.name in _MOVEMENT and all(map(only_narrowed, e.outvars)))
                    for e in uses)
            return memo[v]

        for e in jaxpr.eqns:
            if e.primitive.name in _MOVING and all(map(only_narrowed, e.outvars)):
                found.update(e.outvars)
            for inner, _ in census.sub_jaxprs(e):
                walk(inner)

    walk(closed.jaxpr)
    return frozenset(found)


# Operations that pass a value on unchanged but for its shape (or its rounding).
_RESHAPING = compat.RESHAPING


def _shifted_exps(closed, keep: frozenset) -> frozenset:
    """The ``exp`` equations of ``closed`` (sub-jaxprs included) that can run in half precision.

    That is ``exp(a - m)`` where ``m`` is at least the maximum of ``a`` along
    some axes (``reduce_max`` of ``a``, broadcast, reshaped, behind a
    ``stop_gradient``, a ``max`` with anything, or chosen by a ``select`` on
    its own finiteness against a literal, as ``logsumexp`` does): the
    exponentials of a softmax, a log-softmax or a ``logsumexp``, which lie
    in ``[0, 1]``. Of those, the ones returned are a softmax's whose
    probabilities go on in half precision: an ``exp`` each of whose users is a sum
    (run in float32) or has results that ``keep`` (from ``_narrow_safe``)
    does not hold, and at least one is not a sum. So the exponentials of a
    log-softmax or ``logsumexp`` (only summed, on their way to a ``log``)
    stay float32: their derivative, ``p - onehot`` for a cross-entropy,
    cancels where a probability approaches 1, and half-precision
    probabilities would double its rounding error. So do those of a
    probability that reaches a ``log`` or an output of the function (their
    tiny values matter there). Returned as the equations' output variables.
    """
    found: set = set()

    def walk(jaxpr):
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        users, outputs = _uses(jaxpr)

        def strip(v):
            while not compat.is_literal(v) and v in producer:
                e = producer[v]
                if e.primitive.name not in _RESHAPING:
                    break
                v = e.invars[0]
            return v

        def at_least_max_of(m, a, depth=0) -> bool:
            m = strip(m)
            e = None if compat.is_literal(m) else producer.get(m)
            if e is None or depth > 8:
                return False
            name = e.primitive.name
            if name == "reduce_max":
                return strip(e.invars[0]) == a
            if name == "max":
                return any(at_least_max_of(x, a, depth + 1) for x in e.invars)
            if name == "select_n":
                pred, *cases = e.invars
                p = None if compat.is_literal(pred) else producer.get(strip(pred))
                literal = [compat.is_literal(strip(c)) for c in cases]
                return (p is not None and p.primitive.name == "is_finite"
                        and at_least_max_of(p.invars[0], a, depth + 1)
                        and any(literal)
                        and all(at_least_max_of(c, a, depth + 1)
                                for c, lit in zip(cases, literal) if not lit))
            return False

        for e in jaxpr.eqns:
            for inner, _ in census.sub_jaxprs(e):
                walk(inner)
            if e.primitive.name != "exp" or compat.is_literal(e.invars[0]):
                continue
            out = e.outvars[0]
            others = [u for u in users.get(out, ()) if u.primitive.name not in _REDUCTIONS]
            if (out in outputs or not others
                    or any(o in keep for u in others for o in u.outvars)):
                continue
            d = producer.get(e.invars[0])
            if d is not None and d.primitive.name == "sub":
                a, m = d.invars
                if not compat.is_literal(a) and at_least_max_of(m, strip(a)):
                    found.add(e.outvars[0])

    walk(closed.jaxpr)
    return frozenset(found)


class _Autocast(interpret.Interpreter):
    """The interpreter of one traced ``autocast`` call: compute dtype, rules, narrowing.

    Every floating value is plain or kept wide (``_Wide``), and a kept value
    may be known to be a *statistic* (computed from reductions and scalars:
    a mean, a variance, the sum of a softmax) or the reciprocal of one. A
    *normalised* value, ``a / statistic`` or ``a * reciprocal`` with ``a``
    not itself a statistic, is computed in float32 and then narrowed to the
    compute dtype, unless ``keep`` (from ``_narrow_safe``) says that
    something downstream needs it wide: layer-norm and softmax outputs go on
    in half precision like the hand-written model's.
    """

    def __init__(self, compute_dtype: np.dtype, rules: AutocastRules, keep: frozenset = frozenset(),
                 matmul_dtype: np.dtype | None = None,
                 float8_rules: float8.Float8Rules = float8.Float8Rules(),
                 shifted: frozenset = frozenset(), narrow_early: frozenset = frozenset(),
                 float8_recipe: float8.Recipe | None = None):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.rules = rules
        self.keep = keep
        self.shifted = shifted  # exp equations to run in compute_dtype (``_shifted_exps``)
        self.matmul_dtype = matmul_dtype  # a float8 dtype, or None: products in compute_dtype
        self.float8_rules = float8_rules
        self.float8_recipe = float8_recipe  # a row of float8.RECIPES (float8_scaling)
        self.narrow_early = narrow_early  # collectives that move in compute_dtype (``_narrow_early``)
        self._scopes: list[str] = []  # name stacks of the equations being evaluated
        self._casts: dict[tuple[int, Any], tuple[Any, Any]] = {}

    def eval_eqn(self, eqn, invals):
        self._scopes.append(compat.name_stack(eqn))
        try:
            return super().eval_eqn(eqn, invals)
        finally:
            self._scopes.pop()

    def eval_jaxpr(self, jaxpr, consts, args):
        # One cache of conversions per jaxpr evaluation: everything it holds
        # was made in the trace that evaluation runs in (a loop body or a
        # custom rule, traced later, gets its own).
        outer, self._casts = self._casts, {}
        try:
            return super().eval_jaxpr(jaxpr, consts, args)
        finally:
            self._casts = outer

    def cast(self, x, dtype):
        """``x`` in ``dtype``; one conversion per value and dtype in one jaxpr evaluation."""
        if x.dtype == dtype:
            return x
        key = (id(x), np.dtype(dtype))
        hit = self._casts.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        out = lax.convert_element_type(x, dtype)
        self._casts[key] = (x, out)
        return out

    def loop_carry(self, values, avals):
        # Loop carries keep their dtypes, and are kept there inside the body.
        out = []
        for v, a in zip(values, avals):
            x = _as_original(_unwrap(v)[0], a)
            out.append(_Wide(x) if casting.is_float_dtype(a.dtype) else x)
        return out

    def unify_branches(self, branch_shapes, avals):
        # Where branches disagree on a dtype, use the original program's.
        targets = []
        for i, aval in enumerate(avals):
            outs = [_unwrap(shapes[i]) for shapes in branch_shapes]
            dtypes = {x.dtype for x, _ in outs}
            dtype = dtypes.pop() if len(dtypes) == 1 else aval.dtype
            kinds = {k for _, k in outs}
            kind = kinds.pop() if len(kinds) == 1 else _KEPT
            targets.append((dtype, kind if casting.is_float_dtype(dtype) else _PLAIN))

        def fix(outs):
            return [_wrap(_cast(_unwrap(v)[0], dtype), kind) for v, (dtype, kind) in zip(outs, targets)]

        return fix

    def to_original(self, value, aval):
        return _as_original(_unwrap(value)[0], aval)

    def from_original(self, array, like):
        like_x, kind = _unwrap(like)
        if array is None or not casting.is_float_dtype(like_x.dtype):
            return array
        return _wrap(_cast(array, like_x.dtype), kind)

    def first_order(self, eqn, invals):
        unwrapped = [_unwrap(v) for v in invals]
        outs, kinds = self._rule(eqn, [x for x, _ in unwrapped], [k for _, k in unwrapped])
        return [_wrap(x, k) for x, k in zip(outs, kinds)]

    def _rule(self, eqn, invals, kinds):
        """The outputs of one first-order equation, and the kind of each (see ``_Wide``)."""
        name = eqn.primitive.name
        rules = self.rules
        in_avals = [v.aval for v in eqn.invars]
        nout = len(eqn.outvars)
        floats = [i for i, a in enumerate(in_avals)
                  if casting.is_float_dtype(getattr(a, "dtype", None))]

        if not floats:
            # Integers, booleans, keys: exactly as written.
            return interpret.bind(eqn, invals), [_PLAIN] * nout

        if casting.in_full_precision_scope("/".join(self._scopes)):
            # Inside jaxmp.force_full_precision: in float32 (products included), but for the
            # casts it writes (its return_dtype).
            cast = list(invals)
            for i in floats:
                cast[i] = self.cast(cast[i], casting.wide_dtype(in_avals[i].dtype))
            outs = interpret.bind(eqn, cast)
            return outs, [_KEPT if casting.is_float_dtype(o.dtype) and o.dtype.itemsize >= 4
                          else _PLAIN for o in outs]

        if name == "convert_element_type":
            (x,), (k,) = invals, kinds
            new = compat.new_dtype(eqn)
            if in_avals[0].dtype == new:
                # A weak-type or sharding adjustment: the value keeps its precision.
                return [x], [k]
            if not casting.is_float_dtype(new):
                return interpret.bind(eqn, [x]), [_PLAIN]
            # An explicit cast in ``fn``: respected; a cast up to float32 is kept there.
            wide = np.dtype(new).itemsize >= 4
            return interpret.bind(eqn, [x]), [(k or _KEPT) if wide else _PLAIN]

        kind = rules.kind(name)
        if kind != "low_precision" and name == "exp" and eqn.outvars[0] in self.shifted:
            kind = "bounded"  # exp(x - max(x)) lies in [0, 1]: computed like a bounded function
        return _RULES[kind](self, eqn, invals, kinds, floats, in_avals)

    def _low_precision(self, eqn, invals, kinds, floats, in_avals):
        """A matrix product or convolution: in the compute dtype, or scaled to float8."""
        del kinds, in_avals
        name, nout = eqn.primitive.name, len(eqn.outvars)
        if any(float8.is_float8_dtype(invals[i].dtype) for i in floats):
            # A float8 product written in ``fn`` (or by an inner autocast): kept as it is.
            return interpret.bind(eqn, invals), [_PLAIN] * nout
        if self.matmul_dtype is not None and name in float8.FLOAT8_PRIMITIVES:
            scope = "/".join(s for s in self._scopes if s)
            if float8.placement(eqn, scope, self.rules.low_precision, self.float8_rules) is None:
                # Float8 operands scaled from their own amax, float32 accumulation.
                return [float8.scaled_product(eqn, invals, self.compute_dtype,
                                              self.matmul_dtype, self.float8_recipe)], [_PLAIN]
        cast = list(invals)
        for i in floats:
            cast[i] = self.cast(cast[i], self.compute_dtype)
        params = None
        pref = compat.preferred_element_type(eqn)
        if pref is not None and casting.is_float_dtype(pref):
            params = compat.params_for_bind(eqn, preferred_element_type=self.compute_dtype)
        return interpret.bind(eqn, cast, params), [_PLAIN] * nout

    def _full_precision(self, eqn, invals, kinds, floats, in_avals):
        """Run in (at least) float32; a reduction's result, or one of statistics, is a statistic."""
        name = eqn.primitive.name
        cast = list(invals)
        for i in floats:
            cast[i] = self.cast(cast[i], casting.wide_dtype(in_avals[i].dtype))
        outs = interpret.bind(eqn, cast)
        float_kinds = [kinds[i] for i in floats]
        stat_like, any_stat = _statistics(invals, kinds, floats)
        if name in _REDUCTIONS or (stat_like and any_stat):
            inverse = name == "rsqrt" or (name == "integer_pow" and compat.integer_exponent(eqn) < 0)
            flip = {_STAT: _INV, _INV: _STAT}
            kind = float_kinds[0] if name not in _REDUCTIONS else _STAT
            kind = flip.get(kind, _STAT) if inverse else (kind if kind in flip else _STAT)
        else:
            kind = _KEPT
        return outs, [kind if casting.is_float_dtype(o.dtype) else _PLAIN for o in outs]

    def _bounded(self, eqn, invals, kinds, floats, in_avals):
        """Saturating: a kept operand is narrowed (no float32 digits needed)."""
        del in_avals
        dtypes = [np.dtype(invals[i].dtype) if not kinds[i] else self.compute_dtype
                  for i in floats]
        target = min(dtypes, key=lambda d: d.itemsize)
        cast = list(invals)
        for i in floats:
            cast[i] = self.cast(cast[i], target)
        return interpret.bind(eqn, cast), [_PLAIN] * len(eqn.outvars)

    def _follow(self, eqn, invals, kinds, floats, in_avals):
        """In the narrowest dtype of the operands; in float32 where one is kept there."""
        del in_avals
        dtypes = [np.dtype(invals[i].dtype) for i in floats]
        kept = any(kinds[i] for i in floats)
        if kept:
            target = casting.wide_dtype(max(dtypes, key=lambda d: d.itemsize))
        elif self.compute_dtype in dtypes:
            target = self.compute_dtype
        else:
            target = min(dtypes, key=lambda d: d.itemsize)
        cast = list(invals)
        for i in floats:
            cast[i] = self.cast(cast[i], target)
        outs = interpret.bind(eqn, cast)
        if not kept:
            return outs, [_PLAIN] * len(eqn.outvars)
        kind = self._follow_kind(eqn.primitive.name, eqn, invals, kinds,
                                 *_statistics(invals, kinds, floats))
        if kind == _PLAIN and len(outs) == 1 and target != self.compute_dtype:
            # A normalised value: narrowed once computed, unless needed wide downstream.
            return [self.cast(outs[0], self.compute_dtype)], [_PLAIN]
        return outs, [kind if casting.is_float_dtype(o.dtype) else _PLAIN for o in outs]

    def _passthrough(self, eqn, invals, kinds, floats, in_avals):
        """Each operand keeps its dtype (and its kind, through a one-to-one operation)."""
        del in_avals
        nout = len(eqn.outvars)
        if eqn.primitive.name in _MOVING and eqn.outvars[0] in self.narrow_early:
            # Moved in the compute dtype: only products read it (``_narrow_early``).
            invals = [self.cast(invals[i], self.compute_dtype)
                      if i in floats and np.dtype(invals[i].dtype).itemsize
                      > np.dtype(self.compute_dtype).itemsize else invals[i]
                      for i in range(len(invals))]
            return interpret.bind(eqn, invals), [_PLAIN] * nout
        outs = interpret.bind(eqn, invals)
        if len(outs) == len(invals):
            return outs, list(kinds)
        return outs, [_PLAIN] * nout

    def _as_written(self, eqn, invals, kinds, floats, in_avals):
        """No rule: run exactly as written, in the original dtypes."""
        del kinds, floats
        return (interpret.bind(eqn, [_as_original(x, a) for x, a in zip(invals, in_avals)]),
                [_PLAIN] * len(eqn.outvars))

    def _follow_kind(self, name, eqn, invals, kinds, stat_like, any_stat):
        """The kind of the result of a ``follow`` operation with a kept operand.

        ``_PLAIN`` means: a normalised value that may be narrowed.
        """
        if stat_like and any_stat:
            if name == "div" and kinds[1] in (_STAT, _INV) and invals[0].size == 1:
                return {_STAT: _INV, _INV: _STAT}[kinds[1]]  # 1 / statistic
            return _INV if all(k in (_INV, _PLAIN) for k in kinds) and _INV in kinds else _STAT
        if len(eqn.outvars) != 1 or eqn.outvars[0] in self.keep:
            return _KEPT
        a, b = (kinds + [_PLAIN, _PLAIN])[:2]
        if name == "div" and a not in (_STAT, _INV) and b == _STAT:
            return _PLAIN
        if name == "mul" and ((a == _INV and b not in (_STAT, _INV))
                              or (b == _INV and a not in (_STAT, _INV))):
            return _PLAIN
        return _KEPT


def _statistics(invals, kinds, floats) -> tuple[bool, bool]:
    """``(stat_like, any_stat)``: whether the float operands are all statistics or scalars
    (literals, eps, counts do not stop a result from being a statistic), and whether one is."""
    float_kinds = [kinds[i] for i in floats]
    stat_like = all(k in (_STAT, _INV) or invals[i].size == 1
                    for i, k in zip(floats, float_kinds))
    return stat_like, any(k in (_STAT, _INV) for k in float_kinds)


# How each kind of AutocastRules runs an equation (a field's name; None: no rule).
_RULES = {
    "low_precision": _Autocast._low_precision,  # pylint: disable=protected-access
    "full_precision": _Autocast._full_precision,  # pylint: disable=protected-access
    "bounded": _Autocast._bounded,  # pylint: disable=protected-access
    "follow": _Autocast._follow,  # pylint: disable=protected-access
    "passthrough": _Autocast._passthrough,  # pylint: disable=protected-access
    None: _Autocast._as_written,  # pylint: disable=protected-access
}


def _recompute_policy(low: frozenset) -> Callable:
    """The ``jax.checkpoint`` policy of a float32 region: saves only products, collectives, non-floats.

    A region's float32 intermediates (sums, exponentials, normalisation
    statistics, ...) and its half-precision tail (``_with_narrowing_tail``)
    are then recomputed in the backward pass from the region's inputs;
    matrix products and collectives (``_COMMUNICATING``) are always saved,
    never recomputed. The sums are recomputed too (one more pass over a
    region's input): a saved statistic would let XLA schedule what is
    computed from it in the forward pass, in float32 (see
    ``_recomputed_late``).
    """

    always = low | LOW_PRECISION

    def policy(prim, *avals, **params):
        if prim.name in always or prim.name in _COMMUNICATING:
            return True
        dtypes = [params.get(key) for key in ("new_dtype", "dtype") if params.get(key) is not None]
        dtypes += [getattr(a, "dtype", None) for a in avals]
        return not any(casting.is_float_dtype(d) for d in dtypes)

    policy.saved = always | _COMMUNICATING  # the primitives it saves whatever their dtypes
    return policy


def _float32_regions(jaxpr) -> list[list[int]]:
    """The float32 regions of the autocast program ``jaxpr``, as lists of equation indices.

    A region is a connected group of first-order equations with float32 (or
    wider) outputs, connected through float32 values: a layer-norm's
    statistics and normalisation, a softmax's exponentials and sums, the
    float32 part of a GELU, each with its narrowing tail
    (``_with_narrowing_tail``: the conversion of its result to half
    precision and a layer norm's scale and bias). A region is dropped when an
    equation outside it sits between its equations and reads one of its
    values (it could then not run as one unit); a tail is dropped when it
    makes that so.
    """
    def wide_out(eqn):
        return any(casting.is_float_dtype(v.aval.dtype) and np.dtype(v.aval.dtype).itemsize >= 4
                   for v in eqn.outvars)

    member = [eqn.primitive.name not in interpret.HANDLERS and wide_out(eqn)
              and not compat.is_higher_order(eqn, combiners=True)
              for eqn in jaxpr.eqns]
    producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
    parent = list(range(len(jaxpr.eqns)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, eqn in enumerate(jaxpr.eqns):
        if not member[i]:
            continue
        for v in eqn.invars:
            j = producer.get(v) if not compat.is_literal(v) else None
            if j is not None and member[j] and np.dtype(v.aval.dtype).itemsize >= 4:
                parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for i in range(len(jaxpr.eqns)):
        if member[i]:
            groups.setdefault(find(i), []).append(i)
    users: dict[Any, list[int]] = {}
    for j, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not compat.is_literal(v):
                users.setdefault(v, []).append(j)

    def runs_as_one(idx):  # no equation outside it reads its values before its last one
        inside, outs = set(idx), {v for i in idx for v in jaxpr.eqns[i].outvars}
        return not any(
            j not in inside and any(v in outs for v in jaxpr.eqns[j].invars
                                    if not compat.is_literal(v))
            for j in range(idx[0], idx[-1]))

    regions = []
    for idx in groups.values():
        if len(idx) < 2:
            continue
        with_tail = _with_narrowing_tail(jaxpr, idx, users)
        if with_tail != idx and runs_as_one(with_tail):
            regions.append(with_tail)
        elif runs_as_one(idx):
            regions.append(idx)
    return regions


# Elementwise operations that may continue a region's narrowing tail (``_with_narrowing_tail``).
_TAIL_OPS = compat.TAIL_OPS


def _with_narrowing_tail(jaxpr, idx: list[int], users: dict) -> list[int]:
    """Region ``idx`` extended with the half-precision operations that narrow and scale its outputs.

    The tail is the conversion of a region value to half precision and the
    elementwise operations that follow it with only small other operands
    (a layer norm's scale and bias): ``normalised * scale + bias``. Recomputed
    with the region, their results are not read from the forward pass by the
    backward one (the derivative of ``normalised * scale`` reads
    ``normalised``): XLA fuses a narrowing conversion into each of its users,
    so a backward pass reading the narrowed value keeps the region's float32
    value alive until then.
    """
    members, chain = set(idx), {v for i in idx for v in jaxpr.eqns[i].outvars}
    frontier = list(chain)
    while frontier:
        v = frontier.pop()
        for j in users.get(v, ()):
            eqn = jaxpr.eqns[j]
            if j in members or len(eqn.outvars) != 1:
                continue
            out = eqn.outvars[0].aval
            if not casting.is_half_dtype(getattr(out, "dtype", None)):
                continue
            if eqn.primitive.name == "convert_element_type":
                ok = np.dtype(v.aval.dtype).itemsize >= 4
            elif eqn.primitive.name in _TAIL_OPS:
                ours = [u for u in eqn.invars if not compat.is_literal(u) and u in chain]
                ok = (len(ours) == 1 and casting.is_half_dtype(v.aval.dtype)
                      and v.aval.shape == out.shape
                      and all(compat.is_literal(u) or u in chain
                              or u.aval.size < out.size for u in eqn.invars))
            else:
                ok = False
            if ok:
                members.add(j)
                chain.update(eqn.outvars)
                frontier.extend(eqn.outvars)
    return sorted(members)


def _recomputed_late(fn: Callable, policy: Callable) -> Callable:
    """``jax.checkpoint(fn, policy=policy)``, its recomputation tied to its cotangents.

    A checkpoint's recomputation depends only on values of the forward pass,
    so XLA is free to schedule it there (XLA:CPU does: it drops the
    optimisation barriers of ``prevent_cse`` before scheduling), and the
    float32 values it recomputes then live from the forward pass to the
    backward one, which is what recomputing was to avoid. Here each saved
    input of ``fn`` as large as its largest output gets ``0 * cotangent``
    added before the recomputation (the cotangent of an output of its shape,
    else the first element of one): a data dependence that XLA keeps
    (``0 * x`` is not simplified for floats), so the recomputation waits for
    the backward pass. The sum is exact for finite cotangents; a non-finite
    one makes the gradients non-finite, as it would anyway. The tie is what
    keeps the recomputation apart from the forward pass, so the checkpoint
    has no optimisation barriers (``prevent_cse=False``): on XLA:GPU a barrier
    is a fusion boundary, and with them every tied input was written out once
    more and a region's sums and tail could not fuse with their neighbours
    (the H100 program of a 2-layer GPT step: 1.22x the bytes written, 17 more
    kernels and 4% more scratch memory than without the barriers).

    Reverse-mode only (``jax.custom_vjp``): forward-mode differentiation of
    the result raises (autocast does not tie regions under forward mode, see
    :func:`autocast`).
    """
    remat = jax.checkpoint(fn, policy=policy, prevent_cse=False)

    @jax.custom_vjp
    def run(*xs):
        return fn(*xs)

    def fwd(*xs):
        return jax.vjp(remat, *xs)

    def bwd(vjp, cts):
        leaves, tree = jax.tree_util.tree_flatten(vjp)
        return tuple(jax.tree_util.tree_unflatten(tree, _tied(leaves, cts))(cts))

    run.defvjp(fwd, bwd)
    return run


def _recomputed_from_inputs(fn: Callable, backwards: dict | None = None,
                            key: Any = None) -> Callable:
    """``_recomputed_late`` for a region that saves nothing but its inputs (no product, no
    collective in it): the forward pass runs ``fn`` as written and keeps its inputs; the
    backward pass differentiates ``fn`` afresh on them, tied to the cotangents. The same
    program as the checkpoint's, traced in half the time: a checkpoint is linearised in the
    forward pass and linearised again when it is transposed.

    With ``backwards`` (a dict) and ``key`` (the region's structure, ``_region_key``), the
    backward pass is traced once per structure and operand types and replayed for every
    region with that key: the identical layers of a deep model are differentiated once.
    """

    @jax.custom_vjp
    def run(*xs):
        return fn(*xs)

    def fwd(*xs):
        return fn(*xs), xs

    def backward(xs, cts):
        _, vjp = jax.vjp(fn, *_tied(list(xs), cts))
        return vjp(cts)

    def bwd(xs, cts):
        args = [*xs, *cts]
        if any(compat.varying_axes(a) for a in args):  # in a shard_map body: traced in place
            return tuple(backward(xs, cts))
        types = tuple((a.shape, a.dtype) for a in args)
        known = backwards if backwards is not None and key is not None else {}
        program = known.get((key, types))
        if program is None:
            traced = jax.make_jaxpr(backward)(
                *jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                        (list(xs), list(cts))))
            # Without the recomputed outputs nothing reads (find_nonfinite would take
            # them for gradients, the program's ends).
            program = known[key, types] = (
                compat.without_dead_code(traced.jaxpr, keep_inputs=True), traced.consts)
        return tuple(compat.eval_jaxpr(*program, *args))

    run.defvjp(fwd, bwd)
    return run


def _region_key(jaxpr, region: list[int], inputs: list, outputs: list) -> Any:
    """What a region computes, as a hashable key: two regions with the same key compute the
    same function of their inputs (primitives, parameters, literals, wiring, operand types),
    written on the same lines of the user's code, callers included, under the same names
    (``jax.named_scope``, a framework's module path): the source the backward pass carries.
    The layers of a loop share one; a framework's layers, named each its own, do not.
    ``None`` when a parameter cannot be a key."""
    position = {v: ("in", k) for k, v in enumerate(inputs)}
    parts = []
    try:
        for n, j in enumerate(region):
            eqn = jaxpr.eqns[j]
            ins = tuple(("lit", repr(v.val), str(v.aval)) if compat.is_literal(v)
                        else position[v] for v in eqn.invars)
            frames = compat.user_frames(compat.traceback(eqn))
            where = (tuple((f.file_name, f.start_line) for f in frames), compat.name_stack(eqn))
            parts.append((compat.params_key(eqn), ins,
                          tuple(str(v.aval) for v in eqn.outvars), where))
            position.update({v: ("eqn", n, k) for k, v in enumerate(eqn.outvars)})
        parts.append(tuple(position[v] for v in outputs))
        key = tuple(parts)
        hash(key)
    except (TypeError, KeyError):
        return None
    return key


def _tied(values: list, cts) -> list:
    """``values`` (a region's saved inputs), those of floats as large as its largest cotangent
    with ``0 * cotangent`` added (see ``_recomputed_late``)."""
    floats = [c for c in cts if casting.is_float_dtype(c.dtype) and c.size]
    if not floats:
        return values
    largest = max(c.size for c in floats)
    by_shape = {c.shape: c for c in reversed(floats)}

    def tie(x):
        if not casting.is_float_dtype(getattr(x, "dtype", None)) or x.size < largest:
            return x
        # Elementwise when shapes agree: fewer instructions for XLA to copy
        # into every fusion that reads ``x`` than a broadcast scalar.
        c = by_shape.get(x.shape, floats[0].ravel()[0])
        return x + (c * 0).astype(x.dtype)

    return [tie(x) for x in values]


def _eval_with_regions(closed, args, policy) -> list:
    """Evaluates ``closed`` with each float32 region in its own checkpoint (``_recomputed_late``).

    Each region's float32 values are then recomputed in the backward pass
    where that region's derivative is taken, one region at a time, rather
    than all at the start of the backward pass or in the forward pass.
    """
    jaxpr = closed.jaxpr
    regions = _float32_regions(jaxpr)
    backwards: dict = {}  # per region structure, its traced backward pass
    region_of = {i: r for r in regions for i in r}
    used_after: dict[int, set] = {}
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts))
    env.update(zip(jaxpr.invars, args))
    outside_uses = {v for v in jaxpr.outvars if not compat.is_literal(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not compat.is_literal(v):
                used_after.setdefault(id(v), set()).add(i)

    def read(v):
        return jnp.asarray(v.val, v.aval.dtype) if compat.is_literal(v) else env[v]

    for i, eqn in enumerate(jaxpr.eqns):
        region = region_of.get(i)
        if region is None:
            invals = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "scan":
                outs = _scan_with_regions(eqn, invals, policy)
            else:
                outs = interpret.bind(eqn, invals)
            env.update(zip(eqn.outvars, outs))
            continue
        if i != region[-1]:
            continue
        inside = set(region)
        produced = [v for j in region for v in jaxpr.eqns[j].outvars]
        produced_set = set(produced)
        inputs = list(dict.fromkeys(
            v for j in region for v in jaxpr.eqns[j].invars
            if not compat.is_literal(v) and v not in produced_set))
        outputs = [v for v in produced
                   if v in outside_uses or used_after.get(id(v), set()) - inside]

        def run_region(*xs, region=region, inputs=inputs, outputs=outputs):
            local = dict(zip(inputs, xs))

            def get(v):
                return jnp.asarray(v.val, v.aval.dtype) if compat.is_literal(v) else local[v]

            for j in region:
                e = jaxpr.eqns[j]
                for v, x in zip(e.outvars, interpret.bind(e, [get(v) for v in e.invars])):
                    local[v] = x
            return [local[v] for v in outputs]

        try:
            saves = any(jaxpr.eqns[j].primitive.name in policy.saved for j in region)
            recomputed = (_recomputed_late(run_region, policy) if saves
                          else _recomputed_from_inputs(
                              run_region, backwards,
                              _region_key(jaxpr, region, inputs, outputs)))
            outs = recomputed(*[env[v] for v in inputs])
        except TypeError as e:
            if "forward-mode" not in str(e):
                raise
            raise TypeError(_FORWARD_MODE_MESSAGE) from e
        env.update(zip(outputs, outs))
    return [read(v) for v in jaxpr.outvars]


def _scan_with_regions(eqn, invals: list, policy) -> list:
    """A ``scan`` equation bound with its body's float32 regions recomputed (``_eval_with_regions``).

    Without it, the reverse pass of a scanned model keeps each iteration's
    float32 intermediates (normalisation statistics, softmax exponentials):
    stacked over the iterations, more memory than the hand-written
    half-precision step, where the unrolled model needs less. A body that
    closes over values (up to jax 0.10 ``lax.scan`` passes them as operands),
    or a scan whose parameters jaxmp does not know (autocast ran it as
    written and said so), is bound as it is.
    """
    try:
        body = compat.scan(eqn).body
    except compat.UnknownEquation:
        return interpret.bind(eqn, invals)
    if body.consts:
        return interpret.bind(eqn, invals)
    program = jax.make_jaxpr(lambda *xs: _eval_with_regions(body, xs, policy))(
        *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in body.in_avals])
    if program.consts:
        return interpret.bind(eqn, invals)
    return interpret.bind(eqn, invals, compat.scan_with_body(eqn, program))


_FORWARD_MODE_MESSAGE = (
    "jaxmp.autocast: forward-mode differentiation (jax.jvp, jax.jacfwd, jax.hessian) reached a "
    "float32 region that autocast recomputes in the backward pass (recompute_float32=True, the "
    "default for a half-precision compute_dtype). That recomputation is a jax.custom_vjp, which "
    "JAX differentiates in reverse mode only (jax.grad, jax.vjp).\n"
    "  Fix: jaxmp.autocast(fn, compute_dtype, recompute_float32=False) for a function "
    "differentiated in forward mode: it keeps the float32 intermediates instead of recomputing "
    "them (more memory in the backward pass, the same values).")


def autocast(
    fn: Callable,
    compute_dtype: Any = jnp.bfloat16,
    *,
    rules: AutocastRules = AutocastRules(),
    low_precision: Iterable[str] | None = None,
    full_precision: Iterable[str] | None = None,
    follow: Iterable[str] | None = None,
    passthrough: Iterable[str] | None = None,
    recompute_float32: bool = True,
    bounded: Iterable[str] | None = None,
    matmul_dtype=None,
    float8_rules=None,
    float8_scaling="tensor",
) -> Callable:
    """Runs ``fn`` with a precision chosen per operation, like ``torch.autocast``.

    ``fn`` is written in float32 and is not changed. Every call traces it to a
    jaxpr and evaluates that jaxpr again with these rules (``rules``, a
    :class:`jaxmp.AutocastRules` of primitive names, each in one kind):

    * ``low_precision`` (``dot_general``, ``conv_general_dilated``): operands
      in ``compute_dtype``, result in ``compute_dtype``;
    * ``full_precision`` (sums, products, cumulative sums, ``exp``, ``log``,
      powers, ``sqrt``, ``rsqrt``, ``erf``, ...): floating operands in float32,
      result in float32. Softmax, log-softmax, ``logsumexp`` and the mean and
      variance of a normalisation are made of these, so they run in float32;
    * ``bounded`` (``tanh``, ``logistic``): saturating functions; like
      ``follow``, except that a float32 operand is narrowed to
      ``compute_dtype`` first (``tanh(inf)`` is still 1);
    * ``follow`` (arithmetic, comparisons, reshapes, slices, ``max``...): the
      narrowest dtype of the operands, so a float32 bias, scale or positional
      embedding meeting a half-precision activation is cast down;
    * ``passthrough`` (collectives, ``sort``, sharding annotations): each
      operand keeps its dtype;
    * any other primitive runs as written, in its original dtypes.

    What stays in float32: the result of a ``full_precision`` operation is
    *kept* there, and a ``follow`` operation that mixes a kept value with a
    half-precision one runs in float32 (``x - mean``, a sum before a
    division): these are the values that overflow or lose their digits in
    half precision. A kept value is narrowed back to ``compute_dtype`` at the
    operands of a matrix product, at a ``bounded`` function, by an explicit
    cast in ``fn``, at the outputs of ``fn`` (which keep the dtypes ``fn``
    gives them), and once it is *normalised*: divided by a statistic (a value
    computed from sums and scalars only, such as a softmax's sum or
    ``sqrt(var + eps)``) or multiplied by the reciprocal of one
    (``rsqrt(var + eps)``). The normalisation itself is computed in float32;
    its result, of order one, goes on in half precision, as in a
    hand-written half-precision model, unless something downstream needs its
    float32 digits: a ``full_precision`` operation (``log`` of a
    probability), a loop, a branch or an output of ``fn``. So layer-norm and
    softmax outputs, and everything after a ``tanh``, are half precision;
    the statistics, ``x - mean`` and the sums of a softmax are float32. The
    exponentials of a softmax, ``exp(x - max(x))``, lie in ``[0, 1]`` and
    run in ``compute_dtype`` (like a ``bounded`` function) when the
    probabilities go on in half precision (into an attention product);
    those of a log-softmax or ``logsumexp``, or of probabilities that reach
    a ``log`` or an output of ``fn``, stay float32.

    What it costs: the float32 values are twice the size of half-precision
    ones, the boundaries are conversions, and a float32 normalisation has a
    float32 derivative in the backward pass. Integer, boolean and key values
    are never touched; loop carries keep their dtypes; nested ``jit``,
    ``scan``, ``while_loop``, ``cond``, ``checkpoint``, ``custom_jvp`` and
    ``custom_vjp`` are handled inside (a custom derivative rule is kept and
    evaluated in the original dtypes, so e.g. ``jax.nn.relu`` keeps its
    gradient at 0).

    With ``recompute_float32=True`` (the default for a half-precision
    ``compute_dtype``) the float32 intermediates are not kept for the
    backward pass: each connected float32 region (a layer norm, a softmax)
    gets its own ``jax.checkpoint`` that keeps only its half-precision
    inputs and recomputes the rest, with the conversion of its result to
    ``compute_dtype`` and a layer norm's scale and bias, where its derivative
    is taken: the recomputation is tied to the region's cotangent, so that
    XLA cannot move it into the forward pass. The recomputed work is conversions,
    elementwise operations and the region's sums, never a matrix product:
    what is kept for the backward pass is then all half precision, for some
    more work in the backward pass. The regions are ``jax.custom_vjp``
    functions, which JAX differentiates in reverse mode only; when autocast
    sees its inputs differentiated in forward mode (``jax.jvp``,
    ``jax.jacfwd``, ``jax.hessian``, also under ``jit``) it evaluates that
    trace as with ``recompute_float32=False`` (the same values; forward mode
    has no backward pass to save memory in). The one case it cannot see is
    ``jax.jvp`` of a ``jax.jit``-wrapped autocast function, which raises
    JAX's error: put the ``jit`` outside the ``jvp``, or pass
    ``recompute_float32=False``.

    The result is an ordinary function: ``jit``, ``vmap`` and ``grad`` work on
    it, its outputs have the dtypes ``fn`` gives them, gradients with respect
    to float32 inputs are float32 and the backward pass of a half-precision
    matrix product runs in half precision.

    Args:
        fn: any JAX function of arrays and pytrees of arrays; non-array
            leaves (Python numbers, strings, ...) are treated as constants.
        compute_dtype: the dtype of matrix products: ``jnp.bfloat16``
            (default), ``jnp.float16`` or ``jnp.float32``.
        rules: a :class:`jaxmp.AutocastRules`: which primitives run in which
            precision (default: ``jaxmp.AutocastRules()``).
        low_precision: if given, replaces ``rules.low_precision`` (primitive
            names run in ``compute_dtype``).
        full_precision: if given, replaces ``rules.full_precision``
            (primitive names run in float32).
        follow: if given, replaces ``rules.follow`` (primitive names run in
            the narrowest dtype of their operands).
        passthrough: if given, replaces ``rules.passthrough`` (primitive
            names whose operands keep their own dtypes).
        recompute_float32: recompute float32 intermediates in the backward
            pass instead of saving them (see above).
        bounded: if given, replaces ``rules.bounded`` (saturating functions
            whose float32 operands are narrowed).
        matmul_dtype: ``None`` (default): matrix products in
            ``compute_dtype``. ``jnp.float8_e4m3fn`` (or ``jnp.float8_e5m2``):
            every ``low_precision`` product that ``float8_rules`` selects
            runs with float8 operands, each scaled per tensor from its
            current absolute maximum, accumulating in float32, its result in
            ``compute_dtype``; its backward products take the cotangent in
            ``float8_e5m2``. A convolution runs its forward product and, with
            unit strides, its input gradient in float8, the rest in
            ``compute_dtype`` (XLA's GPU compiler runs only forward
            convolutions in float8). See ``docs/float8.md``.
        float8_rules: a :class:`jaxmp.experimental.Float8Rules`: which products stay in
            ``compute_dtype`` under a float8 ``matmul_dtype`` (default
            ``jaxmp.experimental.Float8Rules()``: none).
        float8_scaling: how the float8 products are scaled. ``"tensor"``
            (default): one power-of-two scale per operand, as above.
            ``"mxfp8"`` (OCP MX v1.0, for GPUs with block-scaled float8, such
            as Blackwell): each operand of each ``dot_general`` in blocks of 32
            consecutive elements along that product's contracting dimension,
            each block with its own power-of-two (E8M0) scale, forward and
            backward (the weight gradient's blocks run along the batch and
            token dimensions), all in ``float8_e4m3fn``, which
            ``matmul_dtype`` must be; a few large rows then cost the others
            nothing. A contracting dimension that is not a multiple of 32 is
            padded with zeros; convolutions keep one scale per tensor. On GPUs
            with block-scaled GEMMs (NVIDIA compute capability 10.0 and up)
            the products are ``jax.nn.scaled_matmul`` (cuDNN's block-scaled
            dot); on the CPU an emulation computes the same numbers; on other
            accelerators (Hopper and older) the ``"tensor"`` recipe runs
            instead, chosen when the product is traced and said once by a
            :class:`jaxmp.experimental.Float8ShortfallWarning`. See ``docs/float8.md``.

    The default sets are also attributes of this function
    (``jaxmp.autocast.FULL_PRECISION``...); to change a rule, pass a new set,
    e.g. ``full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"}``.

    Returns:
        A function with the signature and output dtypes of ``fn``.

    Raises:
        ValueError: for an unknown ``float8_scaling``, or ``"mxfp8"`` without
            ``matmul_dtype=jnp.float8_e4m3fn`` (the message says the fix).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def f(w, x):
        ...     logits = x @ w                      # float16 under autocast
        ...     return jnp.log(jnp.sum(jnp.exp(logits)))  # float32 under autocast
        >>> w, x = jnp.full((4, 3), 6.0), jnp.ones((1, 4))
        >>> float(jaxmp.cast_function(f, jnp.float16)(w, x))  # exp(24) overflows
        inf
        >>> out = jaxmp.autocast(f, jnp.float16)(w, x)
        >>> round(float(out), 3), out.dtype
        (25.099, dtype('float32'))

        Float8 products with one scale per block of 32 (MXFP8): a row 1e5 times
        larger than the others leaves them their precision.

        >>> w = jax.random.normal(jax.random.key(0), (64, 32))
        >>> x = jax.random.normal(jax.random.key(1), (32, 64)).at[0].multiply(1e5)
        >>> mx = jax.jit(jaxmp.autocast(lambda w, x: x @ w, jnp.float32,
        ...                             matmul_dtype=jnp.float8_e4m3fn, float8_scaling="mxfp8"))
        >>> err = jnp.linalg.norm(mx(w, x) - x @ w, axis=1) / jnp.linalg.norm(x @ w, axis=1)
        >>> bool(err.max() < 0.1)
        True
    """
    casting.check_function(fn, "jaxmp.autocast", "autocast(fn, compute_dtype=jnp.bfloat16, ...)")
    compute_dtype = casting.canonical_float_dtype(
        compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype"
    )
    if not isinstance(rules, AutocastRules):
        raise TypeError(f"rules must be a jaxmp.AutocastRules, got {type(rules).__name__}.")
    matmul_dtype = float8.check_matmul_dtype(matmul_dtype, compute_dtype)
    float8_recipe = float8.check_scaling(float8_scaling, matmul_dtype)
    float8_rules = float8.Float8Rules() if float8_rules is None else float8_rules
    if not isinstance(float8_rules, float8.Float8Rules):
        raise TypeError(
            "float8_rules must be a jaxmp.experimental.Float8Rules, got "
            f"{type(float8_rules).__name__}.")
    overrides = {"low_precision": low_precision, "full_precision": full_precision,
                 "follow": follow, "passthrough": passthrough, "bounded": bounded}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        rules = dataclasses.replace(rules, **overrides)
    recompute = recompute_float32 and casting.is_half_dtype(compute_dtype)

    def run_autocast(closed, dyn):
        if matmul_dtype is not None:  # says, once, which products cannot run in float8
            shortfall.warn_if_float8_shortfall(closed, rules, float8_rules, compute_dtype,
                                               matmul_dtype, float8_recipe,
                                               [census.is_differentiated(x) for x in dyn])
        out_avals = closed.out_avals
        keep = _narrow_safe(closed, rules)
        # Under float8 the products quantize their operands from float32: a collective
        # narrowed to compute_dtype first would round twice, so it moves as written.
        early = _narrow_early(closed, rules) if matmul_dtype is None else frozenset()
        interpreter = _Autocast(compute_dtype, rules, keep, matmul_dtype, float8_rules,
                                _shifted_exps(closed, keep), early, float8_recipe)
        consts = list(closed.consts)

        def run(*flat):
            outs = interpreter.eval_jaxpr(closed.jaxpr, flat[:len(consts)], flat[len(consts):])
            return [interpreter.to_original(o, a) for o, a in zip(outs, out_avals)]

        # Forward mode (jax.jvp, jacfwd, hessian) cannot go through the custom_vjp that ties
        # the recomputation to the cotangent; it has no backward pass to save memory in.
        if recompute and not compat.in_forward_mode(dyn):
            program = jax.make_jaxpr(run)(*consts, *dyn)
            return _eval_with_regions(
                program, [*consts, *dyn], _recompute_policy(rules.low_precision))
        return run(*consts, *dyn)

    return functools.wraps(fn)(interpret.transform(fn, run_autocast))


autocast.LOW_PRECISION = LOW_PRECISION
autocast.FULL_PRECISION = FULL_PRECISION
autocast.FOLLOW = FOLLOW
autocast.PASSTHROUGH = PASSTHROUGH
autocast.BOUNDED = BOUNDED
