"""The block-scaled products every block-scaled recipe shares (``mxfp8.py``, ``nvfp4.py``).

An operand of a block-scaled product is laid out as ``(B, F, K)`` (its batch,
free and contracting dimensions, :func:`rows`), quantized in blocks of
``block`` elements along ``K`` (:func:`to_blocks`, :func:`quantized_rows`),
each block with its own scale, and multiplied by :func:`matmul`:
``jax.nn.scaled_matmul`` (cuDNN's block-scaled dot) on CUDA GPUs, an
emulation with XLA's own products elsewhere. What a block's scale is, and
which dtypes hold the elements and the scales, is each recipe's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import sharding


def rows(x: jax.Array, batch, free, contract) -> jax.Array:
    """``x`` as ``(B, F, K)``: its ``batch``, ``free`` and ``contract`` dimensions, in those
    orders, each group flattened: the layout of ``jax.nn.scaled_matmul``'s operands."""
    x = lax.transpose(x, tuple(int(d) for d in (*batch, *free, *contract)))
    sizes = [math.prod(x.shape[i] for i in range(lo, hi)) for lo, hi in (
        (0, len(batch)), (len(batch), len(batch) + len(free)), (len(batch) + len(free), x.ndim))]
    return x.reshape(sizes)


def from_rows(y: jax.Array, shape, dims, dtype) -> jax.Array:
    """The inverse of :func:`rows`: ``y`` (``(B, F, K)``) back in the layout of an array of
    ``shape`` whose dimensions ``dims`` lists in ``y``'s order, in ``dtype``."""
    y = y.reshape([shape[d] for d in dims])
    return lax.transpose(y, tuple(int(i) for i in np.argsort(dims))).astype(dtype)


def to_blocks(x: jax.Array, block: int, axis: int) -> jax.Array:
    """``x`` with its ``axis`` split into ``(ceil(n / block), block)``, the last block padded
    with zeros (which change neither its amax nor a product)."""
    k = x.shape[axis]
    padded = -(-k // block) * block
    if padded != k:
        x = jnp.pad(x, [(0, padded - k) if d == axis else (0, 0) for d in range(x.ndim)])
    return x.reshape(*x.shape[:axis], padded // block, block, *x.shape[axis + 1:])


def from_blocks(blocks: jax.Array, k: int, axis: int) -> jax.Array:
    """The inverse of :func:`to_blocks`: the blocks along ``axis`` joined, cut to ``k``."""
    x = blocks.reshape(*blocks.shape[:axis], -1, *blocks.shape[axis + 2:])
    return lax.slice_in_dim(x, 0, k, axis=axis) if x.shape[axis] != k else x


def quantized_rows(quantize, x: jax.Array, batch, free, contract, block: int,
                   elements_given_scales=None):
    """``quantize(rows(x, batch, free, contract))``: ``x`` as ``(B, F, K)`` in blocks along
    ``K``, quantized in ``x``'s own layout when the blocks lie within one of its dimensions.

    The blocks along the flattened ``contract`` dimensions lie within the
    last of them when its size is a multiple of ``block``: then ``x`` is
    quantized along that dimension where it is, and only its elements and
    scales are laid out as ``(B, F, K)``. Transposing ``x`` first (for a weight
    gradient's blocks along the batch and tokens) made XLA write a transposed
    copy of ``|x|`` to take the blocks' amaxes. Same blocks, same numbers.
    Given ``elements_given_scales(x, scales)`` (``mxfp8.mx_elements``), only the
    scales are taken where ``x`` lies, and the elements are rounded from ``x``
    read as ``(B, F, K)``: the kernel that rounds them writes the layout cuDNN
    reads, where XLA transposed a quantized copy in a kernel of its own.
    """
    last = contract[-1]
    if x.shape[last] % block:
        return quantize(rows(x, batch, free, contract))
    elements, scales = quantize(x, axis=last)
    scales = rows(scales, batch, free, contract)
    if elements_given_scales is None:
        return rows(elements, batch, free, contract), scales
    return elements_given_scales(rows(x, batch, free, contract), scales), scales


def pad_blocks(q: jax.Array, scales: jax.Array, block: int) -> jax.Array:
    """The elements ``q`` padded with zeros to the whole blocks of ``scales``."""
    missing = scales.shape[-1] * block - q.shape[-1]
    return jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, missing)]) if missing else q


def emulated_matmul(qa, sa, qb, sb, dtype, block):
    """What cuDNN's block-scaled dot computes, with XLA's own products.

    One ``dot_general`` per block (float32 accumulation), each block's partial
    products multiplied by its two scales and summed in float32, then rounded
    once to ``dtype``. Elements narrower than a byte (float4), which XLA's CPU
    and GPU products do not take, are converted to float32 first (exact).
    """
    qa, qb = pad_blocks(qa, sa, block), pad_blocks(qb, sb, block)
    if jnp.finfo(qa.dtype).bits < 8:
        qa, qb = qa.astype(jnp.float32), qb.astype(jnp.float32)
    (b, m, k), n = qa.shape, qb.shape[1]
    blocks = k // block
    partial = lax.dot_general(qa.reshape(b, m, blocks, block),
                              qb.reshape(b, n, blocks, block),
                              (((3,), (3,)), ((0, 2), (0, 2))),
                              preferred_element_type=jnp.float32)  # (b, blocks, m, n)
    sa = jnp.transpose(sa.astype(jnp.float32), (0, 2, 1))[..., None]
    sb = jnp.transpose(sb.astype(jnp.float32), (0, 2, 1))[:, :, None, :]
    return jnp.sum(partial * sa * sb, axis=1).astype(dtype)


@functools.lru_cache(maxsize=None)
def _cudnn_matmul(dtype, block):
    """``jax.nn.scaled_matmul`` into ``dtype``: cuDNN's block-scaled dot
    (``__op$block_scaled_dot``), which writes ``dtype`` itself."""

    @jax.custom_batching.custom_vmap
    def matmul(qa, sa, qb, sb):
        qa, qb = pad_blocks(qa, sa, block), pad_blocks(qb, sb, block)
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


def _cuda_matmul(qa, sa, qb, sb, dtype, block):
    """:func:`_cudnn_matmul`, its result typed as varying over the ``shard_map`` axes its
    operands vary over (JAX's custom call does not say, and both branches must agree)."""
    axes = set().union(*(sharding.varying_axes(x) for x in (qa, sa, qb, sb)))
    out = _cudnn_matmul(np.dtype(dtype), block)(qa, sa, qb, sb)
    return sharding.as_varying(out, tuple(sorted(axes, key=str)))


def matmul(qa, sa, qb, sb, dtype, block):
    """The product ``(B, M, N)`` in ``dtype`` of block-scaled operands ``(B, M, K)`` and
    ``(B, N, K)`` with scales ``(B, M, K / block)`` and ``(B, N, K / block)`` (float32
    accumulation, one rounding to ``dtype``).

    The choice is made when the program is lowered (``lax.platform_dependent``):
    cuDNN's block-scaled dot on CUDA, :func:`emulated_matmul` elsewhere.
    """
    return lax.platform_dependent(
        qa, sa, qb, sb, cuda=functools.partial(_cuda_matmul, dtype=dtype, block=block),
        default=functools.partial(emulated_matmul, dtype=dtype, block=block))
