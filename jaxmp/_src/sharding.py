"""Device axes for mixed-precision steps: which axes to average over, and how.

A gradient step inside ``jax.shard_map`` (or ``pmap``) runs once per device.
This module decides, at trace time, what jaxmp does about the other devices:

* :func:`data_axes` checks ``axis_name`` against the axes bound where the step
  is traced, and refuses the silent mistakes (a forgotten ``axis_name`` inside
  ``shard_map``, an axis that is not bound).
* :func:`prepare` marks the differentiated leaves as varying over the data
  axes, so autodiff returns each device's own gradient instead of summing
  replicated gradients by itself in the compute dtype.
* :func:`mean_over_devices` turns those per-device results into the loss and
  gradients of the mean of the per-device losses, in a chosen reduction dtype
  (float32 by default). Leaves sharded over a data axis and gathered in the
  forward pass (FSDP) already hold autodiff's sum over devices: they are only
  divided, never averaged with other devices' shards.
* :func:`verdict` makes one finiteness flag for every device of the mesh, over
  every manual axis, whatever ``axis_name`` lists, so the scaler state stays
  replicated.
* :func:`check_reduce_dtype` checks the dtype of those sums.

The sums jaxmp does not write (XLA's under ``jit``, autodiff's for an FSDP
``all_gather``) are reached by rewriting the loss function's products:
:mod:`jaxmp._src.wide_gradients`, which needs the jaxpr interpreter that this
module, on the path of every gradient step and of :func:`jaxmp.all_finite`,
does without.

Which leaves are sharded is read from JAX's varying-manual-axes types (the
default ``check_vma=True`` of ``shard_map``). Without them (``check_vma=False``,
``pmap``, ``vmap`` axes) every leaf is taken as replicated over the data axes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import compat

PyTree = Any


def manual_axes() -> tuple[str, ...]:
    """The manual mesh axes where this is traced: inside ``shard_map``/``pmap``, else ``()``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(mesh.manual_axes)


