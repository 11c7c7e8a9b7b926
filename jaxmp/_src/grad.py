"""Mixed-precision gradients with loss scaling: ``mp_value_and_grad`` and ``mp_grad``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxmp._src import casting
from jaxmp._src import loss_scale
from jaxmp._src import update

PyTree = Any


def wraps_adding_scaler_state(fn: Callable) -> Callable:
    """Like ``functools.wraps``, for a wrapper that adds a keyword-only ``scaler_state``.

    ``functools.wraps`` would set ``__wrapped__``, making ``inspect.signature``
    report ``fn``'s signature, which has no ``scaler_state``; tools that bind
    arguments to the signature, such as ``equinox.filter_jit``, then reject the
    call. The name and docstring are copied, ``__wrapped__`` is not kept.
    """

    def decorate(wrapper: Callable) -> Callable:
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__
        return wrapper

    return decorate


def _partition(tree: PyTree) -> tuple[PyTree, PyTree]:
    """Splits ``tree`` into its floating-point array leaves and the rest (None elsewhere)."""
    floats = jax.tree_util.tree_map(lambda x: x if casting.is_float_array(x) else None, tree)
    others = jax.tree_util.tree_map(lambda x: None if casting.is_float_array(x) else x, tree)
    return floats, others


def _combine(floats: PyTree, others: PyTree) -> PyTree:
    return jax.tree_util.tree_map(
        lambda f, o: o if f is None else f, floats, others, is_leaf=lambda x: x is None
    )


def _as_varying(x: jax.Array, axis_name: Any) -> jax.Array:
    """Marks ``x`` as varying over ``axis_name`` inside ``shard_map``.

    Differentiating a per-device loss with respect to replicated parameters
    otherwise makes autodiff sum the gradients over devices by itself (JAX's
    varying-manual-axes typing); made varying, each device gets its own
    gradient and jaxmp averages them explicitly, the same way with or without
    ``check_vma`` and under ``pmap``.
    """
    names = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    try:
        varying = jax.typeof(x).manual_axis_type.varying
    except AttributeError:  # older JAX, or outside shard_map
        varying = frozenset()
    missing = tuple(n for n in names if n not in varying)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    if hasattr(jax.lax, "pvary"):  # JAX 0.6 - 0.8
        return jax.lax.pvary(x, missing)
    return x


def _check_loss(loss: Any) -> jax.Array:
    if not isinstance(loss, (jax.Array, float, int)) or isinstance(loss, bool):
        raise TypeError(
            "The loss function must return a scalar floating-point array (or a pair "
            f"(loss, aux) with has_aux=True), got {type(loss).__name__}."
        )
    loss = jnp.asarray(loss)
    if loss.shape != ():
        raise TypeError(
            f"The loss must be a scalar, got an array of shape {loss.shape}. "
            "Reduce it (e.g. with jnp.mean) before returning it."
        )
    if not jnp.issubdtype(loss.dtype, jnp.floating):
        raise TypeError(f"The loss must have a floating-point dtype, got {loss.dtype}.")
    return loss


def _split_aux(out: Any, has_aux: bool) -> tuple[Any, Any]:
    if not has_aux:
        return out, None
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        if isinstance(out, (tuple, list)):
            got = f"a {type(out).__name__} of length {len(out)}"
        elif hasattr(out, "shape") and hasattr(out, "dtype"):
            got = f"a single array of shape {tuple(out.shape)}; without aux, use has_aux=False"
        else:
            got = type(out).__name__
        raise TypeError(
            f"With has_aux=True the loss function must return a pair (loss, aux), got {got}."
        )
    return out[0], out[1]


def prepare_call(fn, compute_dtype, use_mixed_precision, autocast):
    """Checks ``compute_dtype`` and returns ``(call, input_dtype)`` for a gradient step.

    ``call`` is the function to differentiate; ``input_dtype`` is the dtype its
    floating inputs are cast to, or ``None`` when ``autocast`` chooses the
    precision of each operation itself.
    """
    compute_dtype = casting.canonical_float_dtype(
        compute_dtype, allowed=casting.COMPUTE_DTYPES, what="compute_dtype"
    )
    if not use_mixed_precision:
        return fn, jnp.dtype(jnp.float32)
    if autocast:
        from jaxmp._src import autocast as autocast_lib  # pylint: disable=g-import-not-at-top

        return autocast_lib.autocast(fn, compute_dtype=compute_dtype), None
    return fn, compute_dtype


def finish_step(loss, aux, grads, state, *, axis_name, adjust_scale, single_argnum, has_aux):
    """The end of every jaxmp gradient step, once the gradients are unscaled.

    Averages loss and gradients over ``axis_name``, checks finiteness (the same
    answer on every device), adjusts the scaler, and packs the results as
    ``mp_value_and_grad`` returns them.
    """
    if axis_name is not None:
        loss = jax.lax.pmean(loss, axis_name)
        grads = jax.lax.pmean(grads, axis_name)
    finite = loss_scale.all_finite(grads, axis_name)
    if adjust_scale:
        state = loss_scale.adjust(state, finite)
    grads = grads[0] if single_argnum else grads
    value = (loss, aux) if has_aux else loss
    return value, grads, state, finite


def mp_value_and_grad(
    fn: Callable,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    compute_dtype: Any = jnp.float16,
    use_mixed_precision: bool = True,
    axis_name: Any = None,
    autocast: bool = False,
) -> Callable:
    """Like ``jax.value_and_grad``, in mixed precision with loss scaling.

    The returned function takes the arguments of ``fn`` plus a keyword-only
    ``scaler_state`` and, on each call:

    1. casts the floating-point leaves of all arguments to ``compute_dtype``
       (integer arrays, keys and non-array leaves are left alone);
    2. runs ``fn``, converts the loss to float32 and only then multiplies it by
       the scale, so the scaled loss cannot overflow float16;
    3. differentiates the scaled loss with respect to the floating-point leaves
       of the arguments in ``argnums``; gradients come back in the dtype of the
       original leaves (float32 for float32 parameters) and are divided by the
       scale used in this backward pass; non-floating leaves get ``None``, as
       with ``equinox.filter_grad``;
    4. checks that every gradient is finite and adjusts the scaler.

    The returned loss is the true float32 loss, never inflated by the scale.
    Floating-point aux leaves come back in float32, so state carried between
    steps (batch-norm statistics, Haiku state) keeps its dtype.

    With ``use_mixed_precision=False`` the inputs are cast to float32, nothing
    is scaled and ``scaler_state`` is returned unchanged, with the same output
    structure: a training loop switches precision with one flag.

    Args:
        fn: the loss function; returns a scalar, or ``(loss, aux)`` with
            ``has_aux=True``.
        argnums: which positional arguments to differentiate, as in
            ``jax.value_and_grad``.
        has_aux: whether ``fn`` returns ``(loss, aux)``.
        compute_dtype: ``jnp.float16`` (default), ``jnp.bfloat16`` or
            ``jnp.float32``.
        use_mixed_precision: ``False`` runs in float32 without scaling.
        axis_name: inside ``shard_map``/``pmap``, the device axis name(s). The
            loss and the gradients are then those of the mean of the
            per-device losses, and ``finite`` and the new scaler state are the
            same on every device.
        autocast: instead of casting all inputs, apply :func:`jaxmp.autocast`
            to ``fn`` (per-operation precision).

    Returns:
        A function returning ``(loss, grads, scaler_state, finite)``, or
        ``((loss, aux), grads, scaler_state, finite)`` with ``has_aux=True``.
        ``grads`` is a tuple when ``argnums`` is a sequence.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x):
        ...     return jnp.mean((x @ w) ** 2)
        >>> w, x = jnp.ones((3,)), jnp.ones((4, 3))
        >>> state = jaxmp.init_scaler(initial_scale=1024.0)
        >>> loss, grads, state, finite = jaxmp.mp_value_and_grad(loss_fn)(
        ...     w, x, scaler_state=state)
        >>> float(loss), grads.dtype, bool(finite)
        (9.0, dtype('float32'), True)
    """
    int_argnums = isinstance(argnums, int)
    nums = (argnums,) if int_argnums else tuple(argnums)
    if not nums or not all(isinstance(i, int) for i in nums):
        raise TypeError(f"argnums must be an int or a non-empty sequence of ints, got {argnums!r}.")

    call, input_dtype = prepare_call(fn, compute_dtype, use_mixed_precision, autocast)

    @wraps_adding_scaler_state(fn)
    def value_and_grad_fn(*args, scaler_state, **kwargs):
        state = loss_scale.check_scaler_state(scaler_state)
        positions = []
        for i in nums:
            if not -len(args) <= i < len(args):
                raise TypeError(
                    f"argnums={argnums!r} refers to argument {i}, but the function was "
                    f"called with {len(args)} positional arguments."
                )
            positions.append(i % len(args))
        parts = [_partition(args[i]) for i in positions]
        diff = tuple(floats for floats, _ in parts)
        if not any(casting.is_float_array(x) for x in jax.tree_util.tree_leaves(diff)):
            raise TypeError(
                f"No floating-point array leaves to differentiate in the argument(s) "
                f"argnums={argnums!r}. Gradients are taken with respect to float arrays only."
            )
        update.warn_if_half_master_weights(diff, state, use_mixed_precision)
        if axis_name is not None:
            diff = jax.tree_util.tree_map(lambda x: _as_varying(x, axis_name), diff)

        def scaled_loss_fn(diff):
            full = list(args)
            for pos, floats, (_, others) in zip(positions, diff, parts):
                full[pos] = _combine(floats, others)
            call_args, call_kwargs = tuple(full), kwargs
            if input_dtype is not None:
                call_args, call_kwargs = casting.cast_tree((call_args, call_kwargs), input_dtype)
            loss, aux = _split_aux(call(*call_args, **call_kwargs), has_aux)
            loss = _check_loss(loss).astype(jnp.float32)
            if use_mixed_precision:
                aux = casting.cast_to_float32(aux)
                scaled = loss_scale.scale(state, loss)
            else:
                scaled = loss
            return scaled, (loss, aux)

        (_, (loss, aux)), grads = jax.value_and_grad(scaled_loss_fn, has_aux=True)(diff)
        if use_mixed_precision:
            # Divide by the scale of *this* backward pass, in float32, then return
            # each gradient in the dtype of the leaf it belongs to.
            grads = jax.tree_util.tree_map(
                lambda g, p: loss_scale.unscale(state, g).astype(p.dtype), grads, diff
            )
        return finish_step(loss, aux, grads, state, axis_name=axis_name,
                           adjust_scale=use_mixed_precision, single_argnum=int_argnums,
                           has_aux=has_aux)

    return value_and_grad_fn


def mp_grad(fn: Callable, **options: Any) -> Callable:
    """Like ``jax.grad``, in mixed precision with loss scaling.

    Takes the same options as :func:`mp_value_and_grad`.

    Returns:
        A function returning ``(grads, scaler_state, finite)``, or
        ``((grads, aux), scaler_state, finite)`` with ``has_aux=True``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> grads, state, finite = jaxmp.mp_grad(lambda w: jnp.sum(w * w))(
        ...     jnp.ones(2), scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
        >>> grads.tolist(), bool(finite)
        ([2.0, 2.0], True)
    """
    value_and_grad_fn = mp_value_and_grad(fn, **options)
    has_aux = options.get("has_aux", False)

    @wraps_adding_scaler_state(fn)
    def grad_fn(*args, scaler_state, **kwargs):
        value, grads, state, finite = value_and_grad_fn(*args, scaler_state=scaler_state, **kwargs)
        if has_aux:
            return (grads, value[1]), state, finite
        return grads, state, finite

    return grad_fn
