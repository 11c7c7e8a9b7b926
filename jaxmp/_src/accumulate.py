"""Gradient accumulation over micro-batches, with one loss scale per window.

:func:`accumulate_value_and_grad` splits the batch arguments of a loss function
into ``num_microbatches`` micro-batches and runs a ``lax.scan`` over them inside
the step. Each micro-batch is differentiated in the compute dtype with the
*same* loss scale; the scaled gradients are summed in float32; then, once per
effective batch, they are divided by the scale and by the number of
micro-batches, checked for inf/NaN and the scaler is adjusted. If any
micro-batch overflowed, the sum is not finite and the whole window is skipped
(by :func:`jaxmp.optimizer_update`) with a single back-off. Because the backward
pass of each micro-batch runs inside the scan body, the activations kept for
it are those of one micro-batch, not of the whole batch.

Composing with optax:

* ``optax.MultiSteps`` accumulates *across* calls instead of inside one: call
  :func:`jaxmp.mp_value_and_grad` each micro-step and hand the gradients to
  :func:`jaxmp.optimizer_update` with the ``MultiSteps`` optimizer. The
  gradients it receives are already unscaled, so a scale change in the middle
  of a window does not bias the mean; a micro-step that overflows is skipped
  entirely (``MultiSteps`` does not even count it), so the window still averages
  ``k`` finite micro-batches. The scaler, however, is adjusted once per
  micro-step. Both kinds of accumulation can be stacked: ``k`` micro-batches per
  call times ``m`` calls per ``MultiSteps`` window.
* ``optax.apply_if_finite`` is redundant with jaxmp's skip and weaker: after
  ``max_consecutive_errors`` non-finite updates in a row it *applies* them,
  which an overflow storm at the start of float16 training (a scale backing off
  from 2**15) easily reaches. Wrapped in :func:`jaxmp.optimizer_update`, the
  non-finite step is skipped before ``apply_if_finite`` sees it, so its
  counters stay at zero and it never gives up.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import casting
from jaxmp._src import grad as grad_lib
from jaxmp._src import loss_scale
from jaxmp._src import sharding

PyTree = Any


def _as_tuple(nums: Any, name: str) -> tuple[int, ...]:
    out = (nums,) if isinstance(nums, int) and not isinstance(nums, bool) else nums
    try:
        out = tuple(out)
    except TypeError:
        out = None
    if not out or not all(isinstance(i, int) and not isinstance(i, bool) for i in out):
        raise TypeError(f"{name} must be an int or a non-empty sequence of ints, got {nums!r}.")
    return out


def _is_batched_leaf(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _split_leaf(x: Any, k: int, where: str) -> Any:
    if np.ndim(x) == 0 or x.shape[0] % k:
        shape = tuple(np.shape(x))
        raise ValueError(
            f"Every array in the batch arguments must have a leading batch axis "
            f"divisible by num_microbatches={k}; {where} has shape {shape}."
        )
    return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))


def _wide_zeros(x: jax.Array) -> jax.Array:
    dtype = x.dtype if jnp.finfo(x.dtype).bits > 32 else jnp.float32
    return jnp.zeros(x.shape, dtype)


def accumulate_value_and_grad(
    fn: Callable,
    num_microbatches: int,
    *,
    argnums: int | Sequence[int] = 0,
    batch_argnums: int | Sequence[int] | None = None,
    has_aux: bool = False,
    compute_dtype: Any = jnp.float16,
    use_mixed_precision: bool = True,
    axis_name: Any = None,
    autocast: bool = False,
    reduce_dtype: Any = None,
) -> Callable:
    """Like :func:`jaxmp.mp_value_and_grad`, accumulated over micro-batches.

    The returned function is called like the one :func:`jaxmp.mp_value_and_grad`
    returns, ``(*args, scaler_state=state, **kwargs)``, with a full batch. Every
    array leaf of the positional arguments in ``batch_argnums`` (by default all
    positional arguments not in ``argnums``) is split along its leading axis
    into ``num_microbatches`` equal micro-batches; the other arguments and all
    keyword arguments are passed unchanged to every micro-batch.

    ``fn`` must return the *mean* loss of the batch it is given. The result is
    then exactly the full-batch computation: the loss is the mean of the
    micro-batch losses and the gradients are the mean of the micro-batch
    gradients, i.e. those of the full-batch mean loss. Inside, one loss scale is
    used for the whole window, the scaled gradients are summed in float32 (or
    float64 for float64 leaves), and unscaling, the finiteness check (reduced
    over ``axis_name``) and the scaler adjustment happen once, so one
    overflowing micro-batch skips the whole window and backs off once.

    Args:
        fn: the loss function, ``fn(*args, **kwargs) -> loss`` or
            ``(loss, aux)`` with ``has_aux=True``.
        num_microbatches: how many micro-batches the batch is split into (an
            int >= 1); the leading axis of every batch array must be divisible
            by it.
        argnums: which positional arguments to differentiate.
        batch_argnums: which positional arguments hold the batch. Defaults to
            every positional argument not in ``argnums``. Non-array leaves of
            these arguments (Python numbers, ``None``) are not split. To vary a
            PRNG key per micro-batch, pass one key per example (e.g.
            ``jax.random.split(key, batch_size)``) as part of the batch.
        has_aux: whether ``fn`` returns ``(loss, aux)``. The returned ``aux``
            stacks the micro-batch aux values along a new leading axis of size
            ``num_microbatches`` (floating leaves in float32 under mixed
            precision).
        compute_dtype: ``jnp.float16`` (default), ``jnp.bfloat16`` or
            ``jnp.float32``.
        use_mixed_precision: ``False`` runs in float32 without scaling and
            returns ``scaler_state`` unchanged.
        axis_name: as in :func:`jaxmp.mp_value_and_grad`; the loss and
            gradients are averaged over devices once per window.
        autocast: as in :func:`jaxmp.mp_value_and_grad`.
        reduce_dtype: as in :func:`jaxmp.mp_value_and_grad`.

    Returns:
        A function returning ``(loss, grads, scaler_state, finite)``, or
        ``((loss, aux), grads, scaler_state, finite)`` with ``has_aux=True``.

    Raises:
        ValueError: if ``num_microbatches`` is not an int >= 1, if
            ``batch_argnums`` overlaps ``argnums``, or (when called) if a batch
            array's leading axis is not divisible by ``num_microbatches``.
        TypeError: for the misuse :func:`jaxmp.mp_value_and_grad` rejects.

    Examples:
        >>> import jax.numpy as jnp
        >>> import jaxmp
        >>> def loss_fn(w, x, y):
        ...     return jnp.mean((x @ w - y) ** 2)
        >>> w, x, y = jnp.ones(3), jnp.ones((8, 3)), jnp.zeros(8)
        >>> step = jaxmp.accumulate_value_and_grad(loss_fn, num_microbatches=4)
        >>> loss, grads, state, finite = step(
        ...     w, x, y, scaler_state=jaxmp.init_scaler(initial_scale=1024.0))
        >>> float(loss), grads.tolist(), bool(finite)
        (9.0, [6.0, 6.0, 6.0], True)
    """
    if (
        not isinstance(num_microbatches, (int, np.integer))
        or isinstance(num_microbatches, bool)
        or num_microbatches < 1
    ):
        raise ValueError(f"num_microbatches must be an int >= 1, got {num_microbatches!r}.")
    k = int(num_microbatches)
    int_argnums = isinstance(argnums, int) and not isinstance(argnums, bool)
    nums = _as_tuple(argnums, "argnums")
    batch_nums = None if batch_argnums is None else _as_tuple(batch_argnums, "batch_argnums")

    call, input_dtype = grad_lib.prepare_call(fn, compute_dtype, use_mixed_precision, autocast)
    reduce_dtype = sharding.check_reduce_dtype(reduce_dtype)

    def positions_of(numbers, n, name):
        out = []
        for i in numbers:
            if not -n <= i < n:
                raise TypeError(
                    f"{name}={numbers!r} refers to argument {i}, but the function was "
                    f"called with {n} positional arguments."
                )
            out.append(i % n)
        return out

    @grad_lib.wraps_adding_scaler_state(fn)
    def accumulated_fn(*args, scaler_state, **kwargs):
        state = loss_scale.check_scaler_state(scaler_state)
        n = len(args)
        positions = positions_of(nums, n, "argnums")
        if batch_nums is None:
            batch_positions = [i for i in range(n) if i not in positions]
        else:
            batch_positions = positions_of(batch_nums, n, "batch_argnums")
            overlap = sorted(set(batch_positions) & set(positions))
            if overlap:
                raise ValueError(
                    f"Arguments {overlap} are in both argnums and batch_argnums: a "
                    "differentiated argument cannot be split into micro-batches."
                )
        if not batch_positions:
            raise ValueError(
                "There is no batch argument to split into micro-batches: pass the batch "
                "as a positional argument not in argnums, or set batch_argnums."
            )

        parts = [grad_lib._partition(args[i]) for i in positions]  # pylint: disable=protected-access
        diff = tuple(floats for floats, _ in parts)
        if not any(casting.is_float_array(x) for x in jax.tree_util.tree_leaves(diff)):
            raise TypeError(
                f"No floating-point array leaves to differentiate in the argument(s) "
                f"argnums={argnums!r}. Gradients are taken with respect to float arrays only."
            )

        # Split the batch arrays into (k, B // k, ...); keep other leaves aside.
        micro = []
        static = []
        for pos in batch_positions:
            with_paths = jax.tree_util.tree_flatten_with_path(args[pos])[0]
            leaves, treedef = jax.tree_util.tree_flatten(args[pos])
            split = [
                _split_leaf(x, k, f"argument {pos}" + (
                    f" leaf {jax.tree_util.keystr(path)}" if path else ""))
                if _is_batched_leaf(x) else None
                for (path, _), x in zip(with_paths, leaves)
            ]
            micro.append(split)
            static.append((treedef, [None if _is_batched_leaf(x) else x for x in leaves]))

        def rebuild_batch(micro_leaves):
            full = list(args)
            for pos, leaves, (treedef, others) in zip(batch_positions, micro_leaves, static):
                merged = [o if m is None else m for m, o in zip(leaves, others)]
                full[pos] = jax.tree_util.tree_unflatten(treedef, merged)
            return full

        axes = sharding.data_axes(axis_name)
        diff, sharded = sharding.prepare(diff, axes)

        def scaled_loss_fn(diff, micro_leaves):
            full = rebuild_batch(micro_leaves)
            for pos, floats, (_, others) in zip(positions, diff, parts):
                full[pos] = grad_lib._combine(floats, others)  # pylint: disable=protected-access
            call_args, call_kwargs = tuple(full), kwargs
            if input_dtype is not None:
                call_args, call_kwargs = casting.cast_tree((call_args, call_kwargs), input_dtype)
            out = call(*call_args, **call_kwargs)
            loss, aux = grad_lib._split_aux(out, has_aux)  # pylint: disable=protected-access
            loss = grad_lib._check_loss(loss).astype(jnp.float32)  # pylint: disable=protected-access
            if use_mixed_precision:
                aux = casting.cast_to_float32(aux)
                scaled = loss_scale.scale(state, loss)
            else:
                scaled = loss
            return scaled, (loss, aux)

        def body(acc, micro_leaves):
            (_, (loss, aux)), grads = jax.value_and_grad(scaled_loss_fn, has_aux=True)(
                diff, micro_leaves
            )
            acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), acc, grads)
            return acc, (loss, aux)

        # The carry has each leaf's varying axes, so scan's carry types match.
        acc = jax.tree_util.tree_map(
            lambda x: sharding.as_varying(_wide_zeros(x), tuple(sharding.varying_axes(x))), diff)
        acc, (losses, aux) = jax.lax.scan(body, acc, micro)

        inv_k = 1.0 / k
        if use_mixed_precision:
            # One division by the scale of the window, in float32, then the mean.
            acc = loss_scale.unscale(state, acc)
        grads = jax.tree_util.tree_map(
            lambda a, p: (a * jnp.asarray(inv_k, a.dtype)).astype(p.dtype), acc, diff
        )
        return grad_lib.finish_step(jnp.mean(losses), aux, grads, state, axes=axes,
                                    sharded=sharded, reduce_dtype=reduce_dtype,
                                    adjust_scale=use_mixed_precision, single_argnum=int_argnums,
                                    has_aux=has_aux)

    return accumulated_fn

