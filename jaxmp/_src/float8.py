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
   and multiplied with ``preferred_element_type=float32`` (float32
   accumulation); the float32 result is divided by both scales and cast to
   the compute dtype;
3. the whole product is a ``jax.custom_vjp``: the backward pass keeps the
   float8 operands (one byte per element) and takes the incoming cotangent in
   ``float8_e5m2`` (two more exponent bits than e4m3, for the wider range of
   gradients), scaled the same way; both backward products of a
   ``dot_general`` (with respect to each operand) are float8 products
   accumulating in float32.

No state is carried between steps (no amax history): the scale of every
tensor is computed from the tensor itself, in the step that uses it, as
torchao's "tensorwise" recipe does. Which products stay in the compute
dtype is decided by a :class:`jaxmp.Float8Rules` (small products, named
scopes, a predicate).

That is the ``"tensor"`` recipe. How a product is scaled is a row of one
table, :data:`RECIPES` (``float8_scaling=`` of ``autocast``): a name, the
float8 dtypes it takes, its block size and its two product functions. The
``"mxfp8"`` row follows OCP MX v1.0: each operand of a ``dot_general`` is
quantized in blocks of 32 consecutive elements along that product's
contracting dimension, each block with its own power-of-two (E8M0) scale,
forward and backward, all in ``float8_e4m3fn``; it runs through
``jax.nn.scaled_matmul`` (cuDNN's block-scaled dot) where JAX lowers it
(CUDA) and an emulation with the same numbers elsewhere
(:func:`_mx_matmul`). A new recipe (1x128 or 128x128 blocks, NVFP4) is a
new row: its quantizer and its product.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src import sharding

#: The float8 dtypes accepted as ``matmul_dtype``.
FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: The dtype of cotangents in the backward products.
GRAD_DTYPE = jnp.dtype(jnp.float8_e5m2)
#: The float8 format of both operands of a convolution's backward products: JAX's
#: convolution takes operands of one dtype, so the cotangent (scaled per tensor)
#: and the saved e4m3 operand (converted) share it. See :func:`_scaled_conv`.
CONV_GRAD_DTYPE = jnp.dtype(jnp.float8_e5m2)
#: The primitives :func:`jaxmp.autocast` runs in float8 by default.
FLOAT8_PRIMITIVES = compat.FLOAT8_PRIMITIVES


def is_float8_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a float8 dtype (any of JAX's, ``fnuz`` variants included)."""
    return casting.is_float_dtype(dtype) and np.dtype(dtype).itemsize == 1


def check_matmul_dtype(matmul_dtype: Any, compute_dtype: Any) -> np.dtype | None:
    """``matmul_dtype`` as a float8 dtype, or ``None`` for products in ``compute_dtype``.

    Raises a ``ValueError`` naming the accepted dtypes for anything else.
    """
    if matmul_dtype is None:
        return None
    try:
        dtype = jnp.dtype(matmul_dtype)
    except TypeError as e:
        raise ValueError(f"matmul_dtype must be a dtype, got {matmul_dtype!r}.") from e
    if dtype == np.dtype(compute_dtype):
        return None
    if dtype in FLOAT8_DTYPES:
        return dtype
    hint = ""
    if casting.is_float_dtype(dtype) and dtype.itemsize > 1:
        hint = (f" To run matrix products in {dtype.name}, set compute_dtype={dtype.name} "
                "and leave matmul_dtype=None.")
    elif is_float8_dtype(dtype):
        hint = (" Other float8 formats (fnuz, e4m3b11...) are not supported: their range and "
                "the GPU kernels that take them differ.")
    raise ValueError(
        "matmul_dtype must be None (matrix products in compute_dtype) or a float8 dtype: "
        f"jnp.float8_e4m3fn (recommended) or jnp.float8_e5m2; got {dtype.name}." + hint)


class Product(NamedTuple):
    """What :class:`jaxmp.Float8Rules` sees of one matrix product.

    Attributes:
        primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
        lhs_shape: the shape of the left operand.
        rhs_shape: the shape of the right operand (the kernel of a convolution).
        flops: ``2 *`` multiply-adds, as :func:`jaxmp.matmul_flops` counts them.
        scope: the ``jax.named_scope`` names around the product, outermost
            first, joined by ``/`` (``""`` when there are none).
    """

    primitive: str
    lhs_shape: tuple
    rhs_shape: tuple
    flops: int
    scope: str


@dataclasses.dataclass(frozen=True)
class Float8Rules:
    """Which matrix products :func:`jaxmp.autocast` runs in float8 (``matmul_dtype``).

    A product runs in float8 unless one of these says to keep it in the
    compute dtype:

    Attributes:
        primitives: the primitives run in float8 (default ``dot_general`` and
            ``conv_general_dilated``; drop the latter to keep convolutions in
            the compute dtype).
        min_flops: products with fewer FLOPs (``2 *`` multiply-adds) stay in
            the compute dtype: for small products the scaling costs more than
            float8 saves (default 0: every product in float8).
        keep_scopes: names of ``jax.named_scope`` scopes whose products stay
            in the compute dtype, e.g. ``{"head"}`` for an output projection
            written under ``with jax.named_scope("head"):``. A name matches
            one scope of the product's scope path, or a ``/``-separated run
            of them (``"decoder/head"``).
        keep_if: a predicate on a ``Product`` (``primitive``,
            ``lhs_shape``, ``rhs_shape``, ``flops``, ``scope``); products for
            which it returns ``True`` stay in the compute dtype.

    Examples:
        >>> import jaxmp
        >>> jaxmp.Float8Rules()
        Float8Rules()
        >>> rules = jaxmp.Float8Rules(min_flops=2**20, keep_scopes={"head"})
        >>> rules
        Float8Rules(min_flops=1048576, keep_scopes={'head'})
        >>> "head" in rules.keep_scopes
        True
    """

    primitives: frozenset = FLOAT8_PRIMITIVES
    min_flops: int = 0
    keep_scopes: frozenset = frozenset()
    keep_if: Callable[[Product], bool] | None = None

    def __post_init__(self):
        for field in ("primitives", "keep_scopes"):
            names = getattr(self, field)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"Float8Rules.{field} must be a collection of strings, e.g. "
                                f"{{'head'}}; got {names!r}.")
            object.__setattr__(self, field, frozenset(names))
        unknown = sorted(self.primitives - FLOAT8_PRIMITIVES)
        if unknown:
            raise ValueError(f"Float8Rules.primitives: only {sorted(FLOAT8_PRIMITIVES)} can run "
                             f"in float8; got {unknown}.")
        if (not isinstance(self.min_flops, (int, np.integer)) or isinstance(self.min_flops, bool)
                or self.min_flops < 0):
            raise TypeError(f"Float8Rules.min_flops must be an int >= 0, got {self.min_flops!r}.")
        if self.keep_if is not None and not callable(self.keep_if):
            raise TypeError("Float8Rules.keep_if must be a function of a Product returning a "
                            f"bool, or None; got {type(self.keep_if).__name__}.")

    def keeps(self, product: Product) -> bool:
        """Whether ``product`` stays in the compute dtype."""
        if product.primitive not in self.primitives or product.flops < self.min_flops:
            return True
        path = "/" + product.scope + "/"
        if any("/" + name.strip("/") + "/" in path for name in self.keep_scopes):
            return True
        return bool(self.keep_if(product)) if self.keep_if is not None else False

    def __repr__(self) -> str:
        parts = []
        if self.primitives != FLOAT8_PRIMITIVES:
            parts.append(f"primitives={set(sorted(self.primitives))!r}")
        if self.min_flops:
            parts.append(f"min_flops={self.min_flops}")
        if self.keep_scopes:
            parts.append(f"keep_scopes={set(sorted(self.keep_scopes))!r}")
        if self.keep_if is not None:
            parts.append(f"keep_if={getattr(self.keep_if, '__name__', self.keep_if)!r}")
        return f"Float8Rules({', '.join(parts)})"


def product_of(eqn, scope: str) -> Product:
    """The :class:`Product` of a ``dot_general`` or ``conv_general_dilated`` equation."""
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
    out = tuple(eqn.outvars[0].aval.shape)
    if eqn.primitive.name == "dot_general":
        (contract, _), _ = compat.dimension_numbers(eqn)
        macs = math.prod(out) * math.prod(lhs[i] for i in contract)
    else:
        out_features = rhs[compat.dimension_numbers(eqn).rhs_spec[0]]
        macs = math.prod(out) * math.prod(rhs) // max(out_features, 1)
    return Product(eqn.primitive.name, lhs, rhs, 2 * macs, scope)


def placement(eqn, scope: str, low_precision: Iterable[str], rules: Float8Rules) -> str | None:
    """Whether :func:`jaxmp.autocast` with a float8 ``matmul_dtype`` runs ``eqn`` in float8.

    The one decision, asked by autocast to run the product and by the
    census (``jaxmp.Float8ShortfallWarning``) to explain it. Returns ``None``
    when the product runs in float8, else why not:

    * ``"float8_operand"``: the function gives it a float8 operand already; it
      runs as written;
    * ``"kept"``: the user's ``rules`` keep it in the compute dtype;
    * ``"rules"``: its primitive is not in ``AutocastRules.low_precision``;
    * ``"operand"``: it does not have two floating-point operands.

    Args:
        eqn: a ``dot_general`` or ``conv_general_dilated`` equation.
        scope: the ``jax.named_scope`` path around it (see :class:`Product`).
        low_precision: ``AutocastRules.low_precision``.
        rules: the :class:`jaxmp.Float8Rules`.
    """
    dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars]
    floats = [d for d in dtypes if casting.is_float_dtype(d)]
    if any(is_float8_dtype(d) for d in floats):
        return "float8_operand"
    if rules.keeps(product_of(eqn, scope)):
        return "kept"
    if eqn.primitive.name not in low_precision:
        return "rules"
    if len(floats) != 2 or len(dtypes) != 2:
        return "operand"
    return None


