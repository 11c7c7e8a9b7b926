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

That is the ``"tensor"`` recipe. How a product is scaled is a row of one
table, :data:`RECIPES` (``float8_scaling=`` of ``autocast``): a name, the
float8 dtypes it takes, its block size and its two product functions. The
``"mxfp8"`` row follows OCP MX v1.0: each operand of a ``dot_general`` is
quantized in blocks of 32 consecutive elements along that product's
contracting dimension, each block with its own power-of-two (E8M0) scale,
forward and backward, all in ``float8_e4m3fn``; it runs through
``jax.nn.scaled_matmul`` (cuDNN's block-scaled dot) on GPUs with
block-scaled GEMMs and an emulation with the same numbers on the CPU
(:func:`_mx_matmul`); on other accelerators its ``fallback``, the
per-tensor recipe, runs instead (:func:`recipe_for`). A new recipe (1x128
or 128x128 blocks, NVFP4) is a new row: its quantizer and its product.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src import sharding

#: The float8 dtypes accepted as ``matmul_dtype``.
FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: The dtype of cotangents in the backward products.
GRAD_DTYPE = jnp.dtype(jnp.float8_e5m2)
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
    """What :class:`jaxmp.experimental.Float8Rules` sees of one matrix product.

    Attributes:
        primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
        lhs_shape: the shape of the left operand.
        rhs_shape: the shape of the right operand (the kernel of a convolution).
        flops: ``2 *`` multiply-adds, as :func:`jaxmp.debug.matmul_flops` counts them.
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
        >>> jaxmp.experimental.Float8Rules()
        Float8Rules()
        >>> rules = jaxmp.experimental.Float8Rules(min_flops=2**20, keep_scopes={"head"})
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
    return Product(eqn.primitive.name, lhs, rhs, jaxprs.eqn_flops(eqn), scope)


def placement(eqn, scope: str, low_precision: Iterable[str], rules: Float8Rules) -> str | None:
    """Whether :func:`jaxmp.autocast` with a float8 ``matmul_dtype`` runs ``eqn`` in float8.

    The one decision, asked by autocast to run the product and by the
    census (``jaxmp.experimental.Float8ShortfallWarning``) to explain it. Returns ``None``
    when the product runs in float8, else why not:

    * ``"float8_operand"``: the function gives it a float8 operand already; it
      runs as written;
    * ``"kept"``: the user's ``rules`` keep it in the compute dtype;
    * ``"rules"``: its primitive is not in ``AutocastRules.low_precision``;
    * ``"operand"``: it does not have two floating-point operands;
    * ``"transposed_conv"``: a convolution that dilates its input
      (``lhs_dilation``), which XLA's GPU compiler cannot run in float8 (see
      :func:`conv_float8_products`).

    A convolution placed in float8 runs some backward products in the
    compute dtype: :func:`conv_float8_products` says which.

    Args:
        eqn: a ``dot_general`` or ``conv_general_dilated`` equation.
        scope: the ``jax.named_scope`` path around it (see :class:`Product`).
        low_precision: ``AutocastRules.low_precision``.
        rules: the :class:`jaxmp.experimental.Float8Rules`.
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
    if eqn.primitive.name == "conv_general_dilated" and not conv_float8_products(compat.conv_params(eqn))[0]:
        return "transposed_conv"
    return None


# --- Scaling -----------------------------------------------------------------------------

# The exponents of scales: a power of two in this range and its inverse are both normal
# float32 numbers (XLA flushes subnormals on CPU and GPU), and no float32 operand needs more.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 126


def _pow2(e: jax.Array) -> jax.Array:
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
    return _pow2(-scale_exponent(amax, dtype))


def _amax(x: jax.Array) -> jax.Array:
    """The largest magnitude of ``x``, in ``x``'s dtype (exact: a maximum does not round).

    Along the minor dimension first, then over the rest: a row reduction, which
    XLA's GPU compiler can fuse into the kernel that produces ``x``.
    """
    x = jnp.abs(x)
    if x.ndim > 1:
        x = jnp.max(x, axis=-1, initial=0)
    return jnp.max(x, initial=0)


