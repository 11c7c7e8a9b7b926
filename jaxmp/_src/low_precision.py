"""Half-precision parameters and optimizer state that train like float32.

:func:`low_precision_optimizer` wraps any optax transformation so that the
whole training state can live in bfloat16 (or float16): the inner optimizer's
state is stored in ``state_dtype`` between steps and widened to float32 for
the update, and the float32 update is added to half-precision parameters with
a rounding that does not lose small updates:

* ``"nearest"``: round to nearest, what ``optax.apply_updates`` does. An
  update smaller than half a unit in the last place (ulp) of a parameter is
  lost, so slow-moving parameters stall: the baseline the other two fix.
* ``"stochastic"``: round up or down at random with the probabilities that
  make the expected parameter equal the float32 sum (unbiased). The random
  bits are a hash of each element's global index and a key kept in the state.
* ``"kahan"``: keep what rounding lost in a compensation buffer (in the
  parameters' dtype) and add it back on the next step (Kahan summation).

For half-precision parameters the returned updates are float32: the exact
difference between the rounded and the current parameters, so that
``optax.apply_updates(params, updates)`` (which adds in float32 and rounds
back to the parameters' dtype) and :func:`jaxmp.optimizer_update` produce
exactly the rounded parameters, bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxmp._src import casting
from jaxmp._src import sharding

PyTree = Any

class _Rounding(NamedTuple):
    """How one ``param_rounding`` updates a half-precision parameter."""

    keyed: bool  # draws random bits (a PRNG key in the state)
    compensated: bool  # keeps what rounding lost (a Kahan buffer in the state)


# The roundings of low_precision_optimizer, by name (the order of the docs).
ROUNDINGS = {
    "nearest": _Rounding(keyed=False, compensated=False),
    "stochastic": _Rounding(keyed=True, compensated=False),
    "kahan": _Rounding(keyed=False, compensated=True),
}


@struct.dataclass
class LowPrecisionState:
    """The state of :func:`jaxmp.experimental.low_precision_optimizer`.

    The settings (``state_dtype``, ``param_rounding``) live in the
    transformation, not here: this holds only numbers, so it checkpoints and
    crosses ``jit``/``lax.scan`` like any optax state.

    Reading a field that this class does not have reads it from ``inner``:
    ``state.gradient_step`` of a wrapped ``optax.MultiSteps``,
    ``state.hyperparams`` of ``optax.inject_hyperparams``. (Writing goes to
    ``state.replace(inner=...)``, as for any state.)

    Attributes:
        inner: the inner optimizer's state. Its floating-point array leaves
            with at least one dimension are stored in ``state_dtype``; scalar
            floating leaves (hyperparameters of ``optax.inject_hyperparams``,
            schedule values) and integer leaves (step counts) keep their dtype.
        key: for ``"stochastic"`` rounding, the raw ``uint32[2]`` PRNG key data
            the next step's random bits come from; it advances on every step
            (a step skipped by :func:`jaxmp.optimizer_update` leaves it as it
            was). ``None`` for the other roundings.
        compensation: for ``"kahan"``, a tree like the parameters holding, for
            each half-precision parameter, what rounding has lost so far, in
            the parameter's dtype (``None`` for float32 parameters). ``None``
            for the other roundings.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jaxmp
        >>> tx = jaxmp.experimental.low_precision_optimizer(optax.adam(1e-3),
        ...                                                 param_rounding="kahan")
        >>> state = tx.init({"w": jnp.zeros(3, jnp.bfloat16)})
        >>> state.inner[0].mu["w"].dtype, state.compensation["w"].dtype, state.key
        (dtype(bfloat16), dtype(bfloat16), None)
        >>> multi = jaxmp.experimental.low_precision_optimizer(
        ...     optax.MultiSteps(optax.adam(1e-3), 4))
        >>> int(multi.init({"w": jnp.zeros(3, jnp.bfloat16)}).gradient_step)  # the inner field
        0
    """

    inner: PyTree
    key: Any
    compensation: PyTree

    def __getattr__(self, name: str) -> Any:
        """Reads of the inner state's fields, as if it were the inner state itself.

        ``state.gradient_step`` (``optax.MultiSteps``), ``state.hyperparams``
        (``optax.inject_hyperparams``), ``state.count``: code written for the
        wrapped optimizer's state keeps working (called only for names this
        class does not have).
        """
        if name.startswith("__") or name in ("inner", "key", "compensation"):
            raise AttributeError(name)  # copy, pickle and a half-built state: no forwarding
        inner = self.inner
        try:
            return getattr(inner, name)
        except AttributeError:
            raise AttributeError(
                f"'LowPrecisionState' object has no attribute {name!r}, nor has the state of "
                f"the optimizer it wraps ({type(inner).__name__}, in .inner).") from None


# ---------------------------------------------------------------------------
# Inner state: narrow between steps, widen for the update.
# ---------------------------------------------------------------------------


def _is_stored_narrow(x: Any) -> bool:
    """The inner-state leaves kept in ``state_dtype``: floating arrays with a shape."""
    return casting.is_float_array(x) and np.ndim(x) >= 1


def _narrow(tree: PyTree, dtype: np.dtype) -> PyTree:
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if _is_stored_narrow(x) and x.dtype != dtype else x, tree)


def _is_half(x: Any) -> bool:
    return casting.is_float_array(x) and casting.is_narrow_dtype(x.dtype)


# ---------------------------------------------------------------------------
# Random bits: a hash of (key, global element index).
# ---------------------------------------------------------------------------


def _mix(h: jax.Array) -> jax.Array:
    """A bijective 32-bit mixing function (the finaliser of MurmurHash3)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _global_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major index in an array of ``shape``, as ``uint32`` (wraps past 2**32).

    Built from ``broadcasted_iota``, which XLA partitions like any other
    array: under ``jit`` with a sharded parameter each device computes the
    indices of its own shard, the same numbers as on one device.
    """
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _random_bits(key_data: jax.Array, leaf_number: int, x: jax.Array) -> jax.Array:
    """``uint32`` random bits shaped like ``x``: a hash of the element's index, the leaf and the key.

    ``key_data`` is the step's raw ``uint32[2]`` key. The leaf's position in the
    tree, and inside ``shard_map`` this device's index along the axes over
    which ``x`` varies (a parameter sharded by hand), are mixed into the two
    seed words, so no two leaves or shards share their bits. A hash costs a few
    integer operations per element, where ``jax.random.bits`` (threefry) costs
    about ten times a whole Adam update on a CPU; rounding needs uniform bits,
    not cryptographic ones.
    """
    seed0, seed1 = key_data[0], key_data[1] ^ _mix(jnp.uint32(leaf_number + 1))
    for name in sorted(sharding.varying_axes(x), key=str):
        device = jax.lax.axis_index(name).astype(jnp.uint32)
        seed1 = _mix(seed1 ^ (device * jnp.uint32(0x9E3779B9)))
    index = _global_index(x.shape)
    return _mix(_mix(index ^ seed0) ^ seed1)


def _stochastic_round_bfloat16(t: jax.Array, bits: jax.Array) -> jax.Array:
    """float32 to bfloat16, up with probability (distance to the value below) / spacing.

    bfloat16 is float32 with the low 16 bits cut off, so adding 16 random bits
    to the float32 pattern and cutting them off rounds the magnitude up with
    exactly that probability, subnormals included. Above the largest finite
    bfloat16 the carry reaches the exponent: infinity, with the probability
    of the distance to 2**128.
    """
    pattern = jax.lax.bitcast_convert_type(t, jnp.uint32)
    rounded = (pattern + (bits & jnp.uint32(0xFFFF))) & jnp.uint32(0xFFFF0000)
    out = jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)
    return jnp.where(jnp.isfinite(t), out, t.astype(jnp.bfloat16))  # inf, NaN as they are


def _stochastic_round_float16(t: jax.Array, bits: jax.Array) -> jax.Array:
    """float32 to float16, unbiased, with float16's own subnormals and range.

    float16 is not a truncation of float32 (5 exponent bits, not 8), so the
    bfloat16 bit trick does not apply. The magnitude is bracketed between two
    adjacent float16 values ``lo <= |t| < hi`` and rounded up when a uniform
    ``u`` in [0, 1) satisfies ``u * (hi - lo) < |t| - lo``: both sides are exact
    in float32, subnormal spacings included. Above 65504 the next value is
    taken to be 65536, which float16 cannot hold: the result is then infinity
    with probability ``(|t| - 65504) / 32``, and always from 65536 on.
    """
    a = jnp.abs(t)
    nearest = a.astype(jnp.float16)
    below = jnp.where(nearest.astype(jnp.float32) > a,
                      jnp.nextafter(nearest, jnp.zeros_like(nearest)), nearest)
    above = jnp.nextafter(below, jnp.full_like(below, jnp.inf))
    top = float(jnp.finfo(jnp.float16).max)
    spacing_at_top = top - float(np.nextafter(np.float16(top), np.float16(0)))
    spacing = jnp.where(jnp.isinf(above), jnp.float32(spacing_at_top),
                        above.astype(jnp.float32) - below.astype(jnp.float32))
    uniform = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
    up = uniform * spacing < a - below.astype(jnp.float32)
    magnitude = jnp.where(up, above, below)
    out = jnp.copysign(magnitude, t.astype(jnp.float16))
    return jnp.where(jnp.isnan(t), t.astype(jnp.float16), out)


def stochastic_round(t: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
    """Rounds float32 ``t`` to half-precision ``dtype`` with random ``uint32`` ``bits``."""
    if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
        return _stochastic_round_bfloat16(t, bits)
    if jnp.dtype(dtype) == jnp.dtype(jnp.float16):
        return _stochastic_round_float16(t, bits)
    raise ValueError(f"stochastic rounding to {jnp.dtype(dtype).name} is not supported.")


# ---------------------------------------------------------------------------
# The update of one half-precision parameter.
# ---------------------------------------------------------------------------


def _exact_update(p: jax.Array, rounded: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The float32 update ``d`` with ``p + d == rounded``, and the value ``p + d`` in ``p``'s dtype.

    The update is the float32 difference of two half-precision values, which
    is exact whenever their exponents differ by at most 16 (bfloat16) or 13
    (float16): always, unless a step takes a parameter to within 2**-16 of its
    own magnitude of zero. ``optax.apply_updates`` then adds it in float32 and
    rounds the exact sum back to ``p``'s dtype: ``rounded``, bit for bit.

    An update in ``p``'s own dtype could not do this: ``p + d`` rounded to
    bfloat16 reaches only every other bfloat16 value near zero when ``d`` is
    larger than the result (a parameter crossing zero), which happens to a few
    elements on every step of real training.
    """
    p32 = p.astype(jnp.float32)
    d = rounded.astype(jnp.float32) - p32
    return d, (p32 + d).astype(p.dtype)