# --- Scaling -----------------------------------------------------------------------------


def scale_for(amax: jax.Array, dtype: Any) -> jax.Array:
    """The power of two ``s`` (float32) for which ``amax * s`` is largest but ``<= max(dtype)``.

    1 when ``amax`` is zero or not finite.
    """
    max_mantissa, max_exponent = np.frexp(float(jnp.finfo(dtype).max))
    mantissa, exponent = jnp.frexp(amax)
    k = max_exponent - exponent - (mantissa > max_mantissa).astype(jnp.int32)
    scale = jnp.ldexp(jnp.float32(1.0), jnp.clip(k, -126, 127).astype(jnp.int32))
    return jnp.where(jnp.isfinite(amax) & (amax > 0), scale, jnp.float32(1.0))


def quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(x * s)`` in the float8 ``dtype`` and ``1 / s`` (float32), with ``s`` from ``x``'s amax."""
    amax = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)
    scale = scale_for(amax, dtype)
    return (x.astype(jnp.float32) * scale).astype(dtype), (1.0 / scale)


def dequantize(y: jax.Array, inverse_scales: Iterable[jax.Array], dtype: Any) -> jax.Array:
    """A float32 product ``y`` of scaled operands, unscaled and cast to ``dtype``."""
    y = y.astype(jnp.float32)
    for inv in inverse_scales:
        y = y * inv  # one at a time: their product could leave float32's range
    return y.astype(dtype)