def values_are_local(values: Any = ()) -> bool:
    """Whether each of ``values`` is held whole by every device that computes with it.

    True inside a ``shard_map`` whose mesh axes are all manual (each device
    sees its own shards), where ``values`` are typed for a mesh of one device
    (``jit`` of arguments placed on one device, or ``ShapeDtypeStruct`` s with
    such a sharding, as a deviceless compilation for one GPU has them), and,
    when their types say nothing of a mesh, where there is only one device.
    Elsewhere (``jit`` over several devices) XLA may shard a value, and
    reshaping or concatenating values can then move data between devices.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and set(mesh.axis_names) <= set(mesh.manual_axes):
        return True
    meshes = [getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
              for x in jax.tree_util.tree_leaves(values)]
    if meshes and all(m is not None and not m.empty for m in meshes):
        return all(m.size == 1 for m in meshes)
    return jax.device_count() == 1


def _names(axis_name: Any) -> tuple[Any, ...]:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def check_bound(axis_name: Any, what: str = "axis_name") -> tuple[Any, ...]:
    """Returns ``axis_name`` as a tuple of names, raising if one is not bound here.

    A name is bound inside ``shard_map`` (a manual axis of its mesh), ``pmap``
    or ``vmap`` with that ``axis_name``.
    """
    names = _names(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    manual = manual_axes()
    for name in names:
        if not mesh.empty and name in mesh.axis_names and name not in manual:
            raise ValueError(
                f"{what}={axis_name!r}: mesh axis {name!r} is not a manual axis of the "
                f"shard_map this is traced in (manual axes: {manual}). Collectives only run "
                "over manual axes: add it to shard_map's axis_names, or leave it out of "
                f"{what} (XLA partitions automatic axes by itself)."
            )
        try:
            jax.lax.axis_size(name)
        except NameError:
            where = (f"inside a shard_map over the manual axes {manual}" if manual
                     else "outside shard_map, pmap and vmap")
            hint = (f"pass some of {manual}" if manual else
                    "under jit with NamedSharding, leave it None: XLA inserts the "
                    "reductions itself")
            raise ValueError(
                f"{what}={axis_name!r}: axis {name!r} is not bound here ({where}); {hint}."
            ) from None
    return names


def data_axes(axis_name: Any, what: str = "axis_name") -> tuple[Any, ...] | None:
    """Validates ``axis_name`` for a gradient step and returns the data axes.

    Args:
        axis_name: the data-parallel axis name(s) a user passed, ``()`` to opt
            out of averaging, or ``None``.
        what: the argument's name in error messages.

    Returns:
        ``None`` outside ``shard_map``/``pmap`` with ``axis_name=None`` (nothing
        to do); otherwise the tuple of data axes (possibly empty).

    Raises:
        ValueError: inside ``shard_map`` with ``axis_name=None`` (the gradients
            would silently be per device, or summed by autodiff), or for an
            axis that is not bound.
    """
    if axis_name is None:
        manual = manual_axes()
        if manual:
            raise ValueError(
                f"This gradient step is traced inside shard_map (or pmap) over the manual "
                f"axes {manual} but {what}=None. Pass the data-parallel axes, those the "
                f"batch is split over, e.g. {what}={manual[0]!r}: the loss and gradients are "
                f"then those of the mean of the per-device losses. Pass {what}=() for "
                "per-device gradients (finite and the scaler still agree on every device)."
            )
        return None
    return check_bound(axis_name, what)


def varying_axes(x: Any) -> frozenset:
    """The manual axes over which ``x`` is typed as varying (empty outside ``shard_map``)."""
    return compat.varying_axes(x)


def tracks_varying(axes: tuple[Any, ...]) -> bool:
    """Whether varying-manual-axes types are tracked for ``axes`` (``check_vma=True``).

    Needs every axis to be a manual mesh axis; ``pmap``, ``vmap`` and
    ``shard_map(..., check_vma=False)`` do not track them.
    """
    manual = manual_axes()
    if not axes or not all(a in manual for a in axes):
        return False
    probe = compat.pcast_to_varying(jnp.zeros((), jnp.float32), tuple(axes))
    return set(axes) <= varying_axes(probe)


def as_varying(tree: PyTree, axes: tuple[Any, ...]) -> PyTree:
    """Marks every array leaf of ``tree`` as varying over ``axes`` (no data moves)."""
    manual = manual_axes()
    axes = tuple(a for a in axes if a in manual)
    if not axes:
        return tree

    def cast(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return compat.pcast_to_varying(x, missing) if missing else x

    return jax.tree_util.tree_map(cast, tree)


class Plan(NamedTuple):
    """What :func:`prepare` learnt about a step's devices, for :func:`mean_over_devices`.

    Attributes:
        axes: the data axes from :func:`data_axes` (``None`` outside ``shard_map``).
        sharded: mirrors the differentiated leaves; for each, the data axes it
            was already varying over (sharded over them, as FSDP parameters
            are).
    """

    axes: tuple[Any, ...] | None
    sharded: PyTree


def prepare(diff: PyTree, axis_name: Any) -> tuple[PyTree, Plan]:
    """Validates ``axis_name`` and prepares the differentiated leaves of a step.

    Returns ``(diff, plan)``: ``diff`` marked varying over the data axes, so
    that each device gets its own gradient (over every manual axis for
    ``axis_name=()``), and the :class:`Plan` for :func:`mean_over_devices`.
    """
    axes = data_axes(axis_name)
    nothing = jax.tree_util.tree_map(lambda x: frozenset(), diff)
    if axes is None:
        return diff, Plan(None, nothing)
    if not axes:  # opted out: each device's own gradient, nothing summed by autodiff
        return as_varying(diff, manual_axes()), Plan((), nothing)
    sharded = jax.tree_util.tree_map(lambda x: varying_axes(x) & set(axes), diff)
    return as_varying(diff, axes), Plan(axes, sharded)


def recorded_per_device(tree: PyTree, plan: Plan) -> PyTree:
    """``tree`` (what a step records, e.g. a float8 amax history) marked varying over the
    devices' data axes (every manual axis with ``axis_name=()``): each device's backward pass
    records its own values, which :func:`max_over_devices` then joins; left alone outside
    ``shard_map``. Differentiated unvarying, its records would be summed over devices."""
    if plan.axes is None:
        return tree
    return as_varying(tree, plan.axes if plan.axes else manual_axes())


def max_over_devices(tree: PyTree, plan: Plan) -> PyTree:
    """The largest of every device's ``tree`` over the data axes (as one device recording the
    whole batch would), the same on each device; each device's own with ``axis_name=()``."""
    if not plan.axes:
        return tree
    return jax.tree_util.tree_map(lambda x: jax.lax.pmax(x, plan.axes), tree)