def _half_update(rounding: _Rounding, p, u, c, bits):
    """New (update, compensation) for a half-precision parameter ``p`` and float32 update ``u``."""
    p32 = p.astype(jnp.float32)
    if rounding.compensated:
        target = p32 + (u + c.astype(jnp.float32))
    else:
        target = p32 + u
    if rounding.keyed:
        rounded = stochastic_round(target, p.dtype, bits)
    else:
        rounded = target.astype(p.dtype)
    d, new = _exact_update(p, rounded)
    if rounding.compensated:
        # What rounding lost, exact in float32 (a float32 minus a nearby half value).
        lost = jnp.where(jnp.isfinite(target), target - new.astype(jnp.float32), jnp.float32(0))
        return d, lost.astype(c.dtype)
    return d, c


# ---------------------------------------------------------------------------
# The transformation.
# ---------------------------------------------------------------------------


def _check_params(params: PyTree) -> None:
    if params is None:
        raise ValueError(
            "jaxmp.experimental.low_precision_optimizer: update(...) needs the parameters: call "
            "tx.update(grads, state, params) (jaxmp.optimizer_update does). The rounding of "
            "half-precision parameters depends on their current values.")


def low_precision_optimizer(
    inner: optax.GradientTransformation,
    state_dtype: Any = jnp.bfloat16,
    param_rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optax optimizer to keep its state in half precision and update half-precision params.

    With bfloat16 parameters and Adam, the persistent training state takes 6
    bytes per parameter with ``"stochastic"`` rounding (parameters and two
    moments in bfloat16) and 8 with ``"kahan"``, against 12 for float32 master
    weights and float32 Adam; no float32 copy of anything is kept between steps.

    Every step: the gradients, the parameters and the inner state are widened
    to float32; ``inner.update`` runs in float32; its state is narrowed back to
    ``state_dtype``; and the float32 update is added to each half-precision
    parameter with ``param_rounding``. For half-precision parameters the
    updates returned are float32, the exact difference between the rounded and
    the current parameter: ``optax.apply_updates`` adds them in float32 and
    rounds the sum back to the parameter's dtype, which gives exactly the
    rounded parameter, bit for bit (an update in bfloat16 could not: near zero
    it reaches only every other bfloat16 value). :func:`jaxmp.optimizer_update`
    applies them as it is; under ``jax_numpy_dtype_promotion("strict")``, call
    ``optax.apply_updates`` inside ``with jax.numpy_dtype_promotion("standard")``
    (strict promotion refuses a bfloat16 + float32 sum even when the result is
    cast back). float32 (and float64) parameters get the inner update as it is.

    Which inner-state leaves are narrowed: every floating-point array with at
    least one dimension (moments, accumulated gradients of ``optax.MultiSteps``,
    ...). Scalar floating leaves keep their dtype: they cost a few bytes in
    all, and narrowing them would be lossy where it matters, e.g. the learning
    rate that ``optax.inject_hyperparams`` keeps in its state (3e-4 is
    3.0041e-4 in bfloat16). Integer leaves (step counts) are never touched.

    Stochastic rounding: the random bits of an element are a hash of its
    global (row-major) index and a per-step key. Under ``jit`` with sharded
    parameters each device computes its own shard's bits, and the result is
    bit-identical to an unsharded run. Inside ``shard_map``, a parameter
    replicated over the mesh gets the same bits on every device (replicas stay
    identical, and equal to an unsharded run); a parameter that varies over
    mesh axes (sharded by hand, with ``check_vma=True``) gets bits folded with
    its device's index along those axes: the shards round independently, but
    not as an unsharded run would. Above the largest finite value of the
    parameters' dtype, stochastic rounding goes to infinity with probability
    proportional to the distance past it (as if the next value were one
    spacing higher), like round-to-nearest a little earlier; a non-finite
    parameter makes :func:`jaxmp.optimizer_update` skip the step.

    The float32 difference is exact unless a single step takes a parameter
    from ``x`` to a value smaller than ``2**-16 * |x|`` (``2**-13`` in float16)
    without reaching zero; there the sum lands on a neighbour of the rounded
    value, and Kahan compensation records the difference.

    Args:
        inner: any ``optax.GradientTransformation`` (chains, ``MultiSteps``,
            ``inject_hyperparams`` included); extra arguments of
            ``update`` are passed through to it.
        state_dtype: the dtype of the inner state's floating leaves between
            steps, usually ``jnp.bfloat16``; ``jnp.float32`` keeps the state
            as it is (only the parameter rounding changes).
        param_rounding: ``"nearest"``, ``"stochastic"`` or ``"kahan"``.
        seed: the seed of stochastic rounding's key (an integer).

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a
        :class:`jaxmp.experimental.LowPrecisionState`.

    Raises:
        TypeError: if ``inner`` is not an optax transformation or ``seed`` is
            not an integer.
        ValueError: if ``state_dtype`` is not a floating-point dtype or
            ``param_rounding`` is not one of the three.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jaxmp
        >>> tx = jaxmp.experimental.low_precision_optimizer(optax.sgd(1e-3), param_rounding="kahan")
        >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> state = tx.init(params)
        >>> grads = {"w": jnp.ones(2, jnp.bfloat16)}
        >>> for _ in range(10):  # each step is a quarter of bfloat16's spacing at 1.0
        ...     params, state = jaxmp.optimizer_update(params, tx, state, grads, jnp.asarray(True))
        >>> params["w"].tolist()  # float32: 0.99; round-to-nearest would have stayed at 1.0
        [0.98828125, 0.98828125]
    """
    if isinstance(inner, optax.MultiSteps):  # a class with init/update, not a transformation
        inner = inner.gradient_transformation()
    if not isinstance(inner, optax.GradientTransformation):
        raise TypeError(
            "jaxmp.experimental.low_precision_optimizer wraps an optax transformation (e.g. "
            f"optax.adam(1e-3)); got {type(inner).__name__}.")
    state_dtype = casting.canonical_float_dtype(state_dtype, what="state_dtype")
    if param_rounding not in ROUNDINGS:
        raise ValueError(
            f"param_rounding must be one of {', '.join(map(repr, ROUNDINGS))}; "
            f"got {param_rounding!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {seed!r}.")
    seed = int(seed)
    inner = optax.with_extra_args_support(inner)
    rounding = ROUNDINGS[param_rounding]

    def init(params):
        _check_params(params)
        inner_state = _narrow(inner.init(casting.widen_half(params)), state_dtype)
        key = None
        if rounding.keyed:
            key = jax.random.key_data(jax.random.key(seed))
        compensation = None
        if rounding.compensated:
            compensation = jax.tree_util.tree_map(
                lambda p: jnp.zeros_like(p) if _is_half(p) else None, params)
        return LowPrecisionState(inner_state, key, compensation)

    def update(updates, state, params=None, **extra_args):
        if not isinstance(state, LowPrecisionState):
            raise TypeError(
                "jaxmp.experimental.low_precision_optimizer: the state is not a LowPrecisionState "
                f"(got {type(state).__name__}); pass the state returned by this transformation's "
                "init.")
        _check_params(params)
        compensation = state.compensation
        wide_params = casting.widen_half(params)
        if rounding.compensated:
            _check_compensation(params, compensation)
            # The optimizer sees the compensated parameters (weight decay, etc.).
            wide_params = jax.tree_util.tree_map(
                lambda p, c: p if c is None else p + c.astype(p.dtype),
                wide_params, compensation, is_leaf=lambda x: x is None)
        with jax.numpy_dtype_promotion("standard"):  # optax relies on it internally
            inner_updates, inner_state = inner.update(
                casting.widen_half(updates), casting.widen_half(state.inner), wide_params,
                **extra_args)
        inner_state = _narrow(inner_state, state_dtype)

        key, step_key = state.key, None
        if rounding.keyed:
            key, step_key = jax.random.split(jax.random.wrap_key_data(state.key))
            key, step_key = jax.random.key_data(key), jax.random.key_data(step_key)

        is_none = lambda x: x is None
        comp = (compensation if compensation is not None
                else jax.tree_util.tree_map(lambda _: None, params))
        leaves_u, treedef = jax.tree_util.tree_flatten(inner_updates, is_leaf=is_none)
        leaves_p = treedef.flatten_up_to(params)
        leaves_c = treedef.flatten_up_to(comp)
        new_u, new_c = [], []
        for number, (u, p, c) in enumerate(zip(leaves_u, leaves_p, leaves_c)):
            if u is None or p is None or not _is_half(p):
                new_u.append(u)
                new_c.append(c)
                continue
            bits = _random_bits(step_key, number, p) if rounding.keyed else None
            d, c = _half_update(rounding, p, u.astype(jnp.float32), c, bits)
            new_u.append(d)
            new_c.append(c)
        out_updates = jax.tree_util.tree_unflatten(treedef, new_u)
        if rounding.compensated:
            compensation = jax.tree_util.tree_unflatten(treedef, new_c)
        return out_updates, LowPrecisionState(inner_state, key, compensation)

    return optax.GradientTransformationExtraArgs(init, update)


def _check_compensation(params: PyTree, compensation: PyTree) -> None:
    """Refuses parameters whose half-precision leaves do not match the Kahan buffer."""
    def leaf(path, p, c):
        if _is_half(p) != (c is not None) or (c is not None and (
                c.dtype != p.dtype or c.shape != p.shape)):
            buffer = "no buffer" if c is None else f"a {c.dtype}{list(c.shape)} buffer"
            raise ValueError(
                "jaxmp.experimental.low_precision_optimizer: the parameters do not match the Kahan "
                "compensation buffer made by init: the parameter at "
                f"{jax.tree_util.keystr(path) or 'the root'} is "
                f"{getattr(p, 'dtype', p)}{list(np.shape(p))}, and init made {buffer} for it "
                "(init saw it in another dtype or shape, e.g. float32 parameters cast to "
                "bfloat16 after init). Call init on the parameters in the dtypes they are "
                "trained in: tx.init(jaxmp.cast_tree(params, jnp.bfloat16)); with flax's "
                "TrainState, TrainState.create(apply_fn=..., "
                "params=jaxmp.cast_tree(params, jnp.bfloat16), tx=tx).")
        return None

    try:
        jax.tree_util.tree_map_with_path(leaf, params, compensation,
                                         is_leaf=lambda x: x is None)
    except (ValueError, TypeError) as e:
        if "Kahan" in str(e):
            raise
        raise ValueError(
            "jaxmp.experimental.low_precision_optimizer: the parameters do not have the structure "
            "of the Kahan compensation buffer made by init.") from e
