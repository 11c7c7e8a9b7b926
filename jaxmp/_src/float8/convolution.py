"""The float8 convolution, scaled per tensor: what every recipe runs convolutions with.

Which of a convolution's three products run in float8 is
:func:`rules.conv_float8_products`'s (those XLA's GPU compiler runs as cuDNN
float8 graphs); :func:`scaled_conv` quantizes their operands with one
power-of-two scale per tensor, as the ``"tensor"`` recipe's dots do, and
runs the others in the compute dtype. Block-scaled recipes (``"mxfp8"``)
block-scale only ``dot_general`` and take this for their convolutions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src.float8 import rules
from jaxmp._src.float8 import scaling


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


def scaled_conv(a, b, *, params, matmul_dtype, out_dtype):
    """``conv_general_dilated(a, b)`` with its float8 products (:func:`rules.conv_float8_products`).

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
    dtype = scaling.product_dtype(out_dtype)
    narrow = dict(params, preferred_element_type=dtype)
    wide = dict(params, preferred_element_type=None)
    _, input_gradient8, _ = rules.conv_float8_products(params)

    def conv(x, y):
        return compat.bind_conv(x, y, narrow)

    @jax.custom_vjp
    def product(a, b):
        return forward(a, b)[0]

    def forward(a, b):
        ea = scaling.scale_exponent(scaling.amax(a), matmul_dtype)
        eb = scaling.floor(scaling.scale_exponent(scaling.amax(b), matmul_dtype), ea)
        f = scaling.factors((ea, eb), [(0, 1)], dtype)
        a8, b8 = scaling.to_float8(a, f[0], matmul_dtype), scaling.to_float8(b, f[1], matmul_dtype)
        # The kernel gradient's operand in the compute dtype; the input gradient's kernel in
        # float8 (with its scale) or in the compute dtype.
        kernel = (b8, eb) if input_gradient8 else (b.astype(out_dtype),)
        return (conv(a8, b8) * f[2]).astype(out_dtype), (a.astype(out_dtype), *kernel)

    def backward(res, ct):
        a_wide, *kernel = res
        ct_wide = ct.astype(out_dtype)
        if input_gradient8:
            b8, eb = kernel
            ec = scaling.floor(scaling.scale_exponent(scaling.amax(ct), matmul_dtype), eb)
            f = scaling.factors((ec, eb), [(0, 1)], dtype)
            ct8 = scaling.to_float8(ct, f[0], matmul_dtype)
            da = _conv_transpose(narrow, b8, 0, a.shape, ct8) * f[2]
        else:
            da = _conv_transpose(wide, kernel[0], 0, a.shape, ct_wide)
        db = _conv_transpose(wide, a_wide, 1, b.shape, ct_wide)
        return da.astype(a.dtype), db.astype(b.dtype)

    product.defvjp(forward, backward)
    return product(a, b)
