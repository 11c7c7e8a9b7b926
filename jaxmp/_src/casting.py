"""Casting pytrees and functions between floating-point precisions.

Only floating-point *array* leaves are ever cast. Integer and boolean arrays,
PRNG keys (raw ``uint32`` keys and typed keys), Python scalars, strings,
``None`` and callables pass through unchanged, so a whole training state can be
handed to these functions without damaging labels, step counters or keys.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
COMPUTE_DTYPES = HALF_DTYPES + (jnp.dtype(jnp.float32),)
_SHORT_NAMES = {"f16": jnp.float16, "bf16": jnp.bfloat16, "f32": jnp.float32}


def is_array(x: Any) -> bool:
    """Whether ``x`` is a JAX or NumPy array (or NumPy scalar): a value to trace, not a constant."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_float_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a real floating-point dtype (``False`` for PRNG key dtypes)."""
    try:
        return jnp.issubdtype(dtype, jnp.floating)
    except TypeError:  # extended dtypes, e.g. typed PRNG keys
        return False


def is_narrow_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is a floating-point dtype narrower than float32: float16, bfloat16 or a
    float8 format (named "narrow", not "half": float8 is a quarter of float32)."""
    return is_float_dtype(dtype) and np.dtype(dtype).itemsize < 4


def wide_dtype(dtype: Any) -> np.dtype:
    """A floating ``dtype`` raised to at least float32 (float64 stays float64)."""
    dtype = np.dtype(dtype)
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def widen_half(tree: Any) -> Any:
    """``tree`` with its half-precision floating array leaves converted (exactly) to float32.

    Every other leaf (float32, integers, keys, non-arrays) is returned as it is.
    """
    def leaf(x):
        if is_float_array(x) and is_narrow_dtype(x.dtype):
            return x.astype(wide_dtype(x.dtype))
        return x

    return jax.tree_util.tree_map(leaf, tree)


def partition(tree: PyTree, predicate: Callable[[Any], bool] | None = None) -> tuple[PyTree, PyTree]:
    """Splits ``tree`` into the leaves that satisfy ``predicate`` and the rest.

    Both results have the structure of ``tree``, with ``None`` where the other
    holds the leaf; :func:`combine` puts them back together. The default
    predicate is :func:`is_float_array`: the leaves that are differentiated,
    cast or traced.
    """
    predicate = is_float_array if predicate is None else predicate
    chosen = jax.tree_util.tree_map(lambda x: x if predicate(x) else None, tree)
    rest = jax.tree_util.tree_map(lambda x: None if predicate(x) else x, tree)
    return chosen, rest


def combine(chosen: PyTree, rest: PyTree) -> PyTree:
    """The inverse of :func:`partition`: takes each leaf from ``chosen`` unless it is ``None``."""
    return jax.tree_util.tree_map(
        lambda c, r: r if c is None else c, chosen, rest, is_leaf=lambda x: x is None
    )


def is_float_array(x: Any) -> bool:
    """Whether ``x`` is a JAX or NumPy array with a real floating-point dtype.

    This is the predicate behind every cast in jaxmp. Python floats are *not*
    arrays: they are weakly typed in JAX and take the dtype of whatever they
    meet, so they never need casting.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> jaxmp.debug.is_float_array(jnp.ones(2)), jaxmp.debug.is_float_array(jnp.arange(2))
        (True, False)
        >>> jaxmp.debug.is_float_array(jax.random.key(0)), jaxmp.debug.is_float_array(1.0)
        (False, False)
    """
    return is_array(x) and is_float_dtype(x.dtype)


def describe(value: Any) -> str:
    """``value`` for an error message: its ``repr`` when short, else what it is."""
    text = repr(value)
    if len(text) <= 60 and "\n" not in text:
        return text
    if callable(value) and not isinstance(value, type):
        return f"a function ({type(value).__name__})"
    return f"a {type(value).__name__}"


def check_function(fn: Any, api: str, signature: str) -> None:
    """Raises ``TypeError`` unless ``fn`` is callable, naming ``api`` and its ``signature``."""
    if not callable(fn):
        raise TypeError(
            f"{api} takes a function first ({signature}), got {describe(fn)}: are the "
            "arguments in the wrong order?")


def canonical_float_dtype(dtype: Any, *, allowed=None, what: str = "dtype") -> np.dtype:
    """Returns ``dtype`` as a NumPy dtype, raising ``ValueError`` if it is not allowed.

    Args:
        dtype: anything ``jnp.dtype`` understands (``jnp.float16``, ``"bfloat16"``...).
        allowed: the dtypes accepted; by default any floating-point dtype.
        what: the name of the argument, used in the error message.
    """
    if dtype is None:  # jnp.dtype(None) would silently mean float64
        raise ValueError(f"{what} must be a floating-point dtype, got None.")
    if isinstance(dtype, str) and dtype.lower() in _SHORT_NAMES:
        # The short names of policy strings; NumPy would read "f16" as float128.
        dtype = _SHORT_NAMES[dtype.lower()]
    if (callable(dtype) and not isinstance(dtype, type)) or isinstance(
            dtype, (dict, list, tuple, jax.Array, np.ndarray)) or dataclasses.is_dataclass(dtype):
        # A function, a tree or an array where a dtype goes: arguments in the wrong order.
        raise ValueError(
            f"{what} must be a floating-point dtype (jnp.bfloat16, jnp.float16...), got "
            f"{describe(dtype)}: are the arguments in the wrong order? (The function or the "
            "tree comes first, the dtype after it.)")
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a floating-point dtype, got {describe(dtype)}.") from e
    if allowed is None:
        if not jnp.issubdtype(dt, jnp.floating):
            raise ValueError(f"{what} must be a floating-point dtype, got {dt.name}.")
    elif dt not in allowed:
        names = ", ".join(a.name for a in allowed)
        raise ValueError(f"{what} must be one of {names}; got {dt.name}.")
    return dt


def _cast_leaf(x: Any, dtype: np.dtype) -> Any:
    if not is_float_array(x) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def cast_tree(tree: PyTree, dtype: Any) -> PyTree:
    """Casts every floating-point array leaf of ``tree`` to ``dtype``.

    JAX arrays stay JAX arrays and NumPy arrays stay NumPy arrays; every other
    leaf is returned as it is.

    Args:
        tree: any pytree.
        dtype: a floating-point dtype.

    Returns:
        A pytree with the structure of ``tree``.

    Raises:
        ValueError: if ``dtype`` is not a floating-point dtype.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import jaxmp
        >>> tree = {"w": jnp.ones(2), "step": jnp.array(3), "key": jax.random.key(0)}
        >>> out = jaxmp.cast_tree(tree, jnp.bfloat16)
        >>> out["w"].dtype, out["step"].dtype
        (dtype(bfloat16), dtype('int32'))
    """
    dtype = canonical_float_dtype(dtype)
    return jax.tree_util.tree_map(lambda x: _cast_leaf(x, dtype), tree)


def cast_to_float16(tree: PyTree) -> PyTree:
    """Deprecated: ``jaxmp.cast_tree(tree, jnp.float16)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> out = jaxmp.cast_tree({"w": jnp.ones(2), "step": jnp.array(3)}, jnp.float16)
        >>> out["w"].dtype, out["step"].dtype
        (dtype('float16'), dtype('int32'))
    """
    return cast_tree(tree, jnp.float16)


def cast_to_bfloat16(tree: PyTree) -> PyTree:
    """Deprecated: ``jaxmp.cast_tree(tree, jnp.bfloat16)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> jaxmp.cast_tree(jnp.ones(2), jnp.bfloat16).dtype
        dtype(bfloat16)
    """
    return cast_tree(tree, jnp.bfloat16)


def cast_to_float32(tree: PyTree) -> PyTree:
    """Deprecated: ``jaxmp.cast_tree(tree, jnp.float32)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> jaxmp.cast_tree(jnp.ones(2, jnp.float16), jnp.float32).dtype
        dtype('float32')
    """
    return cast_tree(tree, jnp.float32)


def cast_to_half_precision(tree: PyTree, dtype: Any = jnp.float16) -> PyTree:
    """Deprecated: ``jaxmp.cast_tree(tree, dtype)``, ``dtype`` float16 or bfloat16.

    Raises:
        ValueError: if ``dtype`` is not float16 or bfloat16.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> jaxmp.cast_tree(jnp.ones(2), jnp.bfloat16).dtype
        dtype(bfloat16)
    """
    dtype = canonical_float_dtype(dtype, allowed=HALF_DTYPES, what="dtype")
    return cast_tree(tree, dtype)


def cast_function(fn: Callable, dtype: Any, return_dtype: Any = None) -> Callable:
    """Wraps ``fn`` so that its inputs are cast to ``dtype`` before it runs.

    All positional and keyword arguments are cast with :func:`cast_tree`. If
    ``return_dtype`` is given, the floating-point leaves of the outputs (of any
    container type: tuples, dicts, dataclasses, ...) are cast to it afterwards.

    Args:
        fn: the function to wrap.
        dtype: the floating-point dtype the inputs are cast to.
        return_dtype: optional floating-point dtype for the outputs.

    Returns:
        A function with the signature of ``fn``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> f = jaxmp.cast_function(lambda x, y: x @ y, jnp.float16, return_dtype=jnp.float32)
        >>> f(jnp.ones((2, 2)), jnp.ones(2)).dtype
        dtype('float32')
    """
    check_function(fn, "jaxmp.cast_function", "cast_function(fn, dtype, return_dtype=None)")
    dtype = canonical_float_dtype(dtype)
    if return_dtype is not None:
        return_dtype = canonical_float_dtype(return_dtype, what="return_dtype")

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = cast_tree((args, kwargs), dtype)
        out = fn(*args, **kwargs)
        if return_dtype is not None:
            out = cast_tree(out, return_dtype)
        return out

    return wrapped


#: The named scope of the code :func:`force_full_precision` runs: autocast runs every
#: operation inside it in float32 (matrix products included), and ``precision_report``
#: names its products for what they are.
FULL_PRECISION_SCOPE = "jaxmp.force_full_precision"


def in_full_precision_scope(name_stack: str) -> bool:
    """Whether a name stack (``a/b/c``) is inside :func:`force_full_precision`'s code."""
    return FULL_PRECISION_SCOPE in name_stack