# --- The scaled products ---------------------------------------------------------------------


def _dot(a, b, dimension_numbers):
    return lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _dot_layout(a_ndim: int, b_ndim: int, dimension_numbers) -> tuple[list, list, list, list, list]:
    """``(a_free, b_free, ct_batch, ct_a, ct_b)`` of ``dot_general(a, b)``: the free dimensions
    of each operand, and where the product (and its cotangent) holds the batch dimensions,
    ``a``'s free ones and ``b``'s."""
    (ac, bc), (ab, bb) = dimension_numbers
    a_free = [d for d in range(a_ndim) if d not in ac and d not in ab]
    b_free = [d for d in range(b_ndim) if d not in bc and d not in bb]
    nb = len(ab)
    return (a_free, b_free, list(range(nb)), list(range(nb, nb + len(a_free))),
            list(range(nb + len(a_free), nb + len(a_free) + len(b_free))))


def _dot_transposes(ct, a, b, dimension_numbers):
    """The two backward products of ``dot_general(a, b)`` for the cotangent ``ct``, in float32.

    ``ct`` has the layout of the product: batch dimensions, then ``a``'s free
    dimensions, then ``b``'s.
    """
    (ac, bc), (ab, bb) = dimension_numbers
    a_free, b_free, ct_batch, ct_a, ct_b = _dot_layout(a.ndim, b.ndim, dimension_numbers)
    # d/da: contract ct's b-free dimensions with b's free dimensions. The result
    # has a's batch, then a's free dimensions, then b's contracting ones in b's
    # order, each standing for the contracting dimension of a it pairs with.
    da = _dot(ct, b, ((ct_b, b_free), (ct_batch, list(bb))))
    order = list(np.argsort(bc))
    da_dims = list(ab) + a_free + [ac[i] for i in order]
    da = lax.transpose(da, tuple(int(i) for i in np.argsort(da_dims)))
    # d/db: the same with the roles exchanged (a as the left operand keeps
    # b's free dimensions last, as in the forward product).
    db = _dot(a, ct, ((a_free, ct_a), (list(ab), ct_batch)))
    order = list(np.argsort(ac))
    db_dims = list(bb) + [bc[i] for i in order] + b_free
    db = lax.transpose(db, tuple(int(i) for i in np.argsort(db_dims)))
    return da, db


