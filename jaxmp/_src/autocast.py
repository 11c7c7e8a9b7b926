"""Automatic mixed precision per operation: ``autocast``.

``autocast(fn)`` traces ``fn`` to a jaxpr and evaluates it again, one equation
at a time, choosing the precision of every operation from plain sets of
primitive names:

* ``low_precision`` (matrix products, convolutions): operands are cast to the
  compute dtype, and so is the result;
* ``full_precision`` (sums, products, cumulative sums, exp/log and friends,
  powers, square roots, ...): floating operands are cast up to float32 and the
  result is float32;
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
precision. They are narrowed only where the precision is chosen explicitly:
at the operands of a matrix product, by an explicit cast in ``fn``, and at
the outputs of ``fn``, which keep the dtypes ``fn`` gives them.

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
from jaxmp._src import interpret

# Matrix products and convolutions: run in the compute dtype.
LOW_PRECISION = frozenset({"dot_general", "conv_general_dilated"})

# Numerically sensitive operations: run in (at least) float32.
FULL_PRECISION = frozenset({
    # Sums and products whose result outgrows its inputs.
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
    "reduce_window_sum",
    # Exponentials, logarithms, powers and roots.
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "sqrt", "rsqrt", "cbrt",
    # Functions that overflow or lose their tails in half precision.
    "sinh", "cosh", "tan", "asin", "acos", "atanh", "erf", "erfc", "erf_inv",
    "lgamma", "digamma", "igamma", "igammac", "igamma_grad_a", "polygamma", "zeta",
    "bessel_i0e", "bessel_i1e", "random_gamma_grad", "regularized_incomplete_beta",
})

# Operations that run in the narrowest floating dtype of their operands.
FOLLOW = frozenset({
    "add", "sub", "mul", "div", "neg", "max", "min", "abs", "sign", "floor", "ceil",
    "round", "is_finite", "nextafter", "rem", "atan2", "tanh", "logistic", "sin",
    "cos", "atan", "asinh", "acosh", "select_n", "clamp", "eq", "ne", "lt", "le",
    "gt", "ge", "broadcast_in_dim", "reshape", "transpose", "squeeze",
    "expand_dims", "slice", "dynamic_slice", "dynamic_update_slice", "gather",
    "concatenate", "pad", "rev", "reduce_max", "reduce_min", "argmax", "argmin",
    "cummax", "cummin", "reduce_window_max", "reduce_window_min", "stop_gradient",
    "copy", "copy_p", "reduce_precision", "top_k", "split",
})

# Operations whose operands are independent: each keeps its own dtype.
PASSTHROUGH = frozenset({
    "optimization_barrier", "name", "sharding_constraint", "mesh_cast", "reshard",
    "device_put", "psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all",
    "psum_scatter", "reduce_scatter", "pbroadcast", "pvary", "pcast", "sort",
})

_RULE_FIELDS = ("low_precision", "full_precision", "follow", "passthrough")
_DEFAULT_SETS = {"low_precision": LOW_PRECISION, "full_precision": FULL_PRECISION,
                 "follow": FOLLOW, "passthrough": PASSTHROUGH}
_SET_NAMES = {"low_precision": "LOW_PRECISION", "full_precision": "FULL_PRECISION",
              "follow": "FOLLOW", "passthrough": "PASSTHROUGH"}


def _describe(field: str, names: frozenset) -> str:
    """A short expression for a rule set, relative to its default."""
    default = _DEFAULT_SETS[field]
    added, removed = sorted(names - default), sorted(default - names)
    if len(added) + len(removed) > 6:
        return f"<{len(names)} names>"
    text = _SET_NAMES[field]
    if added:
        text += " | {" + ", ".join(repr(n) for n in added) + "}"
    if removed:
        text += " - {" + ", ".join(repr(n) for n in removed) + "}"
    return text


@dataclasses.dataclass(frozen=True)
class AutocastRules:
    """Which primitives :func:`jaxmp.autocast` runs in which precision.

    Each field is a set of primitive names (``jax.make_jaxpr`` shows them);
    the sets are checked in this order: ``low_precision`` (run in the compute
    dtype), ``full_precision`` (run in float32), ``follow`` (run in the
    narrowest dtype of their operands), ``passthrough`` (each operand keeps
    its dtype). A primitive in none of them runs as written. The defaults are
    ``jaxmp.autocast.LOW_PRECISION``, ``FULL_PRECISION``, ``FOLLOW`` and
    ``PASSTHROUGH``. Its ``repr`` names only what differs from them.

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

    def __post_init__(self):
        for field in _RULE_FIELDS:
            names = getattr(self, field)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"AutocastRules.{field} must be a collection of primitive names (strings), "
                    f"e.g. {{'exp', 'log'}}; got {names!r}.")
            object.__setattr__(self, field, frozenset(names))

    def __repr__(self) -> str:
        changed = [f"{f}={_describe(f, getattr(self, f))}" for f in _RULE_FIELDS
                   if getattr(self, f) != _DEFAULT_SETS[f]]
        return f"AutocastRules({', '.join(changed)})"


