"""Optimizer updates that are skipped, losing nothing, when gradients are not finite."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import loss_scale

PyTree = Any


def select_tree(pred: Any, on_true: PyTree, on_false: PyTree) -> PyTree:
    """Picks ``on_true`` or ``on_false`` leaf by leaf, by a scalar boolean ``pred``.

    Array leaves are selected with ``jnp.where``, which copies the chosen value
    bit for bit (no arithmetic touches it). Non-array leaves must be equal in
    both trees and are taken from ``on_false``; ``None`` leaves stay ``None``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> new, old = {"a": jnp.ones(2)}, {"a": jnp.zeros(2)}
        >>> jaxmp.select_tree(jnp.asarray(False), new, old)["a"].tolist()
        [0.0, 0.0]
    """
    pred = loss_scale.check_finite_flag(pred)

    def leaf(t, f):
        if isinstance(t, jax.Array) or isinstance(f, jax.Array):
            t, f = jnp.asarray(t), jnp.asarray(f)
            if t.dtype != f.dtype or t.shape != f.shape:
                raise ValueError(
                    f"Cannot select between leaves of type {t.dtype}{list(t.shape)} and "
                    f"{f.dtype}{list(f.shape)}: the update changed a leaf's type."
                )
            return jnp.where(pred, t, f)
        return f

    return jax.tree_util.tree_map(leaf, on_true, on_false)


def optimizer_update(
    params: PyTree,
    optimizer: optax.GradientTransformation,
    opt_state: PyTree,
    grads: PyTree,
    finite: Any,
) -> tuple[PyTree, PyTree]:
    """Applies one optax step if ``finite``; otherwise returns the inputs unchanged.

    When ``finite`` is false, the parameters and the optimizer state (moments,
    step counts, schedules) come back bit-for-bit identical, so a skipped step
    leaves no trace. Works under ``jit`` and inside ``lax.scan`` (no host
    synchronisation), with any optax optimizer, and with parameter trees that
    hold ``None`` leaves, as ``equinox.partition`` leaves them.

    Args:
        params: the parameters.
        optimizer: an ``optax.GradientTransformation``.
        opt_state: its state.
        grads: gradients with the structure of ``params``.
        finite: scalar boolean, as returned by :func:`mp_value_and_grad`.

    Returns:
        ``(params, opt_state)`` after the step, or unchanged.

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
    """
    finite = loss_scale.check_finite_flag(finite)
    # optax's transformations rely on standard promotion internally (e.g. a
    # float decay raised to an int32 step count). Allow it for the optimizer
    # alone, so users who trace under strict promotion can still use optax.
    with jax.numpy_dtype_promotion("standard"):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
    params = select_tree(finite, new_params, params)
    opt_state = select_tree(finite, new_opt_state, opt_state)
    return params, opt_state
