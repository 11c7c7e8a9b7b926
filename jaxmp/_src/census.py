"""The trace-time check that a mixed-precision step really computes in half precision.

Framework code often pins its own precision (a Flax layer with
``dtype=jnp.float32``, an embedding whose output keeps the parameters' dtype, a
batch captured by a closure, float32 noise drawn inside the loss): casting the
inputs then leaves the matrix products in float32, and the loss looks right
because it *is* float32's. :func:`warn_if_mostly_float32` counts the FLOPs of
the matrix products and convolutions of the traced loss by operand dtype and
warns, once per gradient function, when less than half are in half precision.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from jaxmp._src import casting
from jaxmp._src import source

_PRODUCTS = ("dot_general", "conv_general_dilated")


class MostlyFloat32Warning(UserWarning):
    """Says that a step traced with a half-precision ``compute_dtype`` computes mostly in float32.

    Issued once per gradient function, while the step is traced (never by the
    compiled step), by the cast-inputs path (``autocast=False``) when less than
    half of the loss's matrix-product FLOPs have half-precision operands. The
    message names the first float32 product by the user's file and line.

    Examples:
        >>> import warnings
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> w_out = jnp.ones((8, 64))  # captured by the loss: casting the inputs misses it
        >>> def loss_fn(w, x):  # and the layer fixes its own dtype to float32
        ...     h = (x @ w).astype(jnp.float32)
        ...     return jnp.mean(h @ w_out)
        >>> grad_fn = jaxmp.mp_value_and_grad(loss_fn, autocast=False)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     _ = grad_fn(jnp.ones((8, 8)), jnp.ones((2, 8)), scaler_state=jaxmp.init_scaler())
        >>> caught[0].category is jaxmp.MostlyFloat32Warning
        True
    """


def sub_jaxprs(eqn) -> Iterator[tuple[Any, int]]:
    """The jaxprs inside ``eqn`` (scan, cond, jit, checkpoint, custom rules) with a repeat count."""
    repeat = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(item, "jaxpr", item)
            if hasattr(inner, "eqns"):
                yield inner, repeat


def _flops(eqn) -> int:
    lhs, rhs = (v.aval for v in eqn.invars[:2])
    out = eqn.outvars[0].aval
    if eqn.primitive.name == "dot_general":
        (contracting, _), _ = eqn.params["dimension_numbers"]
        return 2 * math.prod(out.shape) * math.prod(lhs.shape[i] for i in contracting)
    out_features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * math.prod(out.shape) * math.prod(rhs.shape) // max(out_features, 1)


def walk(jaxpr, repeat: int = 1, enclosing: tuple = ()) -> Iterator[tuple[Any, int, tuple]]:
    """``(eqn, times it runs, enclosing equations)`` for every equation of ``jaxpr``, nested ones
    included (each before those inside it)."""
    for eqn in jaxpr.eqns:
        yield eqn, repeat, enclosing
        for inner, times in sub_jaxprs(eqn):
            yield from walk(inner, repeat * times, enclosing + (eqn,))


def census(jaxpr) -> Iterator[tuple[Any, int, tuple]]:
    """``(eqn, flops, enclosing equations)`` for every product of ``jaxpr``, nested ones included."""
    for eqn, repeat, enclosing in walk(jaxpr):
        if eqn.primitive.name in _PRODUCTS:
            yield eqn, repeat * _flops(eqn), enclosing


def warn_if_mostly_float32(closed_jaxpr, compute_dtype: Any, api: str) -> bool:
    """Warns when under half of the product FLOPs of ``closed_jaxpr`` have half-precision operands.

    Returns whether it warned. Names the first product with a float32 operand
    by the user's file and line, with its operand dtypes, and the fix.
    """
    if not casting.is_half_dtype(compute_dtype):
        return False
    total = half = 0
    first = None
    for eqn, flops, enclosing in census(closed_jaxpr.jaxpr):
        dtypes = [np.dtype(v.aval.dtype) for v in eqn.invars[:2]]
        total += flops
        if all(casting.is_half_dtype(d) for d in dtypes):
            half += flops
        elif first is None:
            first = (eqn, enclosing, dtypes)
    if total == 0 or half * 2 >= total:
        return False
    eqn, enclosing, dtypes = first
    where = source.user_location(eqn, enclosing)
    warnings.warn(
        f"jaxmp: this {api} step was traced with compute_dtype={np.dtype(compute_dtype).name} "
        f"but runs only {half / total:.0%} of its matrix-product FLOPs in half precision: "
        f"the model computes in float32 and trains at float32's speed and memory. The first "
        f"float32 product is a {eqn.primitive.name} of {dtypes[0].name} x {dtypes[1].name} "
        f"operands at {where}. Casting the inputs does not reach values the loss makes itself "
        "or layers that fix their own dtype (a Flax module with dtype=jnp.float32, nnx.Embed, "
        "a batch captured by a closure, float32 noise from jax.random inside the loss).\n"
        "  Fix: autocast=True (the default), which chooses the precision of each operation "
        "inside the loss; or cast those values yourself (e.g. the layer's dtype= to the "
        "compute dtype).",
        MostlyFloat32Warning,
        stacklevel=4,
    )
    return True
