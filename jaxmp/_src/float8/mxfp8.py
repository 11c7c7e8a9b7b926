"""The ``"mxfp8"`` recipe: block-scaled float8 products (OCP MX v1.0).

Each operand of a ``dot_general`` is quantized in blocks of 32 consecutive
elements along that product's contracting dimension, each block with its own
power-of-two (E8M0) scale, forward and backward, all in ``float8_e4m3fn``
(:func:`mx_quantize`); it runs through ``jax.nn.scaled_matmul`` (cuDNN's
block-scaled dot) on GPUs with block-scaled GEMMs and an emulation with the
same numbers on the CPU (:func:`_mx_matmul`); on other accelerators its
``fallback``, the per-tensor recipe, runs instead
(:func:`jaxmp._src.float8.recipe_for`). Its convolutions are scaled per
tensor (``convolution.py``). This module holds its row, :data:`RECIPE`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxprs
from jaxmp._src import sharding
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


def _rows(x: jax.Array, batch, free, contract) -> jax.Array:
    """``x`` as ``(B, F, K)``: its ``batch``, ``free`` and ``contract`` dimensions, in those
    orders, each group flattened: the layout of ``jax.nn.scaled_matmul``'s operands."""
    x = lax.transpose(x, tuple(int(d) for d in (*batch, *free, *contract)))
    sizes = [math.prod(x.shape[i] for i in range(lo, hi)) for lo, hi in (
        (0, len(batch)), (len(batch), len(batch) + len(free)), (len(batch) + len(free), x.ndim))]
    return x.reshape(sizes)


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
    k = x.shape[axis]
    padded = -(-k // block) * block
    if padded != k:
        x = jnp.pad(x, [(0, padded - k) if d == axis else (0, 0) for d in range(x.ndim)])
    blocks = x.reshape(*x.shape[:axis], padded // block, block, *x.shape[axis + 1:])
    biased = _block_exponents(blocks, axis + 1, dtype)
    elements = _scaled_blocks(blocks, biased, axis + 1, dtype).reshape(x.shape)
    if padded != k:
        elements = lax.slice_in_dim(elements, 0, k, axis=axis)
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


def _quantized_rows(quantize, x: jax.Array, batch, free, contract, block: int,
                    elements_given_scales=None):
    """``quantize(_rows(x, batch, free, contract))``: ``x`` as ``(B, F, K)`` in blocks along
    ``K``, quantized in ``x``'s own layout when the blocks lie within one of its dimensions.

    The blocks of 32 along the flattened ``contract`` dimensions lie within the
    last of them when its size is a multiple of 32: then ``x`` is quantized
    along that dimension where it is, and only its float8 elements and scales
    are laid out as ``(B, F, K)``. Transposing ``x`` first (for a weight
    gradient's blocks along the batch and tokens) made XLA write a transposed
    copy of ``|x|`` to take the blocks' amaxes. Same blocks, same numbers.
    Given ``elements_given_scales(x, scales)`` (:func:`mx_elements`), only the
    scales are taken where ``x`` lies, and the elements are rounded from ``x``
    read as ``(B, F, K)``: the kernel that rounds them writes the float8 layout
    cuDNN reads, where XLA transposed the float8 copy in a kernel of its own.
    """
    last = contract[-1]
    if x.shape[last] % block:
        return quantize(_rows(x, batch, free, contract))
    elements, scales = quantize(x, axis=last)
    scales = _rows(scales, batch, free, contract)
    if elements_given_scales is None:
        return _rows(elements, batch, free, contract), scales
    return elements_given_scales(_rows(x, batch, free, contract), scales), scales


def _pad_blocks(q: jax.Array, scales: jax.Array, block: int) -> jax.Array:
    """The elements ``q`` padded with zeros to the whole blocks of ``scales``."""
    missing = scales.shape[-1] * block - q.shape[-1]
    return jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, missing)]) if missing else q