def _quantized_forward(product, a, b, matmul_dtype, out_dtype):
    """``product`` of the float8 operands, dequantized to ``out_dtype``, and the residuals."""
    a8, ia = quantize(a, matmul_dtype)
    b8, ib = quantize(b, matmul_dtype)
    return dequantize(product(a8, b8), (ia, ib), out_dtype), (a8, ia, b8, ib)


def _scaled_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype):
    """``dot_general(a, b)`` in float8 with per-tensor scaling; float8 backward (see module)."""

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        dot = lambda x, y: _dot(x, y, dimension_numbers)
        return _quantized_forward(dot, a, b, matmul_dtype, out_dtype)

    def backward(res, ct):
        a8, ia, b8, ib = res
        ct8, ic = quantize(ct, GRAD_DTYPE)
        da, db = _dot_transposes(ct8, a8, b8, dimension_numbers)
        return dequantize(da, (ic, ib), a.dtype), dequantize(db, (ic, ia), b.dtype)

    product.defvjp(forward, backward)
    return product(a, b)


def _conv_transpose(params, operand, wrt: int, other_struct, ct):
    """The backward product of a convolution with respect to argument ``wrt`` (0: lhs, 1: rhs).

    ``operand`` is the other argument (the kernel for ``wrt=0``, the input for
    ``wrt=1``) and ``ct`` the cotangent of the output; both are float8 of one
    format. The transpose is JAX's own rule (any dimension numbers, strides,
    padding, dilations, feature and batch groups), traced once on float32
    stand-ins and then evaluated on the float8 values: besides the
    convolution it holds only data movement (``rev``, ``reshape``,
    ``transpose``), so the convolution binds float8 operands with float32
    accumulation (``preferred_element_type`` of the forward product).
    ``other_struct`` is the shape of the argument differentiated.
    """
    f32 = jnp.float32

    def conv(x, y):
        return compat.bind_conv(x, y, params)

    def transpose(known, g):
        if wrt == 0:
            linear = lambda x: conv(x, known)
        else:
            linear = lambda y: conv(known, y)
        (out,) = jax.linear_transpose(linear, jax.ShapeDtypeStruct(other_struct, f32))(g)
        return out

    closed = jax.make_jaxpr(transpose)(jax.ShapeDtypeStruct(operand.shape, f32),
                                       jax.ShapeDtypeStruct(ct.shape, f32))
    (out,) = interpret.Interpreter().eval_closed(closed, [operand, ct])
    return out