def force_full_precision(fn: Callable, return_dtype: Any = None) -> Callable:
    """Wraps ``fn`` so that it runs in float32, whatever precision its inputs have.

    Use it around the parts of a half-precision model that overflow in float16:
    large sums and means, softmax over large logits, variances. Under
    :func:`jaxmp.autocast` (``mp_value_and_grad``'s default) every operation of
    ``fn`` runs in float32 too, its matrix products included: ``fn`` runs in the
    named scope ``jaxmp.force_full_precision``, which autocast honours.

    Args:
        fn: the function to wrap.
        return_dtype: optional dtype for the outputs, e.g. the compute dtype, so
            that the rest of the model carries on in half precision.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> x = jnp.full((1000,), 100.0, jnp.float16)
        >>> bool(jnp.isinf(jnp.sum(x)))  # 100,000 does not fit in float16
        True
        >>> mean = jaxmp.force_full_precision(jnp.mean, return_dtype=jnp.float16)
        >>> float(mean(x)), mean(x).dtype
        (100.0, dtype('float16'))
    """
    check_function(fn, "jaxmp.force_full_precision",
                   "force_full_precision(fn, return_dtype=None)")
    wide = cast_function(fn, jnp.float32, return_dtype)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        # Under autocast the arguments are often float32 already (autocast decides each
        # operation's precision from a float32 trace), so the casts above vanish from the
        # program: the scope is what tells autocast to run this code in float32.
        with jax.named_scope(FULL_PRECISION_SCOPE):
            return wide(*args, **kwargs)

    return wrapped
