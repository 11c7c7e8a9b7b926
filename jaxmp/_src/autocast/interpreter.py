"""The interpreter of autocast: each equation run in the precision its rule says.

``Autocast`` evaluates the traced jaxpr of ``fn`` again, one equation at a
time, with the kinds of ``rules.py`` and the sets that ``analysis.py``
computed beforehand.

A value computed by a ``full_precision`` operation (or anything computed from
one, and every loop carry but the ``scan`` carries that run in the compute
dtype, see ``_scan``) is *kept* in float32: an operation that mixes it
with a half-precision value runs in float32 rather than narrowing it, because
such values (a large sum before a division, a variance, the normaliser of a
softmax) are exactly the ones that overflow or lose their digits in half
precision. They are narrowed at the operands of a matrix product, at a
``bounded`` function, by an explicit cast in ``fn``, at the outputs of
``fn`` (which keep the dtypes ``fn`` gives them), and once normalised
(divided by a statistic, or multiplied by the reciprocal of one: a softmax,
a layer norm) unless something downstream needs their float32 digits
(``analysis.narrow_safe``).

Integer, boolean and PRNG-key values are never touched. Nested ``jit``,
``scan``, ``while_loop``, ``cond``, ``checkpoint``, ``custom_jvp`` and
``custom_vjp`` are handled by the shared interpreter (``interpret.py``); this
module supplies the per-equation rules. Whether a value is kept wide is part
of its pytree structure (a ``_Wide`` node), so it leaves loop bodies and
branches as static structure, not through side effects.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import interpret
from jaxmp._src import messages
from jaxmp._src import source
from jaxmp._src.autocast import rules as rules_lib

# Reductions: their results are statistics of a tensor (see ``Autocast``).
_REDUCTIONS = compat.REDUCTIONS
# Collectives that move a value between devices unchanged (no arithmetic).
_MOVING = compat.MOVING_COLLECTIVES
# Scatters, by the ``jax.lax`` function that builds each for its operands' dtype.
_SCATTERS = compat.SCATTERS
# Operations whose transpose is a sum (a gather's: a scatter-add), run on float32 operands.
_SUMMED_BACKWARD = compat.SUMMED_BACKWARD


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


class Autocast(interpret.Interpreter):
    """The interpreter of one traced ``autocast`` call: compute dtype, rules, narrowing.

    Every floating value is plain or kept wide (``_Wide``), and a kept value
    may be known to be a *statistic* (computed from reductions and scalars:
    a mean, a variance, the sum of a softmax) or the reciprocal of one. A
    *normalised* value, ``a / statistic`` or ``a * reciprocal`` with ``a``
    not itself a statistic, is computed in float32 and then narrowed to the
    compute dtype, unless ``keep`` (from ``analysis.narrow_safe``) says that
    something downstream needs it wide: layer-norm and softmax outputs go on
    in half precision like the hand-written model's.
    """

    def __init__(self, compute_dtype: np.dtype, rules: rules_lib.AutocastRules,
                 keep: frozenset = frozenset(), matmul_dtype: np.dtype | None = None,
                 float8_rules: float8.Float8Rules = float8.Float8Rules(),
                 shifted: frozenset = frozenset(), narrow_early: frozenset = frozenset(),
                 float8_recipe: float8.Recipe | None = None, broadcast: dict | None = None,
                 from_inputs: dict | None = None):
        super().__init__({**interpret.HANDLERS, "scan": _in_loop(_scan),
                          "while": _in_loop(interpret.HANDLERS["while"])})
        self.loop_depth = 0  # how many loops (scan, while) the equation being evaluated is in
        self.compute_dtype = compute_dtype
        self.rules = rules
        self.keep = keep
        self.shifted = shifted  # exp equations to run in compute_dtype (``analysis.shifted_exps``)
        self.matmul_dtype = matmul_dtype  # a float8 dtype, or None: products in compute_dtype
        self.float8_rules = float8_rules
        self.float8_recipe = float8_recipe  # a row of float8.RECIPES (float8_scaling)
        # The collectives that move in compute_dtype (``analysis.narrow_early``).
        self.narrow_early = narrow_early
        # Values that broadcast a smaller one, and its size (``analysis.broadcast_sizes``).
        self.broadcast = broadcast or {}
        # Which operands of each product are read from the inputs (``jaxprs.read_from_inputs``).
        self.from_inputs = from_inputs or {}
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
            return [_wrap(_cast(_unwrap(v)[0], dtype), kind)
                    for v, (dtype, kind) in zip(outs, targets)]

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
            outs = _bind_widened(eqn, cast, in_avals)
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

    def _recipe(self, eqn) -> float8.Recipe | None:
        """The recipe of a float8 product: a recipe with state (``"delayed"``, one history row
        per product) runs its products inside loops with ``"tensor"`` scaling, said once: one
        row cannot hold a loop's many iterations."""
        recipe = self.float8_recipe
        if recipe is None or recipe.state is None or not self.loop_depth:
            return recipe
        messages.warn_once(
            ("stateful recipe in a loop", recipe.name, source.location_key(eqn, ())),
            f"jaxmp: float8_scaling={recipe.name!r} keeps one amax history per float8 "
            "product, and this product runs inside a loop (lax.scan, nn.scan, while_loop): "
            "its scales come from the tensors themselves (the 'tensor' recipe) instead.\n"
            "  Fix: none needed; to scale it from a history, unroll the loop (a Python loop "
            "over layers) or use float8_scaling='tensor' for the whole function.",
            UserWarning)
        return float8.RECIPES[float8.DEFAULT_RECIPE]

    def _low_precision(self, eqn, invals, kinds, floats, in_avals):
        """A matrix product or convolution: in the compute dtype, or scaled to float8."""
        del kinds, in_avals
        name, nout = eqn.primitive.name, len(eqn.outvars)
        if any(float8.is_float8_dtype(invals[i].dtype) for i in floats):
            # A float8 product written in ``fn`` (or by an inner autocast): kept as it is.
            return interpret.bind(eqn, invals), [_PLAIN] * nout
        if self.matmul_dtype is not None and name in float8.FLOAT8_PRIMITIVES:
            scope = "/".join(s for s in self._scopes if s)
            if float8.placement(eqn, scope, self.rules.low_precision, self.float8_rules,
                                self.from_inputs.get(id(eqn), (True, True))) is None:
                # Float8 operands scaled from their own amax, float32 accumulation.
                return [float8.scaled_product(eqn, invals, self.compute_dtype,
                                              self.matmul_dtype, self._recipe(eqn))], [_PLAIN]
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
        outs = _bind_widened(eqn, cast, in_avals)
        float_kinds = [kinds[i] for i in floats]
        stat_like, any_stat = self._statistics(eqn, invals, kinds, floats)
        if name in _REDUCTIONS or (stat_like and any_stat):
            inverse = name == "rsqrt" or (name == "integer_pow"
                                          and compat.integer_exponent(eqn) < 0)
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
        if (eqn.primitive.name in _SUMMED_BACKWARD and casting.is_narrow_dtype(target)
                and not compat.some_params(eqn, ("unique_indices",)).get("unique_indices")):
            # Its transpose sums cotangents (a gather's is a scatter-add). Run on float32
            # operands and narrowed back (exact), it has JAX sum them in float32, like a
            # sum's operands, and narrow the sum once.
            wide = [self.cast(x, casting.wide_dtype(target)) if i in floats else x
                    for i, x in enumerate(cast)]
            return ([self.cast(o, target) for o in interpret.bind(eqn, wide)],
                    [_PLAIN] * len(eqn.outvars))
        outs = interpret.bind(eqn, cast)
        if not kept:
            return outs, [_PLAIN] * len(eqn.outvars)
        kind = self._follow_kind(eqn.primitive.name, eqn, invals, kinds,
                                 *self._statistics(eqn, invals, kinds, floats))
        if kind == _PLAIN and len(outs) == 1 and target != self.compute_dtype:
            # A normalised value: narrowed once computed, unless needed wide downstream.
            return [self.cast(outs[0], self.compute_dtype)], [_PLAIN]
        return outs, [kind if casting.is_float_dtype(o.dtype) else _PLAIN for o in outs]

    def _passthrough(self, eqn, invals, kinds, floats, in_avals):
        """Each operand keeps its dtype (and its kind, through a one-to-one operation)."""
        del in_avals
        nout = len(eqn.outvars)
        if eqn.primitive.name in _MOVING and eqn.outvars[0] in self.narrow_early:
            # Moved in the compute dtype: only products read it (``analysis.narrow_early``).
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

    def _statistics(self, eqn, invals, kinds, floats) -> tuple[bool, bool]:
        """``(stat_like, any_stat)``: whether the float operands of ``eqn`` are all statistics
        or like one, and whether one is a statistic.

        Like a statistic, a result that stays one: a scalar (a literal, eps, a count), or a
        value that holds no more numbers than the largest statistic among the operands, or
        fewer than the result (a normalisation's per-feature scale or offset: ``scale *
        rsqrt(var + eps)`` is the reciprocal of a statistic still, so the activation it
        multiplies is normalised and narrowed). Sizes are those before a broadcast
        (``analysis.broadcast_sizes``): an activation is never like a statistic broadcast to
        its shape.
        """
        def size(i):
            v = eqn.invars[i]
            return invals[i].size if compat.is_literal(v) else self.broadcast.get(v, invals[i].size)

        stats = [size(i) for i in floats if kinds[i] in (_STAT, _INV)]
        if not stats:
            return all(invals[i].size == 1 for i in floats), False
        largest, out = max(stats), eqn.outvars[0].aval.size
        return all(kinds[i] in (_STAT, _INV) or size(i) <= largest or invals[i].size < out
                   for i in floats), True

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