def _scaled_conv(a, b, *, params, matmul_dtype, out_dtype):
    """``conv_general_dilated(a, b)`` in float8 with per-tensor scaling, forward and backward.

    The forward product is the dot products' (e4m3 operands, float32
    accumulation). Both backward products (input and kernel gradients) are
    float8 convolutions too, from JAX's own transpose rules
    (:func:`_conv_transpose`). JAX's convolution takes two operands of one
    dtype, so the cotangent and the saved operand share one float8 format
    there: :data:`CONV_GRAD_DTYPE`, the cotangent scaled per tensor into it
    and the saved e4m3 operand converted to it.
    """
    params = dict(params, preferred_element_type=jnp.float32)

    def conv(x, y):
        return compat.bind_conv(x, y, params)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        return _quantized_forward(conv, a, b, matmul_dtype, out_dtype)

    def backward(res, ct):
        a8, ia, b8, ib = res
        ct8, ic = quantize(ct, CONV_GRAD_DTYPE)
        a8, b8 = a8.astype(CONV_GRAD_DTYPE), b8.astype(CONV_GRAD_DTYPE)
        da = _conv_transpose(params, b8, 0, a.shape, ct8)
        db = _conv_transpose(params, a8, 1, b.shape, ct8)
        return dequantize(da, (ic, ib), a.dtype), dequantize(db, (ic, ia), b.dtype)

    product.defvjp(forward, backward)
    return product(a, b)


# --- Block scaling (OCP MX) ------------------------------------------------------------------

#: The block of an MX format: elements per scale along a contracting dimension.
MX_BLOCK = 32
#: The element dtype of MXFP8 as ``jax.nn.scaled_matmul`` and cuDNN take it.
MX_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
#: The dtype of MX scales: a biased power-of-two exponent in one byte.
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
# The exponents kept: a float32 power of two stays a normal number (XLA on CPU
# flushes subnormals), and an MX scale of a float32 operand never needs more.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126


def _pow2(e: jax.Array) -> jax.Array:
    """``2.0 ** e`` in float32, exactly, for integer ``e`` in ``[-126, 127]``."""
    return lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)


def _rows(x: jax.Array, batch, free, contract) -> jax.Array:
    """``x`` as ``(B, F, K)``: its ``batch``, ``free`` and ``contract`` dimensions, in those
    orders, each group flattened: the layout of ``jax.nn.scaled_matmul``'s operands."""
    x = lax.transpose(x, tuple(int(d) for d in (*batch, *free, *contract)))
    sizes = [math.prod(x.shape[i] for i in range(lo, hi)) for lo, hi in (
        (0, len(batch)), (len(batch), len(batch) + len(free)), (len(batch) + len(free), x.ndim))]
    return x.reshape(sizes)


