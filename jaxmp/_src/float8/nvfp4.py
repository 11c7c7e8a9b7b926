"""The ``"nvfp4"`` recipe: 4-bit products with two-level scales (NVIDIA's NVFP4).

Each operand of a ``dot_general`` is held as ``float4_e2m1fn`` elements
(values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) with two scales: one
``float8_e4m3fn`` scale per block of 16 consecutive elements along the
product's contracting dimension, and one float32 scale per tensor,
``amax / (6 * 448)``, which brings the block scales into e4m3's range
(:func:`nv_quantize`). Its products run through ``jax.nn.scaled_matmul``
(cuDNN's block-scaled float4 dot) on GPUs with block-scaled GEMMs
(Blackwell), an emulation that rounds exactly as the format does on the CPU,
and the per-tensor float8 recipe (its ``fallback``) on other accelerators.

NVIDIA's training recipe ("Pretraining Large Language Models with NVFP4",
2025) adds four parts, each a switch of :class:`NVFP4`, all on by default:

* ``weight_blocks_2d``: a weight is quantized in 16x16 tiles, one scale per
  tile, so that the forward product (blocks along its input dimension) and
  the input gradient (blocks along its output dimension) multiply the same
  quantized weight. The weight is the right operand of a product without
  batch dimensions (``x @ w``, ``x @ w.T``, as Flax, Haiku and plain JAX write
  a dense layer); the left operand (and a batched product's, when the rules
  let one run in NVFP4) gets 1x16 blocks;
* ``hadamard``: the two operands of each weight gradient are multiplied along
  their contracting dimension (tokens), in blocks of 16, by one random 16x16
  orthogonal matrix (a Hadamard matrix with random signs, from ``seed``): a
  few large values are spread over their block before quantization; the
  matrix cancels in the product (it is orthogonal, :func:`hadamard`);
* ``stochastic_rounding``: the cotangents (gradients) are rounded to float4
  up or down at random, with the probabilities that make the rounding
  unbiased; the random bits are a hash of each element's value, its position
  and ``seed`` (:func:`stochastic_bits`), so a step is reproducible and
  different values draw different bits. Weights and activations round to
  nearest, ties to even;
* ``keep``: a :class:`jaxmp.experimental.Float8Rules` that keeps products in
  the compute dtype when the user passes no ``float8_rules`` (default: those
  under a ``head`` or ``lm_head`` scope, the output projection, which the
  recipe keeps in high precision with the last layers, and the batched
  products of attention, which it does not quantize: only linear layers run
  in NVFP4). Autocast says once which products it keeps.

This module holds the options type, :class:`NVFP4`, and the default row,
:data:`RECIPE`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxprs
from jaxmp._src.float8 import blocks
from jaxmp._src.float8 import convolution
from jaxmp._src.float8 import rules
from jaxmp._src.float8 import scaling
from jaxmp._src.float8 import target
from jaxmp._src.float8.recipe import Recipe


#: Elements per block scale along a contracting dimension (and the side of a weight's tile).
NV_BLOCK = 16
#: The element dtype of NVFP4, its ``matmul_dtype``.
NV_DTYPE = jnp.dtype(jnp.float4_e2m1fn)
#: The dtype of its block scales.
NV_SCALE_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
_FP4_MAX = 6.0
_SCALE_MAX = 448.0


def global_scale(amax: jax.Array) -> jax.Array:
    """The per-tensor (second-level) scale of a tensor with largest magnitude ``amax``:
    ``amax / (6 * 448)`` in float32, so that its block scales fit ``float8_e4m3fn``.

    1 for a tensor of zeros; NaN when ``amax`` is not finite (float4 has no inf
    or NaN: the NaN scale makes the product NaN, so the loss scaler sees it).
    """
    amax = amax.astype(jnp.float32)
    g = jnp.where(amax > 0, amax / np.float32(_FP4_MAX * _SCALE_MAX), np.float32(1))
    return jnp.where(jnp.isfinite(amax), g, np.float32(np.nan))


def stochastic_bits(x: jax.Array, seed: int, index: jax.Array | None = None) -> jax.Array:
    """Reproducible random ``uint32`` bits, one per element of ``x``: a hash (MurmurHash3's
    finaliser) of the element's float32 bits, its position and ``seed``.

    The position is the element's index in ``x`` read in order, or ``index`` (``uint32``,
    ``x``'s shape) where given: the position in the array ``x`` was laid out from.
    """
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    if index is None:
        index = lax.iota(jnp.uint32, x.size).reshape(x.shape)
    h = bits ^ (index * np.uint32(0x9E3779B9)) ^ np.uint32(seed & 0xFFFFFFFF)
    h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _round_float4(v: jax.Array, random_bits: jax.Array | None) -> jax.Array:
    """``v`` (float32, ``|v| <= 6``) in ``float4_e2m1fn``: to nearest-even, or, given
    ``random_bits``, up with probability equal to its distance from the value below, in
    units of the spacing there (unbiased)."""
    if random_bits is None:
        return v.astype(NV_DTYPE)
    mag = jnp.abs(v)
    step = jnp.where(mag < 2, np.float32(0.5), jnp.where(mag < 4, np.float32(1), np.float32(2)))
    low = jnp.floor(mag / step) * step
    u = (random_bits >> 8).astype(jnp.float32) * np.float32(2.0 ** -24)  # uniform in [0, 1)
    up = (u < (mag - low) / step).astype(jnp.float32)
    return (jnp.sign(v) * jnp.minimum(low + step * up, np.float32(_FP4_MAX))).astype(NV_DTYPE)


def _scales(amax: jax.Array, g: jax.Array) -> jax.Array:
    """The ``float8_e4m3fn`` scales of blocks whose amaxes are ``amax``, under the per-tensor
    scale ``g``: ``amax / 6 / g``, rounded to nearest."""
    return (amax.astype(jnp.float32) / np.float32(_FP4_MAX) / g).astype(NV_SCALE_DTYPE)


def _elements(x: jax.Array, scales: jax.Array, g: jax.Array, bits: jax.Array | None
              ) -> jax.Array:
    """The float4 elements of blocks ``x`` given their ``scales`` (broadcast against ``x``),
    under the per-tensor scale ``g``; ``bits``: stochastic (:func:`_round_float4`)."""
    decode = scales.astype(jnp.float32) * g
    v = x.astype(jnp.float32) / jnp.where(decode > 0, decode, np.float32(1))
    v = jnp.clip(jnp.where(decode > 0, v, np.float32(0)), -_FP4_MAX, _FP4_MAX)
    return _round_float4(v, bits)


def _encode(x: jax.Array, amax: jax.Array, g: jax.Array, seed: int | None):
    """Elements and ``float8_e4m3fn`` scales of blocks ``x`` whose amaxes are ``amax``
    (broadcast against ``x``), under the per-tensor scale ``g``; ``seed``: stochastic."""
    scales = _scales(amax, g)
    bits = None if seed is None else stochastic_bits(x, seed)
    return _elements(x, scales, g, bits), scales


def nv_quantize(x: jax.Array, g: jax.Array, axis: int = -1, seed: int | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """``(elements, scales)`` of ``x`` in NVFP4 blocks of 16 along ``axis``, under the
    per-tensor scale ``g`` (:func:`global_scale`).

    Each block's scale is ``amax_block / 6 / g`` rounded to nearest
    ``float8_e4m3fn``; its elements are ``x / (scale * g)``, clipped to ``[-6, 6]``
    (the rounded scale may lie just below) and rounded to ``float4_e2m1fn``:
    to nearest-even, or stochastically with ``seed`` (:func:`stochastic_bits`).
    The last block is padded with zeros; the scales have ``x``'s shape with
    ``ceil(x.shape[axis] / 16)`` along ``axis``. ``x`` is ``scales * g *
    elements`` up to the rounding of the elements.
    """
    axis = axis % x.ndim
    xb = blocks.to_blocks(x, NV_BLOCK, axis)
    amax = jnp.max(jnp.abs(xb), axis=axis + 1, keepdims=True)
    elements, scales = _encode(xb, amax, g, seed)
    return blocks.from_blocks(elements, x.shape[axis], axis), jnp.squeeze(scales, axis + 1)


def tile_quantize(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(elements, tile scales)`` of ``x`` (``(B, N, K)``) in 16x16 tiles over its last two
    dimensions (zero-padded), one ``float8_e4m3fn`` scale per tile, round to nearest-even.

    Returns the elements of ``x``'s shape and scales ``(B, ceil(N/16), ceil(K/16))``.
    """
    b, n, k = x.shape
    tiles = blocks.to_blocks(blocks.to_blocks(x, NV_BLOCK, 2), NV_BLOCK, 1)  # (B,N',16,K',16)
    amax = jnp.max(jnp.abs(tiles), axis=(2, 4), keepdims=True)
    elements, scales = _encode(tiles, amax, g, None)
    elements = blocks.from_blocks(blocks.from_blocks(elements, n, 1), k, 2)
    return elements, scales[:, :, 0, :, 0]