def _bind_widened(eqn, cast, in_avals) -> list:
    """``eqn`` bound on ``cast``, its floating operands widened from ``in_avals``' dtypes.

    A scatter's combiner is a jaxpr typed for the dtype it was traced in: a
    widened scatter-add is built afresh by ``jax.lax`` for its new dtype.
    """
    name = eqn.primitive.name
    if name not in _SCATTERS or all(x.dtype == a.dtype for x, a in zip(cast, in_avals)):
        return interpret.bind(eqn, cast)
    params = compat.some_params(
        eqn, ("dimension_numbers", "indices_are_sorted", "unique_indices", "mode"))
    with interpret.at_source_of(eqn):
        return [_SCATTERS[name](*cast, **params)]


# --- Scans: carries in the compute dtype ----------------------------------------------------


def _scan(interp: Autocast, eqn, invals):
    """A ``scan`` whose float32 carries run in the compute dtype where the body allows it.

    As a hand-written half-precision step carries them: a float32 carry runs in
    the compute dtype when, so carried, the body gives it back in the compute
    dtype and not kept wide (a residual stream ``x + f(x)``, a hidden state
    ``tanh(h @ w + x)``); one that the body gives back kept in float32 stays
    float32 and kept (an accumulator fed by a sum, a value computed under
    ``jaxmp.force_full_precision``). The dtypes are a fixed point: every wide
    carry is narrowed, the body traced, those it gives back wide are widened
    again, until none changes. Under ``jax.checkpoint`` (``nn.remat``) the
    iterations then save half-precision inputs. Stacked inputs (a scanned
    model's weights) stay as they are: each iteration casts its slice where a
    product reads it, which XLA fuses into the product, where a cast of the
    whole stack before the loop would keep a half-precision copy of every
    weight alive for the backward pass and add a conversion of the stacked
    gradients (measured: more scratch memory and bytes written than the
    per-iteration casts; ``docs/autocast.md``).
    """
    p = compat.scan(eqn)
    nc, ncarry = p.num_consts, p.num_carry
    carry_avals = [v.aval for v in eqn.invars[nc:nc + ncarry]]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    narrow = np.dtype(interp.compute_dtype)
    dtypes = [narrow if _wider(a.dtype, narrow) else None for a in carry_avals]
    while any(d is not None for d in dtypes):
        outs = _body_shapes(interp, p.body, consts, _carried(init, dtypes, carry_avals), xs)
        wide = [i for i, d in enumerate(dtypes)
                if d is not None and (isinstance(outs[i], _Wide)
                                      or np.dtype(outs[i].dtype) != narrow)]
        if not wide:
            break
        for i in wide:
            dtypes[i] = None

    def step(carry, x):
        outs = interp.eval_closed(p.body, [*consts, *carry, *x])
        return _carried(outs[:ncarry], dtypes, carry_avals), outs[ncarry:]

    carry, ys = lax.scan(step, _carried(init, dtypes, carry_avals), list(xs), length=p.length,
                         reverse=p.reverse, unroll=p.unroll, _split_transpose=p.split_transpose)
    return [*carry, *ys]


