"""Gradient sums over devices that jaxmp does not write, run in a wider dtype.

Under ``jit`` with ``NamedSharding``, XLA's partitioner puts the sum over
devices of a weight gradient on the output of the matrix product that
contracts the batch axis, in that product's dtype: float16, on scaled values.
Casting the parameter in a ``custom_vjp`` does not move it (the all-reduce
comes before the cast). What does is the product itself producing float32:
:func:`widen_gradient_products` runs a loss function with every
half-precision ``dot_general`` replaced by one whose operand gradients come
out of the product in ``reduce_dtype`` (float16 operands, float32
accumulation and output, as on GPUs), then are cast back to the operand's
dtype. Inside ``shard_map`` the same is done for the reduce-scatter that
differentiates an ``all_gather`` of a half-precision parameter (FSDP).

The rewrite is a :class:`jaxmp._src.interpret.Interpreter` over the loss
function's jaxpr, with ``custom_vjp`` products; the sums jaxmp writes itself
(:func:`jaxmp._src.sharding.mean_over_devices`) need neither.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat
from jaxmp._src import interpret
from jaxmp._src import jaxprs
from jaxmp._src import sharding


def _wide_gradient_dot(eqn, wide):
    dims = compat.dimension_numbers(eqn)
    precision = compat.precision(eqn)

    def product(x, y, dimension_numbers):  # as JAX's rule: the cotangent on the left
        return jax.lax.dot_general(x, y, dimension_numbers, precision=precision,
                                   preferred_element_type=wide)

    @jax.custom_vjp
    def dot(x, y):
        return compat.bind_with(eqn, [x, y])

    def fwd(x, y):
        return dot(x, y), (x, y)

    def bwd(res, g):
        x, y = res
        g = g.astype(x.dtype)
        dx, dy = jaxprs.dot_transposes(g, x, y, dims, product, ct_first=True)
        return dx.astype(x.dtype), dy.astype(y.dtype)

    dot.defvjp(fwd, bwd)
    return dot


def _wide_gradient_gather(eqn, wide):
    """``all_gather`` whose gradient (a reduce-scatter) is summed in ``wide``: FSDP in shard_map."""
    params = compat.all_gather(eqn)

    @jax.custom_vjp
    def gather(x):
        return compat.bind_with(eqn, [x])

    dtype = eqn.invars[0].aval.dtype

    def fwd(x):
        return gather(x), None

    def bwd(_, g):
        out = jax.lax.psum_scatter(
            g.astype(wide), params.axis_name, scatter_dimension=params.dimension,
            axis_index_groups=params.axis_index_groups, tiled=params.tiled)
        return (out.astype(dtype),)

    gather.defvjp(fwd, bwd)
    return gather


class _WideGradients(interpret.Interpreter):
    """Runs a jaxpr as written, but for the half-precision products and gathers it widens."""

    def __init__(self, wide: np.dtype, manual: bool):
        super().__init__()
        self.wide, self.manual = wide, manual

    def first_order(self, eqn, invals):
        half = [v.aval.dtype for v in eqn.invars if casting.is_narrow_dtype(v.aval.dtype)]
        name = eqn.primitive.name
        if name == "dot_general" and not self.manual and len(half) == 2 and half[0] == half[1]:
            return [_wide_gradient_dot(eqn, self.wide)(*invals)]
        if name == "all_gather" and self.manual and half:
            return [_wide_gradient_gather(eqn, self.wide)(*invals)]
        return interpret.bind(eqn, invals)


def widen_gradient_products(fn, reduce_dtype: Any):
    """``fn`` whose gradient reductions across devices run in ``reduce_dtype``.

    Under ``jit`` with ``NamedSharding``, every half-precision matrix product
    gives its operand gradients in ``reduce_dtype`` (then cast back), so the
    sums over devices that XLA inserts after the weight-gradient products run
    in ``reduce_dtype``. Inside ``shard_map``, every half-precision
    ``all_gather`` (FSDP) sums its gradient, a reduce-scatter, in
    ``reduce_dtype``. With ``reduce_dtype=None``, ``fn`` is returned as it is.
    Operations inside custom derivative rules are left as written.
    """
    if reduce_dtype is None or np.dtype(reduce_dtype).itemsize < 4:
        return fn  # half-precision reductions: XLA's and autodiff's already are

    def run(closed, arrays):
        return _WideGradients(reduce_dtype, bool(sharding.manual_axes())).eval_closed(closed, arrays)

    return interpret.transform(fn, run)
