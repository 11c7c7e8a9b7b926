"""Optimizer updates that are skipped, losing nothing, when they would not be finite.

A step is skipped when its gradients are not finite (the ``finite`` flag of
:func:`jaxmp.mp_value_and_grad`) *and* when the optimizer's own update is not:
half-precision optimizer arithmetic can overflow on finite gradients. (The
trace-time check that the parameters a step differentiates under float16 loss
scaling are float32 master weights is the step's own: :mod:`jaxmp._src.kernel`.)
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import casting
from jaxmp._src import host
from jaxmp._src import loss_scale

PyTree = Any


def select_tree(pred: Any, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Picks ``on_true`` or ``on_false`` leaf by leaf, by a scalar boolean ``pred``.

    Array leaves (NumPy arrays included) and Python numbers that differ are
    selected with ``jnp.where``, which copies the chosen value bit for bit (no
    arithmetic touches it). Other leaves must be equal in both trees
    (``ValueError`` otherwise) and are taken from ``on_false`` as they are;
    ``None`` leaves stay ``None``. Two array leaves must have the same dtype
    and shape: ``ValueError`` otherwise, naming the leaf's path.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> new, old = {"a": jnp.ones(2)}, {"a": jnp.zeros(2)}
        >>> jaxmp.select_tree(jnp.asarray(False), new, old)["a"].tolist()
        [0.0, 0.0]
    """
    pred = loss_scale.check_finite_flag(pred, "select_tree(pred, on_true, on_false): pred")
    arrays, numbers = (jax.Array, np.ndarray, np.generic), (int, float, complex)

    def leaf(path, t, f):
        if isinstance(t, numbers) and isinstance(f, numbers) and t == f:
            return f  # a setting (an Equinox module's dropout rate): kept as it is
        if isinstance(t, arrays + numbers) or isinstance(f, arrays + numbers):
            # NumPy arrays and changed Python numbers too (a step counter that
            # starts as a Python int, as flax's TrainState.create makes it).
            t, f = jnp.asarray(t), jnp.asarray(f)
            if t.dtype != f.dtype or t.shape != f.shape:
                raise ValueError(_changed_leaf_message(path, t, f))
            return jnp.where(pred, t, f)
        if t is not f and t != f:
            raise ValueError(
                f"Cannot select between two different non-array leaves at "
                f"{jax.tree_util.keystr(path) or 'the root'}, {t!r} and {f!r}: select_tree "
                "picks arrays; every other leaf must be the same in both trees."
            )
        return f

    return jax.tree_util.tree_map_with_path(leaf, on_true, on_false)


def _changed_leaf_message(path: Any, new: jax.Array, old: jax.Array) -> str:
    """Why ``select_tree`` cannot pick between two leaves of different types, and the fix."""
    where = jax.tree_util.keystr(path) or "the root"
    message = (
        f"Cannot select between leaves of type {new.dtype}{list(new.shape)} (the new value) and "
        f"{old.dtype}{list(old.shape)} (the old one) at {where}: the update changed a leaf's "
        "type, and a value carried between steps must keep it.")
    if new.shape == old.shape and casting.is_float_dtype(new.dtype) and casting.is_float_dtype(
            old.dtype):
        message += (
            f" Make both {old.dtype}: create the old value in the dtype the step returns "
            "(initialise framework state, e.g. Haiku's or Flax's batch statistics, from a "
            "float32 batch or cast it with jaxmp.cast_tree(state, jnp.float32); initialise the "
            "optimizer on the parameters in the dtype they are trained in), or cast the new value "
            "back with jax.tree.map(lambda n, o: n.astype(o.dtype), new, old).")
    return message


def _warn_update_not_finite() -> None:
    """Host side: only called on a step whose gradients were finite but whose update was not."""
    warnings.warn(
        "jaxmp.optimizer_update: the gradients were finite but the optimizer's update (or the "
        "updated parameters) was not, so the step was skipped. This happens when parameters or "
        "optimizer state are kept in half precision (Adam's second moment or an update overflows "
        "float16). Keep master weights in float32: cast them with "
        "jaxmp.cast_tree(params, jnp.float32) before optimizer.init, and let mp_value_and_grad "
        "cast them to the compute dtype; with Haiku policies use params=float32 "
        "(jaxmp.get_policy('p=f32,c=f16,o=f32')). To keep "
        "half-precision parameters, keep them in bfloat16 (float32's range) with "
        "jaxmp.experimental.low_precision_optimizer(..., param_rounding='stochastic').",
        RuntimeWarning,
        stacklevel=1,
    )


