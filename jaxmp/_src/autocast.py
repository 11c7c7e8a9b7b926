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
``custom_vjp`` are handled inside.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core

from jaxmp._src import casting

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

_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})

_F32 = np.dtype(np.float32)


def _is_float_dtype(dtype: Any) -> bool:
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # extended dtypes (typed PRNG keys)
        return False


def _is_half(dtype: Any) -> bool:
    return _is_float_dtype(dtype) and np.dtype(dtype).itemsize < 4


def _cast(x: Any, dtype: Any) -> Any:
    if x.dtype == dtype:
        return x
    return lax.convert_element_type(x, dtype)


def _wide(dtype: Any) -> np.dtype:
    """``dtype`` raised to at least float32 (float64 stays float64)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else _F32


class _Rules(NamedTuple):
    """The compute dtype and the rule sets of one ``autocast`` call."""

    compute_dtype: np.dtype
    low: frozenset
    full: frozenset
    follow: frozenset
    passthrough: frozenset


def _bind(eqn, invals: Sequence[Any], params: dict | None = None) -> list[Any]:
    """Binds the primitive of ``eqn`` as ``jax.core.eval_jaxpr`` does."""
    params = eqn.params if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    if isinstance(bind_params, tuple):  # JAX < 0.7: (subfuns, params)
        subfuns, bind_params = bind_params
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    else:
        out = eqn.primitive.bind(*invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _original_dtypes(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    return [_cast(x, a.dtype) if _is_float_dtype(a.dtype) else x for x, a in zip(values, avals)]


def _eval_jaxpr(jaxpr, consts, args, kept, rules: _Rules):
    """Evaluates ``jaxpr`` under ``rules``.

    ``kept[i]`` says whether ``args[i]`` must stay in float32 (see the module
    docstring). Returns the outputs and whether each output is kept.
    """
    env: dict[Any, tuple[Any, bool]] = {}

    def read(v):
        if isinstance(v, jex_core.Literal):
            return jnp.asarray(v.val, v.aval.dtype), False
        return env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = (c, False)
    for v, x, k in zip(jaxpr.invars, args, kept):
        env[v] = (x, k)

    for eqn in jaxpr.eqns:
        read_in = [read(v) for v in eqn.invars]
        invals = [x for x, _ in read_in]
        inkept = [k for _, k in read_in]
        outs, outkept = _eval_eqn(eqn, invals, inkept, rules)
        for v, x, k in zip(eqn.outvars, outs, outkept):
            env[v] = (x, k)

    results = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in results], [k for _, k in results]


def _eval_closed(closed, args, kept, rules):
    return _eval_jaxpr(closed.jaxpr, closed.consts, args, kept, rules)


def _eval_eqn(eqn, invals, inkept, rules: _Rules):
    name = eqn.primitive.name
    in_avals = [v.aval for v in eqn.invars]
    out_avals = [v.aval for v in eqn.outvars]
    floats = [i for i, a in enumerate(in_avals) if _is_float_dtype(getattr(a, "dtype", None))]

    if name in _CALLS and "jaxpr" in eqn.params:
        closed = eqn.params["jaxpr"]
        if isinstance(closed, jex_core.ClosedJaxpr):
            return _eval_closed(closed, invals, inkept, rules)
    if name in ("closed_call", "core_call") and "call_jaxpr" in eqn.params:
        return _eval_closed(eqn.params["call_jaxpr"], invals, inkept, rules)
    if name in _CHECKPOINTS:
        return _eval_checkpoint(eqn, invals, inkept, rules)
    if name == "scan":
        return _eval_scan(eqn, invals, inkept, rules)
    if name == "while":
        return _eval_while(eqn, invals, inkept, rules)
    if name == "cond":
        return _eval_cond(eqn, invals, inkept, rules)
    if name == "custom_jvp_call":
        return _eval_custom_jvp(eqn, invals, inkept, rules)
    if name == "custom_vjp_call":
        return _eval_custom_vjp(eqn, invals, inkept, rules)

    if not floats:
        # Integers, booleans, keys: exactly as written.
        return _bind(eqn, invals), [False] * len(out_avals)

    if name == "convert_element_type":
        (x,), (k,) = invals, inkept
        new = eqn.params["new_dtype"]
        if in_avals[0].dtype == new:
            # A weak-type or sharding adjustment: the value keeps its precision.
            return [x], [k]
        if not _is_float_dtype(new):
            return _bind(eqn, [x]), [False]
        # An explicit cast in ``fn``: respected; a cast up to float32 is kept there.
        return _bind(eqn, [x]), [np.dtype(new).itemsize >= 4]

    if name in rules.low:
        cast = list(invals)
        for i in floats:
            cast[i] = _cast(cast[i], rules.compute_dtype)
        params = dict(eqn.params)
        pref = params.get("preferred_element_type")
        if pref is not None and _is_float_dtype(pref):
            params["preferred_element_type"] = rules.compute_dtype
        return _bind(eqn, cast, params), [False] * len(out_avals)

    if name in rules.full:
        cast = list(invals)
        for i in floats:
            cast[i] = _cast(cast[i], _wide(in_avals[i].dtype))
        outs = _bind(eqn, cast)
        return outs, [_is_float_dtype(o.dtype) for o in outs]

    if name in rules.follow:
        dtypes = [invals[i].dtype for i in floats]
        if any(inkept[i] for i in floats):
            target = max((np.dtype(d) for d in dtypes), key=lambda d: d.itemsize)
            target = _wide(target)
            kept = True
        elif any(d == rules.compute_dtype for d in dtypes):
            target, kept = rules.compute_dtype, False
        else:
            target, kept = min((np.dtype(d) for d in dtypes), key=lambda d: d.itemsize), False
        cast = list(invals)
        for i in floats:
            cast[i] = _cast(cast[i], target)
        outs = _bind(eqn, cast)
        return outs, [kept and _is_float_dtype(o.dtype) for o in outs]

    if name in rules.passthrough:
        outs = _bind(eqn, invals)
        if len(outs) == len(invals):
            return outs, list(inkept)
        return outs, [False] * len(outs)

    # No rule: run exactly as written, in the original dtypes.
    return _bind(eqn, _original_dtypes(invals, in_avals)), [False] * len(out_avals)


def _eval_checkpoint(eqn, invals, inkept, rules):
    jaxpr = eqn.params["jaxpr"]
    record = {}

    def body(*xs):
        outs, kept = _eval_jaxpr(jaxpr, (), xs, inkept, rules)
        record["kept"] = kept
        return outs

    outs = jax.checkpoint(
        body, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
    )(*invals)
    return list(outs), record["kept"]


def _eval_scan(eqn, invals, inkept, rules):
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    body = p["jaxpr"]
    carry_avals = [v.aval for v in eqn.invars[nc:nc + ncarry]]
    consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
    consts_kept, xs_kept = inkept[:nc], inkept[nc + ncarry:]
    # Loop carries keep their dtypes, and are kept there inside the body.
    init = _original_dtypes(init, carry_avals)
    carry_kept = [_is_float_dtype(a.dtype) for a in carry_avals]
    record = {}

    def step(carry, x):
        outs, kept = _eval_closed(
            body, [*consts, *carry, *x], [*consts_kept, *carry_kept, *xs_kept], rules
        )
        new_carry = _original_dtypes(outs[:ncarry], carry_avals)
        record["kept"] = kept[ncarry:]
        return new_carry, outs[ncarry:]

    carry, ys = lax.scan(
        step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"],
        _split_transpose=p.get("_split_transpose", False),
    )
    return [*carry, *ys], [*carry_kept, *record["kept"]]


def _eval_while(eqn, invals, inkept, rules):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    ckept, bkept = inkept[:cn], inkept[cn:cn + bn]
    carry_avals = [v.aval for v in eqn.invars[cn + bn:]]
    init = _original_dtypes(init, carry_avals)
    carry_kept = [_is_float_dtype(a.dtype) for a in carry_avals]

    def cond_fun(carry):
        (pred,), _ = _eval_closed(p["cond_jaxpr"], [*cconsts, *carry], [*ckept, *carry_kept], rules)
        return pred

    def body_fun(carry):
        outs, _ = _eval_closed(p["body_jaxpr"], [*bconsts, *carry], [*bkept, *carry_kept], rules)
        return _original_dtypes(outs, carry_avals)

    outs = lax.while_loop(cond_fun, body_fun, list(init))
    return list(outs), carry_kept


def _eval_cond(eqn, invals, inkept, rules):
    branches = eqn.params["branches"]
    index, ops, ops_kept = invals[0], invals[1:], inkept[1:]
    out_avals = [v.aval for v in eqn.outvars]

    def branch_fn(closed, record):
        def run(*xs):
            outs, kept = _eval_closed(closed, xs, ops_kept, rules)
            record.append(kept)
            return outs
        return run

    # All branches must agree on the output dtypes: where they do not, use the
    # dtype of the original program.
    records = [[] for _ in branches]
    shapes = [jax.eval_shape(branch_fn(b, r), *ops) for b, r in zip(branches, records)]
    dtypes, kept = [], []
    for i, aval in enumerate(out_avals):
        ds = {s[i].dtype for s in shapes}
        dtypes.append(ds.pop() if len(ds) == 1 else aval.dtype)
        kept.append(any(r[-1][i] for r in records) and _is_float_dtype(dtypes[-1]))

    def final(closed):
        def run(*xs):
            outs, _ = _eval_closed(closed, xs, ops_kept, rules)
            return [_cast(o, d) for o, d in zip(outs, dtypes)]
        return run

    outs = lax.switch(index, [final(b) for b in branches], *ops)
    return list(outs), kept


def _primal_and_original(eqn, inkept, rules):
    """For a custom_jvp/custom_vjp call: its body under autocast, and the call as written.

    ``record["kept"]`` holds, once ``primal`` has run, which of its outputs are
    kept in float32.
    """
    record = {}

    def primal(*xs):
        outs, kept = _eval_closed(eqn.params["call_jaxpr"], xs, inkept, rules)
        record["kept"] = kept
        return outs

    def original(*xs):
        return _bind(eqn, xs)

    return primal, original, record


def _eval_custom_jvp(eqn, invals, inkept, rules):
    """The primal runs under autocast; the derivative is the function's own rule.

    The custom rule is evaluated by binding the original primitive on operands
    cast back to their original dtypes, and its tangents are cast to the
    dtypes of the autocast primal outputs.
    """
    in_avals = [v.aval for v in eqn.invars]
    primal, original, record = _primal_and_original(eqn, inkept, rules)

    fun = jax.custom_jvp(primal)

    @fun.defjvp
    def _(primals, tangents):
        outs = fun(*primals)
        orig_primals = _original_dtypes(primals, in_avals)
        orig_tangents = [
            _cast(t, a.dtype) if _is_float_dtype(a.dtype) else t
            for t, a in zip(tangents, in_avals)
        ]
        _, out_tangents = jax.jvp(original, tuple(orig_primals), tuple(orig_tangents))
        out_tangents = [
            _cast(t, o.dtype) if _is_float_dtype(o.dtype) else t for t, o in zip(out_tangents, outs)
        ]
        return outs, out_tangents

    outs = fun(*invals)
    return list(outs), record["kept"]


def _eval_custom_vjp(eqn, invals, inkept, rules):
    """The primal runs under autocast; the derivative is the function's own rule.

    Under differentiation the original forward rule runs too (in the original
    dtypes) to produce the residuals its backward rule expects; whatever of it
    the residuals do not need is removed by dead-code elimination.
    """
    in_avals = [v.aval for v in eqn.invars]
    primal, original, record = _primal_and_original(eqn, inkept, rules)

    fun = jax.custom_vjp(primal)

    in_dtypes = [x.dtype for x in invals]

    def fwd(*xs):
        outs = primal(*xs)
        _, vjp_fn = jax.vjp(original, *_original_dtypes(xs, in_avals))
        return outs, vjp_fn

    def bwd(vjp_fn, cts):
        cts = [_cast(c, a.dtype) if _is_float_dtype(a.dtype) else c
               for c, a in zip(cts, [v.aval for v in eqn.outvars])]
        in_cts = vjp_fn(cts)
        return tuple(
            _cast(c, d) if _is_float_dtype(d) else None for c, d in zip(in_cts, in_dtypes)
        )

    fun.defvjp(fwd, bwd)
    outs = fun(*invals)
    return list(outs), record["kept"]


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
                    return not _is_float_dtype(params[key]) or _is_half(params[key])
                except TypeError:
                    break
        dtypes = [a.dtype for a in avals if _is_float_dtype(getattr(a, "dtype", None))]
        return not dtypes or all(_is_half(d) for d in dtypes)

    return policy


def autocast(
    fn: Callable,
    compute_dtype: Any = jnp.bfloat16,
    *,
    low_precision: Iterable[str] = LOW_PRECISION,
    full_precision: Iterable[str] = FULL_PRECISION,
    follow: Iterable[str] = FOLLOW,
    passthrough: Iterable[str] = PASSTHROUGH,
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

    With ``recompute_float32=True`` (the default for a half-precision
    ``compute_dtype``) the float32 intermediates are not kept for the
    backward pass: they are recomputed there from the half-precision values
    around them (``jax.checkpoint`` with a policy that saves only
    half-precision values and matrix products). The recomputed work is
    elementwise operations and reductions, never a matrix product. It shrinks
    what is kept for the backward pass (3.8x less than float32 on the
    benchmark ViT, against 2x for casting everything), but not the peak:
    float32 softmax and normalisation temporaries still exist while they are
    computed, and XLA's estimate of the whole step stays above that of casting
    every input to half precision.

    Args:
        fn: any JAX function of arrays and pytrees of arrays; non-array
            leaves (Python numbers, strings, ...) are treated as constants.
        compute_dtype: the dtype of matrix products: ``jnp.bfloat16``
            (default), ``jnp.float16`` or ``jnp.float32``.
        low_precision: primitive names run in ``compute_dtype``.
        full_precision: primitive names run in float32.
        follow: primitive names run in the narrowest dtype of their operands.
        passthrough: primitive names whose operands keep their own dtypes.
        recompute_float32: recompute float32 intermediates in the backward
            pass instead of saving them.

    The defaults are the module-level frozensets, also available as
    attributes of this function (``jaxmp.autocast.FULL_PRECISION``...); to
    change a rule, pass a new set, e.g.
    ``full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"}``.

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
    for label, rule in (("low_precision", low_precision), ("full_precision", full_precision),
                        ("follow", follow), ("passthrough", passthrough)):
        if isinstance(rule, str) or not all(isinstance(n, str) for n in rule):
            raise TypeError(f"{label} must be a collection of primitive names (strings).")
    rules = _Rules(compute_dtype, frozenset(low_precision), frozenset(full_precision),
                   frozenset(follow), frozenset(passthrough))
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
            outs, _ = _eval_jaxpr(closed.jaxpr, consts, dyn, [False] * len(dyn), rules)
            return [_cast(o, a.dtype) if _is_float_dtype(a.dtype) else o
                    for o, a in zip(outs, out_avals)]

        if recompute:
            run = jax.checkpoint(run, policy=_recompute_policy(rules.low))
        outs = run(list(closed.consts), dyn)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

    return wrapped


autocast.LOW_PRECISION = LOW_PRECISION
autocast.FULL_PRECISION = FULL_PRECISION
autocast.FOLLOW = FOLLOW
autocast.PASSTHROUGH = PASSTHROUGH