def _mx_matmul_emulated(qa, sa, qb, sb, dtype=jnp.float32):
    """What cuDNN's block-scaled dot computes, with XLA's own products.

    One float8 ``dot_general`` per block of 32 (float32 accumulation), each
    block's partial products multiplied by its two scales (powers of two:
    exact) and summed in float32, then rounded once to ``dtype``.
    """
    qa, qb = _pad_blocks(qa, sa, MX_BLOCK), _pad_blocks(qb, sb, MX_BLOCK)
    (b, m, k), n = qa.shape, qb.shape[1]
    blocks = k // MX_BLOCK
    partial = lax.dot_general(qa.reshape(b, m, blocks, MX_BLOCK),
                              qb.reshape(b, n, blocks, MX_BLOCK),
                              (((3,), (3,)), ((0, 2), (0, 2))),
                              preferred_element_type=jnp.float32)  # (b, blocks, m, n)
    sa = jnp.transpose(sa.astype(jnp.float32), (0, 2, 1))[..., None]
    sb = jnp.transpose(sb.astype(jnp.float32), (0, 2, 1))[:, :, None, :]
    return jnp.sum(partial * sa * sb, axis=1).astype(dtype)


@functools.lru_cache(maxsize=None)
def _mx_matmul_cudnn(dtype):
    """``jax.nn.scaled_matmul`` into ``dtype``: cuDNN's block-scaled dot
    (``__op$block_scaled_dot``), which writes ``dtype`` itself."""

    @jax.custom_batching.custom_vmap
    def matmul(qa, sa, qb, sb):
        qa, qb = _pad_blocks(qa, sa, MX_BLOCK), _pad_blocks(qb, sb, MX_BLOCK)
        return jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=dtype)

    @matmul.def_vmap
    def matmul_vmap(axis_size, in_batched, qa, sa, qb, sb):
        # JAX's batching rule wants all four operands mapped alike; a weight shared
        # by every example (unmapped) is broadcast, and the mapped axis joins B.
        args = [x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, mapped in zip((qa, sa, qb, sb), in_batched)]
        folded = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args]
        out = matmul(*folded)
        return out.reshape(axis_size, -1, *out.shape[1:]), True

    return matmul


def _mx_matmul_cuda(qa, sa, qb, sb, dtype):
    """:func:`_mx_matmul_cudnn`, its result typed as varying over the ``shard_map`` axes its
    operands vary over (JAX's custom call does not say, and both branches must agree)."""
    axes = set().union(*(sharding.varying_axes(x) for x in (qa, sa, qb, sb)))
    out = _mx_matmul_cudnn(np.dtype(dtype))(qa, sa, qb, sb)
    return sharding.as_varying(out, tuple(sorted(axes, key=str)))


def _mx_matmul(qa, sa, qb, sb, dtype=jnp.float32):
    """The product ``(B, M, N)`` in ``dtype`` of MX operands ``(B, M, K)`` and ``(B, N, K)``
    (float32 accumulation, one rounding to ``dtype``).

    The choice is made when the program is lowered (``lax.platform_dependent``):
    cuDNN's block-scaled dot on CUDA, :func:`_mx_matmul_emulated` elsewhere.
    """
    return lax.platform_dependent(
        qa, sa, qb, sb, cuda=functools.partial(_mx_matmul_cuda, dtype=dtype),
        default=functools.partial(_mx_matmul_emulated, dtype=dtype))


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

    def undo(y, x, dims, dtype):
        """``y`` (``(B, F, K)``) back in the layout of ``x`` whose dims it lists."""
        y = y.reshape([x.shape[d] for d in dims])
        return lax.transpose(y, tuple(int(i) for i in np.argsort(dims))).astype(dtype)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        rows = lambda x, *dims: _quantized_rows(quantize, x, *dims, block, elements)
        out = matmul(*rows(a, ab, a_free, ac), *rows(b, bb, b_free, bc), dtype)
        shape = [a.shape[d] for d in (*ab, *a_free)] + [b.shape[d] for d in b_free]
        residuals = (rows(a, ab, ac, a_free), rows(b, bb, bc, b_free))
        return out.reshape(shape).astype(out_dtype), residuals

    def backward(residuals, ct):
        a_t, b_t = residuals
        # d/da: ct (B, M, N) times b (B, K, N), both in blocks along b's free dimensions.
        rows = lambda x, *dims: _quantized_rows(quantize, x, *dims, block, elements)
        da = matmul(*rows(ct, ct_batch, ct_a, ct_b), *b_t, dtype)
        # d/db: a (B, K, M) times ct (B, N, M), both in blocks along a's free dimensions.
        db = matmul(*a_t, *rows(ct, ct_batch, ct_b, ct_a), dtype)
        return (undo(da, a, [*ab, *a_free, *ac], a.dtype),
                undo(db, b, [*bb, *bc, *b_free], b.dtype))

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
