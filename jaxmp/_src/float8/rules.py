"""Which matrix products of ``autocast`` run in float8, and in which float8 dtypes.

The bottom of the ``float8`` package, read by every recipe and by the census:
the ``matmul_dtype`` values accepted (:func:`check_matmul_dtype`), the
user's :class:`Float8Rules` over a :class:`Product`, the kinds of products
float8 does not pay for, kept in the compute dtype by default (:data:`COSTLY`),
the one placement decision (:func:`placement`) and which products of a
convolution XLA's GPU compiler runs in float8 (:func:`conv_float8_products`). Nothing here says
how a product is scaled: that is a recipe's (``tensor.py``, ``mxfp8.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import jaxprs


#: The float8 dtypes accepted as ``matmul_dtype``.
FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
#: The 4-bit dtypes accepted as ``matmul_dtype`` (with a 4-bit recipe, ``"nvfp4"``).
FLOAT4_DTYPES = (jnp.dtype(jnp.float4_e2m1fn),)
#: The primitives :func:`jaxmp.autocast` runs in float8 by default.
FLOAT8_PRIMITIVES = compat.FLOAT8_PRIMITIVES


def is_float8_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a float8 dtype (any of JAX's, ``fnuz`` variants included)."""
    return casting.is_float_dtype(dtype) and np.dtype(dtype).itemsize == 1


def check_matmul_dtype(matmul_dtype: Any, compute_dtype: Any) -> np.dtype | None:
    """``matmul_dtype`` as a float8 (or float4) dtype, or ``None`` for products in
    ``compute_dtype``.

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
    if dtype in FLOAT8_DTYPES + FLOAT4_DTYPES:
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
        "jnp.float8_e4m3fn (recommended) or jnp.float8_e5m2 (or jnp.float4_e2m1fn with "
        f"float8_scaling='nvfp4'); got {dtype.name}." + hint)


class Product(NamedTuple):
    """What :class:`jaxmp.experimental.Float8Rules` sees of one matrix product.

    Attributes:
        primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
        lhs_shape: the shape of the left operand.
        rhs_shape: the shape of the right operand (the kernel of a convolution).
        flops: ``2 *`` multiply-adds, as :func:`jaxmp.debug.matmul_flops` counts them.
        scope: the ``jax.named_scope`` names around the product, outermost
            first, joined by ``/`` (``""`` when there are none).
        batch_dims: how many batch dimensions a ``dot_general`` has (0 for a
            convolution): the heads and batch of an attention einsum.
        from_inputs: whether each operand is read from the inputs of the
            function autocast runs (a parameter, a batch: moved, reshaped or
            converted only) rather than computed by it (an activation).
        elements: the elements of its two operands and of its result.
    """

    primitive: str
    lhs_shape: tuple
    rhs_shape: tuple
    flops: int
    scope: str
    batch_dims: int = 0
    from_inputs: tuple = (True, True)
    elements: int = 0

    @property
    def activation_product(self) -> bool:
        """A ``dot_general`` with batch dimensions whose two operands the function computes:
        an attention's scores (``q @ k.T``) and its weighted values (``probs @ v``)."""
        return self.batch_dims > 0 and not any(self.from_inputs)

    @property
    def batched(self) -> bool:
        """Whether it is a ``dot_general`` with batch dimensions (an attention product's heads
        and examples; a dense layer has none)."""
        return self.batch_dims > 0

    @property
    def flops_per_element(self) -> float:
        """Its ``flops`` over the elements float8 quantises for it: its two operands and
        its result (the cotangent its backward products quantise)."""
        return self.flops / max(1, self.elements)


class Costly(NamedTuple):
    """A kind of product kept in the compute dtype by default: float8 does not pay for it.

    Attributes:
        keeps: whether a :class:`Product` is of this kind.
        says: why float8 does not pay for it, as the message that lists them says.
    """

    keeps: Callable[[Product], bool]
    says: str