def _tile_scales_along_k(scales: jax.Array, n: int) -> jax.Array:
    """Tile scales ``(B, N', K')`` as the block scales ``(B, N, K')`` of blocks along ``K``."""
    return jnp.repeat(scales, NV_BLOCK, axis=1)[:, :n]


def hadamard(seed: int) -> np.ndarray:
    """The random Hadamard transform: ``H16 @ diag(signs) / 4``, orthogonal, with signs drawn
    from ``numpy.random.default_rng(seed)`` (the same matrix for the same seed)."""
    h = np.array([[1.0]])
    while h.shape[0] < NV_BLOCK:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], NV_BLOCK)
    return (h * signs / np.sqrt(NV_BLOCK)).astype(np.float32)


def _transformed(x: jax.Array, seed: int) -> jax.Array:
    """``x`` (``(B, F, K)``) in float32, zero-padded to whole blocks along ``K``, each block
    multiplied by :func:`hadamard` (exact sums of ``±x / 4`` in float32, no matrix product).

    The fast Walsh-Hadamard transform, each stage elementwise: at stride ``h`` an element
    whose position has bit ``h`` clear becomes ``x + partner``, one with it set
    ``partner - x``, the partner (position xor ``h``) read by reversing pairs of runs of
    ``h``. No stacking or concatenation, so XLA fuses the whole transform into the kernels
    that read it (block amaxes, elements) instead of writing it in float32.
    """
    xb = blocks.to_blocks(x.astype(jnp.float32), NV_BLOCK, 2)  # (B, F, K', 16)
    xb = xb * jnp.asarray(np.random.default_rng(seed).choice([-1.0, 1.0], NV_BLOCK), jnp.float32)
    position = np.arange(NV_BLOCK)
    h = 1
    while h < NV_BLOCK:  # in the order of hadamard(): lo + hi, lo - hi
        pairs = xb.reshape(*xb.shape[:3], NV_BLOCK // (2 * h), 2, h)
        partner = lax.rev(pairs, (4,)).reshape(xb.shape)
        high = jnp.asarray(position & h != 0)
        xb = jnp.where(high, partner - xb, xb + partner)
        h *= 2
    return (xb * np.float32(1 / np.sqrt(NV_BLOCK))).reshape(*x.shape[:2], -1)


@dataclasses.dataclass(frozen=True)
class NVFP4:
    """The options of the NVFP4 recipe: pass ``float8_scaling=NVFP4(...)`` (with
    ``matmul_dtype=jnp.float4_e2m1fn``) to turn parts of it off; ``float8_scaling="nvfp4"``
    is ``NVFP4()``.

    Attributes:
        weight_blocks_2d: weights in 16x16 tiles, the same quantized weight
            forward and backward (else 1x16 blocks along each product's
            contracting dimension, quantized again for the input gradient).
        hadamard: the random Hadamard transform on the operands of the
            weight gradients.
        stochastic_rounding: cotangents rounded stochastically (else to
            nearest-even, as weights and activations are).
        seed: the seed of the Hadamard signs and of the stochastic rounding's
            hash: an ``int``, part of the program (the same seed, the same
            numbers).
        keep: the :class:`jaxmp.experimental.Float8Rules` used when autocast is
            given no ``float8_rules`` (``None``, the default: products under a
            ``head`` or ``lm_head`` scope, and products with batch dimensions,
            attention's, stay in the compute dtype).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> f = jaxmp.autocast(lambda w, x: x @ w, jnp.float32, matmul_dtype=jnp.float4_e2m1fn,
        ...                    float8_scaling=jaxmp.experimental.NVFP4(hadamard=False))
        >>> x = jnp.array([[0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 2.4] * 2])
        >>> [round(float(v), 3) for v in f(jnp.eye(16), x)[0, :8]]  # 2.4: to the float4 2
        [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 2.0]
    """

    weight_blocks_2d: bool = True
    hadamard: bool = True
    stochastic_rounding: bool = True
    seed: int = 0
    keep: rules.Float8Rules | None = None

    def __post_init__(self):
        for name in ("weight_blocks_2d", "hadamard", "stochastic_rounding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVFP4.{name} must be True or False, got "
                                f"{getattr(self, name)!r}.")
        if not isinstance(self.seed, (int, np.integer)) or isinstance(self.seed, bool):
            raise TypeError(f"NVFP4.seed must be an int, got {self.seed!r}.")
        if self.keep is None:
            object.__setattr__(self, "keep", KEEP)
        if not isinstance(self.keep, rules.Float8Rules):
            raise TypeError("NVFP4.keep must be a jaxmp.experimental.Float8Rules, got "
                            f"{type(self.keep).__name__}.")

    def as_recipe(self) -> Recipe:
        """This recipe as a row of the recipe table."""
        return _row(self)


def batched(product: rules.Product) -> bool:
    """Whether ``product`` has batch dimensions (attention's): NVFP4's default keeps it."""
    return product.batched


#: NVFP4's own rules: the output head and attention's batched products in the compute dtype.
KEEP = rules.Float8Rules(keep_scopes=frozenset({"head", "lm_head"}), keep_if=batched)


def _scaled(qa, qb, g: jax.Array, dtype) -> jax.Array:
    """The block-scaled product of two ``(elements, scales)`` pairs in ``dtype``, times the
    product ``g`` of their per-tensor scales."""
    return blocks.matmul(*qa, *qb, dtype, NV_BLOCK) * g.astype(dtype)


def _row_amaxes(x, batch, free, contract) -> jax.Array:
    """The amaxes ``(B, F, K')`` of ``rows(x, batch, free, contract)`` in blocks of 16 along
    ``K``, in ``x``'s dtype: taken where ``x`` lies when the blocks lie within its last
    contracting dimension (no transposed copy of ``|x|``), and only they laid out as rows."""
    last = contract[-1]
    if x.shape[last] % NV_BLOCK:
        return jnp.max(jnp.abs(blocks.to_blocks(blocks.rows(x, batch, free, contract),
                                                NV_BLOCK, 2)), axis=3)
    amax = jnp.max(jnp.abs(blocks.to_blocks(x, NV_BLOCK, last)), axis=last + 1)
    return blocks.rows(amax, batch, free, contract)


def _row_elements(x, batch, free, contract, scales, g, seed) -> jax.Array:
    """The float4 elements of ``rows(x, batch, free, contract)`` given their ``scales``
    (``(B, F, K')``): one elementwise pass that reads ``x`` and writes the ``(B, F, K)``
    layout cuDNN reads. With ``seed``, each element's random bits hash its position as
    :func:`nv_quantize` numbers it: in ``x`` when its blocks lie within ``x``'s last
    contracting dimension (:func:`blocks.quantized_rows`), else in the padded rows."""
    r = blocks.rows(x, batch, free, contract)
    rb = blocks.to_blocks(r, NV_BLOCK, 2)  # (B, F, K', 16)
    bits = None
    if seed is not None and x.shape[contract[-1]] % NV_BLOCK:
        bits = stochastic_bits(rb, seed)
    elif seed is not None:
        index = lax.iota(jnp.uint32, x.size).reshape(x.shape)
        index = blocks.rows(index, batch, free, contract).reshape(rb.shape)
        bits = stochastic_bits(rb, seed, index)
    return blocks.from_blocks(_elements(rb, scales[..., None], g, bits), r.shape[2], 2)


def _amax_and_scale(x, batch, free, contract):
    """``(block amaxes, per-tensor scale)`` of ``x`` in rows: the per-tensor amax is the
    largest block amax (exact), a reduction over the blocks, not a second pass over ``x``."""
    return _with_scale(_row_amaxes(x, batch, free, contract))


def _with_scale(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(amax, per-tensor scale)`` from block amaxes ``amax``. Behind an optimization
    barrier: XLA merges a reduction of a reduction into one over the elements, which read
    the operand a second time for its per-tensor amax."""
    amax = lax.optimization_barrier(amax)
    return amax, global_scale(jnp.max(amax, initial=0))


def _operand(x, g, batch, free, contract, seed, amax=None):
    """``x`` as ``(B, F, K)`` NVFP4 elements and scales in blocks of 16 along ``K``: the
    numbers of :func:`nv_quantize` of its rows (``amax``: its :func:`_row_amaxes`, given)."""
    if amax is None:
        amax = _row_amaxes(x, batch, free, contract)
    scales = _scales(amax, g)
    return _row_elements(x, batch, free, contract, scales, g, seed), scales


def _weight_gradient_operand(x, g, batch, free, contract, options: NVFP4, seed):
    """``(operand, per-tensor scale)`` of ``x`` for a weight gradient: blocks along ``K``
    (the tokens), after the random Hadamard transform when ``options.hadamard``."""
    if not options.hadamard:
        return _operand(x, g, batch, free, contract, seed), g
    # The transform multiplies each block by an orthogonal matrix of entries +-1/4, so no
    # value grows past 4 * amax(x): the per-tensor scale is 4 * x's (no second pass over x
    # for the transformed amax; the block scales lose at most 2 of e4m3's 17 binades).
    t = _transformed(blocks.rows(x, batch, free, contract), options.seed)
    g = g * np.float32(4)
    return nv_quantize(t, g, seed=seed), g


def _tile_amaxes(r: jax.Array) -> jax.Array:
    """The amaxes ``(B, N', K')`` of the 16x16 tiles (zero-padded) of ``r`` (``(B, N, K)``)."""
    tiles = blocks.to_blocks(blocks.to_blocks(r, NV_BLOCK, 2), NV_BLOCK, 1)  # (B,N',16,K',16)
    return jnp.max(jnp.abs(tiles), axis=(2, 4))


def _weight(b, g, batch, free, contract, amax=None):
    """The forward and input-gradient operands of a weight ``b``, from one quantization in
    16x16 tiles (the numbers of :func:`tile_quantize`; ``amax``: its :func:`_tile_amaxes`,
    given): the same scales, and the same elements rounded from them twice, each in the
    layout its product reads (a transposed float4 copy took a kernel of its own)."""
    if amax is None:
        amax = _tile_amaxes(blocks.rows(b, batch, free, contract))
    tiles = _scales(amax, g)
    n, k = (math.prod(b.shape[d] for d in dims) for dims in (free, contract))
    forward_scales = _tile_scales_along_k(tiles, n)
    backward_scales = _tile_scales_along_k(jnp.swapaxes(tiles, 1, 2), k)
    forward = _row_elements(b, batch, free, contract, forward_scales, g, None)
    backward = _row_elements(b, batch, contract, free, backward_scales, g, None)
    return (forward, forward_scales), (backward, backward_scales)


def _nvfp4_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype, options: NVFP4):
    """``dot_general(a, b)`` in NVFP4, forward and backward (see the module docstring).

    The forward product quantizes both operands to nearest; the input
    gradient (``ct . b``) takes the cotangent in blocks along ``b``'s free
    dimensions, stochastically rounded, and ``b`` as quantized in the forward
    pass (a weight's tiles) or again along its free dimensions; the weight
    gradient (``a . ct``) takes both in blocks along ``a``'s free dimensions,
    after the Hadamard transform. Every product writes the compute dtype
    (:func:`scaling.product_dtype`), then is cast to the dtype of the operand it
    differentiates. Each operand's per-tensor scale comes from the block amaxes
    of its first quantization (:func:`_amax_and_scale`).
    """
    del matmul_dtype  # float4_e2m1fn, checked by the table
    dtype = scaling.product_dtype(out_dtype)
    (ac, bc), (ab, bb) = dimension_numbers
    a_free, b_free, ct_batch, ct_a, ct_b = jaxprs.dot_layout(a.ndim, b.ndim, dimension_numbers)
    weight = options.weight_blocks_2d and not bb
    stochastic = options.seed if options.stochastic_rounding else None

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        amax_a, ga = _amax_and_scale(a, ab, a_free, ac)
        if weight:
            tiles, gb = _with_scale(_tile_amaxes(blocks.rows(b, bb, b_free, bc)))
            qb, b_t = _weight(b, gb, bb, b_free, bc, tiles)
        else:
            amax_b, gb = _amax_and_scale(b, bb, b_free, bc)
            qb = _operand(b, gb, bb, b_free, bc, None, amax_b)
            b_t = _operand(b, gb, bb, bc, b_free, None)
        out = _scaled(_operand(a, ga, ab, a_free, ac, None, amax_a), qb, ga * gb, dtype)
        shape = [a.shape[d] for d in (*ab, *a_free)] + [b.shape[d] for d in b_free]
        a_t = _weight_gradient_operand(a, ga, ab, ac, a_free, options, None)
        return out.reshape(shape).astype(out_dtype), (a_t, b_t, gb)

    def backward(residuals, ct):
        (a_t, ga_t), b_t, gb = residuals
        amax_c, gc = _amax_and_scale(ct, ct_batch, ct_a, ct_b)
        qc = _operand(ct, gc, ct_batch, ct_a, ct_b, stochastic, amax_c)
        da = _scaled(qc, b_t, gc * gb, dtype)
        c_t, gc_t = _weight_gradient_operand(ct, gc, ct_batch, ct_b, ct_a, options, stochastic)
        db = _scaled(a_t, c_t, ga_t * gc_t, dtype)
        return (blocks.from_rows(da, a.shape, [*ab, *a_free, *ac], a.dtype),
                blocks.from_rows(db, b.shape, [*bb, *bc, *b_free], b.dtype))

    product.defvjp(forward, backward)
    return product(a, b)


def _per_tensor_conv(a, b, *, params, matmul_dtype, out_dtype):
    """Convolutions, which NVFP4 does not block-scale: per-tensor ``float8_e4m3fn``."""
    del matmul_dtype
    return convolution.scaled_conv(a, b, params=params, matmul_dtype=rules.FLOAT8_DTYPES[0],
                                   out_dtype=out_dtype)


def _row(options: NVFP4) -> Recipe:
    """The recipe-table row of ``options``."""
    return Recipe(
        "nvfp4", (NV_DTYPE,), NV_BLOCK, frozenset({"dot_general"}),
        functools.partial(_nvfp4_dot, options=options), _per_tensor_conv,
        "NVIDIA's NVFP4: float4_e2m1fn elements with one float8_e4m3fn scale per 16 elements "
        "and one float32 scale per tensor; 16x16 weight tiles, a random Hadamard transform on "
        "weight gradients, stochastic rounding of gradients", fallback="tensor",
        native=target.block_scaled_gemms, rules=options.keep)


#: The ``"nvfp4"`` row of the recipe table: :class:`NVFP4` with its defaults.
RECIPE = NVFP4().as_recipe()