def mx_quantize(x: jax.Array, dtype: Any = MX_DTYPE, block: int = MX_BLOCK
                ) -> tuple[jax.Array, jax.Array]:
    """``(elements, scales)`` of ``x`` (``(B, F, K)``) in blocks of ``block`` along ``K``.

    Each block's scale is ``2 ** ceil(log2(amax / max(dtype)))`` (E8M0, so no
    element saturates); the elements are ``x / scale`` rounded to nearest-even
    ``dtype``, shape ``(B, F, K)``. ``K`` need not be a multiple of ``block``: the
    last block is padded with zeros (which change neither its amax nor the
    product), so the scales have shape ``(B, F, ceil(K / block))``. A block of
    zeros gets scale 1 and stays zero; a block with an inf or NaN gets scale 1
    and NaN elements (``float8_e4m3fn`` has no inf), so the product is NaN and
    the loss scaler sees it.
    """
    k = x.shape[-1]
    padded = -(-k // block) * block
    x = x.astype(jnp.float32)
    if padded != k:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - k)])
    blocks = x.reshape(*x.shape[:-1], padded // block, block)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    # amax / max(dtype) rounded up to a power of two, from the float32 bits alone: the
    # difference of the exponents, plus one if amax's mantissa is the larger (448 is
    # 1.75 * 2**8: 449 gets scale 2, 448 scale 1, 224 scale 1/2). Exact, no division.
    top = int(np.array(jnp.finfo(dtype).max, np.float32).view(np.int32))
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    e = (bits >> 23) - (top >> 23) + ((bits & 0x7FFFFF) > (top & 0x7FFFFF)).astype(jnp.int32)
    e = lax.clamp(np.int32(_MIN_EXPONENT), e, np.int32(_MAX_EXPONENT))
    e = lax.select(jnp.isfinite(amax) & (amax > 0), e, jnp.zeros_like(e))
    elements = (blocks * _pow2(-e)[..., None]).astype(dtype).reshape(x.shape)[..., :k]
    scales = lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)
    return elements, scales


def _pad_blocks(q: jax.Array, scales: jax.Array, block: int) -> jax.Array:
    """The elements ``q`` padded with zeros to the whole blocks of ``scales``."""
    missing = scales.shape[-1] * block - q.shape[-1]
    return jnp.pad(q, [(0, 0)] * (q.ndim - 1) + [(0, missing)]) if missing else q


def _mx_matmul_emulated(qa, sa, qb, sb):
    """What cuDNN's block-scaled dot computes, with XLA's own products.

    One float8 ``dot_general`` per block of 32 (float32 accumulation), each
    block's partial products multiplied by its two scales (powers of two:
    exact) and summed in float32.
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
    return jnp.sum(partial * sa * sb, axis=1)


@jax.custom_batching.custom_vmap
def _mx_matmul_cudnn(qa, sa, qb, sb):
    """``jax.nn.scaled_matmul``: cuDNN's block-scaled dot (``__op$block_scaled_dot``)."""
    qa, qb = _pad_blocks(qa, sa, MX_BLOCK), _pad_blocks(qb, sb, MX_BLOCK)
    return jax.nn.scaled_matmul(qa, qb, sa, sb, preferred_element_type=jnp.float32)


@_mx_matmul_cudnn.def_vmap
def _mx_matmul_cudnn_vmap(axis_size, in_batched, qa, sa, qb, sb):
    # JAX's batching rule wants all four operands mapped alike; a weight shared
    # by every example (unmapped) is broadcast, and the mapped axis joins B.
    args = [x if mapped else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, mapped in zip((qa, sa, qb, sb), in_batched)]
    folded = [x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in args]
    out = _mx_matmul_cudnn(*folded)
    return out.reshape(axis_size, -1, *out.shape[1:]), True


def _mx_matmul_cuda(qa, sa, qb, sb):
    """:func:`_mx_matmul_cudnn`, its result typed as varying over the ``shard_map`` axes its
    operands vary over (JAX's custom call does not say, and both branches must agree)."""
    axes = set().union(*(sharding.varying_axes(x) for x in (qa, sa, qb, sb)))
    return sharding.as_varying(_mx_matmul_cudnn(qa, sa, qb, sb), tuple(sorted(axes, key=str)))


def _mx_matmul(qa, sa, qb, sb):
    """The float32 product ``(B, M, N)`` of MX operands ``(B, M, K)`` and ``(B, N, K)``.

    The choice is made when the program is lowered (``lax.platform_dependent``):
    cuDNN's block-scaled dot on CUDA, :func:`_mx_matmul_emulated` elsewhere.
    """
    return lax.platform_dependent(qa, sa, qb, sb, cuda=_mx_matmul_cuda,
                                  default=_mx_matmul_emulated)


