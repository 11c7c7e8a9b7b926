"""Matrix products in float8 with per-tensor *delayed* scaling, for ``autocast``.

``float8_scaling="delayed"``: as the ``"tensor"`` recipe (one power-of-two
scale per operand, cotangents in ``float8_e5m2``, float8 backward products),
except that the scale of each tensor comes from a *history* of its amaxes in
the previous steps, not from the tensor itself. Quantising then waits for
nothing but the tensor: XLA can fuse the multiplication by the scale and the
cast into the kernel that produces the tensor, and compute the tensor's new
amax in that same kernel. That is Transformer Engine's default recipe.

The history is explicit state, :class:`Float8State`, made by
``jaxmp.experimental.init_float8_state``: one row per float8 product of the
function, three tensors per row (the left operand, the right operand, the
cotangent of the result), ``window`` steps per tensor. It holds *scale
exponents*: entry ``e`` of a tensor whose amax was ``m`` is
``scaling.scale_exponent(m, dtype)`` (``m / 2**e <= max(dtype)``), or
:data:`EMPTY` for a step that recorded nothing (the start, an amax of zero or
a non-finite one). The scale of a step is ``2**-(max over the window + margin)``;
an empty window gives scale 1 (Transformer Engine's first step).

How the new history comes back: the product is a ``jax.custom_vjp`` that
takes the latest entries of its history row as a third input (their values
unused), and its backward pass returns, as their "cotangent", the three new
exponents minus :data:`EMPTY`. The gradient step reads the new entries from
the gradient of the history (:func:`updated`: ``EMPTY`` plus the gradient of
the latest column) and shifts the window by one step, in one kernel for every
product; a product whose backward pass does not run (a branch not taken)
records :data:`EMPTY`, "nothing recorded". The scale exponents of every
product are computed once per step from the whole history (one reduction).

A value beyond the delayed scale (a spike: an amax that grew faster than the
margin) is clipped to the float8 dtype's largest value before the cast
(``float8_e4m3fn`` has no inf: its overflow is NaN), so no inf or NaN reaches
the weights; the history records the spike and the next step's scale adapts.
An inf or NaN of the tensor itself stays non-finite, so the loss scaler still
sees it, and it is not recorded.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxmp._src import jaxprs
from jaxmp._src.float8 import convolution
from jaxmp._src.float8 import rules
from jaxmp._src.float8 import scaling
from jaxmp._src.float8.recipe import Recipe
from jaxmp._src.float8.recipe import StateSpec

#: The dtype of cotangents in the backward products.
GRAD_DTYPE = jnp.dtype(jnp.float8_e5m2)
#: The history entry of a step that recorded nothing (the smallest scale exponent).
EMPTY = -126.0
#: The default window (steps of history per tensor), as Transformer Engine's.
WINDOW = 16
#: The default margin: scales one power of two below what the window's largest amax needs.
MARGIN = 1


@struct.dataclass
class Float8State:
    """The amax history of ``float8_scaling="delayed"``: make it with
    ``jaxmp.experimental.init_float8_state``, pass it to the step, take back the one it returns.

    A pytree (Flax ``struct.dataclass``): it goes through ``jax.jit``, ``lax.scan``
    carries, Flax serialization and Orbax checkpoints like the scaler's state.

    Attributes:
        history: float32 ``[products, 3, window]``: for each float8 product, in the
            order they are traced, and each of its left operand, right operand and
            cotangent, the scale exponents of the last ``window`` steps, latest first
            (:data:`EMPTY` where nothing was recorded).
        margin: static int: scales are ``margin`` powers of two below what the
            window's largest amax needs (headroom for growth between steps).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> h = jaxmp.experimental.init_float8_state(lambda w, x: jnp.sum(x @ w),
        ...                                          jnp.ones((4, 4)), jnp.ones((2, 4)), window=8)
        >>> h.history.shape, h.margin  # one product: x, w and the cotangent, 8 steps each
        ((1, 3, 8), 1)
        >>> jax.tree_util.tree_leaves(h)[0] is h.history  # a pytree: jit, scan, checkpoints
        True
    """

    history: jax.Array
    margin: int = struct.field(pytree_node=False, default=MARGIN)


def empty_state(products: int, window: int = WINDOW, margin: int = MARGIN) -> Float8State:
    """A :class:`Float8State` for ``products`` float8 products, with nothing recorded."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"window must be a positive int (steps of amax history), got {window!r}.")
    if not isinstance(margin, int) or isinstance(margin, bool) or margin < 0:
        raise ValueError(f"margin must be a non-negative int (powers of two), got {margin!r}.")
    return Float8State(jnp.full((products, 3, window), EMPTY, jnp.float32), margin)


_FIX = ("  Fix: create it with jaxmp.experimental.init_float8_state(loss_fn, *example_args) "
        "with the compute_dtype, matmul_dtype and float8_rules of the step, and pass back the "
        "one each step returns.")


class _Session:
    """The history one call of an autocast function reads: rows handed out in trace order."""

    def __init__(self, history, margin: int):
        self.history, self.margin, self.count = history, margin, 0
        # Every product's scale exponents at once (int32 [products, 3]): one small reduction.
        self.exponents = None if history is None else jax.lax.stop_gradient(
            delayed_exponents(history, margin))

    def row(self) -> tuple[jax.Array, jax.Array]:
        """``(latest, exponents)`` of the next product: its latest history entries (float32
        ``[3]``, the input whose gradient records the new ones) and its scale exponents."""
        i, self.count = self.count, self.count + 1
        if self.history is None:  # counting the products (init_float8_state)
            return jnp.full((3,), EMPTY, jnp.float32), jnp.zeros((3,), jnp.int32)
        if i >= self.history.shape[0]:
            raise ValueError(
                f"float8_state.history has {self.history.shape[0]} rows, one per float8 "
                "product, but this function has more float8 products.\n" + _FIX)
        return self.history[i, :, 0], self.exponents[i]


