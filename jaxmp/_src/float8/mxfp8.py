"""The ``"mxfp8"`` recipe: block-scaled float8 products (OCP MX v1.0).

Each operand of a ``dot_general`` is quantized in blocks of 32 consecutive
elements along that product's contracting dimension, each block with its own
power-of-two (E8M0) scale, forward and backward, all in ``float8_e4m3fn``
(:func:`mx_quantize`); it runs through ``jax.nn.scaled_matmul`` (cuDNN's
block-scaled dot) on GPUs with block-scaled GEMMs and an emulation with the
same numbers on the CPU (:func:`_mx_matmul`, from ``blocks.py``); on other accelerators its
``fallback``, the per-tensor recipe, runs instead
(:func:`jaxmp._src.float8.recipe_for`). Its convolutions are scaled per
tensor (``convolution.py``). This module holds its row, :data:`RECIPE`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxprs
from jaxmp._src.float8 import blocks as blocks_lib
from jaxmp._src.float8 import convolution
from jaxmp._src.float8 import scaling
from jaxmp._src.float8 import target
from jaxmp._src.float8.recipe import Recipe


#: The block of an MX format: elements per scale along a contracting dimension.
MX_BLOCK = 32
#: The element dtype of MXFP8 as ``jax.nn.scaled_matmul`` and cuDNN take it.
MX_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
#: The dtype of MX scales: a biased power-of-two exponent in one byte.
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
# The exponents of MX scales (:func:`scaling.scale_exponent` clamps to them): E8M0 bytes 1..253.
_EXPONENTS = (-126, 126)


def _block_exponents(blocks: jax.Array, axis: int, dtype: Any) -> jax.Array:
    """The biased E8M0 exponent (uint8) of each block of ``blocks`` (the block along ``axis``):
    :func:`scaling.scale_exponent` of its amax, in one reduction over integers.

    That exponent is the float32 exponent field of ``amax``, plus one where
    its mantissa exceeds that of ``max(dtype)``, less that of ``max(dtype)``:
    ``(bits + carry) >> 23`` on the bits of ``|x|``, which grows with ``|x|``,
    so the block's exponent is the largest of its elements' and XLA takes it in
    the kernel that reads the elements, writing the one-byte scales (an amax,
    then its exponent, took two kernels). Clamped to the bytes 1..253: an
    all-zero block gets scale ``2**-126`` and stays zero; an inf or NaN gets a
    scale of ``2**120`` or more and stays non-finite (NaN in float8), so the
    product is NaN and the loss scaler sees it.
    """
    top = int(np.array(jnp.finfo(dtype).max, np.float32).view(np.uint32))
    carry = np.uint32(0x7FFFFF - (top & 0x7FFFFF))
    bits = lax.bitcast_convert_type(jnp.abs(blocks.astype(jnp.float32)), jnp.uint32)
    biased = ((bits + carry) >> np.uint32(23)).astype(jnp.int32) - (top >> 23) + 127
    biased = lax.clamp(np.int32(127 + _EXPONENTS[0]), biased, np.int32(127 + _EXPONENTS[1]))
    return jnp.max(biased.astype(jnp.uint8), axis=axis)  # the clamp and the max commute


def mx_quantize(x: jax.Array, dtype: Any = MX_DTYPE, block: int = MX_BLOCK, axis: int = -1
                ) -> tuple[jax.Array, jax.Array]:
    """``(elements, scales)`` of ``x`` in blocks of ``block`` along ``axis`` (default: the last).

    Each block's scale is ``2 ** ceil(log2(amax / max(dtype)))`` (E8M0, so no
    element saturates); the elements are ``x / scale`` rounded to nearest-even
    ``dtype``, of ``x``'s shape. ``x.shape[axis]`` need not be a multiple of
    ``block``: the last block is padded with zeros (which change neither its
    amax nor the product), so the scales have ``x``'s shape with
    ``ceil(x.shape[axis] / block)`` along ``axis``. A block of zeros gets
    scale ``2**-126`` and stays zero; a block with an inf or NaN gets a scale of
    ``2**120`` or more and NaN elements where the inf or NaN was (``float8_e4m3fn`` has
    no inf), so the product is NaN and the loss scaler sees it. Two kernels on
    a GPU: the scales (:func:`_block_exponents`), then the elements, which
    read the one-byte scales back (``2**-e`` from their bits).
    """
    axis = axis % x.ndim
    blocks = blocks_lib.to_blocks(x, block, axis)
    biased = _block_exponents(blocks, axis + 1, dtype)
    elements = blocks_lib.from_blocks(_scaled_blocks(blocks, biased, axis + 1, dtype),
                                      x.shape[axis], axis)
    return elements, lax.bitcast_convert_type(biased, E8M0)


def _scaled_blocks(blocks: jax.Array, biased: jax.Array, axis: int, dtype: Any) -> jax.Array:
    """``blocks`` (each along ``axis``) over their scales (biased exponents ``biased``), rounded
    to ``dtype``: ``2**-e`` from each scale's byte ``s = e + 127``, the float32 bits
    ``(254 - s) << 23`` (``e`` in ``[-126, 126]``)."""
    inverse = lax.bitcast_convert_type((254 - biased.astype(jnp.int32)) << 23, jnp.float32)
    return (blocks.astype(jnp.float32) * jnp.expand_dims(inverse, axis)).astype(dtype)


def mx_elements(x: jax.Array, scales: jax.Array, dtype: Any = MX_DTYPE,
                block: int = MX_BLOCK) -> jax.Array:
    """The elements of :func:`mx_quantize` of ``x`` along its last dimension, given its
    ``scales``: ``x / scales`` in ``dtype``, without taking the blocks' amaxes again."""
    k = x.shape[-1]
    padded = scales.shape[-1] * block
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - k)]) if padded != k else x
    biased = lax.bitcast_convert_type(scales, jnp.uint8)
    blocks = x.reshape(*x.shape[:-1], scales.shape[-1], block)
    return _scaled_blocks(blocks, biased, x.ndim, dtype).reshape(x.shape)[..., :k]