def _to_float8(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` (a power of two: exact) in the float8 ``dtype`` (one rounding)."""
    return (x.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def _factors(exponents, sums, dtype) -> jax.Array:
    """The scalars of a scaled product as one vector in ``dtype``: ``2**-e`` for each of
    ``exponents`` (the scales that quantize its operands), then ``2**(e_i + e_j)`` for each
    pair ``(i, j)`` of ``sums`` (the factors that unscale its results).

    ``dtype`` is the dtype the products are unscaled in (:func:`_product_dtype`:
    bfloat16 or float32, which hold these powers of two exactly). One vector
    behind an optimization barrier, so that XLA computes every scalar of the
    product in one small kernel that each consumer reads, rather than
    recomputing them in a small kernel per consumer (it does otherwise). An
    unscaling exponent lies in ``[-126, 252]`` (see :func:`_floor`): above 127
    the factor is inf, as the product itself then lies near or beyond
    float32's range.
    """
    out = [_pow2(-e) for e in exponents]
    for i, j in sums:
        e = exponents[i] + exponents[j]
        out.append(lax.select(e > 127, jnp.float32(np.inf), _pow2(jnp.minimum(e, 127))))
    return lax.optimization_barrier(jnp.stack(out).astype(dtype))


def _floor(e: jax.Array, *others: jax.Array) -> jax.Array:
    """``e`` raised where needed so that ``e + o >= -126`` for each of ``others``: the
    unscaling factor of a product stays a normal float32 (its operands are then quantized
    a little below full range: only operands whose amaxes multiply below ~2**-108 lose
    bits, where float32's own product would lose them)."""
    for o in others:
        e = jnp.maximum(e, np.int32(_MIN_EXPONENT) - o)
    return e


def _product_dtype(out_dtype: Any) -> np.dtype:
    """The dtype a float8 product writes before it is unscaled: ``out_dtype`` when it has
    float32's exponent range (bfloat16, float32), so that the GPU library applies the scales
    and writes ``out_dtype`` (one rounding); float32 otherwise (float16 would overflow on
    the unscaled product, up to ``448 * 57344 * K``)."""
    out_dtype = np.dtype(out_dtype)
    wide = jnp.finfo(out_dtype).maxexp >= jnp.finfo(jnp.float32).maxexp
    return out_dtype if wide else np.dtype(jnp.float32)


def _dequantized(product: Callable, a8, b8, factor: jax.Array) -> jax.Array:
    """``product(a8, b8, dtype)`` times ``factor`` (a power of two), in ``factor``'s dtype.

    The product is asked for in that dtype (bfloat16 or float32, see
    :func:`_product_dtype`) and multiplied by one scalar: XLA gives that scalar
    to cuBLASLt as the float8 GEMM's scale (``__cublas$lt$matmul$f8``, one
    kernel that writes the dtype, one rounding) or folds it into a Triton GEMM's
    epilogue.
    """
    return product(a8, b8, factor.dtype) * factor


# --- The scaled products ---------------------------------------------------------------------


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

    dtype = _product_dtype(out_dtype)

    def forward(a, b):
        ea = scale_exponent(_amax(a), matmul_dtype)
        eb = _floor(scale_exponent(_amax(b), matmul_dtype), ea)
        f = _factors((ea, eb), [(0, 1)], dtype)
        a8, b8 = _to_float8(a, f[0], matmul_dtype), _to_float8(b, f[1], matmul_dtype)
        dot = lambda x, y, dtype: _dot(x, y, dimension_numbers, dtype)
        return _dequantized(dot, a8, b8, f[2]).astype(out_dtype), (a8, ea, b8, eb)

    def backward(res, ct):
        a8, ea, b8, eb = res
        ec = _floor(scale_exponent(_amax(ct), GRAD_DTYPE), ea, eb)
        # d/da unscales by the cotangent's and b's scales, d/db by the cotangent's and a's.
        f = _factors((ec, ea, eb), [(0, 2), (0, 1)], dtype)
        ct8 = _to_float8(ct, f[0], GRAD_DTYPE)
        dtypes = (a.dtype, b.dtype)

        # Each unscaled after its transpose: XLA then writes the product in the layout of the
        # operand it differentiates (multiplied before, a transposed copy of attention-sized
        # gradients was written and read back).
        dot = lambda x, y, dn: _dot(x, y, dn, dtype)
        da, db = jaxprs.dot_transposes(ct8, a8, b8, dimension_numbers, dot)
        return (da * f[3]).astype(dtypes[0]), (db * f[4]).astype(dtypes[1])

    product.defvjp(forward, backward)
    return product(a, b)


def _conv_transpose(params, operand, wrt: int, other_struct, ct):
    """The backward product of a convolution with respect to argument ``wrt`` (0: lhs, 1: rhs).

    ``operand`` is the other argument (the kernel for ``wrt=0``, the input for
    ``wrt=1``) and ``ct`` the cotangent of the output, of one dtype. The
    transpose is JAX's own rule (any dimension numbers, strides, padding,
    dilations, feature and batch groups), traced once on stand-ins of the
    product's dtype (``preferred_element_type``, float32 when unset) and then
    evaluated on the values: besides the convolution it holds only data
    movement (``rev``, ``reshape``, ``transpose``), so the convolution binds
    the operands as they are (float8 ones with ``params``'s result type).
    ``other_struct`` is the shape of the argument differentiated.
    """
    stand_in = params["preferred_element_type"] or jnp.float32

    def conv(x, y):
        return compat.bind_conv(x, y, params)

    def transpose(known, g):
        if wrt == 0:
            linear = lambda x: conv(x, known)
        else:
            linear = lambda y: conv(known, y)
        (out,) = jax.linear_transpose(linear, jax.ShapeDtypeStruct(other_struct, stand_in))(g)
        return out

    closed = jax.make_jaxpr(transpose)(jax.ShapeDtypeStruct(operand.shape, stand_in),
                                       jax.ShapeDtypeStruct(ct.shape, stand_in))
    (out,) = interpret.Interpreter().eval_closed(closed, [operand, ct])
    return out


def conv_float8_products(params) -> tuple[bool, bool, bool]:
    """Which products of a convolution with these ``params`` run in float8: ``(forward,
    input gradient, kernel gradient)``.

    Those XLA's GPU compiler runs as cuDNN float8 graphs. It emits one
    (``__cudnn$convForwardGraph``) only for a convolution it runs as a
    *forward* convolution (``cudnn_fused_conv_rewriter``'s ``F8GraphConv``
    matches ``__cudnn$convForward`` calls alone); a backward-data or
    backward-filter call with float8 operands is widened to float32 instead,
    and the input gradient of a strided convolution becomes a forward
    convolution over a zero-dilated cotangent, with four times the FLOPs
    (stride 2). So:

    * the forward product, unless it dilates its input (``lhs_dilation``, a
      transposed convolution, which XLA runs as a backward-data call): then
      autocast keeps the whole convolution in the compute dtype
      (:func:`placement`);
    * the input gradient when the forward product has unit strides (and no
      batch groups): JAX's transpose is then a forward convolution;
    * never the kernel gradient, which XLA always runs as a backward-filter
      call.

    The others run in the compute dtype, from the values themselves (not from
    their float8 quantization): cuDNN's backward-data and backward-filter
    kernels, with the strides handled natively.
    """
    forward = all(d == 1 for d in params["lhs_dilation"])
    input_gradient = (forward and all(s == 1 for s in params["window_strides"])
                      and params["batch_group_count"] == 1)
    return forward, input_gradient, False


def _scaled_conv(a, b, *, params, matmul_dtype, out_dtype):
    """``conv_general_dilated(a, b)`` with its float8 products (:func:`conv_float8_products`).

    The forward product quantizes both operands into ``matmul_dtype`` (per
    tensor) and is unscaled by one scalar into the compute dtype, like a dot
    (XLA fuses the scale and the output type into the cuDNN float8 graph). An
    input gradient in float8 quantizes the cotangent into ``matmul_dtype`` too
    (e4m3 x e4m3, the pair of the forward product: JAX's convolution takes
    operands of one dtype, and the pair cuDNN's float8 forward kernels take)
    and runs JAX's own transpose rule (:func:`_conv_transpose`) on the saved
    float8 kernel. The other backward products run in the compute dtype on
    the operand and cotangent themselves.
    """
    dtype = _product_dtype(out_dtype)
    narrow = dict(params, preferred_element_type=dtype)
    wide = dict(params, preferred_element_type=None)
    _, input_gradient8, _ = conv_float8_products(params)

    def conv(x, y):
        return compat.bind_conv(x, y, narrow)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        ea = scale_exponent(_amax(a), matmul_dtype)
        eb = _floor(scale_exponent(_amax(b), matmul_dtype), ea)
        f = _factors((ea, eb), [(0, 1)], dtype)
        a8, b8 = _to_float8(a, f[0], matmul_dtype), _to_float8(b, f[1], matmul_dtype)
        # The kernel gradient's operand in the compute dtype; the input gradient's kernel in
        # float8 (with its scale) or in the compute dtype.
        kernel = (b8, eb) if input_gradient8 else (b.astype(out_dtype),)
        return (conv(a8, b8) * f[2]).astype(out_dtype), (a.astype(out_dtype), *kernel)

    def backward(res, ct):
        a_wide, *kernel = res
        ct_wide = ct.astype(out_dtype)
        if input_gradient8:
            b8, eb = kernel
            ec = _floor(scale_exponent(_amax(ct), matmul_dtype), eb)
            f = _factors((ec, eb), [(0, 1)], dtype)
            ct8 = _to_float8(ct, f[0], matmul_dtype)
            da = _conv_transpose(narrow, b8, 0, a.shape, ct8) * f[2]
        else:
            da = _conv_transpose(wide, kernel[0], 0, a.shape, ct_wide)
        db = _conv_transpose(wide, a_wide, 1, b.shape, ct_wide)
        return da.astype(a.dtype), db.astype(b.dtype)

    product.defvjp(forward, backward)
    return product(a, b)


# --- Block scaling (OCP MX) ------------------------------------------------------------------

#: The block of an MX format: elements per scale along a contracting dimension.
MX_BLOCK = 32
#: The element dtype of MXFP8 as ``jax.nn.scaled_matmul`` and cuDNN take it.
MX_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
#: The dtype of MX scales: a biased power-of-two exponent in one byte.
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
def _rows(x: jax.Array, batch, free, contract) -> jax.Array:
    """``x`` as ``(B, F, K)``: its ``batch``, ``free`` and ``contract`` dimensions, in those
    orders, each group flattened: the layout of ``jax.nn.scaled_matmul``'s operands."""
    x = lax.transpose(x, tuple(int(d) for d in (*batch, *free, *contract)))
    sizes = [math.prod(x.shape[i] for i in range(lo, hi)) for lo, hi in (
        (0, len(batch)), (len(batch), len(batch) + len(free)), (len(batch) + len(free), x.ndim))]
    return x.reshape(sizes)


def mx_quantize(x: jax.Array, dtype: Any = MX_DTYPE, block: int = MX_BLOCK, axis: int = -1
                ) -> tuple[jax.Array, jax.Array]:
    """``(elements, scales)`` of ``x`` in blocks of ``block`` along ``axis`` (default: the last).

    Each block's scale is ``2 ** ceil(log2(amax / max(dtype)))`` (E8M0, so no
    element saturates); the elements are ``x / scale`` rounded to nearest-even
    ``dtype``, of ``x``'s shape. ``x.shape[axis]`` need not be a multiple of
    ``block``: the last block is padded with zeros (which change neither its
    amax nor the product), so the scales have ``x``'s shape with
    ``ceil(x.shape[axis] / block)`` along ``axis``. A block of zeros gets
    scale 1 and stays zero; a block with an inf or NaN gets scale 1 and NaN
    elements (``float8_e4m3fn`` has no inf), so the product is NaN and the
    loss scaler sees it.
    """
    axis = axis % x.ndim
    k = x.shape[axis]
    padded = -(-k // block) * block
    if padded != k:
        x = jnp.pad(x, [(0, padded - k) if d == axis else (0, 0) for d in range(x.ndim)])
    blocks = x.reshape(*x.shape[:axis], padded // block, block, *x.shape[axis + 1:])
    # amax / max(dtype) rounded up to a power of two (exact, from the float32 bits). The amax
    # is taken in x's own dtype (a maximum does not round): no float32 copy of x is made.
    e = scale_exponent(jnp.max(jnp.abs(blocks), axis=axis + 1), dtype)
    scaled = blocks.astype(jnp.float32) * jnp.expand_dims(_pow2(-e), axis + 1)
    elements = scaled.astype(dtype).reshape(x.shape)
    if padded != k:
        elements = lax.slice_in_dim(elements, 0, k, axis=axis)
    scales = lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)
    return elements, scales


def _quantized_rows(quantize, x: jax.Array, batch, free, contract, block: int):
    """``quantize(_rows(x, batch, free, contract))``: ``x`` as ``(B, F, K)`` in blocks along
    ``K``, quantized in ``x``'s own layout when the blocks lie within one of its dimensions.

    The blocks of 32 along the flattened ``contract`` dimensions lie within the
    last of them when its size is a multiple of 32: then ``x`` is quantized
    along that dimension where it is, and only its float8 elements and scales
    are laid out as ``(B, F, K)``. Transposing ``x`` first (for a weight
    gradient's blocks along the batch and tokens) made XLA write a transposed
    copy of ``|x|`` to take the blocks' amaxes. Same blocks, same numbers.
    """
    last = contract[-1]
    if x.shape[last] % block:
        return quantize(_rows(x, batch, free, contract))
    elements, scales = quantize(x, axis=last)
    return _rows(elements, batch, free, contract), _rows(scales, batch, free, contract)


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
                      block):
    """``dot_general(a, b)`` with block-scaled operands, forward and backward.

    ``quantize`` takes an operand and returns its elements and scales in
    blocks of ``block`` along its last dimension (or ``axis=``); ``matmul`` multiplies two such
    operands into a ``(B, M, N)`` of a given dtype: every product writes the
    compute dtype (float32 under float16, see :func:`_product_dtype`), then
    cast to the dtype of the operand it differentiates. Every product quantizes its
    operands along its own contracting dimension: the forward product along
    the contracting dimensions of ``dot_general``; the input gradient
    (``ct . b``) along ``b``'s free dimensions; the weight gradient
    (``a . ct``) along ``a``'s free dimensions (a layer's batch and token
    dimensions). The backward operands ``a`` and ``b`` are quantized in the
    forward pass, from the values themselves (not from their forward
    quantization), and saved in float8 with their scales.
    """
    del matmul_dtype  # the recipe's quantize says which float8 dtype
    dtype = _product_dtype(out_dtype)
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
        rows = lambda x, *dims: _quantized_rows(quantize, x, *dims, block)
        out = matmul(*rows(a, ab, a_free, ac), *rows(b, bb, b_free, bc), dtype)
        shape = [a.shape[d] for d in (*ab, *a_free)] + [b.shape[d] for d in b_free]
        residuals = (rows(a, ab, ac, a_free), rows(b, bb, bc, b_free))
        return out.reshape(shape).astype(out_dtype), residuals

    def backward(residuals, ct):
        a_t, b_t = residuals
        # d/da: ct (B, M, N) times b (B, K, N), both in blocks along b's free dimensions.
        rows = lambda x, *dims: _quantized_rows(quantize, x, *dims, block)
        da = matmul(*rows(ct, ct_batch, ct_a, ct_b), *b_t, dtype)
        # d/db: a (B, K, M) times ct (B, N, M), both in blocks along a's free dimensions.
        db = matmul(*a_t, *rows(ct, ct_batch, ct_b, ct_a), dtype)
        return (undo(da, a, [*ab, *a_free, *ac], a.dtype),
                undo(db, b, [*bb, *bc, *b_free], b.dtype))

    product.defvjp(forward, backward)
    return product(a, b)


# --- Where the products run ------------------------------------------------------------------


class Target(NamedTuple):
    """The device a traced product is compiled for, as far as tracing can tell.

    Attributes:
        platform: ``"gpu"``, ``"cpu"``, ``"tpu"``...
        kind: the device kind (``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA B200"``).
        capability: the CUDA compute capability (``"9.0"``) when a device
            object says it; ``None`` when only the device kind is known.
    """

    platform: str
    kind: str
    capability: str | None


def _abstract_platform(device: Any) -> str | None:
    """The platform of an abstract mesh's device, or ``None`` when it cannot be told.

    JAX's abstract devices name their platform from jax 0.9 on; before, only
    their kind, from which the platform of a CPU, an NVIDIA GPU or a TPU is read.
    """
    platform = getattr(device, "platform", None)
    if platform:
        return platform
    kind = str(getattr(device, "device_kind", "")).lower()
    if kind == "cpu":
        return "cpu"
    if "nvidia" in kind:
        return "gpu"
    if "tpu" in kind:
        return "tpu"
    return None


def compile_target(avals: Iterable[Any]) -> Target:
    """Where a product with operands of these abstract values will run.

    The device of the operands' shardings when they have one: ``jit`` with
    sharded arguments, and deviceless ahead-of-time compilation, whose
    arguments (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh,
    ...))`` over a ``jax.experimental.topologies`` topology's devices) carry
    the target's device kind in their types. Else the first device of the
    default backend, where ``jit`` compiles unsharded arguments.
    """
    for aval in avals:
        mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
        device = getattr(mesh, "abstract_device", None)
        platform = _abstract_platform(device) if device is not None else None
        if platform is not None:
            return Target(platform, device.device_kind, None)
    device = jax.devices()[0]
    return Target(device.platform, device.device_kind,
                  getattr(device, "compute_capability", None))


# CUDA compute capabilities of GPUs by device kind, for targets known by their kind alone.
_CAPABILITIES = (
    (re.compile(r"\bG?B(100|200|300)\b|Blackwell|\bGB10\b|RTX 50\d0", re.I), "10.0"),
    (re.compile(r"\bG?H(100|200|800|20)\b", re.I), "9.0"),
    (re.compile(r"\bL4\b|\bL40|RTX 40\d0|\bAda\b", re.I), "8.9"),
    (re.compile(r"\bA(100|800|30|10|40)\b|RTX 30\d0|A6000", re.I), "8.0"),
)
_GENERATIONS = {"12": "Blackwell", "10": "Blackwell", "9": "Hopper", "8.9": "Ada Lovelace",
                "8": "Ampere", "7.5": "Turing", "7": "Volta"}


def _capability(target: Target) -> str | None:
    if target.platform != "gpu":
        return None
    if target.capability is not None:
        return target.capability
    return next((cc for pattern, cc in _CAPABILITIES if pattern.search(target.kind)), None)


def describe(target: Target) -> str:
    """``target`` as a message names it: ``NVIDIA H100 80GB HBM3 (Hopper, sm_90)``."""
    cc = _capability(target)
    if cc is None:
        return target.kind or target.platform
    major = cc.split(".")[0]
    generation = _GENERATIONS.get(cc, _GENERATIONS.get(major))
    sm = "sm_" + cc.replace(".", "")
    return f"{target.kind} ({generation + ', ' if generation else ''}{sm})"


def block_scaled_gemms(target: Target) -> bool:
    """Whether ``target`` runs cuDNN's block-scaled dot (``jax.nn.scaled_matmul``) natively.

    XLA's GPU compiler gives the block-scaled dot to cuDNN on NVIDIA GPUs of
    compute capability 10.0 and up (Blackwell, with cuDNN 9.7 or newer) and
    otherwise expands it into converts and a float32 ``dot`` that its loop
    emitter runs without tensor cores.
    """
    cc = _capability(target)
    try:
        return cc is not None and int(cc.split(".")[0]) >= 10
    except ValueError:  # not a CUDA capability (ROCm's gfx names)
        return False


def recipe_on(recipe: Recipe, target: Target) -> Recipe:
    """The recipe that runs ``recipe``'s products on ``target``.

    A block-scaled recipe runs where its GEMMs exist (GPUs with
    :func:`block_scaled_gemms`) and on the CPU (an emulation with the same
    numbers: the reference the tests check); on any other accelerator (Hopper
    and older NVIDIA GPUs, ROCm, TPU) its ``fallback`` runs instead, the
    per-tensor recipe's float8 GEMMs, which such hardware has.
    """
    if recipe.fallback is None or target.platform == "cpu" or block_scaled_gemms(target):
        return recipe
    return RECIPES[recipe.fallback]


def recipe_for(recipe: Recipe, avals: Iterable[Any]) -> tuple[Recipe, Target]:
    """``(recipe that runs, target)`` for a product of ``recipe`` with operands ``avals``:
    chosen when the product is traced (:func:`compile_target`, :func:`recipe_on`);
    ``jaxmp``'s census says so once when it is the fallback
    (``jaxmp.experimental.Float8ShortfallWarning``)."""
    target = compile_target(avals)
    return recipe_on(recipe, target), target


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
        fallback: the recipe run instead on accelerators without block-scaled
            GEMMs (:func:`recipe_for`); ``None`` for a recipe that runs
            everywhere.
    """

    name: str
    matmul_dtypes: tuple
    block: int
    blocked: frozenset
    dot: Callable
    conv: Callable
    summary: str
    fallback: str | None = None


#: The float8 scaling recipes, by ``float8_scaling`` name: one row each.
RECIPES = {
    "tensor": Recipe(
        "tensor", FLOAT8_DTYPES, 0, frozenset(), _scaled_dot, _scaled_conv,
        "one power-of-two scale per tensor; cotangents in float8_e5m2"),
    "mxfp8": Recipe(
        "mxfp8", (MX_DTYPE,), MX_BLOCK, frozenset({"dot_general"}),
        functools.partial(_block_scaled_dot, quantize=mx_quantize, matmul=_mx_matmul,
                          block=MX_BLOCK),
        _scaled_conv,
        "OCP MXFP8: float8_e4m3fn elements with one E8M0 scale per 32 elements along each "
        "product's contracting dimension, forward and backward", fallback="tensor"),
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
    recipe, _ = recipe_for(recipe, [v.aval for v in eqn.invars])
    a, b = invals
    with interpret.at_source_of(eqn):
        if eqn.primitive.name == "dot_general":
            return recipe.dot(a, b, dimension_numbers=compat.dimension_numbers(eqn),
                              matmul_dtype=matmul_dtype, out_dtype=compute_dtype)
        return recipe.conv(a, b, params=compat.params_for_bind(eqn), matmul_dtype=matmul_dtype,
                           out_dtype=compute_dtype)