_SESSIONS: list[_Session] = []


def check_state(float8_state: Any) -> Float8State:
    """``float8_state`` checked: a :class:`Float8State`, or a ``TypeError`` saying the fix."""
    if not isinstance(float8_state, Float8State):
        got = "nothing" if float8_state is None else type(float8_state).__name__
        raise TypeError(
            "float8_scaling='delayed' takes its scales from an amax history, the keyword "
            f"argument float8_state=; got {got}.\n" + _FIX)
    return float8_state


@contextlib.contextmanager
def session(history, margin: int = MARGIN):
    """The float8 products traced inside read their rows of ``history`` (``None``: count them).

    Yields the session; its ``count`` is the number of products traced. Raises a
    ``ValueError`` at the end when ``history`` has more rows than products.
    """
    if _SESSIONS and _SESSIONS[-1].history is None:  # counting: the inner calls count too
        yield _SESSIONS[-1]
        return
    s = _Session(history, margin)
    _SESSIONS.append(s)
    try:
        yield s
    finally:
        _SESSIONS.pop()
    if history is not None and s.count != history.shape[0]:
        raise ValueError(
            f"float8_state.history has {history.shape[0]} rows, one per float8 product, but "
            f"this function has {s.count} float8 products.\n" + _FIX)


def _current() -> _Session:
    if not _SESSIONS:
        raise TypeError("float8_scaling='delayed' runs inside jaxmp.autocast or "
                        "jaxmp.mp_value_and_grad, with float8_state=.\n" + _FIX)
    return _SESSIONS[-1]


def delayed_exponents(history: jax.Array, margin: int) -> jax.Array:
    """The scale exponents (int32 ``[products, 3]``) from a history: each window's largest
    entry plus ``margin``; 0 (scale 1) for an empty window."""
    top = jnp.max(history, axis=-1)
    e = jnp.minimum(top.astype(jnp.int32) + np.int32(margin), np.int32(126))
    return jnp.where(top > EMPTY, e, np.int32(0))


def updated(state: Float8State, grad: Float8State) -> Float8State:
    """The history after a step: one step older, the entries the step recorded in front
    (``EMPTY`` plus the gradient of the latest column, see the module)."""
    h = state.history
    new = jnp.float32(EMPTY) + grad.history[:, :, :1]
    return state.replace(history=jnp.concatenate([new, h[:, :, :-1]], axis=-1))


def recorded(x: jax.Array, dtype: Any) -> jax.Array:
    """The history entry of ``x``: its scale exponent in float32, :data:`EMPTY` when its amax
    is zero or not finite (an overflow is not remembered)."""
    m = scaling.amax(x).astype(jnp.float32)
    e = scaling.scale_exponent(m, dtype).astype(jnp.float32)
    return jnp.where(jnp.isfinite(m) & (m > 0), e, jnp.float32(EMPTY))


def saturated(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x * scale`` clipped to ``dtype``'s largest value, in ``dtype``: a value beyond the
    delayed scale saturates; an inf of ``x`` stays non-finite (NaN in ``float8_e4m3fn``)."""
    x = x.astype(jnp.float32)
    top = jnp.float32(jnp.finfo(dtype).max)
    y = jnp.clip(x * scale.astype(jnp.float32), -top, top)
    return jnp.where(jnp.isinf(x), x, y).astype(dtype)


def _dot(a, b, dimension_numbers, dtype=jnp.float32):
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=dtype)


def _delayed_dot(a, b, *, dimension_numbers, matmul_dtype, out_dtype):
    """``dot_general(a, b)`` in float8, scaled from the history row of this product."""
    latest, e = _current().row()
    dtype = scaling.product_dtype(out_dtype)

    @jax.custom_vjp
    def product(a, b, latest, e):
        return forward(a, b, latest, e)[0]

    def forward(a, b, latest, e):
        del latest  # only its gradient is used: the new entries
        ea = e[0]
        eb = scaling.floor(e[1], ea)
        f = scaling.factors((ea, eb), [(0, 1)], dtype)
        a8, b8 = saturated(a, f[0], matmul_dtype), saturated(b, f[1], matmul_dtype)
        out = (_dot(a8, b8, dimension_numbers, dtype) * f[2]).astype(out_dtype)
        new = (recorded(a, matmul_dtype), recorded(b, matmul_dtype))
        return out, (a8, ea, b8, eb, e[2], new)

    def backward(res, ct):
        a8, ea, b8, eb, ec, new = res
        ec = scaling.floor(ec, ea, eb)
        f = scaling.factors((ec, ea, eb), [(0, 2), (0, 1)], dtype)
        ct8 = saturated(ct, f[0], GRAD_DTYPE)
        dot = lambda x, y, dn: _dot(x, y, dn, dtype)
        da, db = jaxprs.dot_transposes(ct8, a8, b8, dimension_numbers, dot)
        entries = jnp.stack([*new, recorded(ct, GRAD_DTYPE)]) - jnp.float32(EMPTY)
        return (da * f[3]).astype(a.dtype), (db * f[4]).astype(b.dtype), entries, None

    product.defvjp(forward, backward)
    return product(a, b, latest, e)


#: The ``"delayed"`` row of the recipe table: the first recipe with state.
RECIPE = Recipe(
    "delayed", rules.FLOAT8_DTYPES, 0, frozenset(), _delayed_dot, convolution.scaled_conv,
    "one power-of-two scale per tensor from an amax history of the last steps (needs "
    "float8_state=, jaxmp.experimental.init_float8_state); cotangents in float8_e5m2",
    state=StateSpec(Float8State, check_state, session, empty_state, updated))