def _mx_matmul(qa, sa, qb, sb, dtype=jnp.float32):
    """The product ``(B, M, N)`` in ``dtype`` of MX operands ``(B, M, K)`` and ``(B, N, K)``:
    :func:`blocks.matmul` in blocks of 32 (cuDNN on CUDA, an emulation elsewhere)."""
    return blocks_lib.matmul(qa, sa, qb, sb, dtype, MX_BLOCK)


def _block_scaled_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype, quantize, matmul,
                      block, elements=None):
    """``dot_general(a, b)`` with block-scaled operands, forward and backward.

    ``quantize`` takes an operand and returns its elements and scales in
    blocks of ``block`` along its last dimension (or ``axis=``); ``matmul`` multiplies two such
    operands into a ``(B, M, N)`` of a given dtype: every product writes the
    compute dtype (float32 under float16, see :func:`scaling.product_dtype`), then
    cast to the dtype of the operand it differentiates. Every product quantizes its
    operands along its own contracting dimension: the forward product along
    the contracting dimensions of ``dot_general``; the input gradient
    (``ct . b``) along ``b``'s free dimensions; the weight gradient
    (``a . ct``) along ``a``'s free dimensions (a layer's batch and token
    dimensions). The backward operands ``a`` and ``b`` are quantized in the
    forward pass, from the values themselves (not from their forward
    quantization), and saved in float8 with their scales. ``elements(x, scales)``,
    where given, rounds an operand's elements given its scales
    (:func:`_quantized_rows`).
    """
    del matmul_dtype  # the recipe's quantize says which float8 dtype
    dtype = scaling.product_dtype(out_dtype)
    (ac, bc), (ab, bb) = dimension_numbers
    a_free, b_free, ct_batch, ct_a, ct_b = jaxprs.dot_layout(a.ndim, b.ndim, dimension_numbers)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        rows = lambda x, *dims: blocks_lib.quantized_rows(quantize, x, *dims, block, elements)
        out = matmul(*rows(a, ab, a_free, ac), *rows(b, bb, b_free, bc), dtype)
        shape = [a.shape[d] for d in (*ab, *a_free)] + [b.shape[d] for d in b_free]
        residuals = (rows(a, ab, ac, a_free), rows(b, bb, bc, b_free))
        return out.reshape(shape).astype(out_dtype), residuals

    def backward(residuals, ct):
        a_t, b_t = residuals
        # d/da: ct (B, M, N) times b (B, K, N), both in blocks along b's free dimensions.
        rows = lambda x, *dims: blocks_lib.quantized_rows(quantize, x, *dims, block, elements)
        da = matmul(*rows(ct, ct_batch, ct_a, ct_b), *b_t, dtype)
        # d/db: a (B, K, M) times ct (B, N, M), both in blocks along a's free dimensions.
        db = matmul(*a_t, *rows(ct, ct_batch, ct_b, ct_a), dtype)
        return (blocks_lib.from_rows(da, a.shape, [*ab, *a_free, *ac], a.dtype),
                blocks_lib.from_rows(db, b.shape, [*bb, *bc, *b_free], b.dtype))

    product.defvjp(forward, backward)
    return product(a, b)


#: The ``"mxfp8"`` row of the recipe table.
RECIPE = Recipe(
    "mxfp8", (MX_DTYPE,), MX_BLOCK, frozenset({"dot_general"}),
    functools.partial(_block_scaled_dot, quantize=mx_quantize, matmul=_mx_matmul,
                      block=MX_BLOCK, elements=mx_elements),
    convolution.scaled_conv,
    "OCP MXFP8: float8_e4m3fn elements with one E8M0 scale per 32 elements along each "
    "product's contracting dimension, forward and backward", fallback="tensor",
    native=target.block_scaled_gemms)