def _block_scaled_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype, quantize, matmul):
    """``dot_general(a, b)`` with block-scaled operands, forward and backward.

    ``quantize`` takes an operand laid out as ``(B, F, K)`` and returns its
    elements and block scales along ``K``; ``matmul`` multiplies two such
    operands into a float32 ``(B, M, N)``. Every product quantizes its
    operands along its own contracting dimension: the forward product along
    the contracting dimensions of ``dot_general``; the input gradient
    (``ct . b``) along ``b``'s free dimensions; the weight gradient
    (``a . ct``) along ``a``'s free dimensions (a layer's batch and token
    dimensions). The backward operands ``a`` and ``b`` are quantized in the
    forward pass, from the values themselves (not from their forward
    quantization), and saved in float8 with their scales.
    """
    del matmul_dtype  # the recipe's quantize says which float8 dtype
    (ac, bc), (ab, bb) = dimension_numbers
    a_free, b_free, ct_batch, ct_a, ct_b = _dot_layout(a.ndim, b.ndim, dimension_numbers)

    def undo(y, x, dims, dtype):
        """``y`` (``(B, F, K)``, float32) back in the layout of ``x`` whose dims it lists."""
        y = y.reshape([x.shape[d] for d in dims])
        return lax.transpose(y, tuple(int(i) for i in np.argsort(dims))).astype(dtype)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        out = matmul(*quantize(_rows(a, ab, a_free, ac)), *quantize(_rows(b, bb, b_free, bc)))
        shape = [a.shape[d] for d in (*ab, *a_free)] + [b.shape[d] for d in b_free]
        residuals = (quantize(_rows(a, ab, ac, a_free)), quantize(_rows(b, bb, bc, b_free)))
        return out.reshape(shape).astype(out_dtype), residuals

    def backward(residuals, ct):
        a_t, b_t = residuals
        # d/da: ct (B, M, N) times b (B, K, N), both in blocks along b's free dimensions.
        da = matmul(*quantize(_rows(ct, ct_batch, ct_a, ct_b)), *b_t)
        # d/db: a (B, K, M) times ct (B, N, M), both in blocks along a's free dimensions.
        db = matmul(*a_t, *quantize(_rows(ct, ct_batch, ct_b, ct_a)))
        return (undo(da, a, [*ab, *a_free, *ac], a.dtype),
                undo(db, b, [*bb, *bc, *b_free], b.dtype))

    product.defvjp(forward, backward)
    return product(a, b)


# --- The recipes -----------------------------------------------------------------------------


class Recipe(NamedTuple):
    """One way of scaling the float8 products of ``autocast``: a row of :data:`RECIPES`.

    Attributes:
        name: its ``float8_scaling`` name.
        matmul_dtypes: the ``matmul_dtype`` values it takes.
        block: elements per scale along the contracting dimension of the
            products it block-scales; 0 for one scale per tensor.
        blocked: the primitives it block-scales; the others (convolutions
            under ``"mxfp8"``) run with one scale per tensor.
        dot: ``dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype)``, the
            scaled ``dot_general`` with its float8 backward products.
        conv: ``conv(a, b, *, params, matmul_dtype, out_dtype)``, the same for
            ``conv_general_dilated``.
        summary: what it does, for error messages.
    """

    name: str
    matmul_dtypes: tuple
    block: int
    blocked: frozenset
    dot: Callable
    conv: Callable
    summary: str