def optimizer_update(
    params: PyTree,
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    grads: PyTree,
    finite: Any,
    *,
    return_applied: bool = False,
    check_update: bool | None = None,
    **extra_args: Any,
) -> tuple[PyTree, PyTree] | tuple[PyTree, PyTree, jax.Array]:
    """Applies one optax step if it is finite; otherwise returns the inputs unchanged.

    The step is applied only when ``finite`` is true (the gradients are
    finite) *and*, when parameters or optimizer state are kept in half
    precision, the updated floating-point parameters are all finite, so an
    optimizer that overflows by itself (e.g. Adam's moments kept in float16)
    cannot write ``inf`` or ``NaN`` into the parameters. With float32
    parameters and state a finite gradient gives a finite update unless the
    optimizer divides by zero (``eps=0``) or its learning rate is absurd;
    ``check_update=True`` checks those too, at the cost of reading every
    updated parameter once more. A skipped step
    returns the parameters and the optimizer state (moments, step counts,
    schedules) bit-for-bit identical: it leaves no trace. When float16
    parameters or optimizer state make the update overflow on finite
    gradients, a ``RuntimeWarning`` says why, from inside the step (a
    ``jax.debug.callback`` under ``lax.cond``, traced only when some leaf is
    float16: float32 and bfloat16 steps carry no callback).

    Only the floating-point array leaves of ``params`` are given to the
    optimizer and updated; every other leaf (integer arrays, ``None``, the
    functions and settings of an Equinox module) passes through unchanged, as
    with ``equinox.apply_updates``. Initialise the optimizer on the same
    leaves, e.g. ``optimizer.init(eqx.filter(model, eqx.is_inexact_array))``.

    Works under ``jit`` and inside ``lax.scan`` (no host synchronisation on a
    healthy step), with any optax optimizer.

    Args:
        params: the parameters: any pytree, e.g. a dict or an Equinox module.
        optimizer: an ``optax.GradientTransformation``.
        opt_state: its state.
        grads: gradients with the structure of ``params`` (``None`` where a
            leaf is not differentiated), as :func:`mp_value_and_grad` returns.
        finite: scalar boolean, as returned by :func:`mp_value_and_grad`.
        return_applied: also return whether the step was applied. Off by
            default so that ``params, opt_state = optimizer_update(...)``
            keeps working.
        check_update: whether to skip the step when the updated parameters
            are not finite although the gradients are. ``None`` (default):
            when some floating leaf of the parameters or of the optimizer
            state is float16 or bfloat16.
        **extra_args: passed to ``optimizer.update``, for transformations that
            need them: ``value=loss`` for ``optax.contrib.reduce_on_plateau``,
            ``value=``, ``grad=`` and ``value_fn=`` for ``optax.lbfgs``. A
            ``value_fn`` is called with the floating-point leaves the
            optimizer sees and gets the whole ``params`` back. Optimizers that
            take no extra arguments ignore them.

    Returns:
        ``(params, opt_state)`` after the step, or unchanged; with
        ``return_applied=True``, ``(params, opt_state, applied)`` where
        ``applied`` is a scalar boolean, false for a skipped step.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import jaxmp
        >>> opt = optax.sgd(0.1)
        >>> params = {"w": jnp.ones(2)}
        >>> state = opt.init(params)
        >>> grads = {"w": jnp.array([1.0, jnp.nan])}
        >>> new, _ = jaxmp.optimizer_update(params, opt, state, grads, jnp.asarray(False))
        >>> new["w"].tolist()
        [1.0, 1.0]

        An update that overflows the (here float16) parameters is skipped too:

        >>> opt = optax.sgd(1.0)
        >>> params = {"w": jnp.full(2, 60000.0, jnp.float16)}
        >>> grads = {"w": jnp.full(2, -1e4, jnp.float16)}  # 70000 does not fit in float16
        >>> new, _, applied = jaxmp.optimizer_update(
        ...     params, opt, opt.init(params), grads, jnp.asarray(True), return_applied=True)
        >>> new["w"].tolist(), bool(applied)
        ([60000.0, 60000.0], False)
    """
    _check_update_arguments(params, optimizer, opt_state)
    floats, rest = casting.partition(params)
    _check_not_swapped(floats, opt_state, grads)
    finite = loss_scale.check_finite_flag(finite)
    if not isinstance(return_applied, bool):
        raise TypeError(f"return_applied must be True or False, got {return_applied!r}.")
    if check_update is not None and not isinstance(check_update, bool):
        raise TypeError(f"check_update must be None, True or False, got {check_update!r}.")
    if "value_fn" in extra_args and callable(extra_args["value_fn"]):
        value_fn = extra_args["value_fn"]
        extra_args["value_fn"] = lambda p, *a, **k: value_fn(casting.combine(p, rest), *a, **k)
    if extra_args and not isinstance(optimizer, optax.GradientTransformationExtraArgs):
        optimizer = optax.with_extra_args_support(optimizer)
    # optax's transformations rely on standard promotion internally (e.g. a
    # float decay raised to an int32 step count). Allow it for the optimizer
    # alone, so users who trace under strict promotion can still use optax.
    with jax.numpy_dtype_promotion("standard"):
        try:
            updates, new_opt_state = optimizer.update(grads, opt_state, floats, **extra_args)
        except Exception as e:  # optax fails in its own terms (e.g. AttributeError: 'mu')
            _raise_if_grads_do_not_match(grads, floats, e)
            raise
        new_floats = optax.apply_updates(floats, updates)
    if check_update is None:
        check_update = _has_dtype((floats, new_opt_state), (jnp.float16, jnp.bfloat16))
    applied = finite
    if check_update:
        # The updated parameters: covers a non-finite update (p + inf is not
        # finite) and one that overflows the parameters' own dtype.
        update_finite = loss_scale.all_finite(new_floats)
        applied = finite & update_finite
        if _has_dtype((floats, new_opt_state), (jnp.float16,)):  # say it from the step
            host.call_back_if(finite & jnp.logical_not(update_finite), _warn_update_not_finite)
    params = select_tree(applied, casting.combine(new_floats, rest), params)
    opt_state = select_tree(applied, new_opt_state, opt_state)
    if return_applied:
        return params, opt_state, applied
    return params, opt_state