def _size(axes) -> int:
    return math.prod(jax.lax.axis_size(a) for a in axes)


def _mean_in_device_order(x: jax.Array, axes: tuple[Any, ...], count: int) -> jax.Array:
    """The mean of a scalar over ``axes``, summed in device order whatever the collective backend.

    An all-reduce may add in any order (gloo across processes, XLA within one),
    which changes the last bit of a float32 loss; gathering the values and
    adding them here does not. ``pmax`` of the (equal) results is exact and
    types the result as the same on every device.
    """
    total = jnp.sum(jax.lax.all_gather(x, axes))
    return jax.lax.pmax(total / jnp.asarray(count, total.dtype), axes)


def mean_over_devices(
    loss: jax.Array, grads: PyTree, plan: Plan, reduce_dtype: Any = None
) -> tuple[jax.Array, PyTree]:
    """The loss and gradients of the mean of the per-device losses over ``axes``.

    ``grads`` are the unscaled gradients of the per-device ``loss`` with
    respect to leaves prepared by :func:`prepare`. A leaf replicated over a
    data axis has one gradient per device there: they are summed. A leaf
    sharded over it already holds autodiff's sum over the devices of the
    gradients of its shard: it is kept, so shards are never mixed. Both are
    divided by the number of devices whose losses differ (those over which
    ``loss`` is varying, all of ``axes`` when varying types are not tracked).

    Args:
        loss: this device's float32 loss.
        grads: the unscaled gradients (``None`` leaves are left alone).
        plan: from :func:`prepare`; no data axes (``None`` or ``()``) does nothing.
        reduce_dtype: the dtype of the sums over devices; ``None`` means the
            gradient's dtype raised to at least float32. Results come back in
            each gradient's dtype.

    Returns:
        ``(loss, grads)``.
    """
    axes, sharded = plan
    if not axes:
        return loss, grads
    if tracks_varying(axes):
        loss_axes = tuple(a for a in axes if a in varying_axes(loss))
    else:  # no types to read: every leaf replicated, every loss different
        loss_axes = tuple(axes)
        sharded = jax.tree_util.tree_map(lambda s: frozenset(), sharded)
    count = _size(loss_axes)
    if loss_axes:
        loss = _mean_in_device_order(loss, loss_axes, count)

    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flags = treedef.flatten_up_to(sharded)
    groups: dict[tuple, list[int]] = {}
    for i, (g, done) in enumerate(zip(leaves, flags)):
        groups.setdefault(tuple(a for a in axes if a not in done), []).append(i)
    out = list(leaves)
    for sum_axes, idx in groups.items():
        wide = [leaves[i].astype(reduce_dtype or casting.wide_dtype(leaves[i].dtype)) for i in idx]
        if sum_axes:
            wide = jax.lax.psum(wide, sum_axes)  # one all-reduce for the whole group
        for i, w in zip(idx, wide):
            if count != 1:
                w = w / jnp.asarray(count, w.dtype)
            out[i] = w.astype(leaves[i].dtype)
    return loss, jax.tree_util.tree_unflatten(treedef, out)


def verdict(finite: jax.Array, axes: tuple[Any, ...] | None = None) -> jax.Array:
    """One finiteness flag for every device: the minimum over every manual axis and ``axes``.

    The flag is then typed as invariant over the mesh, so the scaler state
    adjusted with it stays replicated (``out_specs=P()`` works).
    """
    over = tuple(dict.fromkeys(manual_axes() + tuple(axes or ())))
    if not over:
        return finite
    flag = as_varying(finite.astype(jnp.int32), over)
    return jax.lax.pmin(flag, over).astype(jnp.bool_)


def check_reduce_dtype(reduce_dtype: Any) -> np.dtype | None:
    """``None`` (float32 or wider, per leaf) or a floating dtype for gradient reductions."""
    if reduce_dtype is None:
        return None
    return casting.canonical_float_dtype(
        reduce_dtype, allowed=casting.COMPUTE_DTYPES, what="reduce_dtype"
    )