#: The products :func:`jaxmp.autocast` keeps in the compute dtype under a float8
#: ``matmul_dtype`` unless ``Float8Rules(include=...)`` names them: on the H100 program
#: XLA compiles (``benchmarks/README.md``, "Issue 41 part 3"), quantising them costs more
#: than their float8 GEMMs save.
COSTLY = {
    "attention": Costly(
        lambda p: p.primitive == "dot_general" and p.activation_product,
        "products with batch dimensions of two activations the function computes (an "
        "attention's scores q @ k.T and weighted values probs @ v): float8 quantises both "
        "operands and the cotangent, each a full activation, for few FLOPs per element"),
    "convolution": Costly(
        lambda p: p.primitive == "conv_general_dilated",
        "convolutions: XLA's GPU compiler runs only their forward product (and a "
        "unit-stride input gradient) in float8 and widens the rest, so quantising costs more "
        "than it saves (ResNet-50 on an H100: float8 1.18x the bfloat16 step)"),
}


@dataclasses.dataclass(frozen=True)
class Float8Rules:
    """Which matrix products :func:`jaxmp.autocast` runs in float8 (``matmul_dtype``).

    A product runs in float8 unless one of these says to keep it in the
    compute dtype, or it is of a kind float8 does not pay for
    (``jaxmp._src.float8.rules.COSTLY``): by default, products with batch
    dimensions whose two operands the function computes (an attention's
    ``q @ k.T`` and ``probs @ v``, not a projection, whose weight is read
    from the function's inputs) and convolutions stay in the compute dtype,
    said once while tracing (:class:`jaxmp.experimental.Float8ShortfallWarning`);
    ``include`` asks for them in float8.

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
        include: the kinds of products kept in the compute dtype by default to
            run in float8 anyway: ``"attention"`` (batched products of two
            computed activations), ``"convolution"``; default none.
        min_flops_per_element: products with fewer FLOPs per element that
            float8 quantises (both operands and the result,
            ``Product.flops_per_element``) stay in the compute dtype (default
            0: none). On an H100 or a B200 float8 pays from about 1000: a
            GEMM of ``m x k`` by ``k x n`` has ``2mkn / (mk + kn + mn)``.

    Examples:
        >>> import jaxmp
        >>> jaxmp.experimental.Float8Rules()
        Float8Rules()
        >>> rules = jaxmp.experimental.Float8Rules(min_flops=2**20, keep_scopes={"head"})
        >>> rules
        Float8Rules(min_flops=1048576, keep_scopes={'head'})
        >>> "head" in rules.keep_scopes
        True
        >>> jaxmp.experimental.Float8Rules(include={"attention"})  # q @ k.T in float8 too
        Float8Rules(include={'attention'})
    """

    primitives: frozenset = FLOAT8_PRIMITIVES
    min_flops: int = 0
    keep_scopes: frozenset = frozenset()
    keep_if: Callable[[Product], bool] | None = None
    include: frozenset = frozenset()
    min_flops_per_element: int = 0

    def __post_init__(self):
        for field in ("primitives", "keep_scopes", "include"):
            names = getattr(self, field)
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise TypeError(f"Float8Rules.{field} must be a collection of strings, e.g. "
                                f"{{'head'}}; got {names!r}.")
            object.__setattr__(self, field, frozenset(names))
        unknown = sorted(self.primitives - FLOAT8_PRIMITIVES)
        if unknown:
            raise ValueError(f"Float8Rules.primitives: only {sorted(FLOAT8_PRIMITIVES)} can run "
                             f"in float8; got {unknown}.")
        unknown = sorted(self.include - set(COSTLY))
        if unknown:
            raise ValueError(f"Float8Rules.include: the products kept by default are "
                             f"{sorted(COSTLY)}; got {unknown}.")
        for field in ("min_flops", "min_flops_per_element"):
            value = getattr(self, field)
            if (not isinstance(value, (int, np.integer)) or isinstance(value, bool)
                    or value < 0):
                raise TypeError(f"Float8Rules.{field} must be an int >= 0, got {value!r}.")
        if self.keep_if is not None and not callable(self.keep_if):
            raise TypeError("Float8Rules.keep_if must be a function of a Product returning a "
                            f"bool, or None; got {type(self.keep_if).__name__}.")

    def keeps(self, product: Product) -> bool:
        """Whether ``product`` stays in the compute dtype."""
        if product.primitive not in self.primitives or product.flops < self.min_flops:
            return True
        if product.elements and product.flops_per_element < self.min_flops_per_element:
            return True
        path = "/" + product.scope + "/"
        if any("/" + name.strip("/") + "/" in path for name in self.keep_scopes):
            return True
        return bool(self.keep_if(product)) if self.keep_if is not None else False

    def costly(self, product: Product) -> str | None:
        """The kind of :data:`COSTLY` that keeps ``product`` in the compute dtype by default,
        unless ``include`` names it; ``None`` when there is none."""
        return next((name for name, kind in COSTLY.items()
                     if name not in self.include and kind.keeps(product)), None)

    def __repr__(self) -> str:
        parts = []
        names = lambda s: "{" + ", ".join(repr(n) for n in sorted(s)) + "}"  # in one order
        if self.primitives != FLOAT8_PRIMITIVES:
            parts.append(f"primitives={names(self.primitives)}")
        if self.min_flops:
            parts.append(f"min_flops={self.min_flops}")
        if self.keep_scopes:
            parts.append(f"keep_scopes={names(self.keep_scopes)}")
        if self.keep_if is not None:
            parts.append(f"keep_if={getattr(self.keep_if, '__name__', self.keep_if)!r}")
        if self.include:
            parts.append("include={" + ", ".join(map(repr, sorted(self.include))) + "}")
        if self.min_flops_per_element:
            parts.append(f"min_flops_per_element={self.min_flops_per_element}")
        return f"Float8Rules({', '.join(parts)})"