def _in_loop(handler):
    """``handler`` of a loop primitive, with the interpreter's ``loop_depth`` raised inside."""

    def run(interp: Autocast, eqn, invals):
        interp.loop_depth += 1
        try:
            return handler(interp, eqn, invals)
        finally:
            interp.loop_depth -= 1

    return run


def _wider(dtype, narrow) -> bool:
    return casting.is_float_dtype(dtype) and np.dtype(dtype).itemsize > narrow.itemsize


def _carried(values, dtypes, avals) -> list:
    """Loop carries: plain in the compute dtype where ``dtypes`` gives one, else in their
    original dtypes and kept wide (``Autocast.loop_carry``)."""
    out = []
    for v, d, a in zip(values, dtypes, avals):
        x = _unwrap(v)[0]
        if d is not None:
            out.append(_cast(x, d))
        else:
            x = _as_original(x, a)
            out.append(_Wide(x) if casting.is_float_dtype(a.dtype) else x)
    return out


def _body_shapes(interp: Autocast, body, consts, carry, xs) -> list:
    """The outputs (abstract values, ``_Wide`` marks included) of one iteration of ``body``
    under autocast, on ``consts``, ``carry`` and the slices of ``xs``."""
    def abstract(value, sliced=False):
        def leaf(x):
            aval = jax.typeof(x)
            return compat.abstract_like(aval, aval.shape[1:] if sliced else None)
        return jax.tree_util.tree_map(leaf, value)

    def run(consts, carry, xs):
        return interp.eval_closed(body, [*consts, *carry, *xs])

    return jax.eval_shape(run, [abstract(c) for c in consts], [abstract(c) for c in carry],
                          [abstract(x, sliced=True) for x in xs])


# How each kind of AutocastRules runs an equation (a field's name; None: no rule).
_RULES = {
    "low_precision": Autocast._low_precision,  # pylint: disable=protected-access
    "full_precision": Autocast._full_precision,  # pylint: disable=protected-access
    "bounded": Autocast._bounded,  # pylint: disable=protected-access
    "follow": Autocast._follow,  # pylint: disable=protected-access
    "passthrough": Autocast._passthrough,  # pylint: disable=protected-access
    None: Autocast._as_written,  # pylint: disable=protected-access
}