_SIGNATURE = "optimizer_update(params, optimizer, opt_state, grads, finite)"


def _is_transformation(x: Any) -> bool:
    """Whether ``x`` is an optax transformation (or behaves as one: ``init`` and ``update``)."""
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


def _check_update_arguments(params: PyTree, optimizer: Any, opt_state: PyTree) -> None:
    """Raises ``TypeError`` naming the argument in the wrong place, before optax fails on it."""
    if _is_transformation(optimizer):
        return
    where = ""
    if _is_transformation(opt_state):
        where = " It is in the place of opt_state (the third): optimizer and opt_state are swapped."
    elif _is_transformation(params):
        where = " It is in the place of params (the first): the parameters come first."
    raise TypeError(
        f"jaxmp.optimizer_update: the second argument must be the optax optimizer (e.g. "
        f"optax.adam(1e-3)), got {casting.describe(optimizer)}.{where} The arguments are "
        f"{_SIGNATURE}.")


def _structure(tree: PyTree) -> Any:
    """The tree structure of ``tree`` with ``None`` as a leaf, as ``grads`` have it."""
    return jax.tree_util.tree_structure(tree, is_leaf=lambda x: x is None)


def _check_not_swapped(floats: PyTree, opt_state: PyTree, grads: PyTree) -> None:
    """Raises ``TypeError`` when ``opt_state`` and ``grads`` are given in each other's place.

    Told by structure alone, at trace time: the gradients have the structure of the
    parameters' floating leaves; in the swapped call ``opt_state`` has it and ``grads``
    does not. Without this, optax fails inside its own code (``'dict' object has no
    attribute 'mu'``), far from the call.
    """
    params_structure = _structure(floats)
    if _structure(grads) != params_structure and _structure(opt_state) == params_structure:
        raise TypeError(
            "jaxmp.optimizer_update: opt_state and grads are swapped: the fourth argument "
            "(grads) has the structure of the optimizer's state and the third (opt_state) "
            f"that of the parameters. The arguments are {_SIGNATURE}: pass "
            "optimizer_update(params, optimizer, opt_state, grads, finite).")


def _raise_if_grads_do_not_match(grads: PyTree, floats: PyTree, error: Exception) -> None:
    """Re-raises an optimizer's failure as what it is when ``grads`` do not match ``params``."""
    mine, theirs = _structure(grads), _structure(floats)
    if mine != theirs:
        raise ValueError(
            "jaxmp.optimizer_update: grads do not have the structure of params (their "
            "floating-point leaves, None elsewhere, as jaxmp.mp_value_and_grad returns them): "
            f"grads are {mine}, params {theirs}. The arguments are {_SIGNATURE}; are grads "
            "and params swapped, or grads of other arguments (argnums)?") from error


def _has_dtype(tree: PyTree, dtypes: tuple) -> bool:
    """Whether some floating array leaf of ``tree`` has one of ``dtypes``.

    float16 values make the update's own overflow likely, so only then does
    the step carry the host callback that says so; bfloat16 has float32's
    range but rounds coarsely, so its updates are still checked.
    """
    dtypes = {jnp.dtype(d) for d in dtypes}
    return any(casting.is_float_array(x) and jnp.dtype(x.dtype) in dtypes
               for x in jax.tree_util.tree_leaves(tree))
