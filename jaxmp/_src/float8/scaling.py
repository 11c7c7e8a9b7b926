"""Power-of-two scales and float8 quantisation: the arithmetic every recipe shares.

A scale is a power of two, so multiplying by it (and undoing it) is exact;
its exponent is read from the float32 bits of an ``amax``
(:func:`scale_exponent`). Per-tensor scaling divides a tensor by ``2**e``
(:func:`to_float8`) and unscales each product by one factor
(:func:`factors`, :func:`floor`); an MX block stores ``e`` as its E8M0
scale. :func:`product_dtype` is the dtype a float8 product writes before it
is unscaled. One copy, for every recipe and the convolutions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


# The exponents of scales: a power of two in this range and its inverse are both normal
# float32 numbers (XLA flushes subnormals on CPU and GPU), and no float32 operand needs more.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126


def pow2(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` in float32, exactly, for integer ``e`` in ``[-126, 127]``."""
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def scale_exponent(amax: jax.Array, dtype: Any) -> jax.Array:
    """The exponent ``e`` (int32) of the power-of-two scale of values of largest magnitude
    ``amax`` in the float8 ``dtype``: ``amax / 2**e <= max(dtype) < 2 * amax / 2**e``.

    From the float32 bits of ``amax`` alone (no division, no logarithm): the
    difference of the exponents, plus one when ``amax``'s mantissa is the
    larger (448 is ``1.75 * 2**8``: 449 gets ``e = 1``, 448 ``e = 0``, 224
    ``e = -1``). Clamped to ``[-126, 126]``; 0 when ``amax`` is zero or not
    finite (an inf or NaN then stays non-finite in the product, so the loss
    scaler sees it). Per-tensor scaling divides by ``2**e``; an MX block
    stores ``e`` as its E8M0 scale.
    """
    amax = amax.astype(jnp.float32)
    top = int(np.array(jnp.finfo(dtype).max, np.float32).view(np.int32))
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    e = (bits >> 23) - (top >> 23) + ((bits & 0x7FFFFF) > (top & 0x7FFFFF)).astype(jnp.int32)
    e = lax.clamp(np.int32(_MIN_EXPONENT), e, np.int32(_MAX_EXPONENT))
    return lax.select(jnp.isfinite(amax) & (amax > 0), e, jnp.zeros_like(e))


def scale_for(amax: jax.Array, dtype: Any) -> jax.Array:
    """The power of two ``s`` (float32) for which ``amax * s`` is largest but ``<= max(dtype)``.

    1 when ``amax`` is zero or not finite.
    """
    return pow2(-scale_exponent(amax, dtype))


def amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of ``x``, in ``x``'s dtype (exact: a maximum does not round).

    Along the minor dimension first, then over the rest: a row reduction, which
    XLA's GPU compiler can fuse into the kernel that produces ``x``.
    """
    x = jnp.abs(x)
    if x.ndim > 1:
        x = jnp.max(x, axis=-1, initial=0)
    return jnp.max(x, initial=0)


def to_float8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` (a power of two: exact) in the float8 ``dtype`` (one rounding)."""
    return (x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def factors(exponents, sums, dtype) -> jax.Array:
    """The scalars of a scaled product as one vector in ``dtype``: ``2**-e`` for each of
    ``exponents`` (the scales that quantize its operands), then ``2**(e_i + e_j)`` for each
    pair ``(i, j)`` of ``sums`` (the factors that unscale its results).

    ``dtype`` is the dtype the products are unscaled in (:func:`product_dtype`:
    bfloat16 or float32, which hold these powers of two exactly). One vector
    behind an optimization barrier, so that XLA computes every scalar of the
    product in one small kernel that each consumer reads, rather than
    recomputing them in a small kernel per consumer (it does otherwise). An
    unscaling exponent lies in ``[-126, 252]`` (see :func:`floor`): above 127
    the factor is inf, as the product itself then lies near or beyond
    float32's range.
    """
    out = [pow2(-e) for e in exponents]
    for i, j in sums:
        e = exponents[i] + exponents[j]
        out.append(lax.select(e > 127, jnp.float32(np.inf), pow2(jnp.minimum(e, 127))))
    return lax.optimization_barrier(jnp.stack(out).astype(dtype))


def floor(e: jax.Array, *others: jax.Array) -> jax.Array:
    """``e`` raised where needed so that ``e + o >= -126`` for each of ``others``: the
    unscaling factor of a product stays a normal float32 (its operands are then quantized
    a little below full range: only operands whose amaxes multiply below ~2**-108 lose
    bits, where float32's own product would lose them)."""
    for o in others:
        e = jnp.maximum(e, np.int32(_MIN_EXPONENT) - o)
    return e


def product_dtype(out_dtype: Any) -> np.dtype:
    """The dtype a float8 product writes before it is unscaled: ``out_dtype`` when it has
    float32's exponent range (bfloat16, float32), so that the GPU library applies the scales
    and writes ``out_dtype`` (one rounding); float32 otherwise (float16 would overflow on
    the unscaled product, up to ``448 * 57344 * K``)."""
    out_dtype = np.dtype(out_dtype)
    wide = jnp.finfo(out_dtype).maxexp >= jnp.finfo(jnp.float32).maxexp
    return out_dtype if wide else np.dtype(jnp.float32)