def product_of(eqn, scope: str, from_inputs: tuple = (True, True)) -> Product:
    """The :class:`Product` of a ``dot_general`` or ``conv_general_dilated`` equation whose
    operands are read from the function's inputs or not (``from_inputs``,
    :func:`jaxprs.read_from_inputs`)."""
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
    batch = len(compat.dimension_numbers(eqn)[1][0]) if eqn.primitive.name == "dot_general" else 0
    elements = math.prod(lhs) + math.prod(rhs) + sum(math.prod(v.aval.shape)
                                                     for v in eqn.outvars)
    return Product(eqn.primitive.name, lhs, rhs, jaxprs.eqn_flops(eqn), scope, batch,
                   tuple(from_inputs), elements)


def placement(eqn, scope: str, low_precision: Iterable[str], rules: Float8Rules,
              from_inputs: tuple = (True, True)) -> str | None:
    """Whether :func:`jaxmp.autocast` with a float8 ``matmul_dtype`` runs ``eqn`` in float8.

    The one decision, asked by autocast to run the product and by the
    census (``jaxmp.experimental.Float8ShortfallWarning``) to explain it. Returns ``None``
    when the product runs in float8, else why not:

    * ``"float8_operand"``: the function gives it a float8 operand already; it
      runs as written;
    * ``"kept"``: the user's ``rules`` keep it in the compute dtype;
    * ``"rules"``: its primitive is not in ``AutocastRules.low_precision``;
    * ``"operand"``: it does not have two floating-point operands;
    * a key of :data:`COSTLY` (``"attention"``, ``"convolution"``): float8
      does not pay for it, so it stays in the compute dtype by default
      (unless ``rules.include`` names it);
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
        from_inputs: whether each operand is read from the function's inputs
            (:func:`jaxprs.read_from_inputs`; default: both, as when unknown).
    """
    dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars]
    floats = [d for d in dtypes if casting.is_float_dtype(d)]
    if any(is_float8_dtype(d) for d in floats):
        return "float8_operand"
    product = product_of(eqn, scope, from_inputs)
    if rules.keeps(product):
        return "kept"
    if eqn.primitive.name not in low_precision:
        return "rules"
    if len(floats) != 2 or len(dtypes) != 2:
        return "operand"
    costly = rules.costly(product)
    if costly is not None:
        return costly
    if eqn.primitive.name == "conv_general_dilated" and not conv_float8_products(compat.conv_params(eqn))[0]:
        return "transposed_conv"
    return None


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