@jax.tree_util.register_pytree_node_class
class _Wide:
    """A floating value *kept* wide: not narrowed by ``follow`` operations.

    The interpreter's values are arrays (not kept) or ``_Wide`` nodes; being
    a pytree node, the mark travels through loops, branches and custom
    derivative rules as static structure.
    """

    __slots__ = ("x",)

    def __init__(self, x):
        self.x = x

    def tree_flatten(self):
        return (self.x,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(*children)


def _unwrap(value) -> tuple[Any, bool]:
    return (value.x, True) if isinstance(value, _Wide) else (value, False)


def _is_half(dtype: Any) -> bool:
    return casting.is_float_dtype(dtype) and np.dtype(dtype).itemsize < 4


def _cast(x: Any, dtype: Any) -> Any:
    if x.dtype == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def _as_original(x: Any, aval: Any) -> Any:
    return _cast(x, aval.dtype) if casting.is_float_dtype(aval.dtype) else x


class _Autocast(interpret.Interpreter):
    """The interpreter of one ``autocast`` call: its compute dtype and rules."""

    def __init__(self, compute_dtype: np.dtype, rules: AutocastRules):
        super().__init__()
        self.compute_dtype = compute_dtype
        self.rules = rules

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
            targets.append((dtype, casting.is_float_dtype(dtype) and any(k for _, k in outs)))

        def fix(outs):
            fixed = []
            for v, (dtype, kept) in zip(outs, targets):
                x = _cast(_unwrap(v)[0], dtype)
                fixed.append(_Wide(x) if kept else x)
            return fixed

        return fix

    def to_original(self, value, aval):
        return _as_original(_unwrap(value)[0], aval)

    def from_original(self, array, like):
        like_x, kept = _unwrap(like)
        if not casting.is_float_dtype(like_x.dtype):
            return None if array is None else array
        x = _cast(array, like_x.dtype)
        return _Wide(x) if kept else x

    def first_order(self, eqn, invals):
        unwrapped = [_unwrap(v) for v in invals]
        xs = [x for x, _ in unwrapped]
        outs, kept = self._rule(eqn, xs, [k for _, k in unwrapped])
        return [_Wide(x) if k else x for x, k in zip(outs, kept)]

    def _rule(self, eqn, invals, inkept):
        """The outputs of one first-order equation and whether each is kept wide."""
        name = eqn.primitive.name
        rules = self.rules
        in_avals = [v.aval for v in eqn.invars]
        nout = len(eqn.outvars)
        floats = [i for i, a in enumerate(in_avals)
                  if casting.is_float_dtype(getattr(a, "dtype", None))]

        if not floats:
            # Integers, booleans, keys: exactly as written.
            return interpret.bind(eqn, invals), [False] * nout

        if name == "convert_element_type":
            (x,), (k,) = invals, inkept
            new = eqn.params["new_dtype"]
            if in_avals[0].dtype == new:
                # A weak-type or sharding adjustment: the value keeps its precision.
                return [x], [k]
            if not casting.is_float_dtype(new):
                return interpret.bind(eqn, [x]), [False]
            # An explicit cast in ``fn``: respected; a cast up to float32 is kept there.
            return interpret.bind(eqn, [x]), [np.dtype(new).itemsize >= 4]

        if name in rules.low_precision:
            cast = list(invals)
            for i in floats:
                cast[i] = _cast(cast[i], self.compute_dtype)
            params = dict(eqn.params)
            pref = params.get("preferred_element_type")
            if pref is not None and casting.is_float_dtype(pref):
                params["preferred_element_type"] = self.compute_dtype
            return interpret.bind(eqn, cast, params), [False] * nout

        if name in rules.full_precision:
            cast = list(invals)
            for i in floats:
                cast[i] = _cast(cast[i], casting.wide_dtype(in_avals[i].dtype))
            outs = interpret.bind(eqn, cast)
            return outs, [casting.is_float_dtype(o.dtype) for o in outs]

        if name in rules.follow:
            dtypes = [np.dtype(invals[i].dtype) for i in floats]
            if any(inkept[i] for i in floats):
                target = casting.wide_dtype(max(dtypes, key=lambda d: d.itemsize))
                kept = True
            elif self.compute_dtype in dtypes:
                target, kept = self.compute_dtype, False
            else:
                target, kept = min(dtypes, key=lambda d: d.itemsize), False
            cast = list(invals)
            for i in floats:
                cast[i] = _cast(cast[i], target)
            outs = interpret.bind(eqn, cast)
            return outs, [kept and casting.is_float_dtype(o.dtype) for o in outs]

        if name in rules.passthrough:
            outs = interpret.bind(eqn, invals)
            if len(outs) == len(invals):
                return outs, list(inkept)
            return outs, [False] * nout

        # No rule: run exactly as written, in the original dtypes.
        return (interpret.bind(eqn, [_as_original(x, a) for x, a in zip(invals, in_avals)]),
                [False] * nout)


def _recompute_policy(low: frozenset) -> Callable:
    """A ``jax.checkpoint`` policy that saves only half-precision and non-float values.

    Float32 intermediates of the autocast program (sums, exponentials,
    normalisation statistics, ...) are then recomputed in the backward pass
    from the half-precision values around them; matrix products are always
    saved, never recomputed.
    """

    always = low | LOW_PRECISION

    def policy(prim, *avals, **params):
        if prim.name in always:
            return True
        for key in ("new_dtype", "dtype"):
            if key in params and params[key] is not None:
                try:
                    return not casting.is_float_dtype(params[key]) or _is_half(params[key])
                except TypeError:
                    break
        dtypes = [a.dtype for a in avals if casting.is_float_dtype(getattr(a, "dtype", None))]
        return not dtypes or all(_is_half(d) for d in dtypes)

    return policy


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
) -> Callable:
    """Runs ``fn`` with a precision chosen per operation, like ``torch.autocast``.

    ``fn`` is written in float32 and is not changed. Every call traces it to a
    jaxpr and evaluates that jaxpr again with these rules (the rule sets are
    sets of primitive names, checked in this order):

    * ``low_precision`` (``dot_general``, ``conv_general_dilated``): operands
      in ``compute_dtype``, result in ``compute_dtype``;
    * ``full_precision`` (sums, products, cumulative sums, ``exp``, ``log``,
      powers, ``sqrt``, ``rsqrt``, ``erf``, ...): floating operands in float32,
      result in float32. Softmax, log-softmax, ``logsumexp`` and the mean and
      variance of a normalisation are made of these, so they run in float32;
    * ``follow`` (arithmetic, comparisons, ``tanh``, reshapes, slices,
      ``max``...): the narrowest dtype of the operands, so a float32 bias,
      scale or positional embedding meeting a half-precision activation is
      cast down. Values that come out of a float32 operation are not
      narrowed here: an operation mixing one with a half-precision value runs
      in float32. They are narrowed only at the operands of a matrix product,
      by explicit casts in ``fn`` and at the outputs of ``fn``;
    * ``passthrough`` (collectives, ``sort``, sharding annotations): each
      operand keeps its dtype;
    * any other primitive runs as written, in its original dtypes.

    Integer, boolean and key values are never touched; loop carries keep
    their dtypes; nested ``jit``, ``scan``, ``while_loop``, ``cond``,
    ``checkpoint``, ``custom_jvp`` and ``custom_vjp`` are handled inside (a
    custom derivative rule is kept and evaluated in the original dtypes, so
    e.g. ``jax.nn.relu`` keeps its gradient at 0).

    The result is an ordinary function: ``jit``, ``vmap`` and ``grad`` work on
    it, its outputs have the dtypes ``fn`` gives them, gradients with respect
    to float32 inputs are float32 and the backward pass of a half-precision
    matrix product runs in half precision.

    What is kept in float32, and what it costs: the outputs of
    ``full_precision`` operations and what is computed from them (a softmax
    normaliser, a variance) until a matrix product, an explicit cast or the
    output of ``fn`` narrows them; loop carries of float32 loops. These
    values are twice the size of half-precision ones, and every change of
    precision is a conversion XLA has to run.

    With ``recompute_float32=True`` (the default for a half-precision
    ``compute_dtype``) those float32 intermediates are not kept for the
    backward pass: they are recomputed there from the half-precision values
    around them (``jax.checkpoint`` with a policy that saves only
    half-precision values and matrix products). The recomputed work is
    elementwise operations and reductions, never a matrix product: less
    memory kept for the backward pass, more time in it.

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
            pass instead of saving them.

    The default sets are also attributes of this function
    (``jaxmp.autocast.FULL_PRECISION``...); to change a rule, pass a new set,
    e.g. ``full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"}``.

    Returns:
        A function with the signature and output dtypes of ``fn``.

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
    """
    compute_dtype = casting.canonical_float_dtype(
        compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype"
    )
    if not isinstance(rules, AutocastRules):
        raise TypeError(f"rules must be a jaxmp.AutocastRules, got {type(rules).__name__}.")
    overrides = {"low_precision": low_precision, "full_precision": full_precision,
                 "follow": follow, "passthrough": passthrough}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        rules = dataclasses.replace(rules, **overrides)
    interpreter = _Autocast(compute_dtype, rules)
    recompute = recompute_float32 and _is_half(compute_dtype)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        positions = [i for i, x in enumerate(leaves) if casting.is_array(x)]

        def flat_fn(*dyn):
            full = list(leaves)
            for i, x in zip(positions, dyn):
                full[i] = x
            call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, full)
            return fn(*call_args, **call_kwargs)

        dyn = [leaves[i] for i in positions]
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dyn)
        out_avals = closed.out_avals

        def run(consts, dyn):
            outs = interpreter.eval_jaxpr(closed.jaxpr, consts, dyn)
            return [interpreter.to_original(o, a) for o, a in zip(outs, out_avals)]

        if recompute:
            run = jax.checkpoint(run, policy=_recompute_policy(rules.low_precision))
        outs = run(list(closed.consts), dyn)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped


autocast.LOW_PRECISION = LOW_PRECISION
autocast.FULL_PRECISION = FULL_PRECISION
autocast.FOLLOW = FOLLOW
autocast.PASSTHROUGH = PASSTHROUGH
