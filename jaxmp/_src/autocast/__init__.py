"""Automatic mixed precision per operation: ``autocast``.

``autocast(fn)`` traces ``fn`` to a jaxpr and evaluates it again, one equation
at a time, choosing the precision of every operation from plain sets of
primitive names. The package, in the order a call goes through it:

* ``rules.py``: :class:`AutocastRules`, which primitive runs in which precision
  (``low_precision``, ``full_precision``, ``bounded``, ``follow``,
  ``passthrough``, or as written), and the default sets;
* ``analysis.py``: what is read from the traced program before it is
  evaluated, from the rules alone: which values must stay wide, which
  collectives may move narrowed, which exponentials may run in half precision;
* ``interpreter.py``: the evaluation itself, each equation in the precision
  its rule and those analyses give it, values computed in float32 *kept*
  there until they are narrowed;
* ``recompute.py``: with ``recompute_float32``, the interpreter's program
  evaluated once more, each connected float32 region recomputed in the
  backward pass instead of saved.

This module holds the public function, which checks its arguments and wires
the four together; the other modules do not import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp

from jaxmp._src import casting
from jaxmp._src import census
from jaxmp._src import compat
from jaxmp._src import float8
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src import shortfall
from jaxmp._src.autocast import analysis
from jaxmp._src.autocast import interpreter as interpreter_lib
from jaxmp._src.autocast import recompute as recompute_lib
from jaxmp._src.autocast.rules import AutocastRules
from jaxmp._src.autocast.rules import BOUNDED
from jaxmp._src.autocast.rules import FOLLOW
from jaxmp._src.autocast.rules import FULL_PRECISION
from jaxmp._src.autocast.rules import LOW_PRECISION
from jaxmp._src.autocast.rules import PASSTHROUGH


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
    * ``full_precision`` (sums, products, cumulative sums, scatter-adds such
      as ``jax.ops.segment_sum``'s, ``exp``, ``log``, powers, ``sqrt``,
      ``rsqrt``, ``erf``, ...): floating operands in float32, result in
      float32. Softmax, log-softmax, ``logsumexp`` and the mean and
      variance of a normalisation are made of these, so they run in float32;
    * ``bounded`` (``tanh``, ``logistic``): saturating functions; like
      ``follow``, except that a float32 operand is narrowed to
      ``compute_dtype`` first (``tanh(inf)`` is still 1);
    * ``follow`` (arithmetic, comparisons, reshapes, slices, ``max``...): the
      narrowest dtype of the operands, so a float32 bias, scale or positional
      embedding meeting a half-precision activation is cast down. A
      ``gather`` of half-precision values runs on a float32 operand, its
      result narrowed back (exact), so that its transpose in the backward
      pass, a scatter-add of the cotangents, sums in float32;
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
            (by default all but an attention's ``q @ k.T`` and ``probs @ v``
            and convolutions, where float8 does not pay: said once by a
            :class:`jaxmp.experimental.Float8PlacementWarning`) runs with float8
            operands, each scaled per tensor from its
            current absolute maximum, accumulating in float32, its result in
            ``compute_dtype``; its backward products take the cotangent in
            ``float8_e5m2``. A convolution asked for in float8 runs its forward
            product and, with unit strides, its input gradient in float8, the rest in
            ``compute_dtype`` (XLA's GPU compiler runs only forward
            convolutions in float8). See ``docs/float8.md``.
        float8_rules: a :class:`jaxmp.experimental.Float8Rules`: which products stay in
            ``compute_dtype`` under a float8 ``matmul_dtype`` (default
            ``jaxmp.experimental.Float8Rules()``: those float8 does not pay
            for; ``include=`` asks for them).
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
            :class:`jaxmp.experimental.Float8ShortfallWarning`. ``"nvfp4"`` (with
            ``matmul_dtype=jnp.float4_e2m1fn``): NVIDIA's 4-bit recipe,
            ``float4_e2m1fn`` elements with a ``float8_e4m3fn`` scale per 16
            and a float32 scale per tensor, 16x16 weight tiles, a random
            Hadamard transform on weight gradients and stochastic rounding of
            gradients, its output head (``head`` scopes) and attention's
            batched products kept in ``compute_dtype``; a :class:`jaxmp.experimental.NVFP4` turns its
            parts off. Native on the same GPUs as ``"mxfp8"``, with the same
            fallback. ``"delayed"``: one power-of-two scale per tensor from an
            amax history of the last steps (Transformer Engine's recipe): the
            function then takes a keyword ``float8_state=`` (:func:`jaxmp.experimental.init_float8_state`), which
            it reads only; :func:`jaxmp.mp_value_and_grad` returns it updated.
            See ``docs/float8.md``.

    The default sets are also attributes of this function
    (``jaxmp.autocast.FULL_PRECISION``...); to change a rule, pass a new set,
    e.g. ``full_precision=jaxmp.autocast.FULL_PRECISION | {"tanh"}``.

    Returns:
        A function with the signature and output dtypes of ``fn``.

    Raises:
        ValueError: for an unknown ``float8_scaling``, or ``"mxfp8"`` without
            ``matmul_dtype=jnp.float8_e4m3fn`` (``"nvfp4"`` without
            ``jnp.float4_e2m1fn``; the message says the fix).
        TypeError: with ``float8_scaling="delayed"``, when the call has no
            ``float8_state=`` (the message says the fix).

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
    if float8_rules is None:  # the recipe's own (NVFP4 keeps its output head), or none
        float8_rules = float8_recipe.rules or float8.Float8Rules()
    if not isinstance(float8_rules, float8.Float8Rules):
        raise TypeError(
            "float8_rules must be a jaxmp.experimental.Float8Rules, got "
            f"{type(float8_rules).__name__}.")
    overrides = {"low_precision": low_precision, "full_precision": full_precision,
                 "follow": follow, "passthrough": passthrough, "bounded": bounded}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides:
        rules = dataclasses.replace(rules, **overrides)
    recompute = recompute_float32 and casting.is_narrow_dtype(compute_dtype)

    def run_autocast(closed, dyn, margin=None):
        from_inputs = None
        if matmul_dtype is not None:  # says, once, which products cannot run in float8
            from_inputs = jaxprs.read_from_inputs(closed.jaxpr)
            shortfall.warn_if_float8_shortfall(closed, rules, float8_rules, compute_dtype,
                                               matmul_dtype, float8_recipe,
                                               [census.is_differentiated(x) for x in dyn],
                                               from_inputs)
        out_avals = closed.out_avals
        keep = analysis.narrow_safe(closed, rules)
        # Under float8 the products quantize their operands from float32: a collective
        # narrowed to compute_dtype first would round twice, so it moves as written.
        early = analysis.narrow_early(closed, rules) if matmul_dtype is None else frozenset()
        interpreter = interpreter_lib.Autocast(compute_dtype, rules, keep, matmul_dtype,
                                               float8_rules, analysis.shifted_exps(closed, keep),
                                               early, float8_recipe,
                                               analysis.broadcast_sizes(closed), from_inputs)
        consts = list(closed.consts)

        def run(*flat):
            # A recipe with state (float8_scaling="delayed"): its products read their rows of
            # the history, the first input (see _with_state).
            with (contextlib.nullcontext() if margin is None
                  else float8_recipe.state.session(flat[len(consts)], margin)):
                outs = interpreter.eval_jaxpr(closed.jaxpr, flat[:len(consts)],
                                              flat[len(consts):])
            return [interpreter.to_original(o, a) for o, a in zip(outs, out_avals)]

        # Forward mode (jax.jvp, jacfwd, hessian) cannot go through the custom_vjp that ties
        # the recomputation to the cotangent; it has no backward pass to save memory in.
        if recompute and not compat.in_forward_mode(dyn):
            program = jax.make_jaxpr(run)(*consts, *dyn)
            return recompute_lib.eval_with_regions(
                program, [*consts, *dyn], recompute_lib.recompute_policy(rules.low_precision))
        return run(*consts, *dyn)

    if matmul_dtype is not None and float8_recipe.state is not None:
        return _with_state(fn, float8_recipe.state, run_autocast)
    return functools.wraps(fn)(interpret.transform(fn, run_autocast))


def _with_state(fn: Callable, spec: Any, run_autocast: Callable) -> Callable:
    """``fn`` under autocast with a recipe that reads state: a keyword ``float8_state=``.

    The state's history is traced as the first input of the jaxpr, which
    ``run_autocast`` hands to the products (read only: the gradient step
    returns it updated, ``jaxmp.mp_value_and_grad``).
    """

    @functools.wraps(fn)
    def transformed(*args, float8_state=None, **kwargs):
        state = spec.check(float8_state)
        run = functools.partial(run_autocast, margin=state.margin)
        return interpret.transform(lambda h, a, k: fn(*a, **k), run)(state.history, args, kwargs)

    return transformed


def init_float8_state(fn: Callable, *args: Any, window: int = 16, margin: int = 1,
                      compute_dtype: Any = jnp.bfloat16, matmul_dtype: Any = jnp.float8_e4m3fn,
                      float8_rules: Any = None, autocast_rules: Any = None, **kwargs: Any):
    """The amax history of ``float8_scaling="delayed"`` for ``fn``, with nothing recorded yet.

    Traces ``fn(*args, **kwargs)`` once (no computation) under :func:`jaxmp.autocast`
    with these options, which must be those of the step, to count its float8
    products: one row of history per product, for its left operand, right operand
    and cotangent, ``window`` steps each (Transformer Engine's default, 16). Each
    tensor's scale is then ``margin`` powers of two below what the largest amax of
    its window needs. The first step, with nothing recorded, quantises with scale
    1; the following ones from the history. Products inside loops (``lax.scan``)
    have no row: they scale from their own amax.

    Returns:
        A ``Float8State`` (a pytree: ``history``, float32 ``[products, 3, window]``
        of scale exponents), to pass as ``float8_state=`` to the function of
        :func:`jaxmp.mp_value_and_grad` (``float8_scaling="delayed"``), which
        returns it updated as a fifth value.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w[0]) @ w[1])
        >>> w, x = jnp.ones((2, 16, 16)) / 16, jnp.ones((8, 16))
        >>> h = jaxmp.experimental.init_float8_state(loss_fn, w, x, window=4)
        >>> h.history.shape  # two products, three tensors each, four steps
        (2, 3, 4)
        >>> step = jax.jit(jaxmp.mp_value_and_grad(
        ...     loss_fn, matmul_dtype=jnp.float8_e4m3fn, float8_scaling="delayed"))
        >>> loss, grads, s, finite, h = step(w, x, scaler_state=jaxmp.noop_scaler(),
        ...                                  float8_state=h)
        >>> h.history[0, :, 0].tolist()  # this step's scale exponents: x, w[0], cotangent
        [-8.0, -12.0, -24.0]
    """
    casting.check_function(fn, "jaxmp.experimental.init_float8_state",
                           "init_float8_state(loss_fn, *example_args, window=16)")
    rules = {} if autocast_rules is None else {"rules": autocast_rules}
    run = autocast(fn, compute_dtype, matmul_dtype=matmul_dtype, float8_rules=float8_rules,
                   float8_scaling="delayed", **rules)
    spec = float8.RECIPES["delayed"].state
    probe = spec.empty(0, 1, margin)
    with spec.session(None, margin) as counted:
        jax.eval_shape(lambda a, k: run(*a, float8_state=probe, **k), args, kwargs)
    return spec.empty(counted.count, window, margin)


autocast.LOW_PRECISION = LOW_PRECISION
autocast.FULL_PRECISION = FULL_PRECISION
autocast.FOLLOW = FOLLOW
autocast.PASSTHROUGH = PASSTHROUGH
autocast.BOUNDED = BOUNDED
