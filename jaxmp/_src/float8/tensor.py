"""Matrix products in float8 with per-tensor current scaling, for ``autocast``.

``jaxmp.autocast(fn, compute_dtype, matmul_dtype=jnp.float8_e4m3fn)`` replaces
every matrix product of ``fn`` (``dot_general``, and in the forward pass
``conv_general_dilated``) by a *scaled* float8 product, built here:

1. each operand gets a scale from its current absolute maximum (``amax``),
   a power of two chosen so that ``amax * scale`` is as large as possible but
   at most the float8 dtype's largest value (448 for ``float8_e4m3fn``). A
   tensor of magnitude 1e4 and one of magnitude 1e-5 are then quantized with
   the same relative precision. A power of two keeps the multiplication (and
   its undoing) exact. An ``amax`` of zero, or a non-finite one, gets scale 1:
   an inf or NaN in the operand then stays non-finite in the result, so the
   loss scaler still sees it;
2. the operands, multiplied by their scales, are cast to the float8 dtype
   and multiplied into the compute dtype (bfloat16; float32 accumulation
   inside the product, one rounding at its end), and the result is multiplied
   by one power of two, the inverse of both scales. That is the pattern XLA's
   GPU compiler turns into one float8 GEMM that applies the scale and writes
   bfloat16 (cuBLASLt's ``__cublas$lt$matmul$f8`` with the scale as an
   argument, or a Triton GEMM with the scale in its epilogue): no float32
   product is written and read back. A float16 compute dtype, whose range
   cannot hold the unscaled product, gets a float32 product instead;
3. the whole product is a ``jax.custom_vjp``: the backward pass keeps the
   float8 operands (one byte per element) and takes the incoming cotangent in
   ``float8_e5m2`` (two more exponent bits than e4m3, for the wider range of
   gradients), scaled the same way; both backward products of a
   ``dot_general`` (with respect to each operand) are float8 products
   accumulating in float32 and written in the compute dtype, as a bfloat16
   step's gradients are, then cast to each operand's dtype (a float32 weight
   gets a float32 gradient).

The scalars of a product (its operands' scales and its unscaling factors)
are computed once, in one small kernel, from the amaxes; each amax is taken
along the minor dimension first, a row reduction that XLA can fuse into the
kernel producing the operand.

No state is carried between steps (no amax history): the scale of every
tensor is computed from the tensor itself, in the step that uses it, as
torchao's "tensorwise" recipe does. Which products stay in the compute
dtype is decided by a :class:`jaxmp.experimental.Float8Rules` (small products, named
scopes, a predicate).

That is the ``"tensor"`` recipe, the default of ``float8_scaling=``. This
module holds its row of the recipe table, :data:`RECIPE`, and its
``dot_general``; its convolutions are ``convolution.py``'s.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxmp._src import jaxprs
from jaxmp._src.float8 import convolution
from jaxmp._src.float8 import rules
from jaxmp._src.float8 import scaling
from jaxmp._src.float8.recipe import Recipe


#: The dtype of cotangents in the backward products.
GRAD_DTYPE = jnp.dtype(jnp.float8_e5m2)


def _dequantized(product: Callable, a8, b8, factor: jax.Array) -> jax.Array:
    """``product(a8, b8, dtype)`` times ``factor`` (a power of two), in ``factor``'s dtype.

    The product is asked for in that dtype (bfloat16 or float32, see
    :func:`scaling.product_dtype`) and multiplied by one scalar: XLA gives that scalar
    to cuBLASLt as the float8 GEMM's scale (``__cublas$lt$matmul$f8``, one
    kernel that writes the dtype, one rounding) or folds it into a Triton GEMM's
    epilogue.
    """
    return product(a8, b8, factor.dtype) * factor


def _dot(a, b, dimension_numbers, dtype=jnp.float32):
    return lax.dot_general(a, b, dimension_numbers, preferred_element_type=dtype)


def _scaled_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype):
    """``dot_general(a, b)`` in float8 with per-tensor scaling; float8 backward (see module).

    Each product is one float8 ``dot_general`` whose result (in ``out_dtype``
    for bfloat16 and float32, see :func:`_dequantized`) is multiplied by one
    power of two, the product of its operands' scales: the pattern XLA's GPU
    compiler turns into a single cuBLASLt float8 GEMM with the scale as an
    argument and a ``bfloat16`` output.
    """

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    dtype = scaling.product_dtype(out_dtype)

    def forward(a, b):
        ea = scaling.scale_exponent(scaling.amax(a), matmul_dtype)
        eb = scaling.floor(scaling.scale_exponent(scaling.amax(b), matmul_dtype), ea)
        f = scaling.factors((ea, eb), [(0, 1)], dtype)
        a8, b8 = scaling.to_float8(a, f[0], matmul_dtype), scaling.to_float8(b, f[1], matmul_dtype)
        dot = lambda x, y, dtype: _dot(x, y, dimension_numbers, dtype)
        return _dequantized(dot, a8, b8, f[2]).astype(out_dtype), (a8, ea, b8, eb)

    def backward(res, ct):
        a8, ea, b8, eb = res
        ec = scaling.floor(scaling.scale_exponent(scaling.amax(ct), GRAD_DTYPE), ea, eb)
        # d/da unscales by the cotangent's and b's scales, d/db by the cotangent's and a's.
        f = scaling.factors((ec, ea, eb), [(0, 2), (0, 1)], dtype)
        ct8 = scaling.to_float8(ct, f[0], GRAD_DTYPE)
        dtypes = (a.dtype, b.dtype)

        # Each unscaled after its transpose: XLA then writes the product in the layout of the
        # operand it differentiates (multiplied before, a transposed copy of attention-sized
        # gradients was written and read back).
        dot = lambda x, y, dn: _dot(x, y, dn, dtype)
        da, db = jaxprs.dot_transposes(ct8, a8, b8, dimension_numbers, dot)
        return (da * f[3]).astype(dtypes[0]), (db * f[4]).astype(dtypes[1])

    product.defvjp(forward, backward)
    return product(a, b)


#: The ``"tensor"`` row of the recipe table (the default).
RECIPE = Recipe(
    "tensor", rules.FLOAT8_DTYPES, 0, frozenset(), _scaled_dot, convolution.scaled_conv,
    "one power-of-two scale per tensor; cotangents in float8_e5m2")