#: The float8 scaling recipes, by ``float8_scaling`` name: one row each.
RECIPES = {
    "tensor": Recipe(
        "tensor", FLOAT8_DTYPES, 0, frozenset(), _scaled_dot, _scaled_conv,
        "one power-of-two scale per tensor; cotangents in float8_e5m2"),
    "mxfp8": Recipe(
        "mxfp8", (MX_DTYPE,), MX_BLOCK, frozenset({"dot_general"}),
        functools.partial(_block_scaled_dot, quantize=mx_quantize, matmul=_mx_matmul),
        _scaled_conv,
        "OCP MXFP8: float8_e4m3fn elements with one E8M0 scale per 32 elements along each "
        "product's contracting dimension, forward and backward"),
}
#: The recipe used when none is named.
DEFAULT_RECIPE = "tensor"


def check_scaling(float8_scaling: Any, matmul_dtype: np.dtype | None) -> Recipe:
    """The :data:`RECIPES` row named ``float8_scaling``, for ``matmul_dtype`` (checked).

    ``matmul_dtype`` is what :func:`check_matmul_dtype` returned (``None``:
    products in the compute dtype). Raises a ``ValueError`` naming the problem
    and the fix for an unknown name, a recipe other than ``"tensor"`` without
    a float8 ``matmul_dtype``, or a ``matmul_dtype`` the recipe does not take.
    """
    recipe = RECIPES.get(float8_scaling) if isinstance(float8_scaling, str) else None
    if recipe is None:
        hint = ""
        if isinstance(float8_scaling, str) and float8_scaling.lower() in RECIPES:
            hint = f" Names are lower case: float8_scaling={float8_scaling.lower()!r}."
        elif isinstance(float8_scaling, str) and "fp4" in float8_scaling.lower():
            hint = " 4-bit formats (mxfp4, nvfp4) are not implemented."
        raise ValueError(
            f"float8_scaling must be one of {sorted(RECIPES)}: 'tensor' (default, one scale "
            f"per tensor) or 'mxfp8' (one scale per block of {MX_BLOCK}); got "
            f"{float8_scaling!r}." + hint)
    if matmul_dtype is None:
        if recipe.name != DEFAULT_RECIPE:
            raise ValueError(
                f"float8_scaling={recipe.name!r} scales float8 matrix products, but "
                "matmul_dtype is None (or the compute dtype): the products run in the compute "
                "dtype and there is nothing to scale.\n"
                f"  Fix: pass matmul_dtype=jnp.{recipe.matmul_dtypes[0].name} with "
                f"float8_scaling={recipe.name!r}, or leave float8_scaling out.")
        return recipe
    if np.dtype(matmul_dtype) not in recipe.matmul_dtypes:
        takes = " or ".join(f"jnp.{d.name}" for d in recipe.matmul_dtypes)
        raise ValueError(
            f"float8_scaling={recipe.name!r} takes matmul_dtype={takes} ({recipe.summary}); "
            f"got {np.dtype(matmul_dtype).name}.\n"
            f"  Fix: matmul_dtype={takes}, or float8_scaling='tensor' for "
            f"{np.dtype(matmul_dtype).name} products with one scale per tensor.")
    return recipe


def scaled_product(eqn, invals, compute_dtype: np.dtype, matmul_dtype: np.dtype,
                   recipe: Recipe | None = None) -> jax.Array:
    """The float8 replacement of a ``dot_general`` or ``conv_general_dilated`` equation.

    ``recipe`` is a row of :data:`RECIPES` (default ``"tensor"``). The
    operands keep the dtypes they have (a float32 weight is quantized from
    float32); the result is in ``compute_dtype``. The new equations carry the
    source location of ``eqn`` (the user's line).
    """
    recipe = RECIPES[DEFAULT_RECIPE] if recipe is None else recipe
    a, b = invals
    with interpret.at_source_of(eqn):
        if eqn.primitive.name == "dot_general":
            return recipe.dot(a, b, dimension_numbers=compat.dimension_numbers(eqn),
                              matmul_dtype=matmul_dtype, out_dtype=compute_dtype)
        return recipe.conv(a, b, params=compat.params_for_bind(eqn), matmul_dtype=matmul_dtype,
                           out_dtype=compute_dtype)
